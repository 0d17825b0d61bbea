"""Probes: what the grader compares, so that no verdict is decided where the student's code runs.

The graded tests run inside the grading child, in the same process as the student's code, and report over a pipe:
code that forges those reports (or rewires pytest) could claim passes. A probe closes that. For each exercise, a
probe calls the exercise's function (or drives its class) on inputs drawn from a seed and returns plain data: ints,
floats, strings, lists, dicts and tensors, never objects. The parent draws a fresh seed for every grading (the child
learns it only when it starts), computes the reference's outputs in its own process *before* the child starts, and
compares what the child sends back under the probe's tolerance. A graded test is worth its points only when pytest
reported it passed *and* the probes of every exercise it grades agreed: forged passes earn nothing, because the
data can only be right if the student's function computes it.

One module per chapter with exercises, `chNN` (ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11,
ch12, ch13, ch14, ch15): `PROBES = {exercise: Probe(...)}`. Each imports the chapter's modules as `minillm.*`, which
in the child is the student's copy and in the parent the reference.

The child loads this package from the grader's own files by path (student folders do not hold the chapter modules:
some write out reference rules for the helper exercises they call). A probe's output has to equal the reference's on
this grading's inputs, whoever wrote the code that produced it (chapter 12's kernel runs through the grader's own
emulator, loaded by path too). What it does not settle: properties a graded test checks beyond the probe's inputs. Without
isolation the student's code could also rewrite these files for the next grading; the grader then warns.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import select
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

from minillm.core.config import short_repr

PROBES_DIR = Path(__file__).resolve().parent
GRADER_FILES_DIR = PROBES_DIR.parent.parent  # the grader's minillm/: probes may load a trusted module from it by path
MAX_NUMBERS = 200_000  # a probe's output is small data; more is refused (a student cannot flood the parent)
PROBE_SECONDS = 120.0  # one probe's limit in the grading child (each runs in ~0.1-5 s on one thread)
MAX_PROBE_BYTES = 16 << 20  # what a forked probe may send back (MAX_NUMBERS as JSON is a few MB)


@dataclass(frozen=True)
class Probe:
    """One exercise's probe: `run(seed)` returns its outputs as plain data; floats (and float tensors) agree when
    |got - want| <= atol + rtol * |want|, everything else exactly."""

    run: Callable[[int], Any]
    rtol: float = 0.0
    atol: float = 0.0


def generator(seed: int) -> torch.Generator:
    """The probe's torch generator (CPU), seeded: the same inputs in the parent and in the child."""
    return torch.Generator().manual_seed(seed)


def rng(seed: int) -> random.Random:
    """The probe's Python random generator, seeded."""
    return random.Random(seed)


def outcome(call: Callable[[], Any]) -> Any:
    """What `call()` returned, or {"raises": <exception type name>} when it raised: a probe records an expected
    error as data (e.g. an allocator out of blocks), so the student's code must raise the same type."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the type is the data
        return {"raises": type(e).__name__}


@contextmanager
def substituted(module: ModuleType, **rules: Callable) -> Iterator[None]:
    """`module`'s functions named in `rules` replaced by them while the block runs, restored after. A probe of an
    exercise that calls other exercises of its chapter runs them on the reference's rules (written out in the
    probe), so that a mistake in one of them shows in its own probe only."""
    saved = {name: getattr(module, name) for name in rules}
    for name, rule in rules.items():
        setattr(module, name, rule)
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(module, name, f)


def chapter_module(nn: str, package: str = __name__) -> ModuleType:
    """The probes of chapter nn (`chNN` in this package, imported under `package`)."""
    return importlib.import_module(f"{package}.ch{nn}")


def run_probes(probes: dict[str, Probe], seed: int, isolate: bool = False,
               seconds: float = PROBE_SECONDS) -> dict[str, dict]:
    """{exercise: {"data": encoded outputs} or {"error": "Type: message"}} for every probe, in order. With
    `isolate` (the grading child) each probe runs in a forked process of its own, limited to `seconds`: a student's
    kernel that segfaults or loops costs that exercise only, not the chapter's other probes."""
    results = {}
    for exercise, probe in probes.items():
        if isolate and hasattr(os, "fork"):
            results[exercise] = _run_forked(probe, seed, seconds)
        else:
            results[exercise] = _run_one(probe, seed)
    return results


