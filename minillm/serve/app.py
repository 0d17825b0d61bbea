"""The HTTP server: FastAPI routes over the `AsyncEngine`, run by uvicorn, drained on SIGTERM.

A request's path from the socket to a step and back:

    uvicorn (event loop) -> route handler: JSON parsed, fields checked (protocol), prompt tokenized, context checked
      -> AsyncEngine.submit: admitted (or 429 now) -> EngineCore inbox -> engine thread: step after step
      -> each step's RequestOutput -> event loop -> this request's queue -> handler
      -> streamed: one SSE chunk per output with new text, then [DONE]; or one JSON body at the end

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (stream true or false), `GET /v1/models`,
`GET /health` (503 while loading or draining), `GET /metrics` (Prometheus), `GET /dashboard` (a live view of the
engine, `minillm.serve.dashboard`) and the JSON it polls, `GET /dashboard/state`.

Faults, each ending one request alone: a client that disconnects aborts its request (its blocks go back to the pool
at the next step); a request that runs past `request_timeout` is aborted and told so; a request that fails in the
engine gets an error. Draining (SIGTERM, or `drain()`): new requests get 503, those in flight have
`shutdown_timeout` seconds to finish, then the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST

from minillm.core.config import check_choice, check_float, check_instance, check_int
from minillm.serve import protocol as P
from minillm.serve.async_engine import AsyncEngine, RequestStream
from minillm.serve.dashboard import DASHBOARD_HTML, dashboard_state
from minillm.serve.engine_process import EngineProcess, ProcessAsyncEngine
from minillm.serve.metrics import ServerMetrics

POLL_S = 0.5  # how often a non-streamed handler looks whether its client is still there


@dataclass
class ServeOptions:
    """What the server does besides the engine: its name, bounds and time limits."""

    model_name: str = "minillm-base"
    max_queued_requests: int = 256  # samples in flight (accepted, not finished) before 429
    max_queued_tokens: int = 1 << 20  # their tokens (prompt + max_tokens) before 429
    request_timeout: float = 600.0  # seconds from arrival to the final output, then the request is aborted
    shutdown_timeout: float = 30.0  # seconds a drain waits for requests in flight before aborting them
    max_request_bytes: int = 1 << 22  # a larger body is refused (413) before it is parsed: 4 MiB

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str):
            raise TypeError(f"ServeOptions.model_name must be a str (what clients pass as `model`), got "
                            f"{type(self.model_name).__name__} {self.model_name!r}")
        if not self.model_name:
            raise ValueError("ServeOptions.model_name must not be empty: clients pass it as `model`")
        for name in ("max_queued_requests", "max_queued_tokens", "max_request_bytes"):
            setattr(self, name, check_int(f"ServeOptions.{name}", getattr(self, name)))  # stored as the plain int
        self.request_timeout = check_float("ServeOptions.request_timeout", self.request_timeout, minimum=0.0,
                                           include_minimum=False)
        self.shutdown_timeout = check_float("ServeOptions.shutdown_timeout", self.shutdown_timeout, minimum=0.0)


class Server:
    """The engine, the API state and the metrics of one serving process (or one in-process server in tests)."""

    def __init__(self, engine: Any, tokenizer: Any, options: ServeOptions | None = None):
        if options is not None and not isinstance(options, ServeOptions):
            raise TypeError(f"options must be a ServeOptions or None, got {type(options).__name__}")
        self.options = dataclasses.replace(options) if options is not None else ServeOptions()  # re-checked
        if not callable(getattr(tokenizer, "encode", None)):
            raise TypeError(f"tokenizer must have an encode(text) method (the engine's tokenizer), got "
                            f"{type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        bounds = (self.options.max_queued_requests, self.options.max_queued_tokens)
        self.engine = (ProcessAsyncEngine(engine, *bounds) if isinstance(engine, EngineProcess)
                       else AsyncEngine(engine, *bounds))
        self.context_length = self.engine.context_length
        self.vocab_size = self.engine.vocab_size
        ranks = getattr(tokenizer, "mergeable_ranks", None)  # the longest token bounds how much text a prompt holds
        self.max_token_bytes = max(map(len, ranks)) if isinstance(ranks, dict) and ranks else None
        self.metrics = ServerMetrics(self)
        self.engine.on_output.append(lambda stream, out: self.metrics.observe_output(out))
        self.engine.on_final.append(lambda stream, out: self.metrics.observe_final(out, time.perf_counter()))
        self.status = "loading"  # -> "ready" when the engine's thread runs -> "draining" -> "stopped"
        self.created = int(time.time())
        self.app = build_app(self)

    # ----------------------------------------------------------------------------------------- life cycle

    async def startup(self) -> None:
        self.engine.start()
        self.status = "ready"

    async def shutdown(self) -> None:
        self.status = "stopped"
        await asyncio.to_thread(self.engine.stop)

    async def drain(self) -> None:
        """Refuse new requests (503), let those in flight finish for `shutdown_timeout` s, then abort the rest."""
        if self.status == "draining":
            return
        self.status = "draining"
        deadline = time.monotonic() + self.options.shutdown_timeout
        while self.engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.engine.num_in_flight:
            self.engine.abort_all()
            end = time.monotonic() + 10.0  # the aborts' final outputs come with the next step
            while self.engine.num_in_flight and time.monotonic() < end:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # let the handlers write their last events

    # ----------------------------------------------------------------------------------------- requests

    def admit(self, parsed: P.ParsedRequest, arrival: float) -> tuple[RequestStream, list[int]]:
        """Tokenize, check the context, and submit; returns the stream and each prompt's token count."""
        check_instance("parsed", parsed, P.ParsedRequest, "a ParsedRequest (parse_completion / parse_chat)")
        arrival = check_float("arrival", arrival)
        param = "prompt" if parsed.kind == "completion" else "messages"
        ids = [p if isinstance(p, list) else self._encode(p, param) for p in parsed.prompts]
        max_tokens = parsed.params.max_new_tokens
        allowed = [P.check_context(len(t), max_tokens, self.context_length, parsed.max_tokens_given, param)
                   for t in ids]
        params = parsed.params
        if min(allowed) != max_tokens:
            params = type(params)(**{**vars(params), "max_new_tokens": min(allowed)})
        tokens = sum(len(t) + params.max_new_tokens for t in ids) * params.n
        stream = self.engine.submit(ids, params, tokens, arrival)
        self.metrics.prompt_tokens.inc(sum(len(t) for t in ids))
        return stream, [len(t) for t in ids]


    def _encode(self, text: str, param: str) -> list[int]:
        """The prompt's token ids; text the tokenizer refuses (a special token's text, "<|endoftext|>") is a 400.

        subtle: a text longer than the context could hold even if every token were the longest one is refused
        before tokenizing: tokenizing megabytes runs on the event loop and would stall every other client."""
        if self.max_token_bytes is not None and len(text) > self.context_length * self.max_token_bytes:
            raise P.RequestError(f"this model's maximum context length is {self.context_length} tokens; the "
                                 f"{param} has {len(text)} characters, more than {self.context_length} tokens of at "
                                 f"most {self.max_token_bytes} bytes can hold", param, "context_length_exceeded")
        try:
            return self.tokenizer.encode(text)
        except ValueError as exc:
            raise P.RequestError(f"{param}: {exc}", param) from exc


