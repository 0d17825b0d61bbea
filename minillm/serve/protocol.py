"""The OpenAI wire format: request bodies checked field by field, responses and stream chunks built, SSE framed.

Everything here is plain data in, plain data out (dicts, strings, bytes): no sockets, no engine. The server
(`minillm.serve.app`) parses a body with `parse_completion` / `parse_chat`, hands the engine the `EngineRequest`s
they return, and turns each `RequestOutput` back into the JSON a client of the OpenAI API expects.

    body (JSON) --parse_completion / parse_chat--> ParsedRequest(prompts, SamplingParams, stream, ...)
                                                    | (a RequestError -> 400 {"error": {message, type, param, code}})
    engine outputs --completion_chunk / chat_chunk--> sse_event(chunk) = b"data: {...}\\n\\n" ... b"data: [DONE]\\n\\n"

The mapping, written down once:
- finish_reason: the engine's "stop" (end of text or a stop string) and "length" (max_tokens or the context window)
  pass through as OpenAI's. A request that fails alone ("error"), is aborted by the server (its timeout, a drain
  that ran out of time) or cannot be served ends a stream with an error event, `data: {"error": {...}}`, then
  `data: [DONE]` (the status line, 200, was sent with the first byte), and a non-streamed request with an HTTP error
  (500, 503 or 504). A client that disconnects gets nothing: its request is aborted.
- The chat template (our model has no chat training; the template only makes turns visible in plain text):
  each message becomes "### System:\\n...", "### User:\\n..." or "### Assistant:\\n..." followed by a blank line,
  and the prompt ends with "### Assistant:\\n". Chat requests also stop at "\\n### " (the next turn's marker).
- Fields of the API the engine does not have (logprobs, echo, penalties, logit_bias, tools, suffix) are refused
  with a 400 naming them rather than silently ignored; unknown fields too (a misspelt "max_token" would otherwise
  be ignored and the default used).
What it leaves out: logprobs (the sampler does not keep them), tools and function calls, images, `best_of` > n.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from minillm.core.config import check_int, check_label, short_repr
from minillm.core.sampling import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")
CHAT_STOP = "\n### "  # where the model starts a next turn on its own: every chat request stops there
MAX_STOP_STRINGS = 4  # the OpenAI API's limit
MAX_N = 16  # samples per prompt (each holds its own KV blocks after the shared prompt)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default for max_tokens
API_SEED_LIMIT = 2**32  # seeds the API takes: [0, 2**32), each giving its own samples on every device


class RequestError(ValueError):
    """A request the server refuses: its HTTP status and the OpenAI error object's fields."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`; param and code None or str."""
    message, type = check_label("message", message), check_label("type", type)
    param, code = (None if v is None else check_label(name, v) for name, v in (("param", param), ("code", code)))
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------------------------------- SSE framing


def _check_event_data(data: Any) -> None:
    """A TypeError/ValueError naming `data` unless it is a one-line str or a dict of JSON values.

    subtle: json.dumps would write NaN and inf as the bare words NaN and Infinity, which are not JSON (a client's
    parser refuses the chunk), and a str with a newline would end the `data:` line early: both are refused here."""
    if isinstance(data, str):
        if "\n" in data or "\r" in data:
            raise ValueError(f"data as a str must be one line (an event's data line), got {short_repr(data)}")
        return
    if not isinstance(data, dict):
        raise TypeError(f"data must be a dict (sent as JSON) or a str, got {type(data).__name__}")
    stack: list[Any] = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"data's objects must have str keys, got {list(value)[:5]!r}")
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"data must hold finite numbers (JSON has no NaN or inf), got {value}")
        elif value is not None and not isinstance(value, (str, int, float)):
            raise TypeError(f"data must hold JSON values (dict, list, str, number, bool, None), got "
                            f"{type(value).__name__}")


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying `data`: a dict as compact JSON, or a string as it is ("[DONE]").

    The frame is the line `data: <payload>` and a blank line, UTF-8 encoded: b'data: {"a":1}\\n\\n'. JSON never
    holds a raw newline (json.dumps escapes it inside strings), so one event is always one `data:` line.
    """
    _check_event_data(data)
    # BEGIN SOLUTION
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")
    # END SOLUTION


SSE_DONE = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------------- request bodies


@dataclass
class ParsedRequest:
    """A checked request: what the engine needs, and what the response must echo."""

    kind: str  # "completion" or "chat"
    prompts: list[str | list[int]]  # one or more prompts (a completions batch); chat: the rendered conversation
    params: SamplingParams  # n, max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with `usage` and no choices
    max_tokens_given: bool = True  # False: max_tokens defaulted (then the context window caps it, not a 400)
    extra: dict[str, Any] = field(default_factory=dict)


_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "user",
           "top_k", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "best_of"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                         "tool_choice"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _printable(name: str) -> str:
    """A field name as it can be echoed in a UTF-8 error body: a lone surrogate ("\\ud800") escaped, the rest as
    it is."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a number, got {short_repr(value)}", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {short_repr(value)}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer, got {short_repr(value)}", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {short_repr(value)}", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {short_repr(value)}", name)
    return value


