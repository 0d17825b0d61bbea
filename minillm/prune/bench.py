"""Chapter 10's benchmark: every pruning method on `base` against the dense model, on quality, bytes and speed.

What it reports:
  - unstructured pruning by magnitude and by Wanda at each sparsity (10-70%): validation perplexity and its delta,
    the share of zeros, the bytes of the block linears in the dense, bitmask and CSR formats; at 50% also the
    teacher-forced greedy agreement with the dense model and KL(p_dense || p_pruned) from the same forwards (mean,
    99th percentile, max; nats per token), the free-running greedy continuations identical to dense's and their mean
    common prefix, decode tok/s (dense kernels: the zeros cost the same) and the chapter 06 engine on the pruned
    model token for token against `generate_ids`;
  - 2:4 by magnitude and by Wanda: the same, with the pattern verified and the bytes of the 2:4 format;
  - the same 50% comparison on `draft` and on `base` with planted outlier features (chapter 09's
    `inject_outliers`, a function-preserving rescaling that magnitude pruning sees and Wanda does not);
  - the magnitude masks against `torch.nn.utils.prune.l1_unstructured`'s, layer by layer;
  - structured MLP pruning at 25% (and 50%): parameters removed, perplexity before and after a short recovery
    fine-tune (KL to the dense model), greedy agreement, decode tok/s at batch 1 and prefill time for 256 tokens
    against dense (`minillm.core.timing.compare`: alternating runs, medians), the engine token for token;
  - attention heads masked by importance (1, 2, 4 of 8 per block): perplexity; and 2 of 8 per block removed for
    real (`prune_heads`), recovered like the MLP: perplexity, KV bytes per token, agreement, speed (the full run only);
  - one linear layer (256 -> 1024) at 50/70/90% zeros: dense `F.linear` against a CSR sparse matmul, at 1 and 256
    tokens, microseconds per call;
  - on a CUDA GPU of compute capability 8.0+: `semi_structured.layer_speed`, the 2:4 kernel against dense.
The command: `python -m minillm.prune.bench [--quick | --size S] [--threads N] [--json FILE]` (quick ~40 s,
default a few minutes on one thread; the tour runs the `tour` sizes in under a minute). Timings on a shared CPU are noisy;
perplexity, agreement, KL, bytes and masks are deterministic. `format_table(report)` prints the report as tables;
`quotes(report)` gives the chapter text the same tables by name and its single numbers, read from the committed
`chapters/results/10-pruning.json` (`minillm.course.results`).
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as torch_prune

from minillm.bench.agreement import output_consistency, teacher_forced_kl
from minillm.bench.check import same_tokens
from minillm.bench.cli import bench_parser, check_sizes, pick_size, start, write_report
from minillm.bench.driver import engine_tokens
from minillm.bench.models import load_model
from minillm.bench.tables import markdown_table
from minillm.bench.workload import eval_prompts
from minillm.core.config import (check_fits_window, check_int, check_label, check_module_has_data, check_sequence,
                                 check_tensor_elements, reads_report, short_repr)
from minillm.core.model import GPT, require_model
from minillm.core.sampling import SamplingParams, check_seed
from minillm.core.timing import check_calls, check_repeats, compare
from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.gpt.dataset import default_eval_tokens
from minillm.gpt.eval import check_eval_ids, perplexity
from minillm.kvcache.generate import generate_ids
from minillm.prune.masks import check_sparsities, check_sparsity, is_nm_sparse, magnitude_mask
from minillm.prune.semi_structured import layer_speed, semi_structured_support, stored_bytes
from minillm.prune.structured import (
    head_scores,
    lowest_heads,
    mask_heads,
    mlp_neuron_scores,
    mlp_widths,
    prune_heads,
    prune_mlp,
    recover,
)
from minillm.prune.unstructured import block_linears, block_weights, check_prunable, prune_model, weight_sparsity
from minillm.quant.gptq import calibration_windows
from minillm.quant.outliers import inject_outliers

SPARSITIES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
# The planted outliers: chapter 09's features 3, 77, 150 of 256 (scaled to the model's width), times 16 (a power of
# two, so the rescaling is exact in float and Wanda's masks come out identical).
OUTLIER_CHANNELS, OUTLIER_FACTOR = (3, 77, 150), 16.0
RECOVERY_LR = 1e-4  # AdamW, constant, KL to the dense model; 40 steps of 4 x 256 tokens take ~30 s on one thread
PROMPT_LEN = 32
DECODE_PROMPT_LEN = 16  # the first tokens of the first prompt: the prompt of the timed batch-1 decode
MASKED_HEADS = (1, 2, 4)  # the head study: heads per block masked by importance
ENGINE = dict(num_blocks=64, block_size=16, max_num_seqs=8)  # the engine of the engine checks: every prompt at once


@dataclass(frozen=True)
class Sizes:
    val_tokens: int  # validation tokens for perplexity
    num_prompts: int  # validation prompts of PROMPT_LEN tokens for agreement and the engine
    new_tokens: int  # greedy tokens generated per prompt
    decode_new: int  # tokens decoded at batch 1 per timed run
    repeats: int  # timed runs (median)
    calibration: int  # Wanda's calibration windows of block_size training tokens
    sparsities: tuple[float, ...]  # unstructured sparsities swept
    side_tokens: int  # validation tokens of the 50% comparisons on draft and planted outliers
    structured: tuple[float, ...]  # fractions of MLP neurons removed
    recovery_steps: int
    heads: bool  # the attention-head study
    cost_repeats: int  # layer_costs: repeats, and calls per repeat
    cost_calls: int

    def __post_init__(self) -> None:
        check_sizes(self)  # every field by its type, named: a bad size fails here, not minutes into a run


SIZES = {
    "quick": Sizes(4096, 4, 32, 16, 1, 8, (0.5,), 2048, (0.25,), 10, False, 1, 5),  # tour --quick, tests: ~40 s
    "tour": Sizes(4096, 6, 32, 32, 3, 8, (0.5,), 2048, (0.25,), 10, False, 3, 20),  # the tour: under a minute
    "full": Sizes(16384, 16, 48, 64, 5, 32, SPARSITIES, 8192, (0.25, 0.5), 60, True, 5, 50),  # the CLI: minutes
}


def block_bytes(model: nn.Module, fmt: str) -> int:
    """Bytes of the block linears' weights in storage format `fmt` (fp32 values), biases included (dense)."""
    check_prunable(model, "block_bytes")  # a QuantizedGPT holds no nn.Linear: it would count 0 bytes
    linears = [lin for block in model.transformer.h for _, lin in block_linears(block)]
    return sum(stored_bytes(lin.weight, fmt) + (lin.bias.nbytes if lin.bias is not None else 0) for lin in linears)