def _too_large(size: int, limit: int) -> P.RequestError:
    return P.RequestError(f"the request body is {size} bytes or more, over this server's limit of {limit} "
                          f"(--max-request-bytes)", None, "request_too_large", status=413)


def _error(exc: P.RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _outcome_of_error(exc: P.RequestError) -> str:
    if exc.status == 429:
        return "overloaded"
    if exc.status == 503:
        return "unavailable"
    return "context_length_exceeded" if exc.code == "context_length_exceeded" else "invalid"


def _end_error(reason: str, error: str | None, why: str | None) -> P.RequestError:
    """The error that ends a request whose final output is not stop/length."""
    if why == "timeout":
        return P.RequestError("the request ran past the server's request timeout and was aborted", None,
                              "timeout", status=504, type="timeout_error")
    if why == "shutdown":
        return P.RequestError("the server shut down before this request finished", None, "server_shutdown",
                              status=503, type="service_unavailable")
    if reason == "error":
        return P.RequestError(error or "the request failed in the engine", None, "engine_error", status=500,
                              type="server_error")
    return P.RequestError("the request was aborted", None, "aborted", status=503, type="service_unavailable")


async def _next(server: Server, stream: RequestStream, deadline: float) -> tuple[Any, str | None]:
    """The next output of `stream`, or (None, "timeout") once the deadline passes (the stream is then aborted)."""
    left = deadline - time.perf_counter()
    try:
        return await asyncio.wait_for(stream.get(), max(left, 0.0)), None
    except asyncio.TimeoutError:
        server.engine.abort(stream)
        return None, "timeout"


def build_app(server: Server) -> FastAPI:
    """The FastAPI application of `server` (its lifespan starts and stops the engine's thread)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.startup()
        try:
            yield
        finally:
            await server.shutdown()

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def read_body(request: Request) -> Any:
        """The JSON body, read no further than `max_request_bytes` (413 past it, before parsing anything)."""
        limit = server.options.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as exc:  # malformed, not UTF-8, an int past 4300 digits, nested too deep
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
            raise P.RequestError(f"the request body is not valid JSON: {why}", None, "invalid_json") from exc

    async def complete(request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        try:
            if server.status != "ready":
                raise P.RequestError(f"the server is {server.status}; retry later", None, "server_" + server.status,
                                     status=503, type="service_unavailable")
            body = await read_body(request)
            if kind == "completion":
                parsed = P.parse_completion(body, server.options.model_name, server.vocab_size)
            else:
                parsed = P.parse_chat(body, server.options.model_name)
            stream, prompt_lens = server.admit(parsed, arrival)
        except P.RequestError as exc:
            server.metrics.outcome(_outcome_of_error(exc))
            return _error(exc)
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        deadline = arrival + server.options.request_timeout
        if parsed.stream:
            return StreamingResponse(_sse(server, request, parsed, stream, rid, prompt_lens, deadline),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(server, request, parsed, stream, rid, prompt_lens, deadline)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.options.model_name, "object": "model",
                                            "created": server.created, "owned_by": "minillm",
                                            "max_model_len": server.context_length}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != server.options.model_name:
            return _error(P.RequestError(f"the model {model_id!r} does not exist; this server serves "
                                         f"{server.options.model_name!r}", "model", "model_not_found", status=404))
        return JSONResponse({"id": model_id, "object": "model", "created": server.created, "owned_by": "minillm",
                             "max_model_len": server.context_length})

    @app.get("/health")
    async def health() -> Response:
        if server.engine.error is not None:
            return JSONResponse({"status": "failed", "error": server.engine.error}, status_code=503)
        code = 200 if server.status == "ready" else 503
        return JSONResponse({"status": server.status}, status_code=code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """404 (no such route), 405 (wrong method) and the like, in the OpenAI error shape."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                                       "type": "invalid_request_error", "param": None, "code": code}},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return HTMLResponse(DASHBOARD_HTML)

    @app.get("/dashboard/state")
    async def state() -> dict[str, Any]:
        return dashboard_state(server)

    return app


async def _sse(server: Server, request: Request, parsed: P.ParsedRequest, stream: RequestStream, rid: str,
               prompt_lens: list[int], deadline: float) -> AsyncIterator[bytes]:
    """The SSE body: chunks as outputs arrive, then a usage chunk if asked, then [DONE]. Closed early (the client
    went away): the request is aborted in `finally`."""
    created, model, n = int(time.time()), server.options.model_name, parsed.params.n
    completion_tokens = 0
    outcome = "disconnected"  # unless the body below runs to one of its ends
    try:
        if parsed.kind == "chat":
            for i in range(stream.expected):
                chunk = P.chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""}, None)
                if parsed.include_usage:
                    chunk["usage"] = None
                yield P.sse_event(chunk)
        while not stream.ended:
            out, why = await _next(server, stream, deadline)
            if out is None:  # timed out (and aborted): take the aborted outputs, then tell the client
                while not stream.ended:
                    await stream.get()
                outcome = "timeout"
                yield P.sse_event(_end_error("abort", None, "timeout").body())
                yield P.SSE_DONE
                return
            index = stream.request_ids.index(out.request_id) * n + out.index
            finish = P.FINISH_REASONS.get(out.finish_reason) if out.finished else None
            if out.finished and finish is None:  # failed, or aborted by the server: the whole response ends
                server.engine.abort(stream)
                while not stream.ended:
                    await stream.get()
                outcome = "error" if out.finish_reason == "error" else "abort"
                why = "shutdown" if server.status == "draining" else None
                yield P.sse_event(_end_error(out.finish_reason, out.error, why).body())
                yield P.SSE_DONE
                return
            if out.finished:
                completion_tokens += len(out.output_token_ids)
                if index == 0:
                    outcome = out.finish_reason  # the request's outcome: its first choice's "stop" or "length"
            text = out.new_text or ""
            if not text and finish is None:
                continue  # tokens whose text is held back (a partial character or a possible stop string)
            if parsed.kind == "chat":
                chunk = P.chat_chunk(rid, created, model, index, {"content": text} if text else {}, finish)
            else:
                chunk = P.completion_chunk(rid, created, model, index, text, finish)
            if parsed.include_usage:
                chunk["usage"] = None
            yield P.sse_event(chunk)
        if parsed.include_usage:
            yield P.sse_event(P.usage_chunk(rid, created, model, parsed.kind,
                                            P.usage(sum(prompt_lens), completion_tokens)))
        yield P.SSE_DONE
    finally:
        if not stream.done:
            server.engine.abort(stream)
            outcome = "disconnected"
        server.metrics.outcome(outcome)


