"""The chapter 07 experiment: one prefill-heavy online workload served colocated, with chunked prefill, and
disaggregated; decode inter-token latency (ITL), time to first token (TTFT), the KV transfer, and a timeline.

Adds the three policies, a step recorder for the colocated timeline and the per-policy summary; requests join at
their Poisson arrival times through the kit's open-loop driver (`minillm.bench.driver.drive`). What it leaves out: goodput sweeps over the request rate
(DistServe's metric; chapter 15 has the load generator) and more than one worker per role.

    python -m minillm.disagg.bench --model base --n 24 --rate 2 --prompt-len 160:224 --output-len 32

The three policies see the same requests (the kit's seeded `workload("prefill-heavy", ...)`):
  colocated      chapter 06's `LLM` without chunked prefill: a whole prompt runs in one step, and every decode
                 of that step waits for it (the interference)
  chunked        the same engine with chunked prefill (Sarathi): a step takes at most `chunk` tokens of prompt
  disaggregated  `DisaggregatedLLM`: prompts in one process, decodes in another, the KV sent between them
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.driver import drive
from minillm.bench.models import load_model
from minillm.bench.workload import WorkloadRequest, workload
from minillm.core.config import GPTConfig, check_choice, check_instance, check_label, short_repr
from minillm.core.io import atomic_save_figure, check_output_file
from minillm.core.model import require_model
from minillm.disagg.kv_transfer import kv_bytes
from minillm.disagg.llm import DisaggConfig, DisaggregatedLLM
from minillm.disagg.messages import StepRecord, TransferRecord
from minillm.engine import LLM, EngineConfig
from minillm.engine.request import RequestOutput
from minillm.engine.throughput import check_workload

POLICIES = ("colocated", "chunked", "disaggregated")


@dataclass
class PolicyResult:
    policy: str
    outputs: dict[str, RequestOutput]  # request id -> final output
    timeline: list[StepRecord]  # every model step (colocated: role "colocated"; disaggregated: both workers)
    transfers: list[TransferRecord] = field(default_factory=list)
    start: float = 0.0  # perf_counter at t = 0 of the workload
    duration_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """Milliseconds: TTFT and decode ITL percentiles, plus the transfer's bytes and seconds."""
        outs = list(self.outputs.values())
        ttft = np.array([o.ttft for o in outs if o.token_times]) * 1e3
        itl = np.array([g for o in outs for g in o.itl]) * 1e3
        # The first gap (token 1 -> token 2) is where disaggregation pays for the hand-off: token 1 came from the
        # prefill worker, token 2 from the decode worker after the KV arrived. Later gaps are pure decode.
        steady = np.array([g for o in outs for g in o.itl[1:]]) * 1e3
        row = {
            "requests": len(outs),
            "output_tokens": sum(len(o.output_token_ids) for o in outs),
            "duration_s": self.duration_s,
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "itl_p50_ms": float(np.percentile(itl, 50)), "itl_p99_ms": float(np.percentile(itl, 99)),
            "itl_max_ms": float(itl.max()),
            "itl_steady_p99_ms": float(np.percentile(steady, 99)) if steady.size else float("nan"),
            "first_gap_p50_ms": float(np.median([o.itl[0] for o in outs if o.itl]) * 1e3),
        }
        if self.transfers:
            wire = np.array([t.received_time - t.sent_time for t in self.transfers]) * 1e3
            admit = np.array([t.unpacked_time - t.sent_time for t in self.transfers]) * 1e3
            row.update({
                "kv_bytes_per_request": float(np.mean([t.nbytes for t in self.transfers])),
                "kv_bytes_total": float(sum(t.nbytes for t in self.transfers)),
                "transfer_p50_ms": float(np.percentile(wire, 50)), "transfer_p99_ms": float(np.percentile(wire, 99)),
                "handoff_to_admit_p50_ms": float(np.percentile(admit, 50)),
            })
        return row


