"""Chapter 09's benchmark: every quantization method on `base` against fp32, on memory, quality and speed.

For each case (fp32; int8 weight-only, without and with the tied embedding/head; int4 group-wise by round-to-nearest,
by GPTQ and by a short QAT fine-tune; W8A8 with dynamic per-token activation scales) it reports:
  - weight bytes: every tensor the model holds (the tied head once), and the bytes of the block linears alone
    (codes + scales + zero points + biases), each as a ratio to fp32;
  - validation perplexity on the first `val_tokens` ids of the validation split (`minillm.gpt.eval`), and its delta %;
  - greedy-token agreement with fp32 on a fixed prompt set (windows of the validation text): teacher-forced (both
    models read fp32's greedy continuation; the share of positions where their argmax agrees) and free-running (the
    prompts whose whole greedy continuation through `generate_ids` is identical, and the mean common prefix);
  - KL(p_fp32 || p_quantized) per position from the same teacher-forced forwards (mean, 99th percentile, max; nats);
  - decode tokens/s at batch 1 through chapter 04's `generate_ids`, against fp32 by `minillm.core.timing.compare`
    (alternating runs, medians), on the threads the caller set (the CLI uses one);
  - the chapter 06 engine (`minillm.LLM`) on the quantized models, token for token against `generate_ids` of the
    same model (the engine contract) and against fp32;
  - the int8 KV cache (chapter 04's and 05's caches storing int8 codes, fp32 weights): bytes per token, perplexity
    through the cache (`kv_perplexity`), greedy tokens against fp32, the engine's "paged-int8" backend, decode tok/s;
  - the outlier study: W8A8 on `base` and on `base` with planted outlier features (the same function), plain, with
    LLM.int8's decomposition and after SmoothQuant;
  - one layer's cost at batch 1 and at 256 tokens: fp32 `F.linear`, de-quantize-then-multiply, and W8A8 through
    `torch._int_mm` and through its exact float64 twin: where de-quantization costs more than it saves.
The command: `python -m minillm.quant.bench [--quick | --size S] [--threads N] [--json FILE]` (quick ~1 min,
default a few minutes on one thread; the tour runs the `tour` sizes in about a minute). Timings on a shared CPU are
noisy; quality numbers (perplexity, agreement, KL, bytes) are deterministic. `quotes(report)` gives chapter 09's
tables and numbers from a report saved with `--json`.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.bench.agreement import output_consistency, teacher_forced_kl
from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, check_sizes, cpu_description, pick_size, start, write_report
from minillm.bench.driver import engine_tokens
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.bench.workload import eval_prompts
from minillm.core.config import (check_choice, check_has_data, check_int, check_tensor_elements, reads_report,
                                 tensor_kind)
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, check_seed
from minillm.core.timing import check_calls, check_repeats, compare, measure
from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.gpt.dataset import default_eval_tokens
from minillm.gpt.eval import check_eval_ids, perplexity
from minillm.kvcache.cache import ContiguousKVCache
from minillm.kvcache.generate import generate_ids
from minillm.quant.gptq import calibration_windows, check_calibration, gptq_quantize_model
from minillm.quant.kv_cache import Int8ContiguousKVCache
from minillm.quant.linear import QuantConfig, QuantLinear, check_fp32_model, quantize_model, weight_bytes
from minillm.quant.outliers import inject_outliers, input_absmax, outlier_report, smooth_model
from minillm.quant.qat import convert_qat, finetune_qat
from minillm.quant.w8a8 import int8_matmul, quantize_activations


METHODS = ("fp32", "rtn", "gptq", "qat")


@dataclass(frozen=True)
class Case:
    name: str
    config: QuantConfig | None  # None: the fp32 model itself (method "fp32")
    method: str = "rtn"  # "rtn" (round to nearest), "gptq", or "qat" (fine-tuned under fake quantization, then RTN)

    def __post_init__(self) -> None:
        # subtle: `build` picks the method by name; an unchecked typo ("gptx") would measure RTN under its label
        if not isinstance(self.name, str):
            raise TypeError(f"Case.name must be a str, got {type(self.name).__name__}")
        object.__setattr__(self, "method", check_choice("Case.method", self.method, METHODS))
        if self.config is not None and not isinstance(self.config, QuantConfig):
            raise TypeError(f"Case.config must be a QuantConfig or None, got {type(self.config).__name__}")
        if (self.config is None) != (self.method == "fp32"):
            raise ValueError(f"Case.method={self.method!r} with config={self.config!r}: config is None exactly "
                             "for method 'fp32'")


@dataclass(frozen=True)
class Sizes:
    val_tokens: int  # validation tokens for perplexity
    num_prompts: int  # validation prompts of 32 tokens for agreement, identical tokens and the engine
    new_tokens: int  # greedy tokens generated per prompt
    decode_new: int  # tokens decoded at batch 1 per timed run
    repeats: int  # timed runs of each decode (median)
    qat_steps: int
    calibration: int  # GPTQ's calibration windows of block_size training tokens
    outlier_tokens: int  # validation tokens of the outlier study
    cost_repeats: int  # layer_costs: repeats, and calls per repeat
    cost_calls: int

    def __post_init__(self) -> None:
        check_sizes(self)  # every field by its type, named: a bad size fails here, not minutes into a run


SIZES = {
    "quick": Sizes(4096, 4, 32, 16, 1, 5, 8, 2048, 1, 5),  # the tour's --quick and the tests: about a minute
    "tour": Sizes(4096, 6, 32, 32, 3, 5, 8, 2048, 3, 20),  # the tour: the quick quality sizes, timed properly
    "full": Sizes(16384, 16, 48, 64, 5, 30, 32, 8192, 7, 50),  # python -m minillm.quant.bench: a few minutes
}
PROMPT_LEN = 32
ENGINE = dict(num_blocks=64, block_size=16, max_num_seqs=8)  # the engine of the engine checks: every prompt at once


CASES: tuple[Case, ...] = (
    Case("fp32", None, "fp32"),
    Case("int8 weight-only", QuantConfig("int8")),
    Case("int8 weight-only + head", QuantConfig("int8", quantize_head=True)),
    Case("int4 group-wise RTN", QuantConfig("int4", group_size=128)),
    Case("int4 GPTQ", QuantConfig("int4", group_size=128), "gptq"),
    Case("int4 QAT", QuantConfig("int4", group_size=128), "qat"),
    Case("W8A8", QuantConfig("w8a8")),
)


def linear_bytes(model: nn.Module) -> int:
    """Bytes of the block linears alone: fp32 weight + bias, or codes + scales + zero points + bias."""
    require_model(model, "linear_bytes: model")
    return sum(t.nbytes for m in model.transformer.h.modules() if isinstance(m, (nn.Linear, QuantLinear))
               for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))


# AdamW learning rate and windows per step of the QAT fine-tune (distillation loss). subtle: measured on base, 30
# steps at 2e-5 beat RTN (+0.22% vs +0.30% on 16k validation tokens) while 1e-4 overshoots (+0.36% after 20 steps,
# +0.83% after 30): a short fine-tune of an already-good model is sensitive to its step size.
QAT_LR, QAT_BATCH = 2e-5, 4


def build(model: GPT, case: Case, calibration: torch.Tensor, qat_steps: int = 20) -> tuple[nn.Module, float]:
    """(the case's model, seconds it took to quantize, fine-tuning included). Every argument is checked whichever
    case reads it (calibration: GPTQ's; qat_steps: QAT's), so a bad one is named on the first case, not the sixth."""
    require_model(model, "build")
    if not isinstance(case, Case):
        raise TypeError(f"case must be a quant.bench Case, got {type(case).__name__}")
    check_calibration(model, calibration, "build")
    qat_steps = check_int("qat_steps", qat_steps)
    t0 = time.perf_counter()
    if case.method == "fp32":
        out = model
    elif case.method == "gptq":
        out = gptq_quantize_model(model, case.config, calibration)
    elif case.method == "qat":
        # Distillation from the fp32 model, not next-token loss on training text the model has already seen many
        # times (that drifts perplexity by itself; with distillation the fp32 control run is the model unchanged).
        net, _ = finetune_qat(model, case.config, steps=qat_steps, batch_size=QAT_BATCH, lr=QAT_LR, distill=True)
        out = convert_qat(net, case.config)
    else:  # "rtn": Case refuses every other method
        out = quantize_model(model, case.config)
    return out, time.perf_counter() - t0


@torch.inference_mode()
def kv_perplexity(model: nn.Module, tokens: torch.Tensor, make_cache: Callable[[int, int], Any],
                  batch_size: int = 8) -> float:
    """Perplexity with attention reading K/V back from a cache: each window of block_size tokens is run as one
    prefill into a fresh `make_cache(B, T)`, so every query attends over stored (e.g. int8) keys and values, its own
    included, exactly as a decode step would. Windows are back to back, the last one shorter; with a plain fp32
    cache this is `minillm.gpt.eval.perplexity` whenever the windows tile the text (tested). What make_cache returns
    must be a cache (an `attend` method) for B rows of T slots: a TypeError/ValueError naming make_cache otherwise."""
    cfg = require_model(model, "kv_perplexity")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"tokens must be a 1-D int64 tensor of token ids, got {tensor_kind(tokens)} "
                        f"{tuple(getattr(tokens, 'shape', ()))}")
    check_has_data("tokens", tokens)  # its ids are read below
    if tokens.numel() < 2:
        raise ValueError(f"tokens must hold at least 2 ids (an input and the target after it), got {tokens.numel()}")
    lo, hi = (int(v) for v in torch.aminmax(tokens))
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"tokens holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {cfg.vocab_size})")
    batch_size = check_int("batch_size", batch_size)
    if not callable(make_cache):
        raise TypeError(f"make_cache must be callable (batch_size, max_len) -> cache, got {type(make_cache).__name__}")
    bs = cfg.block_size
    n = tokens.numel() - 1  # targets
    starts = list(range(0, n, bs))
    total, count = 0.0, 0
    for length in sorted({min(bs, n - s) for s in starts}):
        group = [s for s in starts if min(bs, n - s) == length]
        for i in range(0, len(group), batch_size):
            chunk = group[i:i + batch_size]
            x = torch.stack([tokens[s:s + length] for s in chunk]).to(model.device)  # (B, T)
            y = torch.stack([tokens[s + 1:s + length + 1] for s in chunk]).to(model.device)  # (B, T)
            cache = _checked_cache(make_cache, len(chunk), length)
            h = model.hidden(x, torch.arange(length, device=x.device), cache)  # (B, T, C)
            logits = model.logits(h).float()  # (B, T, V)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    return math.exp(total / count)


def _checked_cache(make_cache: Callable[[int, int], Any], B: int, T: int) -> Any:
    """make_cache(B, T), refused naming make_cache unless it is a cache (an `attend` method) whose batch_size and
    max_len, where it has them, fit B rows of T tokens: a None cache would measure without one, silently."""
    cache = make_cache(B, T)
    if not callable(getattr(cache, "attend", None)):
        raise TypeError(f"make_cache({B}, {T}) must return a KV cache (with an attend method), got "
                        f"{type(cache).__name__}")
    rows, slots = getattr(cache, "batch_size", B), getattr(cache, "max_len", T)
    if rows != B or slots < T:
        raise ValueError(f"make_cache({B}, {T}) returned a cache of batch_size={rows}, max_len={slots}: it must hold "
                         f"B={B} rows of T={T} tokens; build it from the two arguments")
    return cache


def _kv_int8_case(model: GPT, val: torch.Tensor, prompts: list[list[int]], fp32_tokens: list[list[int]],
                 greedy: SamplingParams, base_ppl: float, decode_prompt: list[int],
                 decode_params: SamplingParams, repeats: int) -> dict[str, Any]:
    """The int8 KV cache on fp32 weights: KV bytes, perplexity through the cache, greedy tokens, decode tok/s."""
    cfg = model.config
    fp32_ppl = kv_perplexity(model, val, lambda B, T: ContiguousKVCache(cfg, B, T))
    ppl = kv_perplexity(model, val, lambda B, T: Int8ContiguousKVCache(cfg, B, T))
    max_len = len(prompts[0]) + greedy.max_new_tokens
    tokens = [generate_ids(model, p, greedy, kv_cache=Int8ContiguousKVCache(cfg, 1, max_len)) for p in prompts]
    eng = engine_tokens(LLM(model, None, EngineConfig(**ENGINE, attention_backend="paged-int8")), prompts, greedy)
    n = len(decode_prompt) + decode_params.max_new_tokens
    cmp = compare(lambda: generate_ids(model, decode_prompt, decode_params),
                  lambda: generate_ids(model, decode_prompt, decode_params,
                                       kv_cache=Int8ContiguousKVCache(cfg, 1, n)), warmup=1, repeats=repeats)
    fp32_bytes = ContiguousKVCache(cfg, 1, cfg.block_size).nbytes
    int8_bytes = Int8ContiguousKVCache(cfg, 1, cfg.block_size).nbytes
    return {"case": "KV cache int8 (fp32 weights)", "kv_bytes_per_token": int8_bytes // cfg.block_size,
            "fp32_kv_bytes_per_token": fp32_bytes // cfg.block_size, "kv_ratio": fp32_bytes / int8_bytes,
            "perplexity": ppl, "fp32_cache_perplexity": fp32_ppl, "ppl_delta_pct": (ppl / fp32_ppl - 1) * 100,
            "eval_perplexity_check": fp32_ppl / base_ppl,
            "identical_prompts": same_tokens(fp32_tokens, tokens).equal,
            "engine_same_as_generate": same_tokens(tokens, eng).equal, "prompts": len(prompts),
            "tok_s": decode_params.max_new_tokens / cmp.candidate.median, "speedup": cmp.speedup}


# The planted outliers of the study: features 3, 77 and 150 of ln_1/ln_2 on a width of 256 (scaled to the model's).
OUTLIER_CHANNELS, OUTLIER_FACTOR = [3, 77, 150], 50.0


def outlier_study(model: GPT, val: torch.Tensor, calibration: torch.Tensor) -> dict[str, Any]:
    """W8A8 on `base` and on `base` with planted outlier features (same function), plain, with LLM.int8's
    decomposition (threshold 6) and after SmoothQuant (α = 0.5); int8 weight-only beside them. Perplexity deltas are
    against fp32 `base`; W8A8 runs its float64 twin here (the same integers, faster on the CPU). `val` the validation
    ids, `calibration` (N, T) ids: a TypeError / ValueError naming them (perplexity would call val `tokens`)."""
    val = check_eval_ids("val", val, require_model(model, "outlier_study").vocab_size)
    check_calibration(model, calibration, "outlier_study")
    base_ppl = perplexity(model, val)
    channels = [c * model.config.n_embd // 256 for c in OUTLIER_CHANNELS]
    report: dict[str, Any] = {"channels": channels, "factor": OUTLIER_FACTOR, "val_tokens": val.numel(), "rows": []}
    for label, m in (("base", model), ("base + planted outliers", inject_outliers(model, channels, OUTLIER_FACTOR))):
        stats = outlier_report(input_absmax(m, calibration[:4]))
        variants = {
            "fp32": m,
            "int8 weight-only": quantize_model(m, QuantConfig("int8")),
            "W8A8": quantize_model(m, QuantConfig("w8a8", use_int_mm=False)),
            "W8A8 + LLM.int8 (6.0)": quantize_model(m, QuantConfig("w8a8", use_int_mm=False, outlier_threshold=6.0)),
            "SmoothQuant + W8A8": quantize_model(smooth_model(m, calibration), QuantConfig("w8a8", use_int_mm=False)),
        }
        ppl = {name: perplexity(v, val) for name, v in variants.items()}
        report["rows"].append({"model": label, "max_abs": max(r["max_abs"] for r in stats),
                               "max_over_median": max(r["max_over_median"] for r in stats),
                               "layers_with_outliers": sum(r["outlier_features"] > 0 for r in stats),
                               "layers": len(stats),
                               "ppl_delta_pct": {k: (v / base_ppl - 1) * 100 for k, v in ppl.items()}})
    return report


def layer_costs(in_features: int = 256, out_features: int = 1024, tokens: tuple[int, ...] = (1, 256),
                repeats: int = 7, calls: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    """Microseconds per call of one (out, in) linear for each implementation, at each number of tokens M."""
    in_features = check_int("in_features", in_features)
    out_features = check_int("out_features", out_features)
    repeats = check_repeats("repeats", repeats)
    calls = check_calls("calls", calls)
    seed = check_seed(check_int("seed", seed, 0))  # [0, 2**64): torch's generator's range
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple)):
        raise TypeError(f"tokens must be a tuple of token counts, got {type(tokens).__name__} {tokens!r}")
    if not tokens:
        raise ValueError("tokens must hold at least one token count, got an empty tuple")
    tokens = [check_int(f"tokens[{i}]", M) for i, M in enumerate(tokens)]  # the plain ints
    # the layer's weight and each call's input and output: named here, not by torch's allocator
    check_tensor_elements("out_features x in_features", (out_features, in_features))
    check_tensor_elements("tokens x in_features", (max(tokens), in_features))
    check_tensor_elements("tokens x out_features", (max(tokens), out_features))
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_features, out_features)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=g) * 0.02)
    q8 = QuantLinear.from_linear(lin, QuantConfig("int8"))
    q4 = QuantLinear.from_linear(lin, QuantConfig("int4", group_size=128))
    w8a8 = QuantLinear.from_linear(lin, QuantConfig("w8a8"))
    w8a8_ref = QuantLinear.from_linear(lin, QuantConfig("w8a8", use_int_mm=False))
    rows = []
    with torch.inference_mode():
        for M in tokens:
            x = torch.randn(M, in_features, generator=g)
            xq, _ = quantize_activations(x)
            wt = w8a8.qweight.t()
            fns = {"fp32 F.linear": lambda: lin(x), "int8 de-quantize + F.linear": lambda: q8(x),
                   "int4 unpack + de-quantize + F.linear": lambda: q4(x), "W8A8 torch._int_mm": lambda: w8a8(x),
                   "W8A8 float64 twin": lambda: w8a8_ref(x),
                   "int8 x int8 matmul alone (_int_mm)": lambda: int8_matmul(xq, wt)}
            row: dict[str, Any] = {"tokens": M, "shape": (out_features, in_features)}
            base_fn = fns.pop("fp32 F.linear")
            for name, fn in fns.items():
                cmp = compare(lambda: [base_fn() for _ in range(calls)], lambda: [fn() for _ in range(calls)],
                              warmup=1, repeats=repeats)
                row["fp32 F.linear"] = cmp.baseline.median / calls * 1e6
                row[name] = cmp.candidate.median / calls * 1e6
            rows.append(row)
    return rows


def run_all(model: GPT, real_text: bool, size: str = "full", seed: int = 0) -> dict[str, Any]:
    """Everything the tour and the chapter table report, at one of the `SIZES`. Every argument is checked before
    any work (TypeError/ValueError naming it): an fp32 GPT, a bool real_text, a known size, a 64-bit seed."""
    sz = pick_size(SIZES, size)
    check_fp32_model(model, "run_all: model")
    if not isinstance(real_text, bool):  # a str such as 'no' is truthy: real text would be read for it
        raise TypeError(f"real_text must be a bool (trained weights read the validation text), got "
                        f"{type(real_text).__name__} {real_text!r}")
    seed = check_seed(seed)
    V = model.config.vocab_size
    val = default_eval_tokens(sz.val_tokens)
    prompts = eval_prompts([PROMPT_LEN] * sz.num_prompts, V, real_text, seed)
    # subtle: the validation text opens the split; the prompts are taken from the same stretch, which is fine for
    # agreement (both models read the same prompts) and keeps every number on one fixed, documented token set.
    calibration = calibration_windows(sz.calibration, model.config.block_size, seed)
    greedy = SamplingParams.greedy(sz.new_tokens, ignore_eos=True)
    report: dict[str, Any] = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "size": size,
                              "val_tokens": val.numel(), "prompts": sz.num_prompts, "prompt_len": PROMPT_LEN,
                              "new_tokens": sz.new_tokens, "calibration": list(calibration.shape),
                              "qat_steps": sz.qat_steps,
                              "qat_windows": [QAT_BATCH, model.config.block_size], "cases": []}
    fp32_tokens = [generate_ids(model, p, greedy) for p in prompts]
    sequences = [p + t for p, t in zip(prompts, fp32_tokens)]
    base_bytes, base_linear = weight_bytes(model), linear_bytes(model)
    base_ppl = perplexity(model, val)
    decode_prompt = prompts[0][:16]
    decode_params = SamplingParams.greedy(sz.decode_new, ignore_eos=True)
    for case in CASES:
        qmodel, build_s = build(model, case, calibration, sz.qat_steps)
        # W8A8's quality numbers come from its float64 twin: the same integers (int32 sums are exact either way)
        # at a cost that does not hang on the CPU's int8 instructions (on a 256-token window _int_mm was 15x slower
        # than the twin on one machine, 6x faster on another). Its speed is timed through _int_mm below.
        scored = qmodel if case.config is None or case.config.mode != "w8a8" else \
            quantize_model(model, replace(case.config, use_int_mm=False))
        ppl = base_ppl if case.config is None else perplexity(scored, val)
        kl = teacher_forced_kl(model, scored, sequences, PROMPT_LEN)  # one forward each: KL and argmax agreement
        tokens = fp32_tokens if case.config is None else [generate_ids(scored, p, greedy) for p in prompts]
        free = output_consistency(fp32_tokens, tokens)
        row: dict[str, Any] = {
            "case": case.name, "mode": case.config.mode if case.config else "fp32", "method": case.method,
            "weight_bytes": weight_bytes(qmodel), "bytes_ratio": base_bytes / weight_bytes(qmodel),
            "linear_bytes": linear_bytes(qmodel), "linear_ratio": base_linear / linear_bytes(qmodel),
            "perplexity": ppl, "ppl_delta_pct": (ppl / base_ppl - 1) * 100,
            **kl, "identical_prompts": free["identical"], "mean_common_prefix": free["mean_common_prefix"],
            "quantize_s": build_s,
        }
        if case.config is None:
            t = measure(lambda: generate_ids(model, decode_prompt, decode_params), warmup=1, repeats=sz.repeats)
            row.update(tok_s=sz.decode_new / t.median, speedup=1.0)
        else:
            cmp = compare(lambda: generate_ids(model, decode_prompt, decode_params),
                          lambda: generate_ids(qmodel, decode_prompt, decode_params), warmup=1, repeats=sz.repeats)
            row.update(tok_s=sz.decode_new / cmp.candidate.median, fp32_tok_s=sz.decode_new / cmp.baseline.median,
                       speedup=cmp.speedup)
            if case.method == "gptq" or case.name == "int8 weight-only":
                eng = engine_tokens(LLM(scored, None, EngineConfig(**ENGINE)), prompts, greedy)
                row["engine"] = {"same_as_generate": same_tokens(tokens, eng).equal,
                                 "same_as_fp32": same_tokens(fp32_tokens, eng).equal, "prompts": sz.num_prompts}
        report["cases"].append(row)
    report["kv_int8"] = _kv_int8_case(model, val, prompts, fp32_tokens, greedy, base_ppl, decode_prompt,
                                     decode_params, sz.repeats)
    report["outliers"] = outlier_study(model, val[:sz.outlier_tokens], calibration)
    report["layer_costs"] = layer_costs(repeats=sz.cost_repeats, calls=sz.cost_calls)
    return report


def _pct(v: float) -> str:
    """A perplexity delta in percent, signed: "+0.23%"."""
    return f"{v:+.2f}%"


def _times(v: float) -> str:
    """A ratio: "3.92x"."""
    return f"{v:.2f}x"


def _kv_cells(kv: dict[str, Any]) -> dict[str, str]:
    """The int8 KV cache's numbers, formatted once for the printed report and for `quotes`."""
    return {"kv_bytes": f"{kv['kv_bytes_per_token']:,}", "kv_fp32_bytes": f"{kv['fp32_kv_bytes_per_token']:,}",
            "kv_ratio": _times(kv["kv_ratio"]), "kv_ppl": f"{kv['perplexity']:.3f}",
            "kv_fp32_ppl": f"{kv['fp32_cache_perplexity']:.3f}", "kv_delta": _pct(kv["ppl_delta_pct"]),
            "kv_identical": f"{kv['identical_prompts']}/{kv['prompts']}",
            "kv_engine": f"{kv['engine_same_as_generate']}/{kv['prompts']}", "kv_tok_s": f"{kv['tok_s']:.0f}",
            "kv_speedup": _times(kv["speedup"])}


def _sig2(v: float) -> str:
    """A small positive number with two significant digits in fixed notation (0.000020, 0.0058, 0.27); 0 as "0"."""
    if v <= 0:
        return "0"
    return f"{v:.{max(0, 1 - math.floor(math.log10(v)))}f}"


def _decode_cell(r: dict[str, Any], report: dict[str, Any]) -> str:
    if "fp32_tok_s" not in r:  # the fp32 row: its own rate
        return f"{r['tok_s']:.0f}"
    return f"{r['tok_s']:.0f} vs {r['fp32_tok_s']:.0f} ({_times(r['speedup'])})"


# Every column of the methods tables: header -> the cell of one case row `r` of the report. `format_table` prints
# them all; a chapter text quotes a few at a time (`quotes`), so a number is formatted the same wherever it appears.
CASE_COLUMNS: dict[str, Callable[[dict[str, Any], dict[str, Any]], str]] = {
    "method": lambda r, rep: r["case"],
    "weight bytes (x smaller)": lambda r, rep: f"{r['weight_bytes'] / 1e6:.2f} MB ({_times(r['bytes_ratio'])})",
    "block linears (x smaller)": lambda r, rep: f"{r['linear_bytes'] / 1e6:.2f} MB ({_times(r['linear_ratio'])})",
    "val ppl": lambda r, rep: f"{r['perplexity']:.3f}",
    "delta": lambda r, rep: _pct(r["ppl_delta_pct"]),
    "argmax agreement": lambda r, rep: f"{100 * r['agreement']:.1f}%",
    "KL from fp32, mean (nats/token)": lambda r, rep: _sig2(r["kl_mean"]),
    "KL, 99th percentile": lambda r, rep: _sig2(r["kl_p99"]),
    "KL, max": lambda r, rep: _sig2(r["kl_max"]),
    "identical prompts": lambda r, rep: f"{r['identical_prompts']}/{rep['prompts']}",
    "mean common prefix": lambda r, rep: f"{r['mean_common_prefix']:.1f}",
    "decode tok/s vs fp32 (ratio)": _decode_cell,
    "time to quantize (s)": lambda r, rep: f"{r['quantize_s']:.2f}",
}
# The columns of the chapter's two tables: what each method costs and gives, and how far its outputs are from fp32's.
METHODS_COLUMNS = ("method", "weight bytes (x smaller)", "block linears (x smaller)", "val ppl", "delta",
                   "argmax agreement", "identical prompts", "decode tok/s vs fp32 (ratio)")
DIVERGENCE_COLUMNS = ("method", "delta", "argmax agreement", "KL from fp32, mean (nats/token)", "KL, 99th percentile",
                      "identical prompts", "mean common prefix")
RUN_COLUMNS = ("method", "time to quantize (s)", "KL, max", "decode tok/s vs fp32 (ratio)")


@reads_report
def cases_table(report: dict[str, Any], columns: tuple[str, ...] = tuple(CASE_COLUMNS)) -> str:
    """The methods as a Markdown table of the named `CASE_COLUMNS`, one row per case."""
    return markdown_table(list(columns), [[CASE_COLUMNS[c](r, report) for c in columns] for r in report["cases"]])


@reads_report
def outlier_table(report: dict[str, Any]) -> str:
    """The outlier study: per model, its largest activations and each variant's perplexity delta against fp32."""
    rows = report["outliers"]["rows"]
    variants = list(rows[0]["ppl_delta_pct"])
    header = ["model", "max \\|x\\|", "max / median", "layers with \\|x\\| ≥ 6"] + variants
    return markdown_table(header, [[r["model"], f"{r['max_abs']:.0f}", f"{r['max_over_median']:.0f}x",
                                    f"{r['layers_with_outliers']}/{r['layers']}"]
                                   + [_pct(r["ppl_delta_pct"][v]) for v in variants] for r in rows])


@reads_report
def layer_cost_table(report: dict[str, Any]) -> str:
    """One layer's microseconds per call, one row per implementation, one column per number of tokens."""
    costs = report["layer_costs"]
    names = [k for k in costs[0] if k not in ("tokens", "shape")]
    header = [f"one {tuple(costs[0]['shape'])} layer, µs per call"] + [
        f"{c['tokens']} token{'s' if c['tokens'] != 1 else ''}" for c in costs]
    return markdown_table(header, [[name] + [f"{c[name]:,.0f}" for c in costs] for name in names])


@reads_report
def format_table(report: dict[str, Any]) -> str:
    n = report["prompts"]
    lines = [cases_table(report)]
    lines.append(f"perplexity on the first {report['val_tokens']:,} validation tokens; agreement and KL "
                 f"teacher-forced over {n} prompts x {report['new_tokens']} greedy tokens of fp32 (the common prefix "
                 f"of free-running continuations, in tokens of {report['new_tokens']}); calibration (GPTQ) "
                 f"{report['calibration'][0]} x {report['calibration'][1]} training tokens; QAT {report['qat_steps']} "
                 f"steps of {report['qat_windows'][0]} x {report['qat_windows'][1]} training tokens (distillation, "
                 f"lr {QAT_LR:g}); torch threads {report['threads']}; {report['cpu']}")
    for r in report["cases"]:
        if "engine" in r:
            e = r["engine"]
            lines.append(f"engine (minillm.LLM) on {r['case']}: identical to generate_ids of the same model "
                         f"{e['same_as_generate']}/{e['prompts']}, to fp32 {e['same_as_fp32']}/{e['prompts']}")
    kv = _kv_cells(report["kv_int8"])
    lines.append(f"{report['kv_int8']['case']}: {kv['kv_bytes']} B/token vs {kv['kv_fp32_bytes']} ({kv['kv_ratio']} "
                 f"smaller); ppl through the cache {kv['kv_ppl']} vs {kv['kv_fp32_ppl']} fp32 cache "
                 f"({kv['kv_delta']}); identical greedy prompts {kv['kv_identical']}; engine (paged-int8) = "
                 f"generate_ids {kv['kv_engine']}; decode {kv['kv_tok_s']} tok/s ({kv['kv_speedup']} fp32 cache)")
    o = report["outliers"]
    lines.append(f"\noutlier study ({o['val_tokens']:,} val tokens; planted: features {o['channels']} "
                 f"x{o['factor']:g}), perplexity delta vs fp32 base:\n")
    lines.append(outlier_table(report))
    lines.append(layer_cost_table(report))
    return "\n".join(lines)


# Short names of the cases, the outlier study's models and variants, and the layer implementations, for `quotes`.
CASE_KEYS = {"fp32": "fp32", "int8 weight-only": "int8", "int8 weight-only + head": "int8_head",
             "int4 group-wise RTN": "rtn", "int4 GPTQ": "gptq", "int4 QAT": "qat", "W8A8": "w8a8"}
OUTLIER_KEYS = {"base": "base", "base + planted outliers": "planted"}
VARIANT_KEYS = {"fp32": "fp32", "int8 weight-only": "int8", "W8A8": "w8a8", "W8A8 + LLM.int8 (6.0)": "llm_int8",
                "SmoothQuant + W8A8": "smoothquant"}
LAYER_KEYS = {"fp32 F.linear": "fp32", "int8 de-quantize + F.linear": "int8",
              "int4 unpack + de-quantize + F.linear": "int4", "W8A8 torch._int_mm": "w8a8",
              "W8A8 float64 twin": "w8a8_twin", "int8 x int8 matmul alone (_int_mm)": "int_mm"}
VALUE_COLUMNS = {"ppl": "val ppl", "delta": "delta", "agreement": "argmax agreement",
                 "kl_mean": "KL from fp32, mean (nats/token)", "kl_p99": "KL, 99th percentile", "kl_max": "KL, max",
                 "identical": "identical prompts", "prefix": "mean common prefix", "quantize_s": "time to quantize (s)"}


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What chapter 09's text quotes from a full run's report (`minillm.course.results`): the tables "methods",
    "divergence", "run" (time to quantize, largest KL, decode rates), "outliers" and "layer_costs", and single values named by a case's short name (`CASE_KEYS`) and a
    quantity, e.g. "gptq_delta" = "+0.23%", "int8_speedup" = "0.69x" (decode against fp32), "rtn_kl_mean"; the int8
    KV cache's ("kv_..."), the engine checks ("int8_engine" = "16/16"), the outlier study's deltas
    ("planted_w8a8_delta"), one layer's microseconds ("layer_256_int_mm_us") and its time over fp32's
    ("layer_1_int4_vs_fp32" = "21.8x"), the fp32 decode rates the run saw, and the run's machine and minutes."""
    out = {"methods": cases_table(report, METHODS_COLUMNS), "divergence": cases_table(report, DIVERGENCE_COLUMNS),
           "run": cases_table(report, RUN_COLUMNS),
           "outliers": outlier_table(report), "layer_costs": layer_cost_table(report),
           "cpu": report["cpu"], "threads": str(report["threads"]), "minutes": f"{report['wall_s'] / 60:.0f}"}
    cases = {CASE_KEYS[r["case"]]: r for r in report["cases"]}
    for key, r in cases.items():
        for name, column in VALUE_COLUMNS.items():
            out[f"{key}_{name}"] = CASE_COLUMNS[column](r, report)
        out[f"{key}_tok_s"] = f"{r['tok_s']:.0f}"
        out[f"{key}_bytes_ratio"], out[f"{key}_linear_ratio"] = _times(r["bytes_ratio"]), _times(r["linear_ratio"])
        if key != "fp32":
            out[f"{key}_speedup"] = _times(r["speedup"])
        if "engine" in r:
            e = r["engine"]
            out[f"{key}_engine"] = f"{e['same_as_generate']}/{e['prompts']}"
            out[f"{key}_engine_fp32"] = f"{e['same_as_fp32']}/{e['prompts']}"
    fp32_rates = [cases["fp32"]["tok_s"]] + [r["fp32_tok_s"] for r in report["cases"] if "fp32_tok_s" in r]
    out["fp32_tok_s_min"], out["fp32_tok_s_max"] = f"{min(fp32_rates):.0f}", f"{max(fp32_rates):.0f}"
    # the gap between the two deltas as printed (+0.30% and +0.23%: 0.07), so a reader's subtraction agrees
    gap = round(cases["rtn"]["ppl_delta_pct"], 2) - round(cases["gptq"]["ppl_delta_pct"], 2)
    out["rtn_minus_gptq_delta"] = f"{gap:.2f}"
    out["rtn_over_gptq_kl"] = f"{cases['rtn']['kl_mean'] / cases['gptq']['kl_mean']:.1f}x"
    out["qat_over_gptq_kl"] = f"{cases['qat']['kl_mean'] / cases['gptq']['kl_mean']:.1f}x"
    out["w8a8_over_int8_head_kl"] = f"{cases['w8a8']['kl_mean'] / cases['int8_head']['kl_mean']:.1f}x"
    out.update(_kv_cells(report["kv_int8"]))
    for r in report["outliers"]["rows"]:
        model = OUTLIER_KEYS[r["model"]]
        out[f"{model}_max_abs"] = f"{r['max_abs']:.0f}"
        out[f"{model}_max_over_median"] = f"{r['max_over_median']:.0f}x"
        for variant, delta in r["ppl_delta_pct"].items():
            out[f"{model}_{VARIANT_KEYS[variant]}_delta"] = _pct(delta)
    for c in report["layer_costs"]:
        for name, key in LAYER_KEYS.items():
            out[f"layer_{c['tokens']}_{key}_us"] = f"{c[name]:,.0f}"
            if key != "fp32":
                out[f"layer_{c['tokens']}_{key}_vs_fp32"] = f"{c[name] / c['fp32 F.linear']:.1f}x"
    return out


def build_parser() -> argparse.ArgumentParser:
    # CPU only: the int8 kernels timed here (torch._int_mm, the de-quantizing linears) are the CPU's.
    return bench_parser("python -m minillm.quant.bench", __doc__.splitlines()[0],
                        "the smallest sizes, as the tour's --quick (~1 min)", sizes=SIZES, devices=("cpu",))


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    t0 = time.perf_counter()
    loaded = load_model("base", args.device, args.seed)
    report = run_all(loaded.model, real_text=loaded.trained, size=args.size, seed=args.seed)
    report["model"] = loaded.label
    report["wall_s"] = time.perf_counter() - t0  # the whole command, loading the model included
    write_report(args.json, report)
    print(f"model: {loaded.label}")
    print(format_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