async def _whole(server: Server, request: Request, parsed: P.ParsedRequest, stream: RequestStream, rid: str,
                 prompt_lens: list[int], deadline: float) -> Response:
    """A non-streamed response: wait for every final output (watching the client), then one JSON body."""
    finals: dict[int, Any] = {}
    n = parsed.params.n
    try:
        while not stream.ended:
            out, why = await _next(server, stream, min(deadline, time.perf_counter() + POLL_S))
            if out is None:
                if await request.is_disconnected():
                    server.engine.abort(stream)
                    server.metrics.outcome("disconnected")
                    return Response(status_code=499)
                if time.perf_counter() < deadline:
                    continue
                while not stream.ended:
                    await stream.get()
                server.metrics.outcome("timeout")
                return _error(_end_error("abort", None, "timeout"))
            if out.finished:
                finals[stream.request_ids.index(out.request_id) * n + out.index] = out
    finally:
        if not stream.done:
            server.engine.abort(stream)
    outs = [finals[i] for i in range(stream.expected)]
    bad = [o for o in outs if o.finish_reason not in P.FINISH_REASONS]
    if bad:
        reason = bad[0].finish_reason
        server.metrics.outcome("error" if reason == "error" else "abort")
        return _error(_end_error(reason, bad[0].error, "shutdown" if server.status == "draining" else None))
    server.metrics.outcome(outs[0].finish_reason)  # the request's outcome: its first choice's "stop" or "length"
    use = P.usage(sum(prompt_lens), sum(len(o.output_token_ids) for o in outs))
    texts, finish = [o.text or "" for o in outs], [P.FINISH_REASONS[o.finish_reason] for o in outs]
    make = P.completion_response if parsed.kind == "completion" else P.chat_response
    return JSONResponse(make(rid, int(time.time()), server.options.model_name, texts, finish, use))