class _StepRecorder:
    """Times every `LLM.step()` and reads what its scheduler chose, to draw the colocated timeline.

    subtle: it wraps the engine's `scheduler.schedule` on this one instance (chapter 06 has no step-trace hook);
    the wrapper returns the scheduler's own output untouched, so the engine behaves exactly as without it.
    """

    def __init__(self, llm):
        self.last = None
        original = llm.scheduler.schedule

        def schedule(*args, **kwargs):
            self.last = original(*args, **kwargs)
            return self.last

        llm.scheduler.schedule = schedule

    def record(self, start: float, end: float) -> StepRecord | None:
        sched, self.last = self.last, None
        if sched is None or sched.is_empty:
            return None
        prompt_tokens = sum(s.num_new_tokens for s in sched.scheduled if s.start < s.request.num_prompt_tokens)
        decodes = sum(1 for s in sched.scheduled if s.start >= s.request.num_prompt_tokens)
        kind = "mixed" if prompt_tokens and decodes else ("prefill" if prompt_tokens else "decode")
        return StepRecord("colocated", kind, start, end, prompt_tokens + decodes,
                          [s.request.request_id for s in sched.scheduled])


def check_policy_results(results: object, reads: tuple[str, ...]) -> dict[str, PolicyResult]:
    """`results` as `run_policies` returns them: a dict of policy name -> PolicyResult, or anything with the
    attributes `reads` the caller reads (a TypeError naming the first entry that lacks one)."""
    if not isinstance(results, dict):
        raise TypeError(f"results must be a dict of policy -> PolicyResult (run_policies' output), got "
                        f"{type(results).__name__} {short_repr(results)}")
    for policy, res in results.items():
        if not isinstance(policy, str) or not all(hasattr(res, name) for name in reads):
            raise TypeError(f"results must map policy names to PolicyResults (with {', '.join(reads)}), got "
                            f"{short_repr(policy)}: {type(res).__name__}")
    return results


def run_online(engine, workload: list[WorkloadRequest], policy: str) -> PolicyResult:
    """Feed `workload` at its arrival times (open loop) and step the engine until every request finished."""
    check_instance("engine", engine, (LLM, DisaggregatedLLM), "an LLM or a DisaggregatedLLM (build_engine's)")
    check_workload(workload)
    check_label("policy", policy)
    disagg = isinstance(engine, DisaggregatedLLM)
    timeline: list[StepRecord] = []
    first_step = len(engine.timeline) if disagg else 0
    first_transfer = len(engine.transfers) if disagg else 0
    if disagg:  # wait on the workers no longer than the next arrival, so requests join on time
        def step(until_next: float) -> list[RequestOutput]:
            return engine.step(timeout=min(until_next, engine.config.heartbeat_s))
    else:
        recorder = _StepRecorder(engine)

        def step(until_next: float) -> list[RequestOutput]:
            start = time.perf_counter()
            outs = engine.step()
            rec = recorder.record(start, time.perf_counter())
            if rec is not None:
                timeline.append(rec)
            return outs
    run = drive(engine, workload, realtime=True, step=step)
    if disagg:
        timeline, transfers = engine.timeline[first_step:], engine.transfers[first_transfer:]
    else:
        transfers = []
    return PolicyResult(policy, run.outputs, timeline, transfers, run.start, run.duration_s)