def torch_prune_agreement(model: GPT, sparsity: float = 0.5) -> dict[str, int]:
    """How many block weights get the same mask from `magnitude_mask` and from `torch.nn.utils.prune`."""
    check_prunable(model, "torch_prune_agreement")
    sparsity = check_sparsity(sparsity)  # before torch.nn.utils.prune, which would refuse it in its own words
    same = total = 0
    for block in model.transformer.h:
        for _, lin in block_linears(block):
            probe = nn.Linear(lin.in_features, lin.out_features, bias=False, device=lin.weight.device)
            with torch.no_grad():
                probe.weight.copy_(lin.weight)
            torch_prune.l1_unstructured(probe, "weight", amount=sparsity)
            same += bool(torch.equal(probe.weight_mask.bool(), magnitude_mask(lin.weight, sparsity)))
            total += 1
    return {"same": same, "layers": total}


class Harness:
    """The fixed yardsticks every case is measured with: validation tokens, prompts, the dense model's outputs.

    Every prompt with its greedy tokens, and the decode prompt with its timed tokens, must fit the dense model's
    window uncut (a ValueError naming the prompt length, the tokens and the window otherwise): generation would
    stop early, and the agreement and tok/s below count tokens that were never generated."""

    def __init__(self, model: GPT, real_text: bool, sizes: Sizes, seed: int):
        check_prunable(model, "Harness")
        if not isinstance(real_text, bool):  # 'no' is truthy: it would pick the real validation text
            raise TypeError(f"real_text must be a bool, got {type(real_text).__name__} {short_repr(real_text)}")
        if not isinstance(sizes, Sizes):
            raise TypeError(f"sizes must be a prune.bench Sizes (e.g. SIZES['quick']), got {type(sizes).__name__}")
        seed = check_seed(seed)
        self.model = model
        window = model.config.block_size
        check_fits_window("Harness: each prompt", PROMPT_LEN, sizes.new_tokens, window, "the dense model")
        check_fits_window("Harness: the decode prompt", DECODE_PROMPT_LEN, sizes.decode_new, window, "the dense model")
        self.val = default_eval_tokens(sizes.val_tokens)
        top = int(self.val.max())
        if top >= model.config.vocab_size:  # else the first forward refuses, naming its own `idx`
            raise ValueError(f"Harness: model has vocab_size={model.config.vocab_size}, but the validation text holds "
                             f"token ids up to {top}: the benchmark needs a model of the shipped tokenizer's "
                             f"vocabulary")
        self.num_prompts, self.prompt_len, new = sizes.num_prompts, PROMPT_LEN, sizes.new_tokens
        self.prompts = eval_prompts([self.prompt_len] * self.num_prompts, model.config.vocab_size, real_text, seed)
        self.greedy = SamplingParams.greedy(new, ignore_eos=True)
        self.dense_tokens = [generate_ids(model, p, self.greedy) for p in self.prompts]
        self.sequences = [p + t for p, t in zip(self.prompts, self.dense_tokens)]
        self.dense_ppl = perplexity(model, self.val)
        self.decode_prompt = self.prompts[0][:DECODE_PROMPT_LEN]
        self.decode = SamplingParams.greedy(sizes.decode_new, ignore_eos=True)
        self.repeats = sizes.repeats

    def check_pruned(self, pruned: object, who: str) -> None:
        """A TypeError / ValueError naming `pruned` unless it can be measured against the dense model: a minillm GPT
        (any: a quantized one is only run) with real weights and the dense model's vocabulary and window (pruning
        changes neither; the comparisons run the same tokens through both). who names the caller in messages."""
        who = check_label("who", who)
        cfg = require_model(pruned, f"Harness.{who} (pruned)")
        check_module_has_data(f"Harness.{who}: pruned", pruned)
        dense = self.model.config
        for field in ("vocab_size", "block_size"):
            if getattr(cfg, field) != getattr(dense, field):
                raise ValueError(f"Harness.{who}: pruned has {field}={getattr(cfg, field)}, the dense model "
                                 f"{field}={getattr(dense, field)}: pruning changes neither vocabulary nor window")

    def quality(self, pruned: nn.Module) -> dict[str, Any]:
        self.check_pruned(pruned, "quality")
        ppl = perplexity(pruned, self.val)
        return {"perplexity": ppl, "ppl_delta_pct": (ppl / self.dense_ppl - 1) * 100}

    def agreement(self, pruned: nn.Module) -> dict[str, Any]:
        """Against dense: teacher-forced argmax agreement and KL (one forward of each model per prompt), the
        free-running continuations (identical ones, mean common prefix), and the engine against `generate_ids`."""
        self.check_pruned(pruned, "agreement")
        kl = teacher_forced_kl(self.model, pruned, self.sequences, self.prompt_len)
        tokens = [generate_ids(pruned, p, self.greedy) for p in self.prompts]
        free = output_consistency(self.dense_tokens, tokens)
        eng = engine_tokens(LLM(pruned, None, EngineConfig(**ENGINE)), self.prompts, self.greedy)
        return {**kl, "identical_prompts": free["identical"], "mean_common_prefix": free["mean_common_prefix"],
                "engine_same_as_generate": same_tokens(tokens, eng).equal, "prompts": self.num_prompts}

    def speed(self, pruned: nn.Module) -> dict[str, Any]:
        """Decode tok/s at batch 1 (generate_ids) and a 256-token prefill, pruned vs dense, alternating runs."""
        self.check_pruned(pruned, "speed")
        n = self.decode.max_new_tokens
        dec = compare(lambda: generate_ids(self.model, self.decode_prompt, self.decode),
                      lambda: generate_ids(pruned, self.decode_prompt, self.decode), warmup=1, repeats=self.repeats)
        x = torch.tensor([self.sequences[0] * 8], device=self.model.device)[:, :self.model.config.block_size]
        with torch.inference_mode():
            pre = compare(lambda: self.model(x), lambda: pruned(x), warmup=1, repeats=self.repeats)
        return {"tok_s": n / dec.candidate.median, "dense_tok_s": n / dec.baseline.median, "speedup": dec.speedup,
                "prefill_tokens": x.size(1), "prefill_speedup": pre.speedup}