def _run_one(probe: Probe, seed: int) -> dict:
    try:
        return {"data": encode(probe.run(seed))}
    except Exception as e:  # noqa: BLE001 - the student's code may raise anything; it is reported as data
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def _run_forked(probe: Probe, seed: int, seconds: float) -> dict:
    """`_run_one` in a forked child that sends its JSON back over a pipe; a signal, a silent exit or `seconds`
    passing is an error naming it (the child is killed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked child: run, send, leave without running any exit handler of the parent's
        os.close(read_end)
        code = 0
        try:
            payload = json.dumps(_run_one(probe, seed)).encode()
            with os.fdopen(write_end, "wb") as out:
                out.write(payload)
        except BaseException:  # noqa: BLE001 - whatever happens, the parent names it from the exit code
            code = 1
        os._exit(code)
    os.close(write_end)
    chunks, size, deadline = [], 0, time.monotonic() + seconds
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while (left := deadline - time.monotonic()) > 0 and size <= MAX_PROBE_BYTES:
            if not select.select([pipe], [], [], left)[0]:
                continue
            chunk = pipe.read(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    if time.monotonic() >= deadline or size > MAX_PROBE_BYTES:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        why = f"took longer than {seconds:g} s" if size <= MAX_PROBE_BYTES else "sent more than its share of data"
        return {"error": f"ProbeFailed: the exercise {why}; its process was killed"}
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"error": f"ProbeFailed: the exercise's process died of {signal.Signals(os.WTERMSIG(status)).name}"}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return {"error": f"ProbeFailed: the exercise's process exited ({os.WEXITSTATUS(status)}) without its data"}


# --------------------------------------------------------------------------------------------- plain data
def encode(value: Any, _count: list[int] | None = None) -> Any:
    """`value` as JSON-able plain data: tensors become {"tensor": dtype, "shape": [...], "values": [...]}; tuples
    become lists. Anything else (an object, a function) is a TypeError: probes return data only."""
    count = [0] if _count is None else _count
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
        count[0] += t.numel()
        if count[0] > MAX_NUMBERS:
            raise ValueError(f"a probe's output holds more than {MAX_NUMBERS:,} numbers")
        if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
            t = t.float()
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(t.shape),
                "values": t.reshape(-1).tolist()}
    if value is None or isinstance(value, (bool, int, float, str)):
        count[0] += 1
        return value
    if isinstance(value, (list, tuple)):
        return [encode(v, count) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v, count) for k, v in value.items()}
    raise TypeError(f"a probe returned a {type(value).__name__}; probes return plain data (numbers, strings, "
                    f"lists, dicts, tensors)")


def difference(want: Any, got: Any, rtol: float, atol: float, where: str = "output") -> str | None:
    """None when `got` equals `want` (floats within rtol/atol, NaN equal to NaN), else where and how they differ."""
    if isinstance(want, dict) and "tensor" in want and "values" in want:
        if not (isinstance(got, dict) and "tensor" in got and "values" in got and "shape" in got):
            return f"{where}: expected a tensor, got {_kind(got)}"
        if got["tensor"] != want["tensor"] or got["shape"] != want["shape"]:
            return (f"{where}: expected a {want['tensor']} tensor of shape {short_repr(want['shape'])}, got "
                    f"{got['tensor']!r:.40} of shape {short_repr(got['shape'])}")
        if not isinstance(got["values"], list) or len(got["values"]) != len(want["values"]):
            return f"{where}: the tensor's values do not match its shape"
        for i, (w, g) in enumerate(zip(want["values"], got["values"])):
            problem = _scalar_difference(w, g, rtol, atol, f"{where}, element {i} (flattened)")
            if problem:
                return problem
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            keys = sorted(got) if isinstance(got, dict) else _kind(got)
            return f"{where}: expected the keys {sorted(want)}, got {keys}"
        for k in want:
            problem = difference(want[k], got[k], rtol, atol, f"{where}[{short_repr(k)}]")
            if problem:
                return problem
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{where}: expected a list of {len(want)}, got {_kind(got)}"
        for i, (w, g) in enumerate(zip(want, got)):
            problem = difference(w, g, rtol, atol, f"{where}[{i}]")
            if problem:
                return problem
        return None
    return _scalar_difference(want, got, rtol, atol, where)


def _scalar_difference(want: Any, got: Any, rtol: float, atol: float, where: str) -> str | None:
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        try:  # `got` came from the child: an int too large for a float is a difference, not the grader's crash
            if math.isnan(want) and math.isnan(got):
                return None
            if want == got or (math.isfinite(want) and abs(got - want) <= atol + rtol * abs(want)):
                return None
        except OverflowError:
            pass
        return f"{where}: expected {want!r}, got {short_repr(got)}"
    if type(want) is not type(got) or want != got:
        return f"{where}: expected {short_repr(want)}, got {short_repr(got)}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__ if not isinstance(value, dict) else "a dict"