def build_engine(policy: str, model, tokenizer=None, block_size: int = 16, num_blocks: int = 512,
                 max_num_seqs: int = 32, chunk: int = 64, device: str = "cpu"):
    """The engine for one policy; the colocated ones share every setting but chunking."""
    policy = check_choice("policy", policy, POLICIES)
    window = require_model(model, "build_engine").block_size
    if policy == "colocated":
        return LLM(model, tokenizer, EngineConfig(num_blocks=num_blocks, block_size=block_size,
                                                  max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max(window, max_num_seqs) + max_num_seqs,
                                                  enable_chunked_prefill=False, device=device))
    if policy == "chunked":
        return LLM(model, tokenizer, EngineConfig(num_blocks=num_blocks, block_size=block_size,
                                                  max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max(chunk, max_num_seqs),
                                                  enable_chunked_prefill=True, device=device))
    if policy == "disaggregated":
        return DisaggregatedLLM(model, tokenizer, DisaggConfig(num_blocks=num_blocks, block_size=block_size,
                                                               max_num_seqs=max_num_seqs,
                                                               max_num_batched_tokens=max(window, max_num_seqs),
                                                               device=device, num_threads=1))
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def run_policies(model, workload: list[WorkloadRequest], policies: tuple[str, ...] = POLICIES,
                 warmup: list[WorkloadRequest] | None = None, engines: dict[str, Any] | None = None,
                 **engine_kwargs) -> dict[str, PolicyResult]:
    """Each policy on the same workload, after a warm-up; engines passed in `engines` are reused (not closed)."""
    require_model(model, "run_policies")
    check_workload(workload)
    if not isinstance(policies, (list, tuple)):
        raise TypeError(f"policies must be a tuple of policy names {POLICIES}, got {short_repr(policies)}")
    for i, policy in enumerate(policies):
        check_choice(f"policies[{i}]", policy, POLICIES)
    if warmup is not None:
        check_workload(warmup, "warmup")
    if engines is not None and not isinstance(engines, dict):
        raise TypeError(f"engines must be a dict of policy -> engine or None, got {type(engines).__name__}")
    results: dict[str, PolicyResult] = {}
    for policy in policies:
        own = engines is None or policy not in engines
        engine = build_engine(policy, model, **engine_kwargs) if own else engines[policy]
        try:
            if warmup:
                engine.generate([r.prompt_token_ids for r in warmup], [r.params for r in warmup])
            results[policy] = run_online(engine, workload, policy)
            results[policy].details["torch_threads"] = 1 if policy == "disaggregated" else torch.get_num_threads()
        finally:
            if own and hasattr(engine, "close"):
                engine.close()
    return results


