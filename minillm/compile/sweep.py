"""Where `torch.compile` wins and where it loses on the CPU: decode at batch 1 and batch 8, and a prefill, on one
thread and on two, each compiled step against the same step eager.

What it measures, per case and thread count (`python -m minillm.compile.sweep`):
  - decode at batch B: `StaticDecoder(batch_size=B)` eager against compiled, each over its own static-shape cache
    prefilled with the same `context` tokens per row; one timed run is `steps` decode steps from that point (the
    cache is rolled back between runs with `truncate`), so both time the same positions;
  - prefill: the model's forward over a (B, T) prompt batch with no cache (`model.hidden`, then the head on the last
    row), eager against `torch.compile(..., dynamic=False)`;
  - for each: the compiled outputs against eager's (largest absolute logit difference, and the argmax of every
    row), the graphs built (a second graph for one case is a recompilation), the first call's seconds (the compile,
    or inductor's on-disk cache), and the speed-up: eager median / compiled median, the two timed in turn.
On CUDA each decode case also captures the eager step as a CUDA graph (`StaticDecoder(mode="cuda-graph")`, batch 1
and batched alike) and times its replay in the same interleaved run.
`profile_decode` gives the operators behind one case, eager and compiled, from `torch.profiler`: which calls the
compiled step still makes (the matrix products) and which it replaced with its own generated kernels.

Each thread count gets fresh graphs (`torch._dynamo.reset()` first): inductor writes the thread count into the
code it generates, so a graph built for one thread would run on one thread whatever `torch.set_num_threads` says
later. What it leaves out: the engine's ragged steps (their shapes change every step); other backends are one
`--backend` away (any of dynamo's).
The command: `python -m minillm.compile.sweep [--threads-list 1,2] [--quick] [--backend inductor] [--profile]
[--json FILE]`; `quotes(report)` gives the tables and the figures chapter 13's text includes from the saved report.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from minillm.bench.cli import bench_parser, cli_type, start, write_report
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.compile.decode import StaticDecoder, check_backend, check_eval_mode, counting_backend, own_code
from minillm.core.config import (check_choice, check_float, check_int, check_report, check_tensor_elements,
                                 check_threads, reads_report, short_repr)
from minillm.core.model import GPT, require_model
from minillm.core.sampling import check_seed
from minillm.core.timing import check_repeats, interleave, time_once
from minillm.kvcache.generate import prefill

# Logits of a compiled step against eager's: the same sums in another order (fused kernels, other blockings).
LOGIT_ATOL = 1e-3


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "prefill"
    batch: int  # rows: sequences per decode step, or prompts per prefill
    tokens: int  # decode: the context already in the cache; prefill: the prompt length T

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", check_choice("Case.kind", self.kind, ("decode", "prefill")))
        for field in ("batch", "tokens"):  # stored as the plain int, within the float range (frozen: object's setattr)
            object.__setattr__(self, field, check_int(f"Case.{field}", getattr(self, field)))

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode, batch {self.batch}, context {self.tokens}"
        return f"prefill, T = {self.tokens}" + (f", batch {self.batch}" if self.batch > 1 else "")


CASES = (Case("decode", 1, 64), Case("decode", 8, 64), Case("prefill", 1, 128))


def check_case(model: GPT, case: Case, steps: int) -> int:
    """A case the model can run, before any work: `steps` a positive int, and every position inside the context
    window (decode: the `tokens` of context plus `steps` more; prefill: the `tokens` of the prompt), since the
    learned position embedding stops at block_size, and a batch whose largest tensor fits `check_tensor_elements`.
    A TypeError / ValueError naming the argument otherwise; returns steps as the plain int it holds."""
    cfg = require_model(model, "the compile sweep")
    check_eval_mode(model, "the compile sweep")  # eager and compiled outputs are compared: no dropout
    if not isinstance(case, Case):
        raise TypeError(f"case must be a sweep Case, got {type(case).__name__} {case!r}")
    steps = check_int("steps", steps)
    needed = case.tokens + steps if case.kind == "decode" else case.tokens
    if needed > cfg.block_size:
        what = f"{case.tokens} context tokens + steps={steps}" if case.kind == "decode" else f"{case.tokens} tokens"
        raise ValueError(f"case {case.name!r} needs {what} = {needed} positions, past the model's context window "
                         f"block_size={cfg.block_size}")
    # the largest tensor the case allocates: decode, each layer's K (and V) cache; prefill, the MLP's (B, T, 4C)
    shape = ((case.batch, cfg.n_head, needed, cfg.head_size) if case.kind == "decode"
             else (case.batch, case.tokens, 4 * cfg.n_embd))
    check_tensor_elements("case.batch x case.tokens", shape)
    return steps


def check_backend_and_seed(backend: str, seed: int) -> tuple[str, int]:
    """What every entry point takes besides the case, before any work: `backend` one of dynamo's backends (a
    prefill case compiles with it too, not only the decoder, which checks its own), `seed` an int >= 0 (the inputs'
    manual_seed); a TypeError / ValueError naming the argument. Returns (backend, seed) as the plain str and int."""
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a torch.compile backend name, got {type(backend).__name__} {backend!r}")
    return check_backend(backend), check_seed(check_int("seed", seed, 0))  # [0, 2**64): torch's generator's range


def _ids(model: GPT, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, shape, generator=g).to(model.device)


def _decode_runs(model: GPT, case: Case, steps: int, mode: str, backend: str, seed: int
                 ) -> tuple[StaticDecoder, Callable[[], list[torch.Tensor]]]:
    """A decoder for the case, prefilled, and a run: `steps` decode steps from the end of the context."""
    dec = StaticDecoder(model, mode, backend=backend, max_len=case.tokens + steps, batch_size=case.batch)
    B, T = case.batch, case.tokens
    prefill(model, dec.cache, _ids(model, (B, T), seed), torch.arange(T, device=model.device).expand(B, T))
    tokens = _ids(model, (steps, B), seed + 1)  # (steps, B): the same inputs for eager and compiled
    positions = torch.arange(T, T + steps, device=model.device).view(steps, 1).expand(steps, B)

    @torch.inference_mode()
    def run() -> list[torch.Tensor]:
        dec.cache.truncate(T)
        return [dec(model, dec.cache, tokens[i], positions[i]) for i in range(steps)]  # each (B, V)

    return dec, run


def _prefill_runs(model: GPT, case: Case, compiled: bool, backend: str, seed: int
                  ) -> tuple[dict[str, Any], Callable[[], list[torch.Tensor]]]:
    """The no-cache forward over a (B, T) prompt batch, eager or compiled, and a run of it; the dict counts graphs."""
    idx = _ids(model, (case.batch, case.tokens), seed)
    positions = torch.arange(case.tokens, device=model.device).view(1, -1)
    built = {"compiles": 0}

    def forward(idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.logits(model.hidden(idx, positions)[:, -1])  # (B, T) -> (B, V)

    if compiled:
        def count() -> None:
            built["compiles"] += 1

        forward = torch.compile(own_code(forward), fullgraph=True, dynamic=False,
                                backend=counting_backend(backend, count))

    @torch.inference_mode()
    def run() -> list[torch.Tensor]:
        return [forward(idx, positions)]

    return built, run


def _agreement(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, bool]:
    """(largest absolute logit difference, whether every row's argmax is the same) of two runs' outputs."""
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    return diff, all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, want))


def run_case(model: GPT, case: Case, steps: int = 16, repeats: int = 5, backend: str = "inductor", seed: int = 0
             ) -> dict[str, Any]:
    """One case at the current thread count: compiled against eager (and on CUDA, for decode, the captured CUDA
    graph too), checked, timed in turn. `steps` decode steps (positive; context + steps within block_size)."""
    steps = check_case(model, case, steps)
    repeats = check_repeats("repeats", repeats)
    backend, seed = check_backend_and_seed(backend, seed)
    graph = None
    if case.kind == "decode":
        _, eager = _decode_runs(model, case, steps, "eager", backend, seed)
        comp_dec, comp = _decode_runs(model, case, steps, "compile", backend, seed)
        graphs = lambda: comp_dec.compiles  # noqa: E731
        if model.device.type == "cuda":
            _, graph = _decode_runs(model, case, steps, "cuda-graph", backend, seed)
    else:  # prefill
        _, eager = _prefill_runs(model, case, False, backend, seed)
        built, comp = _prefill_runs(model, case, True, backend, seed)
        graphs = lambda: built["compiles"]  # noqa: E731
    first_call, got = time_once(comp, model.device)  # the first call compiles
    want = eager()
    diff, same_argmax = _agreement(got, want)
    row = {"case": case.name, "kind": case.kind, "batch": case.batch, "tokens": case.tokens,
           "steps": steps if case.kind == "decode" else 1, "threads": torch.get_num_threads(),
           "max_abs_diff": diff, "same_argmax": same_argmax, "ok": same_argmax and diff <= LOGIT_ATOL,
           "compiles": graphs(), "first_call_seconds": first_call}
    if graph is None:
        t_eager, t_comp = interleave([eager, comp], warmup=1, repeats=repeats, device=model.device)
    else:
        g_diff, g_same = _agreement(graph(), want)  # the first call captures
        t_eager, t_comp, t_graph = interleave([eager, comp, graph], warmup=1, repeats=repeats, device=model.device)
        row.update(graph_max_abs_diff=g_diff, graph_same_argmax=g_same, graph_s=t_graph.median,
                   graph_speedup=t_eager.median / t_graph.median)
        row["ok"] = row["ok"] and g_same and g_diff <= LOGIT_ATOL
    return {**row, "eager_s": t_eager.median, "compiled_s": t_comp.median, "speedup": t_eager.median / t_comp.median}


def thread_counts(text: str) -> tuple[int, ...]:
    """--threads-list's text, "1,2" -> (1, 2): comma-separated ints in [1, 4 x cores] (`check_threads`; a ValueError
    naming threads[i])."""
    if not isinstance(text, str):
        raise TypeError(f"threads must be a str of comma-separated ints like '1,2', got {type(text).__name__} "
                        f"{short_repr(text)}")
    try:
        threads = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"threads must be comma-separated ints, got {text!r}") from None
    # at most 4 per core: torch's pool crashes on 100000
    return tuple(check_threads(f"threads[{i}]", n) for i, n in enumerate(threads))


def run_sweep(model: GPT, threads: tuple[int, ...] = (1, 2), cases: tuple[Case, ...] = CASES, steps: int = 16,
              repeats: int = 5, backend: str = "inductor", seed: int = 0) -> dict[str, Any]:
    """Every case at every thread count; the thread setting is restored afterwards. `threads` and `cases` are
    lists (or tuples); everything is checked before the first case is timed."""
    for name, values in (("threads", threads), ("cases", cases)):
        if not isinstance(values, (list, tuple)) or not values:
            raise TypeError(f"{name} must be a non-empty list or tuple, got {type(values).__name__} "
                            f"{short_repr(values)}")
    # subtle: True is an int, and torch.set_num_threads(True) fails inside torch; 100000 threads crash its pool
    threads = tuple(check_threads(f"threads[{i}]", n) for i, n in enumerate(threads))
    for case in cases:
        steps = check_case(model, case, steps)
    repeats = check_repeats("repeats", repeats)
    backend, seed = check_backend_and_seed(backend, seed)
    before = torch.get_num_threads()
    rows = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            torch._dynamo.reset()  # fresh graphs for this thread count (see the module docstring)
            rows += [run_case(model, case, steps, repeats, backend, seed) for case in cases]
    finally:
        torch.set_num_threads(before)
        torch._dynamo.reset()
    return {"device": str(model.device), "backend": backend, "rows": rows}


def profile_decode(model: GPT, case: Case = CASES[0], steps: int = 16, backend: str = "inductor",
                   top: int | None = 8, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The operators of `steps` decode steps, eager and compiled: the `top` (a positive int, or None for every
    operator) by self CPU time, per step, for a decode `case`; each one's share is of all the operators' self time.
    Every argument is checked before the first profile runs."""
    steps = check_case(model, case, steps)
    if case.kind != "decode":  # its decoder would be sized for a prompt, and refused naming its own max_len
        raise ValueError(f"profile_decode profiles decode steps: case must be a decode Case, got {case.name!r}")
    if top is not None:
        top = check_int("top", top)
    backend, seed = check_backend_and_seed(backend, seed)
    out = {}
    for mode in ("eager", "compile"):
        _, run = _decode_runs(model, case, steps, mode, backend, seed)
        run()  # compile (and warm up) outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        out[mode] = [{"name": e.key, "calls_per_step": e.count / steps, "self_us_per_step": e.self_cpu_time_total
                      / steps, "share": e.self_cpu_time_total / total} for e in events[:top]]
    return out