def check_harness(h: object, who: str) -> Harness:
    """`h` if it is a `Harness`; a TypeError naming `h` and `who` (the function given it) otherwise, before an
    AttributeError from the middle of a sweep."""
    if not isinstance(h, Harness):
        raise TypeError(f"{who}: h must be a prune.bench Harness, got {type(h).__name__} {short_repr(h)}")
    return h


def unstructured_rows(h: Harness, calibration: torch.Tensor, sparsities: tuple[float, ...]) -> list[dict]:
    check_harness(h, "unstructured_rows")
    sparsities = check_sparsities(sparsities)
    rows = []
    dense_bytes = block_bytes(h.model, "dense")
    for method in ("magnitude", "wanda"):
        for s in sparsities:
            pruned = prune_model(h.model, method, s, calibration)
            row = {"method": method, "sparsity": s, "block_sparsity": weight_sparsity(pruned)["blocks"],
                   **h.quality(pruned), "dense_bytes": dense_bytes,
                   "bitmask_bytes": block_bytes(pruned, "bitmask"), "csr_bytes": block_bytes(pruned, "csr")}
            if s == 0.5:
                row.update(h.agreement(pruned), **h.speed(pruned))
            rows.append(row)
    return rows


def two_four_rows(h: Harness, calibration: torch.Tensor) -> list[dict]:
    check_harness(h, "two_four_rows")
    rows = []
    for method in ("magnitude", "wanda"):
        pruned = prune_model(h.model, method, calibration=calibration, pattern="2:4")
        weights = block_weights(pruned)
        fp16 = sum(stored_bytes(w, "2:4", element_bytes=2) for w in weights)
        fp16_dense = sum(w.numel() * 2 for w in weights)
        rows.append({"method": method, "pattern_ok": all(is_nm_sparse(w, 2, 4) for w in weights),
                     "block_sparsity": weight_sparsity(pruned)["blocks"], **h.quality(pruned),
                     "two_four_bytes_fp32": sum(stored_bytes(w, "2:4") for w in weights),
                     "dense_bytes_fp32": sum(w.numel() * 4 for w in weights),
                     "fp16_ratio": fp16_dense / fp16, **h.agreement(pruned), **h.speed(pruned)})
    return rows