def parse_stop(value: Any) -> tuple[str, ...]:
    """The `stop` field as a tuple of strings: null -> (), "x" -> ("x",), a list of 1-4 non-empty strings as it is.

    Anything else is a RequestError with param "stop": a number, a list holding a non-string or an empty string
    (it would match everywhere), more than four strings (the API's limit).
    """
    # BEGIN SOLUTION
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise RequestError(f"stop must be a string or a list of strings, got {short_repr(value)}", "stop")
    if len(value) > MAX_STOP_STRINGS:
        raise RequestError(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(value)}", "stop")
    for s in value:
        if not isinstance(s, str) or s == "":
            raise RequestError(f"every stop sequence must be a non-empty string, got {s!r}", "stop")
    return tuple(value)
    # END SOLUTION


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields of the API this engine cannot honour: refused unless they ask for what the engine does anyway."""
    def is_(name: str, *allowed: Any) -> bool:  # the value is one of `allowed`, of the same JSON type
        value = body.get(name)
        return any(value == a and type(value) is type(a) for a in allowed)

    unsupported = {
        "logprobs": not is_("logprobs", None, False, 0),  # the legacy API's integer or the chat API's flag
        "top_logprobs": not is_("top_logprobs", None, 0),
        "echo": not is_("echo", None, False),
        "suffix": not is_("suffix", None, ""),
        "presence_penalty": not is_("presence_penalty", None, 0, 0.0),
        "frequency_penalty": not is_("frequency_penalty", None, 0, 0.0),
        "logit_bias": not is_("logit_bias", None, {}),
        "tools": not is_("tools", None, []),
        "tool_choice": not is_("tool_choice", None, "none"),
        "response_format": not is_("response_format", None, {"type": "text"}),
        "best_of": not (is_("best_of", None, 1) or is_("best_of", body.get("n", 1))),
    }
    for name, refused in unsupported.items():
        if name in body and refused:
            raise RequestError(f"{name}={body[name]!r} is not supported by this server", name, "unsupported_parameter")


def _check_server_side(model_name: Any, vocab_size: Any = 1) -> None:
    """The server's own arguments (not the client's): a TypeError/ValueError, never a 400 blaming the request."""
    if not isinstance(model_name, str) or not model_name:
        raise TypeError(f"model_name must be the served model's name, a non-empty str, got {model_name!r}")
    check_int("vocab_size", vocab_size)


def _common(body: Any, fields: set[str], model_name: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", None)
    unknown = sorted(_printable(k) for k in set(body) - fields)
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(f"model must be a string naming the served model ({model_name!r}), got {model!r}", "model")
    if model != model_name:
        raise RequestError(f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found", status=404)
    _refuse_unsupported(body)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError(f"stream_options must be an object with include_usage only, got {options!r}",
                               "stream_options")
        include_usage = _flag(options, "include_usage")
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise RequestError(f"user must be a string, got {body['user']!r}", "user")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < API_SEED_LIMIT):
        raise RequestError(f"seed must be an integer in [0, 2**32), got {short_repr(seed)} (torch's CPU generator "
                           f"keeps 32 bits of a seed: 0 and 2**32 would give the same samples)", "seed")
    return {
        "stream": stream, "include_usage": include_usage, "seed": seed,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0),
        "top_k": _integer(body, "top_k", 0, 0, 1 << 30),
        "n": _integer(body, "n", 1, 1, MAX_N),
        "stop": parse_stop(body.get("stop")),
        "ignore_eos": _flag(body, "ignore_eos"),
    }


def _params(common: dict[str, Any], max_tokens: int, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
    temperature = common["temperature"]
    if 0.0 < temperature < 1e-2:
        temperature = 0.0  # below the sampler's smallest temperature the distribution is the argmax anyway
    if common["top_p"] == 0.0:
        raise RequestError("top_p must be greater than 0 (use temperature 0 for greedy decoding)", "top_p")
    return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=common["top_k"],
                          top_p=common["top_p"], seed=common["seed"], stop=common["stop"] + extra_stop,
                          ignore_eos=common["ignore_eos"], n=common["n"])


def _prompt_list(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    """The completions `prompt`: a string, a list of token ids, or a list of either (a batch)."""
    def one(p: Any) -> str | list[int]:
        if isinstance(p, str):
            if p == "":
                raise RequestError("prompt must not be empty", "prompt")
            return p
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", "prompt")
            return list(p)
        raise RequestError(f"prompt must be a non-empty string or a list of token ids, got {short_repr(p)}", "prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [one(p) for p in prompt]  # a batch: ["a", "b"] or [[1, 2], [3]]
    return [one(prompt)]


def parse_completion(body: Any, model_name: str, vocab_size: int) -> ParsedRequest:
    """A `/v1/completions` body, checked: RequestError (400, naming the field) for anything the API would refuse."""
    _check_server_side(model_name, vocab_size)
    common = _common(body, COMPLETION_FIELDS, model_name)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    prompts = _prompt_list(body["prompt"], vocab_size)
    max_tokens = _integer(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, 0, 1 << 30)
    return ParsedRequest("completion", prompts, _params(common, max_tokens), common["stream"],
                         common["include_usage"], max_tokens_given=body.get("max_tokens") is not None)


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}, got "
                                   f"{short_repr(part)}", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got {short_repr(content)}",
                       f"messages[{i}].content")


def render_chat(messages: Any) -> str:
    """The conversation as one prompt, in this server's chat template (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list, got {short_repr(messages)}", "messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object, got {short_repr(message)}", f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}",
                               f"messages[{i}].role")
        turns.append(f"### {role.capitalize()}:\n{_content(message, i)}\n\n")
    return "".join(turns) + "### Assistant:\n"


