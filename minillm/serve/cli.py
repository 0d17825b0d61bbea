"""`minillm serve`: one command puts a model behind the OpenAI API, with each earlier chapter's technique a flag.

    minillm serve                                   # base, on 127.0.0.1:8000, the engine's defaults
    minillm serve --enable-prefix-caching           # chapter 05's prefix cache
    minillm serve --speculative draft-model         # chapter 08: the shipped draft proposes, the target verifies
    minillm serve --quantize int8                   # chapter 09: int8 weight-only linears
    minillm serve --attention-backend selective-cpp # chapter 13: the C++ decode attention
    minillm serve --tensor-parallel-size 2          # chapter 14: two ranks on gloo
    minillm serve --kv-dtype bfloat16               # chapter 09: a narrower KV cache

`build_engine` is the same switchboard as a function, for the tour, the benchmark and the notebook. What it leaves
out: several models in one server, LoRA adapters, and authentication (it listens on loopback by default; put a
proxy that checks keys in front of it before you open it to a network).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import select
import signal
import subprocess
import sys
import time

import httpx
import torch

from minillm.bench.cli import threads_argument
from minillm.core.config import check_float, check_instance, check_int
from minillm.core.device import DEVICE_CHOICES
from minillm.gpt.pretrained import SHIPPED_PRESETS
from minillm.engine.process import WorkerDiedError
from minillm.serve.app import Server, ServeOptions, serve
from minillm.serve.engine_process import QUANTIZE_CHOICES, EngineProcess, build_engine
from minillm.speculative.engine import METHODS as SPECULATIVE_METHODS
from minillm.tokenizer import load_tokenizer


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _check_serve_args(args: argparse.Namespace) -> ServeOptions:
    """The flags that need no model, checked before one is loaded (each error names its flag); the options."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0: a free one), got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.served_model_name is not None and not args.served_model_name:
        raise ValueError("--served-model-name must not be empty: clients pass it as `model`")
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    for flag in ("max_queued_requests", "max_queued_tokens", "max_request_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return ServeOptions(model_name=args.served_model_name or args.model,
                        max_queued_requests=args.max_queued_requests, max_queued_tokens=args.max_queued_tokens,
                        request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
                        max_request_bytes=args.max_request_bytes)


def _cmd_serve(args: argparse.Namespace) -> int:
    options = _check_serve_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    build = dict(model=args.model, device=args.device, speculative=args.speculative, draft=args.draft_model,
                 gamma=args.gamma, quantize=args.quantize, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
                 enable_chunked_prefill=not args.no_chunked_prefill, attention_backend=args.attention_backend,
                 kv_dtype=args.kv_dtype, tensor_parallel_size=args.tensor_parallel_size)
    if args.engine_core == "process":  # the engine in a child process; this one tokenizes and talks HTTP
        try:
            engine, tokenizer = EngineProcess(build, threads=args.threads), load_tokenizer()
        except WorkerDiedError as exc:  # the child's traceback ends with what was wrong
            print(f"minillm serve: the engine could not start: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
            return 2
    else:
        engine, tokenizer = build_engine(**build)
    try:
        return serve(Server(engine, tokenizer, options), args.host, args.port, args.log_level)
    finally:
        close = getattr(engine, "stop" if isinstance(engine, EngineProcess) else "close", None)
        if close is not None:
            close()


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    check_instance("subparsers", subparsers, argparse._SubParsersAction, "an ArgumentParser's add_subparsers()")
    p = subparsers.add_parser("serve", help="chapter 15: serve a model behind the OpenAI API (FastAPI + uvicorn)")
    p.add_argument("--model", default="base", choices=sorted(SHIPPED_PRESETS),
                   help="the shipped model to serve (default: base)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", choices=DEVICE_CHOICES)
    p.add_argument("--threads", type=threads_argument, default=None,
                   help="torch threads of the engine (default: torch's choice)")
    p.add_argument("--engine-core", default="process", choices=("process", "thread"),
                   help="run the engine core in a process of its own (default) or on a thread of the server's")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    g = p.add_argument_group("the engine (chapters 05-14)")
    g.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the pool (chapter 05)")
    g.add_argument("--max-num-seqs", type=int, default=32, help="the most requests running at once (chapter 06)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step (chapter 06)")
    g.add_argument("--enable-prefix-caching", action="store_true", help="share cached prompt blocks (chapter 05)")
    g.add_argument("--no-chunked-prefill", action="store_true", help="prefill whole prompts (chapter 06)")
    g.add_argument("--speculative", default="none", choices=("none",) + tuple(SPECULATIVE_METHODS),
                   help="speculative decoding (chapter 08)")
    g.add_argument("--draft-model", default="draft", help="the draft for --speculative draft-model")
    g.add_argument("--gamma", type=int, default=4, help="draft tokens per step (chapter 08)")
    g.add_argument("--quantize", default="none", choices=QUANTIZE_CHOICES, help="weight-only quantization (ch. 09)")
    g.add_argument("--attention-backend", default="selective",
                   help="selective, paged, paged-int8, selective-cpp (the C++ decode attention of chapter 13)")
    g.add_argument("--kv-dtype", default="float32", help="KV cache dtype: float32, bfloat16, float16 (chapter 09)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks on gloo (chapter 14)")
    s = p.add_argument_group("admission and time limits")
    s.add_argument("--max-queued-requests", type=int, default=256,
                   help="samples in flight before new requests get 429 (default 256)")
    s.add_argument("--max-queued-tokens", type=int, default=1 << 20,
                   help="their tokens (prompt + max_tokens) in flight before 429")
    s.add_argument("--request-timeout", type=_positive_float, default=600.0, help="seconds per request")
    s.add_argument("--max-request-bytes", type=int, default=1 << 22,
                   help="request bodies larger than this get 413 before they are parsed (default 4 MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds a SIGTERM drain waits for requests in flight before aborting them")
    p.set_defaults(handler=_cmd_serve)


class ServerProcess:
    """`minillm serve` in a child process on a free loopback port, for benchmarks and the tour: the server then
    has its own interpreter (its own GIL), as in a deployment, instead of sharing one with the client.

        with ServerProcess(["--enable-prefix-caching"], threads=1) as url: ...   # url = "http://127.0.0.1:PORT"

    Leaving the block sends SIGTERM (the server drains) and waits for exit code 0; a server that does not start, or
    does not stop, within `timeout` seconds is killed and raises."""

    def __init__(self, args: list[str] | tuple[str, ...] = (), threads: int | None = 1, timeout: float = 120.0):
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise TypeError(f"args must be a list of command-line strings, got {args!r}")
        if threads is not None:
            threads = check_int("threads", threads)
        timeout = check_float("timeout", timeout, minimum=0.0, include_minimum=False)
        self.cmd = [sys.executable, "-m", "minillm", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        if threads is not None:
            self.cmd += ["--threads", str(threads)]
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = self._first_line()
            match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            if match is None:
                raise RuntimeError(f"`minillm serve` did not start: {line.strip() or 'no output'}")
            self.url = f"http://127.0.0.1:{match.group(1)}"
            deadline = time.monotonic() + self.timeout
            while not self._healthy():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"`minillm serve` at {self.url} did not become healthy in {self.timeout} s")
                time.sleep(0.05)
        except BaseException:
            self._kill()
            raise
        return self.url

    def _first_line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        return self.proc.stdout.readline() if ready else ""

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        try:
            self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            raise RuntimeError(f"`minillm serve` at {self.url} did not stop within {self.timeout} s") from None
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if code != 0 and exc[0] is None:
            raise RuntimeError(f"`minillm serve` at {self.url} exited with {code}")