def fifty_percent(model: GPT, val: torch.Tensor, calibration: torch.Tensor) -> dict[str, float]:
    """{dense, magnitude, wanda}: perplexity at 50% unstructured, for a side model (draft, planted outliers)."""
    check_prunable(model, "fifty_percent: model")
    val = check_eval_ids("val", val, model.config.vocab_size)  # named here: perplexity would call it `tokens`
    out = {"dense": perplexity(model, val)}
    for method in ("magnitude", "wanda"):
        out[method] = perplexity(prune_model(model, method, 0.5, calibration), val)
    return out


def structured_rows(h: Harness, calibration: torch.Tensor, fractions: tuple[float, ...], steps: int) -> list[dict]:
    check_harness(h, "structured_rows")
    fractions = check_sparsities(fractions, "fractions")
    scores = mlp_neuron_scores(h.model, calibration)
    rows = []
    for f in fractions:
        pruned = prune_mlp(h.model, f, scores)
        before = h.quality(pruned)
        recovered, losses = recover(pruned, h.model, steps, lr=RECOVERY_LR)
        rows.append({"fraction": f, "mlp_hidden": mlp_widths(pruned),
                     "params": recovered.num_params(), "dense_params": h.model.num_params(),
                     "block_bytes": block_bytes(recovered, "dense"), "dense_block_bytes": block_bytes(h.model, "dense"),
                     "before_recovery": before, **h.quality(recovered), "recovery_steps": steps,
                     "recovery_loss": [losses[0], losses[-1]] if losses else [],
                     **h.agreement(recovered), **h.speed(recovered)})
    return rows


def head_rows(h: Harness, calibration: torch.Tensor, steps: int) -> dict[str, Any]:
    """Heads masked by importance (1, 2, 4 per block), and 2 per block removed for real, recovered and timed."""
    nh = check_harness(h, "head_rows").model.config.n_head
    if nh < max(MASKED_HEADS):  # prune_heads keeps one at least: removing 2 needs 3, masking 4 needs 4
        raise ValueError(f"head_rows masks up to {max(MASKED_HEADS)} heads per block: the model needs at least "
                         f"{max(MASKED_HEADS)} heads per block, it has n_head={nh}")
    scores = head_scores(h.model, calibration)
    masked = [{"heads_per_block": k, **h.quality(mask_heads(h.model, lowest_heads(scores, k)))}
              for k in MASKED_HEADS]
    pruned = prune_heads(h.model, lowest_heads(scores, 2))
    before = h.quality(pruned)
    recovered, _ = recover(pruned, h.model, steps, lr=RECOVERY_LR)
    cfg = h.model.config
    removed = {"heads_per_block": 2, "n_head": recovered.config.n_head, "before_recovery": before,
               **h.quality(recovered), "recovery_steps": steps, "params": recovered.num_params(),
               "dense_params": h.model.num_params(),
               "kv_bytes_per_token": 2 * cfg.n_layer * recovered.config.attn_dim * 4,
               "dense_kv_bytes_per_token": 2 * cfg.n_layer * cfg.attn_dim * 4,
               **h.agreement(recovered), **h.speed(recovered)}
    return {"masked": masked, "removed": removed}