# What each row of a sweep report holds (`run_case`), as the tables and `quotes` read it.
ROW_KEYS = ("case", "kind", "batch", "threads", "steps", "eager_s", "compiled_s", "speedup", "compiles",
            "first_call_seconds", "max_abs_diff", "same_argmax")


@reads_report
def sweep_table(report: dict[str, Any]) -> str:
    """The rows of a sweep report as a Markdown table: per case and thread count, eager and compiled time per step
    (a prefill: per call), the speed-up, the graphs built, the first call, and the checks against eager. A report
    without its rows (`ROW_KEYS`) is a TypeError / ValueError naming it (`check_report`)."""
    check_report("report", report, ("rows",), "rows", ROW_KEYS)
    rows = []
    for r in report["rows"]:
        unit = r["steps"] if r["kind"] == "decode" else 1
        what = "ms/step" if r["kind"] == "decode" else "ms"
        rows.append([r["case"], str(r["threads"]), f"{1e3 * r['eager_s'] / unit:.2f} {what}",
                     f"{1e3 * r['compiled_s'] / unit:.2f} {what}", f"{r['speedup']:.2f}x", str(r["compiles"]),
                     f"{r['first_call_seconds']:.1f} s", f"{r['max_abs_diff']:.1e}", str(r["same_argmax"])])
        if "graph_s" in r:  # a note after the last column (CUDA only)
            rows[-1].append(f"CUDA graph {1e3 * r['graph_s'] / unit:.2f} {what}, {r['graph_speedup']:.2f}x, "
                            f"same argmax {r['graph_same_argmax']}")
    return markdown_table(["case", "threads", "eager", "compiled", "speed-up", "graphs", "first call",
                           "largest logit difference", "same argmax"], rows)