# --------------------------------------------------------------------------------------------------- running it


class _DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT drain first: 503 to new requests, the rest finish or are aborted, then exit 0."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.minillm = server
        self._draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining:  # a second signal: stop now
            self.should_exit = True
            return
        self._draining = True
        loop = asyncio.get_event_loop()

        async def drain_then_exit() -> None:
            await self.minillm.drain()
            self.should_exit = True

        loop.call_soon_threadsafe(lambda: loop.create_task(drain_then_exit()))


def loopback_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on `host`:`port` (port 0: a free one), bound before uvicorn starts.

    A host that does not resolve is a ValueError naming it; a port in use (or not ours to take) stays an OSError,
    with the address in its message."""
    if not isinstance(host, str) or not host:
        raise TypeError(f"host must be a non-empty str (an address or a name), got {host!r}")
    port = check_int("port", port, 0)
    if port > 65535:
        raise ValueError(f"port must be in [0, 65535] (0: a free one), got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except socket.gaierror as exc:
        sock.close()
        raise ValueError(f"host {host!r} does not resolve to an address to listen on: {exc.strerror}") from None
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> int:
    """Run `server` until SIGTERM/SIGINT (drained), in this thread; returns the exit code, 0."""
    check_instance("server", server, Server, "a minillm serve.app.Server")
    log_level = check_choice("log_level", log_level, ("critical", "error", "warning", "info", "debug", "trace"))
    sock = loopback_socket(host, port)
    print(f"minillm serving {server.options.model_name!r} on http://{host}:{sock.getsockname()[1]} "
          f"(OpenAI API at /v1, metrics at /metrics, dashboard at /dashboard)", flush=True)
    config = uvicorn.Config(server.app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False)
    _DrainingServer(config, server).run(sockets=[sock])
    return 0


class ServerThread:
    """An in-process server on a loopback port, in a thread (notebooks, tests, the tour): `with ServerThread(s) as
    t: t.url`. Leaving the block drains it (shutdown_timeout applies) and joins the thread."""

    def __init__(self, server: Server, host: str = "127.0.0.1", timeout: float = 60.0):
        if not isinstance(server, Server):
            raise TypeError(f"server must be a minillm.serve.app.Server, got {type(server).__name__}")
        timeout = check_float("timeout", timeout, minimum=0.0, include_minimum=False)
        self.server = server
        self.sock = loopback_socket(host, 0)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(server.app, log_level="warning", timeout_graceful_shutdown=5, access_log=False)
        self.uvicorn = uvicorn.Server(config)
        self.timeout = timeout
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]},
                                       name="minillm-server", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not (self.uvicorn.started and self.server.status == "ready"):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start within {self.timeout} s")
            time.sleep(0.01)
        return self

    def drain(self) -> None:
        """Drain from this thread (what SIGTERM does in `serve`), then stop uvicorn."""
        loop = self._loop()
        if loop is not None and self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.drain(), loop).result(
                self.server.options.shutdown_timeout + 30)
        self.uvicorn.should_exit = True

    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self.server.engine._loop

    def __exit__(self, *exc: object) -> None:
        try:
            self.drain()
        finally:
            self.uvicorn.should_exit = True
            self.thread.join(self.timeout)
            self.sock.close()
            if self.thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not stop within {self.timeout} s")
