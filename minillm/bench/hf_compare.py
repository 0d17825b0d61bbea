"""Tokens/s at batch 1 against Hugging Face `generate(use_cache=True)` on the same weights: one comparison for all.

Adds `hf_comparison(model, prompt, new_tokens, generate_fn)`: our batch-1 greedy path (`generate_fn(prompt,
params) -> ids`: chapter 04's `generate_ids`, chapter 13's fused C++ step, ...) interleaved with HF's on the model
converted by `minillm.core.hf.to_hf_model`, medians of repeats (`minillm.core.timing.compare`), and the two
outputs checked token for token. Chapter 04 reports it for its KV cache, chapter 13 for every fast path. What it
leaves out: batches above one (chapter 06 compares the engine with HF's batched paths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from minillm.bench.check import same_tokens
from minillm.core.hf import to_hf_model
from minillm.core.sampling import SamplingParams
from minillm.core.timing import compare

GenerateFn = Callable[[list[int], SamplingParams], list[int]]  # (prompt ids, params) -> generated ids


def hf_comparison(model: nn.Module, prompt: list[int], new_tokens: int, generate_fn: GenerateFn, warmup: int = 1,
                  repeats: int = 3, attn_implementation: str = "sdpa") -> dict[str, Any]:
    """HF `generate` (the baseline) against `generate_fn`, `new_tokens` greedy tokens each (end-of-text ignored):
    seconds, tok/s, their ratio (ours over HF's speed) and whether the tokens are identical."""
    hf = to_hf_model(model, attn_implementation=attn_implementation)
    params = SamplingParams.greedy(new_tokens, ignore_eos=True)
    idx = torch.tensor([prompt], device=model.device)  # (1, P)
    mask = torch.ones_like(idx)  # (1, P)
    out: dict[str, list[int]] = {}

    def run_hf() -> None:
        with torch.inference_mode():
            seq = hf.generate(idx, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)  # (1, P + n)
        out["hf"] = seq[0, len(prompt):].tolist()

    def run_ours() -> None:
        out["ours"] = generate_fn(prompt, params)

    cmp = compare(run_hf, run_ours, warmup=warmup, repeats=repeats, device=model.device)
    return {"new_tokens": new_tokens, "prompt_len": len(prompt), "hf_s": cmp.baseline.median,
            "ours_s": cmp.candidate.median, "hf_tok_s": new_tokens / cmp.baseline.median,
            "ours_tok_s": new_tokens / cmp.candidate.median, "ratio": cmp.speedup,
            "identical": same_tokens([out["hf"]], [out["ours"]]).ok, "attn_implementation": attn_implementation}