def operator_name(name: str) -> str:
    """A profiled operator's name as a table shows it: inductor's generated code without the hash that names its
    graph ("## Call CompiledFxGraph f6a...q ##" -> "## Call CompiledFxGraph … ##")."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a profiled operator's name (a str), got {type(name).__name__}")
    return re.sub(r"(CompiledFxGraph) \w+", r"\1 …", name)


def profile_table(ops: list[dict[str, Any]], top: int = 8) -> str:
    """One mode's operators from `profile_decode` as a Markdown table: the first `top` by self time, each with its
    calls and self time per step and its share, and one row for the rest of the listed operators."""
    top = check_int("top", top, 0)  # a count: -1 would slice off the last operator, not show them all
    if not isinstance(ops, list) or not all(isinstance(o, dict) for o in ops):
        raise TypeError(f"ops must be a list of operator rows (dicts, as profile_decode gives), got "
                        f"{type(ops).__name__}")
    checked = []
    for i, o in enumerate(ops):
        if lacking := [k for k in ("name", "calls_per_step", "self_us_per_step", "share") if k not in o]:
            raise ValueError(f"ops[{i}] must be an operator row of profile_decode; it lacks {lacking}")
        numbers = {k: check_float(f"ops[{i}][{k!r}]", o[k], 0) for k in ("calls_per_step", "self_us_per_step", "share")}
        checked.append({**o, **numbers})  # the plain numbers: a str or None would fail inside format()
    ops = checked
    rows = [[f"`{operator_name(o['name'])}`", f"{o['calls_per_step']:.0f}", f"{o['self_us_per_step']:.0f} µs",
             f"{100 * o['share']:.0f}%"] for o in ops[:top]]
    rest = ops[top:]
    if rest:
        rows.append([f"the other {len(rest)} operators", f"{sum(o['calls_per_step'] for o in rest):.0f}",
                     f"{sum(o['self_us_per_step'] for o in rest):.0f} µs",
                     f"{100 * sum(o['share'] for o in rest):.0f}%"])
    return markdown_table(["operator", "calls per step", "self time per step", "share of the operators' time"], rows)


@reads_report
def format_sweep(report: dict[str, Any]) -> str:
    check_report("report", report, ("backend", "device", "rows") + (("profile_case",) if "profile" in report else ()))
    lines = [f"torch.compile ({report['backend']}) against eager, {report['device']}; each row one interleaved run",
             "", sweep_table(report)]
    for mode, ops in report.get("profile", {}).items():
        lines += [f"{mode}, per decode step ({report['profile_case']}):", "", profile_table(ops)]
    return "\n".join(lines).rstrip("\n")


PRODUCTS = ("aten::addmm", "aten::mm")  # the step's matrix products: the block linears (with bias) and the head
GUARDS = "TorchDynamo Cache Lookup"  # the compiled step's guard check before each call
GENERATED = "CompiledFxGraph"  # in the name of the call into inductor's generated code


def _row_key(row: dict[str, Any]) -> str:
    """A sweep row's name in `quotes`: "decode1_t1" (decode at batch 1, one thread), "prefill1_t2"."""
    return f"{row['kind']}{row['batch']}_t{row['threads']}"


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What the chapter text quotes from a report of `main --profile --json`: the table of cases ("cases"); the
    batch-1 decode step's operators, eager ("profile_eager", the first 4 and the rest) and compiled
    ("profile_compile", the first 6 and the rest); per row (`_row_key`) its `_speedup` ("1.04x") and its eager and
    compiled ms per step, a prefill's per call (`_eager_ms`, `_compiled_ms`); over the rows the lowest and highest speed-up
    (`speedup_min`, `speedup_max`), first call (`first_call_min`, `first_call_max`, "0.5 s") and the largest logit
    difference from eager (`max_abs_diff`); per profiled mode the products' share of the operators' time
    (`eager_products_share`, "80%"), the guard check's and inductor's generated code's (`compile_guard_share`,
    `compile_generated_share`), and the operator calls per step (`eager_calls`, `compile_calls`); the run's
    settings (`profile_case`, `model`, `cpu`, `command`)."""
    out = {"cases": sweep_table(report)}  # checks the rows first
    rows = report["rows"]
    if not rows:
        raise ValueError("report['rows'] is empty: a sweep report has a row per case and thread count to quote")
    for r in rows:
        unit = r["steps"] if r["kind"] == "decode" else 1
        key = _row_key(r)
        out[f"{key}_speedup"] = f"{r['speedup']:.2f}x"
        out[f"{key}_eager_ms"] = f"{1e3 * r['eager_s'] / unit:.2f}"
        out[f"{key}_compiled_ms"] = f"{1e3 * r['compiled_s'] / unit:.2f}"
    speedups = [r["speedup"] for r in rows]
    out["speedup_min"], out["speedup_max"] = f"{min(speedups):.2f}x", f"{max(speedups):.2f}x"
    first = [r["first_call_seconds"] for r in rows]
    out["first_call_min"], out["first_call_max"] = f"{min(first):.1f} s", f"{max(first):.1f} s"
    out["max_abs_diff"] = f"{max(r['max_abs_diff'] for r in rows):.0e}"
    for mode, top in (("eager", 4), ("compile", 6)):
        ops = report.get("profile", {}).get(mode)
        if ops is None:
            continue
        out[f"profile_{mode}"] = profile_table(ops, top)
        out[f"{mode}_products_share"] = f"{100 * sum(o['share'] for o in ops if o['name'] in PRODUCTS):.0f}%"
        out[f"{mode}_calls"] = f"{sum(o['calls_per_step'] for o in ops):.0f}"
        if mode == "compile":
            out["compile_guard_share"] = f"{100 * sum(o['share'] for o in ops if o['name'] == GUARDS):.0f}%"
            out["compile_generated_share"] = f"{100 * sum(o['share'] for o in ops if GENERATED in o['name']):.0f}%"
    for key in ("profile_case", "model", "cpu", "command"):
        if key in report:
            out[key] = str(report[key])
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser("python -m minillm.compile.sweep", __doc__.splitlines()[0], "fewer repeats")
    ap.add_argument("--threads-list", default="1,2", type=cli_type(cast=thread_counts),
                    help="thread counts to sweep, comma-separated (default 1,2)")
    ap.add_argument("--backend", default="inductor", type=cli_type(check_backend),
                    help="torch.compile backend (default inductor)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the batch-1 decode step, eager and compiled, at --threads (every operator)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = start(ap, argv)
    loaded = load_model("base", args.device, args.seed)
    report = run_sweep(loaded.model, args.threads_list, repeats=3 if args.quick else 5, backend=args.backend,
                       seed=args.seed)
    if args.profile:
        report["profile_case"] = CASES[0].name
        report["profile"] = profile_decode(loaded.model, backend=args.backend, top=None, seed=args.seed)
    report["model"] = loaded.label
    print(f"model: {loaded.label}")
    print(format_sweep(report))
    write_report(args.json, report)
    return 0 if all(r["ok"] for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
