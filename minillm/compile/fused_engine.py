"""Continuous batching on the fused C++ step: chapter 06's engine with a step of a few rows in ONE call.

What it adds: `FusedEngineModel(model)`, a module with GPT's interface (`config`, `hidden`, `logits`, `device`)
that chapter 06's engine runs like any model: `LLM(FusedEngineModel(model), config)`. Its `hidden` takes the
engine's flat step, idx (1, N) at their positions over the paged pools (chapter 05), and when the step has at most
MAX_FUSED_ROWS rows (a decode step of up to that many requests, a speculative verify, a short prompt chunk) and the
pools are float32 on the CPU, runs all of it in `FusedDecoder::paged` of `csrc/decode_cpu.cpp`: each row's embedding,
every block's layernorms and products (the weights walked once for up to 16 rows at a time, as the speculative
verify does), its K/V written at its slot of each layer's pool and its attention read through its block table in
place, then ln_f. `logits` is the tied head in the same C++ (one walk over it for the rows the engine samples).
A longer step runs the model's own forward over the same pools, so the two paths mix freely within one request.

Why: the engine's plain CPU path (`fast_cpu_model` with the "selective-cpp" backend) still calls about 150 PyTorch
operators per step; at the sizes a CPU decodes, that per-operator cost is most of a step (chapter 13's profile).
The batch-1 fused step removed it for one request; this removes it for a batch, so every scheduler feature of
chapters 06-08 (preemption, swapping, prefix caching, speculative verification) runs on the fast step unchanged.

Its twin is the model's own `hidden` and `logits` over the same pools: the same greedy tokens from the engine
(tested), logits equal to float rounding. What it leaves out: several threads, other KV dtypes and devices (they
take the model's own forward), and the layers the batch-1 fused step refuses (a TypeError naming the layer: chapter
09's int8 and int4 weight-only linears run, anything else does not).

The benchmark: `python -m minillm.compile.fused_engine [--quick] [--loads 1,4,16] [--json FILE]`, chapter 06's
engine on `base` over chapter 06's mixed workload (3 requests per batch slot, greedy) at each load, on
`fast_cpu_model` (every few-row product in C++, PyTorch between them) against the same engine on
`FusedEngineModel(fast_cpu_model(base))`, both with the "selective-cpp" attention, alternated in one run (warm-up,
median of repeats); the outputs must be identical.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
import torch.nn as nn

from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.bench.workload import check_load_list, workload
from minillm.compile.cpu_gemv import cpp_errors_as_value_errors, fast_cpu_model
from minillm.compile.decode import check_eval_mode, eval_mode
from minillm.compile.fused_step import LINEARS, WatchedModel, build_cpp_decoder
from minillm.core.config import check_has_data, check_int, reads_report, short_repr, tensor_kind
from minillm.core.model import GPT
from minillm.core.sampling import check_seed
from minillm.core.timing import check_calls, check_repeats, compare, interleave
from minillm.engine.config import EngineConfig
from minillm.engine.step_models import register_shipped_step_model
from minillm.engine.throughput import run_engine
from minillm.paged import PagedBatch
from minillm.paged.backends import make_attention_backend
from minillm.paged.paged_cache import PagedKVCache

MAX_FUSED_ROWS = 64  # most rows a step runs in C++ (4 walks over the weights); longer ones run the model's forward
LOADS = (1, 4, 16)  # the benchmark's loads (requests running at once)
MAX_LOAD = 256  # most requests at once a load may ask for (3 per slot are built, each with its pool blocks)
MIXED_VOCAB = 4096  # the mixed workload's prompts are real text in the shipped tokenizer's ids
REQUESTS_PER_SLOT = 3  # requests per batch slot, so the batch stays full as requests finish
BACKEND = "selective-cpp"  # both engines' attention (their long steps; the fused step reads the pools itself)


class FusedEngineModel(WatchedModel, nn.Module):
    """`model` (a float32 CPU GPT, or chapter 09's int8/int4 weight-only quantization of one) for chapter 06's engine,
    its short steps in one C++ call (module doc). The C++ step holds the model's own tensors, as `FusedCPUDecoder`
    does: an in-place update is seen; any other change (`WatchedModel`: a tensor converted, replaced or re-viewed, a
    layer swapped, added or given another `forward`, the model swapped, a changed config, eps or attribute, a
    forward hook, a quantized layer's scale gone bad) is a ValueError at the next step (`check_step`, a few µs on
    `base`, runs at every step over the pools). The model must be in eval mode when it runs (the C++ step has
    no dropout)."""

    def __init__(self, model: GPT):
        nn.Module.__init__(self)
        if not isinstance(model, GPT):
            raise TypeError(f"FusedEngineModel needs a minillm GPT, got {type(model).__name__}")
        if model.device.type != "cpu":
            raise ValueError(f"FusedEngineModel runs on the CPU, the model is on {model.device}")
        self.model = model
        self.config = model.config
        self._watch_model()
        self._cpp: Any
        self._cpp, self.int8_linears, self.int4_linears = build_cpp_decoder(model, [], [])
        self.num_fused_steps = 0  # steps run in C++ (the rest ran the model's forward: long chunks, other caches)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def fusable(self, cache: Any, rows: int) -> bool:
        """Whether a step of `rows` rows over `cache` runs in C++: a paged pool of float32 CPU tensors holding a
        batch (`set_batch`), and at most MAX_FUSED_ROWS rows."""
        if type(rows) is not int:  # the common case costs one type test; an int subclass is read as its plain int
            if not isinstance(rows, int) or isinstance(rows, bool):
                raise TypeError(f"rows must be an int (the step's token count), got {type(rows).__name__} "
                                f"{short_repr(rows)}")
            rows = int.__index__(rows)
        return (isinstance(cache, PagedKVCache) and getattr(cache, "batch", None) is not None and 1 <= rows <=
                MAX_FUSED_ROWS and cache.device.type == "cpu" and all(
                    pool.dtype == torch.float32 for pool in (*cache.k_pools, *cache.v_pools)))  # int8 pools: no

    def hidden(self, idx: torch.Tensor, positions: torch.Tensor, cache: Any = None,
               collect: list[torch.Tensor] | None = None) -> torch.Tensor:
        """GPT.hidden: idx (1, N), positions (1, N) -> (1, N, C), after ln_f; in C++ when `fusable`. idx and positions
        must be int64 tensors with values (a TypeError/ValueError naming them), whichever path runs."""
        for name, t in (("idx", idx), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
                raise TypeError(f"{name} must be an int64 tensor of token ids / positions, got {tensor_kind(t)}")
            check_has_data(name, t)
        if collect is not None and not isinstance(collect, list):
            raise TypeError(f"collect must be a list (each block's output is appended) or None, got "
                            f"{type(collect).__name__}")
        if cache is not None and not callable(getattr(cache, "attend", None)):
            raise TypeError(f"cache must be a KV cache (with attend(layer_idx, q, k, v)) or None, got "
                            f"{type(cache).__name__}")
        batch = getattr(cache, "batch", None) if isinstance(cache, PagedKVCache) else None
        if batch is not None:  # every step over the pools, whichever path runs it (the two mix within a request)
            self.check_step()
        if collect is not None or idx.dim() != 2 or idx.shape[0] != 1 or not self.fusable(cache, idx.shape[1]):
            positions = self.model.check_inputs(idx, positions)  # ids and positions in range: the C++ step's checks
            return self.model.hidden(idx, positions, cache, collect)
        check_eval_mode(self.model, "a FusedEngineModel step")
        N = idx.shape[1]
        if tuple(positions.shape) not in ((N,), (1, N)):
            raise ValueError(f"positions must be (1, N) or (N,) for idx (1, N={N}), got shape {tuple(positions.shape)}")
        self.num_fused_steps += 1
        with cpp_errors_as_value_errors():  # the C++ checks: ids, positions, slots against the block tables
            h = self._cpp.paged(idx[0].contiguous(), positions.expand_as(idx)[0].contiguous(), batch.slot_mapping,
                                batch.block_tables, batch.context_lens, batch.query_lens, cache.k_pools,
                                cache.v_pools)  # (N, C)
        return h.unsqueeze(0)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """GPT.logits: h (..., C) float32 -> (..., V), the tied head in C++ for rows (R, C) (the model's own for other
        ranks); a TypeError/ValueError naming h for anything but a float32 CPU tensor of the model's width. The
        model is looked at first, as in `hidden`: a caller may change the head between the two."""
        self.check_step()
        C = self.config.n_embd
        if not isinstance(h, torch.Tensor) or h.dtype != torch.float32:
            raise TypeError(f"h must be a float32 tensor (..., C={C}) of hidden states (the model's dtype), got "
                            f"{tensor_kind(h)}")
        check_has_data("h", h)
        if h.dim() == 0 or h.shape[-1] != C or h.device.type != "cpu":
            raise ValueError(f"h must be (..., C={C}) on the CPU, got shape {tuple(h.shape)} on {h.device}")
        if h.dim() != 2:
            return self.model.logits(h)
        with cpp_errors_as_value_errors():
            return self._cpp.head(h.contiguous())


# Chapter 06's engine takes this implementation by name ("fused-cpp"), as it takes an attention backend: every
# linear in C++ where the step runs the model's forward (`fast_cpu_model`), each short step one C++ call.
register_shipped_step_model("fused-cpp", lambda model: FusedEngineModel(fast_cpu_model(model)))


def load_point(model: GPT, concurrency: int, repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """One load: chapter 06's engine on `fast_cpu_model(model)` against the same engine on the fused step, both over
    the same `REQUESTS_PER_SLOT * concurrency` mixed requests, alternated (`compare`); outputs must be identical."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a minillm GPT, got {type(model).__name__}")
    concurrency = check_int("concurrency", concurrency)
    if concurrency > MAX_LOAD:  # its requests are built before any runs
        raise ValueError(f"concurrency must be at most {MAX_LOAD} requests at once, got {concurrency}")
    repeats = check_repeats("repeats", repeats)
    if type(seed) is not int or not 0 <= seed < 2**63:  # the workload's generator (numpy) takes these
        raise ValueError(f"seed must be an int in [0, 2**63), got {short_repr(seed)}")
    if model.config.vocab_size < MIXED_VOCAB:
        raise ValueError(f"model.config.vocab_size={model.config.vocab_size} cannot hold the mixed workload's prompts: "
                         f"real text in the shipped tokenizer's {MIXED_VOCAB} ids")
    fast = fast_cpu_model(model)
    fused = FusedEngineModel(fast)
    reqs = workload("mixed", REQUESTS_PER_SLOT * concurrency, seed=seed, vocab_size=model.config.vocab_size)
    longest = max(len(w.prompt_token_ids) + w.params.max_new_tokens for w in reqs)
    config = EngineConfig(num_blocks=-(-longest // 16) * concurrency + 8, block_size=16, max_num_seqs=concurrency,
                          max_num_batched_tokens=512, attention_backend=BACKEND)
    runs: dict[str, list[Any]] = {"fast": [], "fused": []}
    cmp = compare(lambda: runs["fast"].append(run_engine(fast, reqs, config)),
                  lambda: runs["fused"].append(run_engine(fused, reqs, config)), warmup=1, repeats=repeats)
    same = same_tokens(runs["fast"][0].outputs, *[r.outputs for r in runs["fast"][1:] + runs["fused"]],
                       unit="requests")
    tokens = sum(len(o) for o in runs["fast"][0].outputs)
    return {"concurrency": concurrency, "requests": len(reqs), "output_tokens": tokens, "identical": same.ok,
            "check": same.check, "fast_tok_s": tokens / cmp.baseline.median, "fused_tok_s": tokens / cmp.candidate.median,
            "speedup": cmp.speedup, "fused_steps": fused.num_fused_steps / (repeats + 1),
            "steps": runs["fused"][0].extra["steps"], "timing": cmp.to_dict()}


STEP_SIZES = (1, 2, 4, 8, 16)  # sequences in the timed decode steps of `step_costs`


def step_costs(model: GPT, context: int = 160, sizes: Sequence[int] = STEP_SIZES, repeats: int = 5,
               calls: int = 20) -> dict[str, Any]:
    """What one engine decode step costs on the fused step as the batch grows: S sequences of `context` cached
    tokens each (random keys and values in a "selective" pool), one new token each, `hidden` + `logits` as the
    engine calls them; ms per step for each S of `sizes` (interleaved, medians of `repeats` rounds of `calls`
    steps). And what each row past the fourth adds (`row_ms`: the slope from 4 to the largest S) beside the
    multiply-adds of one row's products (`row_flops`: 2 x the block linears' and the head's weights), as
    `row_gflops`: the rate those would run at if they were the row's whole cost. At a short context they nearly
    are; at a long one the row's attention, which reads its sequence's cached keys and values, adds to it. The
    pools are overwritten at the same slots every call (the timing needs only their shapes)."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a minillm GPT, got {type(model).__name__}")
    context = check_int("context", context)
    if not isinstance(sizes, (list, tuple)) or len(sizes) < 2 or not all(
            type(n) is int and 1 <= n <= MAX_FUSED_ROWS for n in sizes):
        raise ValueError(f"sizes must list at least two batch sizes in [1, {MAX_FUSED_ROWS}], got {short_repr(sizes)}")
    repeats = check_repeats("repeats", repeats)
    calls = check_calls("calls", calls)
    cfg = model.config
    if context >= cfg.block_size:
        raise ValueError(f"context must leave room for one new token in the window block_size={cfg.block_size}, "
                         f"got {context}")
    fused = FusedEngineModel(model)
    bs = 16
    per_seq = -(-(context + 1) // bs)
    cache = make_attention_backend("selective", cfg, per_seq * max(sizes), bs)
    g = torch.Generator().manual_seed(0)
    for pool in cache.k_pools + cache.v_pools:
        pool.copy_(torch.randn(pool.shape, generator=g))

    def timed(S: int):
        tables = torch.arange(S * per_seq).view(S, per_seq)
        slots = tables[:, context // bs] * bs + context % bs
        batch = PagedBatch(slots, tables, torch.full((S,), context + 1), torch.ones(S, dtype=torch.int64))
        idx = torch.randint(0, cfg.vocab_size, (1, S), generator=g)
        positions = torch.full((1, S), context)

        def run() -> None:
            for _ in range(calls):
                cache.set_batch(batch)
                fused.logits(fused.hidden(idx, positions, cache)[0])
        return run

    with torch.inference_mode(), eval_mode(model):
        timings = interleave([timed(S) for S in sizes], warmup=1, repeats=repeats)
    ms = {S: 1000 * t.median / calls for S, t in zip(sizes, timings)}
    lo = min((S for S in sizes if S >= 4), default=min(sizes))
    hi = max(sizes)
    row_ms = (ms[hi] - ms[lo]) / (hi - lo) if hi > lo else float("nan")
    weights = sum(block.get_submodule(n).in_features * block.get_submodule(n).out_features  # nn.Linear, QuantLinear
                  for block in model.transformer.h for n in LINEARS)
    row_flops = 2 * (weights + model.config.vocab_size * model.config.n_embd)  # and the tied head
    return {"context": context, "step_ms": {str(S): v for S, v in ms.items()}, "row_ms": row_ms,
            "row_flops": row_flops, "row_gflops": row_flops / (row_ms / 1000) / 1e9}


def run(loads: Sequence[int] = LOADS, repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """Every load of `loads` on `base`, and the decode step's cost by batch size (`step_costs`), one torch thread as
    set by the caller."""
    loads = check_load_list(loads, most=MAX_LOAD)  # the plain ints
    repeats = check_repeats("repeats", repeats)  # stored in the report as the plain int
    seed = check_seed(seed)
    loaded = load_model("base", "cpu", seed)
    points = [load_point(loaded.model, c, repeats, seed) for c in loads]
    return {"model": loaded.label, "threads": torch.get_num_threads(), "backend": BACKEND, "repeats": repeats,
            "requests_per_slot": REQUESTS_PER_SLOT, "points": points,
            "identical": all(p["identical"] for p in points), "step_costs": step_costs(loaded.model, 160),
            "step_costs_short": step_costs(loaded.model, 16)}


HEADER = ["concurrent requests", "requests", "fast_cpu_model tok/s", "fused step tok/s", "speed-up",
          "steps in C++ / steps", "identical"]


def _cells(p: dict[str, Any]) -> list[str]:
    return [str(p["concurrency"]), str(p["requests"]), f"{p['fast_tok_s']:,.0f}", f"{p['fused_tok_s']:,.0f}",
            f"{p['speedup']:.2f}x", f"{p['fused_steps']:.0f} / {p['steps']}", str(p["identical"])]


@reads_report
def format_report(report: dict[str, Any]) -> str:
    lines = [f"chapter 06's engine on {report['model']}, {report['threads']} thread(s), mixed workload, "
             f"{report['requests_per_slot']} requests per batch slot, attention {report['backend']!r}",
             " | ".join(HEADER)]
    lines += [" | ".join(c.rjust(len(h)) for c, h in zip(_cells(p), HEADER)) for p in report["points"]]
    for costs in (report["step_costs_short"], report["step_costs"]):
        lines.append(f"one decode step of S sequences after {costs['context']} cached tokens: " + ", ".join(
            f"S={S} {v:.2f} ms" for S, v in costs["step_ms"].items()) + f"; each further row {costs['row_ms']:.3f} "
            f"ms, its {costs['row_flops'] / 1e6:.1f} MFLOP of products at {costs['row_gflops']:.0f} GFLOP/s")
    return "\n".join(lines)


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What chapter 13's text quotes from a report of `main --json`: the table ("loads") and per load c the speed-up
    and both engines' tok/s (`speedup_c4`, `fast_tok_s_c4`, `fused_tok_s_c4`)."""
    per_load = {f"{k}_c{p['concurrency']}": v for p in report["points"]
                for k, v in (("speedup", f"{p['speedup']:.2f}x"), ("fast_tok_s", f"{p['fast_tok_s']:,.0f}"),
                             ("fused_tok_s", f"{p['fused_tok_s']:,.0f}"))}
    costs = report["step_costs"]
    steps = {f"step_ms_{S}": f"{v:.2f} ms" for S, v in costs["step_ms"].items()}
    table = markdown_table(HEADER, [_cells(p) for p in report["points"]], "r" * (len(HEADER) - 1) + "c")
    return {**per_load, **steps, "loads": table,
            "row_ms": f"{costs['row_ms']:.3f} ms", "row_gflops": f"{costs['row_gflops']:.0f} GFLOP/s",
            "row_mflop": f"{costs['row_flops'] / 1e6:.1f} MFLOP", "context": str(costs["context"]),
            "row_ms_short": f"{report['step_costs_short']['row_ms']:.3f} ms",
            "row_gflops_short": f"{report['step_costs_short']['row_gflops']:.0f} GFLOP/s",
            "context_short": str(report["step_costs_short"]["context"]),
            "identical": str(report["identical"]), "cpu": str(report["cpu"]), "threads": str(report["threads"])}


def build_parser():
    ap = bench_parser("python -m minillm.compile.fused_engine", __doc__.split("\n")[0], "loads 1 and 4, one repeat",
                      devices=("cpu",))
    ap.add_argument("--loads", help="comma-separated concurrency levels (default 1,4,16)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = start(ap, argv)
    try:
        loads = check_load_list([int(c) for c in args.loads.split(",")] if args.loads is not None else (
            [1, 4] if args.quick else list(LOADS)), most=MAX_LOAD)
    except (ValueError, TypeError) as e:
        ap.error(f"--loads must be comma-separated ints in [1, {MAX_LOAD}]: {e}")
    report = run(loads, repeats=1 if args.quick else 3, seed=args.seed)
    print(format_report(report))
    write_report(args.json, report)
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