def layer_costs(sparsities: tuple[float, ...] = (0.5, 0.7, 0.9), tokens: tuple[int, ...] = (1, 256),
                repeats: int = 5, calls: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    """µs per call of one 256 -> 1024 linear: dense F.linear vs CSR (torch.addmm on a sparse_csr weight)."""
    sparsities = check_sparsities(sparsities)
    tokens = [check_int(f"tokens[{i}]", M) for i, M in enumerate(check_sequence("tokens", tokens))]
    check_tensor_elements("tokens x 1024 (the layer's outputs)", (max(tokens), 1024))  # not torch's allocator
    repeats = check_repeats("repeats", repeats)
    calls = check_calls("calls", calls)
    seed = check_seed(check_int("seed", seed, 0))  # [0, 2**64): torch's generator's range
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(1024, 256, generator=g) * 0.02
    bias = torch.zeros(1024)
    rows = []
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        for s in sparsities:
            w = w0 * magnitude_mask(w0, s)
            csr = w.to_sparse_csr()
            for M in tokens:
                x = torch.randn(M, 256, generator=g)
                cmp = compare(lambda: [F.linear(x, w, bias) for _ in range(calls)],
                              lambda: [torch.addmm(bias[:, None], csr, x.T).T for _ in range(calls)],
                              warmup=1, repeats=repeats)
                rows.append({"sparsity": s, "tokens": M, "dense_us": cmp.baseline.median / calls * 1e6,
                             "csr_us": cmp.candidate.median / calls * 1e6, "csr_speedup": cmp.speedup})
    return rows


def run_all(model: GPT, real_text: bool, size: str = "full", seed: int = 0, draft: GPT | None = None
            ) -> dict[str, Any]:
    """Everything the tour and the chapter table report, at one of the `SIZES`.

    Every argument is checked before the first measurement: `seed` an int in [0, 2**64), `draft` (pruned at 50% on
    the same text and calibration) None or a dense minillm GPT of the model's vocabulary and at least its window."""
    sz = pick_size(SIZES, size)
    # calibration_windows' range, and torch's (check_seed): not after the first sweeps
    seed = check_seed(check_int("seed", seed, 0))
    if draft is not None:
        check_prunable(draft, "run_all: draft")
        d, m = draft.config, require_model(model, "run_all: model")
        if d.vocab_size != m.vocab_size or d.block_size < m.block_size:
            raise ValueError(f"run_all: draft has vocab_size={d.vocab_size}, block_size={d.block_size}; it reads the "
                             f"model's text and calibration windows: vocab_size={m.vocab_size} and block_size >= "
                             f"{m.block_size}")
    h = Harness(model, real_text, sz, seed)
    calibration = calibration_windows(sz.calibration, model.config.block_size, seed)
    report: dict[str, Any] = {
        "threads": torch.get_num_threads(), "size": size, "val_tokens": h.val.numel(), "prompts": h.num_prompts,
        "prompt_len": h.prompt_len, "new_tokens": h.greedy.max_new_tokens, "calibration": list(calibration.shape),
        "decode_tokens": h.decode.max_new_tokens, "timed_runs": h.repeats,
        "dense": {"perplexity": h.dense_ppl, "params": model.num_params(), "block_bytes": block_bytes(model, "dense")},
    }
    report["unstructured"] = unstructured_rows(h, calibration, sz.sparsities)
    report["two_four"] = two_four_rows(h, calibration)
    side_val = h.val[:sz.side_tokens]
    report["side_val_tokens"] = side_val.numel()
    report["base_side"] = fifty_percent(model, side_val, calibration)
    channels = [c * model.config.n_embd // 256 for c in OUTLIER_CHANNELS]
    report["planted_outliers"] = fifty_percent(inject_outliers(model, channels, OUTLIER_FACTOR), side_val,
                                               calibration)
    report["planted_outliers"].update(channels=channels, factor=OUTLIER_FACTOR)
    if draft is not None:
        report["draft"] = fifty_percent(draft, side_val, calibration)
    report["torch_prune"] = torch_prune_agreement(model)
    report["structured"] = structured_rows(h, calibration, sz.structured, sz.recovery_steps)
    if sz.heads:
        report["heads"] = head_rows(h, calibration, sz.recovery_steps)
    report["layer_costs"] = layer_costs(repeats=sz.cost_repeats, calls=sz.cost_calls)
    report["layer_cost_timing"] = {"repeats": sz.cost_repeats, "calls": sz.cost_calls}
    why = semi_structured_support()
    report["semi_structured_gpu"] = {"skipped": why} if why else {"rows": layer_speed()}
    return report


# ----- the report as tables (the command's printout) and as the pieces the chapter text quotes -------------------


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _quality_cells(r: dict[str, Any], n: int) -> list[str]:
    """The cells every pruned model's row shares: argmax agreement, KL from dense, identical continuations, engine."""
    return [_pct(r["agreement"]), f"{r['kl_mean']:.3g} / {r['kl_p99']:.3g}",
            f"{r['identical_prompts']}/{n} ({r['mean_common_prefix']:.1f})", f"{r['engine_same_as_generate']}/{n}"]


def _speed_cell(r: dict[str, Any]) -> str:
    return f"{r['tok_s']:.0f} vs {r['dense_tok_s']:.0f} ({r['speedup']:.2f}x)"


@reads_report
def fifty_rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, row) of every 50% mask the report measured against dense: unstructured, then 2:4."""
    rows = [(f"{r['method']} 50%", r) for r in report["unstructured"] if r["sparsity"] == 0.5]
    return rows + [(f"2:4 {r['method']}", r) for r in report["two_four"]]


@reads_report
def structured_rows_of(report: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, what is left, row) of every structured cut: the MLP rows, then the heads removed (full run only)."""
    out = [(f"{100 * r['fraction']:.0f}% of MLP neurons", f"MLPs {r['mlp_hidden'][0]} wide", r)
           for r in report["structured"]]
    if "heads" in report:
        r = report["heads"]["removed"]
        out.append((f"{r['heads_per_block']} heads per block", f"{r['n_head']} of {r['n_head'] + r['heads_per_block']}"
                    f" heads", r))
    return out


@reads_report
def unstructured_table(report: dict[str, Any]) -> str:
    return markdown_table(["method", "sparsity", "val ppl", "delta", "block linears: dense / bitmask / CSR MB"],
                          [[r["method"], f"{100 * r['block_sparsity']:.0f}%", f"{r['perplexity']:.3f}",
                            f"{r['ppl_delta_pct']:+.2f}%", f"{r['dense_bytes'] / 1e6:.2f} / "
                            f"{r['bitmask_bytes'] / 1e6:.2f} / {r['csr_bytes'] / 1e6:.2f}"]
                           for r in report["unstructured"]], "lrrrl")


@reads_report
def fifty_table(report: dict[str, Any]) -> str:
    n = report["prompts"]
    return markdown_table(["at 50%", "val ppl", "delta", "argmax agreement", "KL from dense, mean / p99 (nats)",
                           "identical continuations (mean common prefix)", "engine = generate_ids",
                           "decode tok/s vs dense"],
                          [[name, f"{r['perplexity']:.3f}", f"{r['ppl_delta_pct']:+.2f}%", *_quality_cells(r, n),
                            _speed_cell(r)] for name, r in fifty_rows(report)])


@reads_report
def structured_table(report: dict[str, Any]) -> str:
    n, rows, cuts = report["prompts"], [], structured_rows_of(report)
    for name, left, r in cuts:
        b = r["before_recovery"]
        rows.append([name, left, f"{r['params'] / 1e6:.2f} M ({r['params'] / r['dense_params']:.3f})",
                     f"{b['perplexity']:.3f} ({b['ppl_delta_pct']:+.2f}%)", f"{r['perplexity']:.3f}",
                     f"{r['ppl_delta_pct']:+.2f}%", *_quality_cells(r, n), _speed_cell(r),
                     f"{r['prefill_speedup']:.2f}x"])
    return markdown_table(["removed", "left", "params (x dense)", "ppl before recovery", "after", "delta",
                           "agreement", "KL mean / p99", "identical (prefix)", "engine = generate_ids",
                           "decode tok/s vs dense", f"prefill {cuts[0][2]['prefill_tokens'] if cuts else ''}"],
                          rows, "ll" + "r" * 10)


@reads_report
def heads_masked_table(report: dict[str, Any]) -> str:
    removed = report["heads"]["removed"]
    heads = removed["n_head"] + removed["heads_per_block"]  # the dense model's heads per block
    return markdown_table(["heads masked per block, by importance", "val ppl", "delta"],
                          [[f"{r['heads_per_block']} of {heads}", f"{r['perplexity']:.3f}",
                            f"{r['ppl_delta_pct']:+.2f}%"] for r in report["heads"]["masked"]])


@reads_report
def side_table(report: dict[str, Any]) -> str:
    labels = (("base_side", "base"), ("planted_outliers", "base + planted outlier features (the same function)"),
              ("draft", "draft"))
    return markdown_table([f"50% unstructured, first {report['side_val_tokens']:,} val tokens", "dense ppl",
                           "magnitude", "Wanda"],
                          [[label, f"{report[k]['dense']:.2f}", f"{report[k]['magnitude']:.2f}",
                            f"{report[k]['wanda']:.2f}"] for k, label in labels if k in report])


@reads_report
def layer_cost_table(report: dict[str, Any]) -> str:
    return markdown_table(["zeros", "tokens", "dense F.linear (us)", "CSR (us)", "CSR speed vs dense"],
                          [[f"{100 * r['sparsity']:.0f}%", str(r["tokens"]), f"{r['dense_us']:.0f}",
                            f"{r['csr_us']:.0f}", f"{r['csr_speedup']:.2f}x"] for r in report["layer_costs"]],
                          "rrrrr")


@reads_report
def format_table(report: dict[str, Any]) -> str:
    d = report["dense"]
    lines = [f"dense: perplexity {d['perplexity']:.3f} on the first {report['val_tokens']:,} validation tokens; "
             f"block linears {d['block_bytes'] / 1e6:.2f} MB; Wanda calibration {report['calibration'][0]} x "
             f"{report['calibration'][1]} training tokens; torch threads {report['threads']}", "",
             unstructured_table(report), fifty_table(report)]
    for r in report["two_four"]:
        lines.append(f"2:4 {r['method']}: pattern verified {r['pattern_ok']}; 2:4 format "
                     f"{r['two_four_bytes_fp32'] / 1e6:.2f} MB vs {r['dense_bytes_fp32'] / 1e6:.2f} MB dense fp32 "
                     f"(in fp16: {r['fp16_ratio']:.2f}x smaller)")
    t = report["torch_prune"]
    lines += [f"magnitude masks equal to torch.nn.utils.prune.l1_unstructured's: {t['same']}/{t['layers']} layers",
              "", side_table(report), structured_table(report)]
    if report["structured"]:
        r = report["structured"][0]
        lines.append(f"recovery: {r['recovery_steps']} AdamW steps of 4 x 256 training tokens, KL to dense, lr "
                     f"{RECOVERY_LR:g}")
    if "heads" in report:
        r = report["heads"]["removed"]
        lines += [f"2 heads per block removed: KV cache {r['kv_bytes_per_token']:,} B/token vs "
                  f"{r['dense_kv_bytes_per_token']:,}", "", heads_masked_table(report)]
    else:
        lines.append("")
    lines += ["one 256 -> 1024 linear, us per call:", "", layer_cost_table(report)]
    gpu = report["semi_structured_gpu"]
    if "skipped" in gpu:
        lines.append(f"2:4 sparse kernels: skipped ({gpu['skipped']})")
    else:
        for r in gpu["rows"]:
            lines.append(f"2:4 kernel {r['dtype']} {tuple(r['shape'])} at M={r['tokens']}: {r['dense_ms']:.4f} vs "
                         f"{r['sparse_ms']:.4f} ms ({r['speedup']:.2f}x), max |err| {r['max_abs_err']:.2e}")
    return "\n".join(lines)


def _row_values(prefix: str, r: dict[str, Any], n: int) -> dict[str, str]:
    """The single numbers of one measured row, each under `prefix_field`, for the fields the row has."""
    out = {f"{prefix}_ppl": f"{r['perplexity']:.2f}", f"{prefix}_delta": f"{r['ppl_delta_pct']:+.2f}%"}
    if "agreement" in r:
        out.update({f"{prefix}_agreement": _pct(r["agreement"]), f"{prefix}_kl_mean": f"{r['kl_mean']:.3g}",
                    f"{prefix}_kl_p99": f"{r['kl_p99']:.3g}", f"{prefix}_identical": f"{r['identical_prompts']}/{n}",
                    f"{prefix}_prefix": f"{r['mean_common_prefix']:.1f}"})
    if "speedup" in r:
        out.update({f"{prefix}_speedup": f"{r['speedup']:.2f}x", f"{prefix}_prefill_speedup":
                    f"{r['prefill_speedup']:.2f}x"})
    if "before_recovery" in r:
        out.update({f"{prefix}_before_delta": f"{r['before_recovery']['ppl_delta_pct']:+.2f}%",
                    f"{prefix}_params_fewer": _pct(1 - r["params"] / r["dense_params"])})
    return out


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What the chapter text quotes from a report (`minillm.course.results`): the tables above by name, and single
    numbers named `method_percent_field` (e.g. "magnitude_50_delta", "two_four_wanda_kl_mean", "mlp_25_speedup",
    "csr_90_m256"), formatted as the tables format them."""
    n = report["prompts"]
    q = {"unstructured": unstructured_table(report), "fifty": fifty_table(report), "side": side_table(report),
         "structured": structured_table(report), "layer_costs": layer_cost_table(report),
         "cpu": report["cpu"], "threads": str(report["threads"]), "dense_ppl": f"{report['dense']['perplexity']:.2f}",
         "val_tokens": f"{report['val_tokens']:,}", "side_val_tokens": f"{report['side_val_tokens']:,}",
         "calibration_windows": str(report["calibration"][0]), "calibration_tokens": str(report["calibration"][1]),
         "prompts": str(n), "new_tokens": str(report["new_tokens"]), "positions": f"{n * report['new_tokens']:,}",
         "decode_tokens": str(report["decode_tokens"]), "timed_runs": str(report["timed_runs"]),
         "dense_mb": f"{report['dense']['block_bytes'] / 1e6:.2f} MB",
         "torch_prune_same": f"{report['torch_prune']['same']}/{report['torch_prune']['layers']}"}
    for r in report["unstructured"]:
        prefix = f"{r['method']}_{100 * r['sparsity']:.0f}"
        q.update(_row_values(prefix, r, n), **{f"{prefix}_bitmask_mb": f"{r['bitmask_bytes'] / 1e6:.2f} MB",
                                              f"{prefix}_csr_mb": f"{r['csr_bytes'] / 1e6:.2f} MB"})
    for r in report["two_four"]:
        q.update(_row_values(f"two_four_{r['method']}", r, n))
    r = report["two_four"][0]  # both masks keep the same count, so the format takes the same bytes
    q.update(two_four_mb=f"{r['two_four_bytes_fp32'] / 1e6:.2f} MB",
             two_four_dense_mb=f"{r['dense_bytes_fp32'] / 1e6:.2f} MB", two_four_fp16_ratio=f"{r['fp16_ratio']:.2f}x")
    for key in ("base_side", "planted_outliers", "draft"):
        for field in ("dense", "magnitude", "wanda") if key in report else ():
            q[f"{key}_{field}"] = f"{report[key][field]:.2f}"
    for r in report["structured"]:
        q.update(_row_values(f"mlp_{100 * r['fraction']:.0f}", r, n))
    if report["structured"]:
        q["recovery_steps"] = str(report["structured"][0]["recovery_steps"])
    if "heads" in report:
        q["heads_masked"] = heads_masked_table(report)
        for r in report["heads"]["masked"]:
            q[f"heads_masked_{r['heads_per_block']}_delta"] = f"{r['ppl_delta_pct']:+.2f}%"
        r = report["heads"]["removed"]
        q.update(_row_values("heads_removed", r, n), heads_removed_kv_bytes=f"{r['kv_bytes_per_token']:,}",
                 heads_dense_kv_bytes=f"{r['dense_kv_bytes_per_token']:,}")
    for r in report["layer_costs"]:
        q[f"csr_{100 * r['sparsity']:.0f}_m{r['tokens']}"] = f"{r['csr_speedup']:.2f}x"
    timing = report["layer_cost_timing"]
    q.update(layer_cost_repeats=str(timing["repeats"]), layer_cost_calls=str(timing["calls"]))
    pruned = [r for _, r in fifty_rows(report)] + [r for _, _, r in structured_rows_of(report)]
    q["engine_fewest"] = f"{min(r['engine_same_as_generate'] for r in pruned)}/{n}"
    q["engine_models"] = str(len(pruned))
    same_kernels = [r["speedup"] for _, r in fifty_rows(report)]  # zeros in dense matrices: the ratio is noise
    q["dense_kernel_speedups"] = f"{min(same_kernels):.2f}x to {max(same_kernels):.2f}x"
    return q


def build_parser() -> argparse.ArgumentParser:
    return bench_parser("python -m minillm.prune.bench", __doc__.splitlines()[0],
                        # subtle: argparse %-formats help strings, so a bare percent sign would break --help
                        "the smallest sizes, as the tour's --quick (~40 s): 50 percent only, 25 percent structured, "
                        "short recovery",
                        sizes=SIZES)


def main(argv: list[str] | None = None) -> int:
    args = start(build_parser(), argv)
    loaded = load_model("base", args.device, args.seed)
    draft = load_model("draft", args.device, args.seed)
    report = run_all(loaded.model, real_text=loaded.trained, size=args.size, seed=args.seed,
                     draft=draft.model if draft.trained else None)
    report["model"] = loaded.label
    print(f"model: {loaded.label}")
    print(format_table(report))
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