def plot_timeline(results: dict[str, PolicyResult], ax=None, window: tuple[float, float] | None = None):
    """One lane per engine (two for disaggregated: its prefill and decode workers): prefill, decode, mixed steps."""
    check_policy_results(results, ("timeline", "start"))
    if ax is not None and not callable(getattr(ax, "broken_barh", None)):
        raise TypeError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    if window is not None and (not isinstance(window, (tuple, list)) or len(window) != 2
                               or not all(isinstance(t, (int, float)) and math.isfinite(t) for t in window)):
        raise TypeError(f"window must be a (start, end) pair of seconds or None, got {short_repr(window)}")
    import matplotlib.pyplot as plt

    colors = {"prefill": "tab:orange", "decode": "tab:blue", "mixed": "tab:purple"}
    lanes: list[tuple[str, list[StepRecord], float]] = []
    for policy, res in results.items():
        if policy == "disaggregated":
            lanes.append(("disagg: prefill worker", [s for s in res.timeline if s.role == "prefill"], res.start))
            lanes.append(("disagg: decode worker", [s for s in res.timeline if s.role == "decode"], res.start))
        else:
            lanes.append((policy, res.timeline, res.start))
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.6 + 0.55 * len(lanes)))
    for y, (name, steps, t0) in enumerate(reversed(lanes)):
        for kind, color in colors.items():
            bars = [((s.start - t0) * 1e3, (s.end - s.start) * 1e3) for s in steps if s.kind == kind and
                    s.num_tokens > 0]
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, label=kind if y == 0 else None)
    ax.set_yticks(range(len(lanes)), [name for name, _, _ in reversed(lanes)])
    ax.set_xlabel("ms since the first arrival")
    if window is not None:
        ax.set_xlim(window[0] * 1e3, window[1] * 1e3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", ncols=3, fontsize="small")
    ax.set_title("model steps per engine: orange = prompt, blue = decode, purple = both in one step")
    return ax


def format_table(results: dict[str, PolicyResult]) -> str:
    """The policies' summaries (`PolicyResult.summary`) as a markdown table, one row per policy."""
    check_policy_results(results, ("summary",))
    cols = ["policy", "TTFT p50", "TTFT p99", "decode ITL p50", "decode ITL p99", "ITL p99 w/o 1st gap",
            "1st gap p50", "KV sent/request", "transfer p50"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for policy, res in results.items():
        s = res.summary()
        kv = f"{s['kv_bytes_per_request'] / 1e6:.2f} MB" if "kv_bytes_per_request" in s else "-"
        tr = f"{s['transfer_p50_ms']:.1f} ms" if "transfer_p50_ms" in s else "-"
        lines.append(f"| {policy} | {s['ttft_p50_ms']:.0f} ms | {s['ttft_p99_ms']:.0f} ms | {s['itl_p50_ms']:.1f} ms | "
                     f"{s['itl_p99_ms']:.1f} ms | {s['itl_steady_p99_ms']:.1f} ms | {s['first_gap_p50_ms']:.1f} ms | {kv} | "
                     f"{tr} |")
    return "\n".join(lines)


def check_results(results: dict[str, "PolicyResult"], workload: list[WorkloadRequest], config) -> dict[str, int]:
    """The experiment's two correctness checks: every policy's greedy ids equal, request by request, and every
    KV hand-off exactly 2·L·nh·hs·T·bytes for its prompt of T tokens (`kv_bytes`)."""
    if not check_policy_results(results, ("outputs", "transfers")):
        raise ValueError("results must hold at least one policy's PolicyResult, got an empty dict")
    check_workload(workload)
    check_instance("config", config, GPTConfig, "the model's GPTConfig")
    ids = {p: {i: o.output_token_ids for i, o in r.outputs.items()} for p, r in results.items()}
    first, *others = ids.values()
    same = same_tokens({r.request_id: first.get(r.request_id) for r in workload}, *others, unit="requests")
    plens = {r.request_id: len(r.prompt_token_ids) for r in workload}
    transfers = results["disaggregated"].transfers if "disaggregated" in results else []
    exact = sum(t.nbytes == kv_bytes(config, plens[t.request_id]) for t in transfers)
    return {"identical": same.equal, "requests": same.total, "exact_transfers": exact, "transfers": len(transfers)}


def build_parser() -> argparse.ArgumentParser:
    """The kit's shared options (`minillm.bench.cli`; the workers run on the CPU here) and this benchmark's own."""
    p = bench_parser("python -m minillm.disagg.bench", __doc__.split("\n")[0], devices=("cpu",))
    p.add_argument("--model", default="base", help="shipped checkpoint or preset (default base)")
    p.add_argument("--n", type=int, default=24, help="requests")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--prompt-len", default="160:224", help="uniform prompt length range LO:HI")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--chunk", type=int, default=64, help="chunked prefill: prompt tokens per step")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--plot", help="write the timeline figure here (png)")
    return p


def main(argv: list[str] | None = None) -> int:
    # --threads: the colocated engines' torch threads (default 1, like each disaggregated worker)
    args = start(build_parser(), argv)
    check_output_file(args.plot, "--plot", (".png",))
    loaded = load_model(args.model, seed=args.seed)
    model, name, V = loaded.model, loaded.label, loaded.model.config.vocab_size
    plen = f"uniform:{args.prompt_len}"
    work = workload("prefill-heavy", args.n, args.seed, args.rate, V, prompt_len=plen, output_len=args.output_len)
    warm = workload("prefill-heavy", 2, args.seed + 1, math.inf, V, prompt_len=plen, output_len=4)
    results = run_policies(model, work, warmup=warm, block_size=args.block_size, chunk=args.chunk)
    print(f"model {name}; {args.n} requests at {args.rate}/s, prompts {args.prompt_len}, {args.output_len} output "
          f"tokens; colocated engines use {torch.get_num_threads()} torch threads, each worker 1")
    print(format_table(results))
    check = check_results(results, work, model.config)
    print(f"greedy ids identical across {', '.join(results)}: {check['identical']}/{check['requests']} requests; "
          f"KV hand-offs equal to the formula: {check['exact_transfers']}/{check['transfers']}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        ax = plot_timeline(results)
        atomic_save_figure(ax.figure, args.plot, dpi=120, bbox_inches="tight")
    if args.json:
        write_report(args.json, {p_: {"summary": r.summary(), "timeline": [vars(s) for s in r.timeline]}
                                 for p_, r in results.items()})
    return 0 if check["identical"] == check["requests"] and check["exact_transfers"] == check["transfers"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
