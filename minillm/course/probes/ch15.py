"""Chapter 15's probes: SSE frames, `stop` fields, percentiles and goodput on data drawn from the seed."""

from __future__ import annotations

from minillm.serve.loadgen import SLO, RequestRecord, goodput, percentile
from minillm.serve.protocol import RequestError, parse_stop, sse_event
from . import Probe, outcome, rng

WORDS = ("a", "x y", "line one\nline two", 'say "hi"', "back\\slash", "\u00e9t\u00e9", "\u4e2d\u6587", "\U0001f600",
         "tab\there", "")


def _value(r, depth: int = 0):
    """A JSON value: numbers, bools, None, strings with newlines, quotes and non-ASCII, nested lists and dicts."""
    kind = r.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return r.randrange(-1000, 1000)
    if kind == 1:
        return round(r.uniform(-10, 10), r.randrange(1, 6))
    if kind == 2:
        return r.choice((True, False, None))
    if kind in (3, 4):
        return r.choice(WORDS)
    if kind == 5:
        return [_value(r, depth + 1) for _ in range(r.randrange(0, 4))]
    return {r.choice(WORDS) or "k": _value(r, depth + 1) for _ in range(r.randrange(0, 4))}


def _frame(data) -> dict:
    """sse_event's frame as its type and its text (bytes are not plain data; a str frame shows as its repr)."""
    out = sse_event(data)
    return {"type": type(out).__name__, "text": out.decode("utf-8") if isinstance(out, bytes) else repr(out)}


def sse_events(seed: int) -> list:
    """Frames of random dicts (nested, with newlines, quotes and non-ASCII inside strings, which JSON escapes or
    keeps as UTF-8), an empty dict, "[DONE]" and a one-line string: the frame's type and its text, byte for byte."""
    r = rng(seed)
    cases: list = [{}, "[DONE]", "plain text \u00e9", {"object": "text_completion", "choices": [{"text": "\n"}]}]
    cases += [{r.choice(WORDS) or "key": _value(r) for _ in range(r.randrange(1, 5))} for _ in range(10)]
    return [outcome(lambda d=d: _frame(d)) for d in cases]


def _stop(value):
    """parse_stop's result and its type, or the refusal's type, param and status."""
    try:
        out = parse_stop(value)
    except RequestError as e:
        return {"raises": "RequestError", "param": e.param, "status": e.status}
    return {"type": type(out).__name__, "value": out}


def parse_stops(seed: int) -> list:
    """None, strings (the empty one refused), lists of 0 to 6 strings (more than 4 refused), lists with an empty
    string or a non-string at a random place, and other types (a number, a bool, a tuple, a dict)."""
    r = rng(seed)
    words = [w for w in WORDS if w] + ["\n", "###", "</s>"]
    cases: list = [None, "", "\n", r.choice(words), [], 3, True, 2.5, ("a",), {"s": "a"}]
    for n in range(0, 7):
        cases.append([r.choice(words) for _ in range(n)])
    for bad in ("", 1, None, ["a"]):
        xs = [r.choice(words) for _ in range(r.randrange(1, 4))]
        xs.insert(r.randrange(len(xs) + 1), bad)
        cases.append(xs)
    return [outcome(lambda v=v: _stop(v)) for v in cases]


def percentiles(seed: int) -> list:
    """Unsorted lists of 1 to 40 values (ints and floats, with duplicates) at q = 0, 100, 50, 25, 90, 99.9 and
    random q (fractional ranks near 0 and 1 included); each result and the list after the call (left as it was)."""
    r = rng(seed)
    outs = []
    for n in (1, 2, 3, 4, 7, 10, 40):
        values = [r.choice((r.randrange(-50, 50), round(r.uniform(-100, 100), 3))) for _ in range(n)]
        if n > 3:
            values[r.randrange(n)] = values[0]  # a duplicate
        qs = [0, 100, 50, 25, 90, 99.9, r.uniform(0, 100)] + [100 * f / max(n - 1, 1) for f in (1 - 1e-6, 1 + 1e-6)]
        before = list(values)
        got = [outcome(lambda q=q: percentile(values, q)) for q in qs if q <= 100]
        outs.append({"got": got, "unchanged": values == before})
    return outs


def _record(r, i: int, ttft: float | None, gaps: list[float], tokens: int | None = None,
            success: bool = True) -> RequestRecord:
    """A request sent at a random time whose first text chunk came `ttft` s later (no chunk when None), the next
    ones `gaps` apart (none without a first); `tokens` output tokens (the number of chunks when None)."""
    send = r.randrange(0, 8) * 0.25
    chunks = [] if ttft is None else [send + ttft]
    for gap in gaps if chunks else []:
        chunks.append(chunks[-1] + gap)
    n = len(chunks) if tokens is None else tokens
    return RequestRecord(index=i, prompt_len=5, max_tokens=max(n, 1), send_s=send, chunk_s=chunks,
                         done_s=chunks[-1] if chunks else send, output_tokens=n, success=success,
                         error=None if success else "500")


def goodputs(seed: int) -> list:
    """Requests meeting every bound, missing one bound each, failed ones that would meet every bound, one-token
    requests (no TPOT: a TPOT bound is met), requests with no text chunk (no TTFT, no E2E), TPOT from the token count
    not the chunk count, values exactly on a bound; every combination of bounds over random durations."""
    r = rng(seed)
    records = [
        _record(r, 0, 0.25, [0.125, 0.125]),  # TTFT 0.25, TPOT 0.125, E2E 0.5
        _record(r, 1, 1.5, [0.125]),  # slow first token
        _record(r, 2, 0.125, [0.5, 0.5]),  # slow tokens
        _record(r, 3, 0.125, [0.125], success=False),  # fast, but failed
        _record(r, 4, 0.125, [], success=False),
        _record(r, 5, 0.5, []),  # one token
        _record(r, 6, 0.75, [], tokens=1),
        _record(r, 7, None, []),  # no text at all
        _record(r, 8, 0.125, [0.125] * 20),  # a long tail: E2E 2.625
        _record(r, 9, 0.25, [0.25, 0.25], tokens=9),  # TPOT 0.5 / 8 = 0.0625 by tokens, 0.25 by chunks
        _record(r, 10, 0.5, [0.25, 0.25]),  # on the bounds: TTFT 0.5, TPOT 0.25, E2E 1.0
    ]
    records += [_record(r, 11 + i, r.choice((0.125, 0.25, 0.5, 1.0, None)), [r.choice((0.0625, 0.25, 0.5))
                for _ in range(r.randrange(0, 4))], success=r.random() < 0.8) for i in range(8)]
    bounds = [(None, None, None), (0.5, None, None), (None, 0.25, None), (None, None, 1.0), (0.5, 0.25, 1.0),
              (1.0, 0.125, 3.0), (0.25, 0.0625, 1.0)]
    outs = []
    for ttft_s, tpot_s, e2e_s in bounds:
        slo = SLO(ttft_s=ttft_s, tpot_s=tpot_s, e2e_s=e2e_s)
        duration = r.choice((1.0, 2.0, 2.5, 10.0))
        outs.append([goodput(records, slo, duration), goodput(records[:1], slo, 1.0), goodput([], slo, 1.0),
                     [goodput([rec], slo, 1.0) for rec in records]])
    return outs


PROBES = {
    "sse_event": Probe(sse_events),
    "parse_stop": Probe(parse_stops),
    "percentile": Probe(percentiles, rtol=1e-9, atol=1e-9),
    "goodput": Probe(goodputs, rtol=1e-12, atol=0.0),
}