def parse_chat(body: Any, model_name: str) -> ParsedRequest:
    """A `/v1/chat/completions` body, checked; max_tokens (or max_completion_tokens) defaults to the context left."""
    _check_server_side(model_name)
    common = _common(body, CHAT_FIELDS, model_name)
    if "messages" not in body:
        raise RequestError("messages is required", "messages")
    prompt = render_chat(body["messages"])
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, None, 0, 1 << 30)
    given = max_tokens is not None
    return ParsedRequest("chat", [prompt], _params(common, max_tokens if given else 1 << 30, (CHAT_STOP,)),
                         common["stream"], common["include_usage"], max_tokens_given=given)


def check_context(num_prompt_tokens: int, max_tokens: int, context_length: int, given: bool,
                  prompt_param: str = "prompt") -> int:
    """The max_tokens to run with: a prompt that leaves no room, or asks for more than is left, is a 400 with
    code "context_length_exceeded" (as the OpenAI API answers); a defaulted max_tokens is capped to what is left.
    `prompt_param` is the field the prompt came in ("prompt", or a chat request's "messages"), named by the 400."""
    prompt_param = check_label("prompt_param", prompt_param)
    num_prompt_tokens = check_int("num_prompt_tokens", num_prompt_tokens, 0)
    max_tokens = check_int("max_tokens", max_tokens, 0)
    context_length = check_int("context_length", context_length)
    if not isinstance(given, bool):
        raise TypeError(f"given must be a bool (was max_tokens in the request?), got {given!r}")
    room = context_length - num_prompt_tokens
    if room <= 0 or (given and max_tokens > room):
        asked = f"{num_prompt_tokens} in the prompt" + (f" + {max_tokens} to generate" if given else "")
        raise RequestError(f"this model's maximum context length is {context_length} tokens; the request needs "
                           f"{asked}", "max_tokens" if given and room > 0 else prompt_param, "context_length_exceeded")
    return min(max_tokens, room)


# --------------------------------------------------------------------------------------------------- responses

# The engine's finish reasons -> OpenAI's: the end-of-text token and a stop string are both "stop" (the model
# chose to end); "abort" and "error" end a response with an error instead (see app.py).
FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The OpenAI usage object of token counts (ints >= 0)."""
    prompt_tokens = check_int("prompt_tokens", prompt_tokens, 0)
    completion_tokens = check_int("completion_tokens", completion_tokens, 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None) -> dict[str, Any]:
    """One streamed `text_completion` chunk for choice `index`."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, str],
               finish_reason: str | None) -> dict[str, Any]:
    """One streamed `chat.completion.chunk` for choice `index`; its first carries {"role": "assistant"}."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, kind: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: no choices, the whole request's usage."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def completion_response(rid: str, created: int, model: str, texts: list[str], finish: list[str],
                        use: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                        for i, (t, f) in enumerate(zip(texts, finish))], "usage": use}


def chat_response(rid: str, created: int, model: str, texts: list[str], finish: list[str],
                  use: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                         "finish_reason": f} for i, (t, f) in enumerate(zip(texts, finish))], "usage": use}
