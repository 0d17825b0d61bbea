"""Chapter 06's throughput comparison: one workload through the engine, static batching and Hugging Face's two
batched paths, on the same model in one process.

What it adds: the runners (`run_engine`, `run_static_batches`, `run_hf_generate`, `run_hf_continuous`), each
returning the outputs and per-request token times as a `RunResult`, and `offline_throughput`, which alternates
the engine and static batching `repeats` times and reports each one's median run. Chapter 06's benchmark and tour
and chapter 13's tour (the same comparison on the fastest path) call it, so it is a module of the engine rather
than of chapter 06's benchmark (no chapter imports another chapter's benchmark). What it leaves out: online
arrivals, the frontier and chunked prefill (`minillm.engine.bench`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from minillm.bench.check import same_tokens
from minillm.bench.driver import RunStats, drive
from minillm.bench.workload import WorkloadRequest
from minillm.core.config import check_int, check_sequence, short_repr
from minillm.core.hf import to_hf_model
from minillm.core.metrics import RequestTimes
from minillm.core.model import GPT, require_model
from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.engine.static import run_static


@dataclass
class RunResult(RunStats):
    name: str
    outputs: list[list[int]]  # per request, workload order
    times: list[RequestTimes]
    duration_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    cpu_s: float = float("nan")  # process CPU time of the run (all threads): the work done, whatever the contention

    @property
    def output_token_ids(self) -> list[list[int]]:
        return self.outputs


def check_workload(workload: object, name: str = "workload") -> Sequence[WorkloadRequest]:
    """`workload` if it is a non-empty list (or tuple) of WorkloadRequests (`minillm.bench.workload.workload`); a
    TypeError / ValueError naming `name` and the first entry that is not one."""
    for i, w in enumerate(check_sequence(name, workload)):
        if not isinstance(w, WorkloadRequest):
            raise TypeError(f"{name}[{i}] must be a WorkloadRequest, got {type(w).__name__} {short_repr(w)}")
    return workload  # type: ignore[return-value]


def check_hf_model(hf_model: object, method: str) -> None:
    """A Hugging Face model (`minillm.core.hf.to_hf_model`) with `method`; a TypeError naming hf_model otherwise."""
    if not callable(getattr(hf_model, method, None)):
        raise TypeError(f"hf_model must be a Hugging Face model with {method}() (minillm.core.hf.to_hf_model), got "
                        f"{type(hf_model).__name__}")


# ----------------------------------------------------------------------------------------------- the engines


def run_engine(model: GPT, workload: Sequence[WorkloadRequest], config: EngineConfig, realtime: bool = False,
               name: str = "continuous") -> RunResult:
    """The engine on the workload, fed by `minillm.bench.driver.drive`. Offline (realtime=False): everything queued
    at t=0. Online: each request is added when its arrival time comes, so TTFT includes queueing."""
    check_workload(workload)
    llm = LLM(model, None, config)
    run = drive(llm, workload, realtime=realtime)
    outs = run.outputs.values()
    return RunResult(name, run.output_token_ids, run.times, run.duration_s,
                     {"preemptions": sum(o.num_preemptions for o in outs), "steps": llm.num_steps}, run.cpu_s)


def run_static_batches(model: GPT, workload: Sequence[WorkloadRequest], batch_size: int) -> RunResult:
    """Static batching (`run_static`) on the workload, `batch_size` requests at a time, all at t=0."""
    require_model(model, "run_static_batches")
    check_workload(workload)
    c0 = time.process_time()
    res = run_static(model, [w.prompt_token_ids for w in workload], [w.params for w in workload], batch_size)
    cpu = time.process_time() - c0
    duration = max(t[-1] for t in res.token_times if t) - res.start_time
    times = [RequestTimes(res.start_time, t, len(w.prompt_token_ids)) for t, w in zip(res.token_times, workload)]
    return RunResult("static", res.output_token_ids, times, duration, {"batches": res.num_batches}, cpu)


def run_hf_generate(hf_model, workload: Sequence[WorkloadRequest], batch_size: int) -> RunResult:
    """Hugging Face `generate` on left-padded batches of `batch_size`, greedy. A batch runs to its longest request's
    length (HF has one max_new_tokens per call); each request keeps its own first `output_len` tokens."""
    check_hf_model(hf_model, "generate")
    check_workload(workload)
    batch_size = check_int("batch_size", batch_size)
    outputs: list[list[int]] = []
    times: list[RequestTimes] = []
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for lo in range(0, len(workload), batch_size):
            group = workload[lo : lo + batch_size]
            T = max(len(w.prompt_token_ids) for w in group)
            idx = torch.zeros(len(group), T, dtype=torch.long)  # (B, T) left-padded
            mask = torch.zeros(len(group), T, dtype=torch.long)  # (B, T) 1 = real token
            for r, w in enumerate(group):
                n = len(w.prompt_token_ids)
                idx[r, T - n :] = torch.tensor(w.prompt_token_ids)
                mask[r, T - n :] = 1
            n_new = max(w.output_len for w in group)
            gen = hf_model.generate(idx.to(hf_model.device), attention_mask=mask.to(hf_model.device),
                                    max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0)
            now = time.perf_counter()
            for r, w in enumerate(group):
                outputs.append(gen[r, T : T + w.output_len].tolist())
                times.append(RequestTimes(t0, [now] * w.output_len, len(w.prompt_token_ids)))
    return RunResult("hf-generate", outputs, times, time.perf_counter() - t0, cpu_s=time.process_time() - c0)


def hf_generate_batch_available() -> bool:
    try:
        from transformers import GenerationMixin

        return hasattr(GenerationMixin, "generate_batch")
    except ImportError:
        return False


def run_hf_continuous(hf_model, workload: Sequence[WorkloadRequest], max_batch: int, block_size: int = 16,
                      num_blocks: int = 512) -> RunResult:
    """Hugging Face's continuous batching (the manager behind `generate_batch`), greedy, on CPU.

    `generate_batch` takes one max_new_tokens for all requests; our workload has one per request, so this adds
    them one by one to the same manager (`add_request(max_new_tokens=...)`). Timed from the first add to the last
    result: the manager's start-up and shut-down (a thread, a second or two) are left out, in HF's favour.
    """
    check_hf_model(hf_model, "init_continuous_batching")
    check_workload(workload)
    max_batch, block_size = check_int("max_batch", max_batch), check_int("block_size", block_size)
    num_blocks = check_int("num_blocks", num_blocks)
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=8)
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=512,
                                  max_requests_per_batch=max_batch, use_cuda_graph=False, use_async_batching=False)
    manager = hf_model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
    manager.start()
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        rid = {}
        for i, w in enumerate(workload):
            rid[manager.add_request(list(w.prompt_token_ids), request_id=f"w{i}", max_new_tokens=w.output_len,
                                    eos_token_id=-1)] = i
        got: dict[int, list[int]] = {}
        while len(got) < len(workload):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                got[rid[res.request_id]] = list(res.generated_tokens)
            elif res is None and not manager.is_running():
                raise RuntimeError("Hugging Face's continuous-batching thread stopped unexpectedly")
        duration = time.perf_counter() - t0
        cpu = time.process_time() - c0
    finally:
        manager.stop(block=True, timeout=10)
    outs = [got[i] for i in range(len(workload))]
    times = [RequestTimes(t0, [t0 + duration] * len(o), len(w.prompt_token_ids)) for o, w in zip(outs, workload)]
    return RunResult("hf-generate_batch", outs, times, duration, cpu_s=cpu)


def _median_run(runs: Sequence[RunResult]) -> RunResult:
    """The run at the median tok/CPU-s (the upper middle one for an even count)."""
    return sorted(runs, key=lambda r: r.tokens_per_cpu_s)[len(runs) // 2]


def offline_throughput(model: GPT, workload: Sequence[WorkloadRequest], batch: int = 32, num_blocks: int = 512,
                       with_hf: bool = True, attention_backend: str = "selective", repeats: int = 3,
                       engine_model: Any = None) -> dict[str, Any]:
    """Output tokens/s of the engine, static batching and (optionally) HF's two paths, same model and prompts.

    The engine and static batching, the pair this chapter compares, alternate `repeats` times (engine, static,
    engine, static, ...) and each reports its median run by tok/CPU-s, so one slow second on a shared machine does
    not decide the ratio; every repeat must give the same outputs. HF's paths run once each (their outputs are
    checked against the engine's; at about 12 s a run they would double the tour's cost).
    `attention_backend` is the engine's (`EngineConfig.attention_backend`; chapter 13 passes its C++ one), and so
    is `engine_model`, a model with GPT's interface the engine runs instead of `model` (chapter 13's fused step,
    `FusedEngineModel`); static batching and HF always run `model`."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {short_repr(repeats)}")
    cfg = EngineConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=batch, max_num_batched_tokens=512,
                       attention_backend=attention_backend)
    engine = model if engine_model is None else engine_model
    require_model(engine, "offline_throughput (engine_model)")
    engine_runs, static_runs = zip(*[(run_engine(engine, workload, cfg), run_static_batches(model, workload, batch))
                                     for _ in range(repeats)])
    runs = [_median_run(engine_runs), _median_run(static_runs)]
    hf_note = ""
    if with_hf:
        hf = to_hf_model(model, attn_implementation="sdpa")
        runs.append(run_hf_generate(hf, workload, batch))
        if hf_generate_batch_available():
            runs.append(run_hf_continuous(hf, workload, batch, num_blocks=num_blocks))
        else:
            hf_note = "transformers has no generate_batch in this version"
    ref = runs[0].outputs
    rows = {r.name: {"tokens_per_s": r.tokens_per_s, "duration_s": r.duration_s, "output_tokens": r.output_tokens,
                     "tokens_per_cpu_s": r.tokens_per_cpu_s, "cpu_s": r.cpu_s,
                     "agree_with_engine": same_tokens(ref, r.outputs).equal, "repeats": 1, **r.extra} for r in runs}
    for r, mine in zip(runs, (engine_runs, static_runs)):
        rows[r.name].update(repeats=repeats, tokens_per_cpu_s_all=[m.tokens_per_cpu_s for m in mine],
                            repeats_identical=all(same_tokens(mine[0].outputs, m.outputs).ok for m in mine[1:]))
    return {"n": len(workload), "batch": batch, "runs": rows, "hf_note": hf_note}
