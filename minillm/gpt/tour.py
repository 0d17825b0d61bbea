"""Tour, chapter 02: the GPT against Hugging Face's GPT-2, its two attention paths, and the shipped checkpoints."""

from __future__ import annotations

import math

import torch

from minillm.core.config import GPTConfig
from minillm.core.model import GPT
from minillm.core.rows import Row, TourContext
from minillm.core.timing import compare
from minillm.gpt.dataset import split_tokens
from minillm.gpt.eval import perplexity
from minillm.gpt.pretrained import is_shipped, load_pretrained

TITLE = "the GPT from scratch"

# Random-initialized GPT-2 shapes for the parity row, odd ones included (3 and 5 heads, odd vocabularies).
PARITY_SHAPES = [
    dict(vocab_size=101, n_positions=24, n_embd=36, n_layer=2, n_head=3),
    dict(vocab_size=257, n_positions=32, n_embd=64, n_layer=3, n_head=4),
    dict(vocab_size=53, n_positions=16, n_embd=20, n_layer=1, n_head=5),
]
PARITY_TOL = 1e-5


def _parity_row(ctx: TourContext) -> Row:
    row = dict(chapter="02", technique="GPT-2 from scratch", baseline="HF GPT2LMHeadModel", optimized="minillm GPT",
               metric="max |Δlogit|", unit="", device="cpu")
    try:
        import transformers
    except ImportError:
        return Row(**row, check="transformers (a dev extra) is not installed", check_passed=False, skipped=True,
                   value=float("nan"))

    gen = torch.Generator().manual_seed(ctx.seed)
    worst = 0.0
    for i, shape in enumerate(PARITY_SHAPES):
        torch.manual_seed(ctx.seed + i)
        hf_cfg = transformers.GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=None, eos_token_id=None)
        hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
        x = torch.randint(0, shape["vocab_size"], (2, shape["n_positions"]), generator=gen)
        with torch.no_grad():
            want = hf(x).logits
            for impl in ("sdpa", "explicit"):
                worst = max(worst, (GPT.from_hf(hf, attn_impl=impl)(x) - want).abs().max().item())
    ok = worst <= PARITY_TOL
    return Row(**row, check=f"{len(PARITY_SHAPES)} random configs x 2 attn paths, max |Δ| {worst:.1e} "
               f"{'<=' if ok else '>'} {PARITY_TOL:g}", check_passed=ok, value=worst)


def _attention_row(ctx: TourContext, base) -> Row:
    sdpa = base
    explicit = GPT(type(base.config).from_dict({**base.config.to_dict(), "attn_impl": "explicit"}))
    explicit.load_state_dict(sdpa.state_dict())
    explicit.to(ctx.device).eval()
    B, T = (1, 256) if ctx.quick else (4, 256)
    gen = torch.Generator().manual_seed(ctx.seed)
    x = torch.randint(0, base.config.vocab_size, (B, T), generator=gen).to(ctx.device)
    with torch.no_grad():
        diff = (explicit(x) - sdpa(x)).abs().max().item()
        cmp = compare(lambda: explicit(x), lambda: sdpa(x), warmup=1, repeats=3 if ctx.quick else 5, device=ctx.device)
    ok = diff <= 1e-4
    return Row(chapter="02", technique="fused attention (SDPA)", baseline="explicit softmax (attention_ref)",
               optimized="F.scaled_dot_product_attention", metric=f"speed-up (base fwd, B={B} T={T})",
               check=f"max |Δlogit| {diff:.1e} on base {'<=' if ok else '>'} 1e-4", check_passed=ok,
               value=cmp.speedup, unit="x", device=str(ctx.device),
               details={"timing": cmp.to_dict(), "max_abs_diff": diff})


def _checkpoint_rows(ctx: TourContext, models: dict) -> list[Row]:
    n_tokens = 4096 if ctx.quick else 16384
    val = split_tokens("val", ctx.corpus_path)[:n_tokens]
    rows = []
    base_params = models["base"].num_params() if models.get("base") is not None else None
    for name, model in models.items():
        row = dict(chapter="02", technique=f"shipped checkpoint '{name}'", baseline="strict safetensors load",
                   optimized=f"minillm.load({name!r})", metric=f"val perplexity ({val.numel():,} tokens)",
                   device=str(ctx.device))
        if model is None:
            rows.append(Row(**row, check="checkpoint file not found", check_passed=False, value=float("nan")))
            continue
        ppl = perplexity(model, val, batch_size=8)
        n = model.num_params()
        check = f"{n / 1e6:.2f}M params, all tensors loaded"
        ok = math.isfinite(ppl)
        if name == "draft" and base_params:
            ratio = base_params / n
            check += f", {ratio:.1f}x fewer than base"
            ok = ok and ratio >= 6.0
        rows.append(Row(**row, check=check, check_passed=ok, value=ppl, details={"num_params": n}))
    return rows


def run(ctx: TourContext) -> list[Row]:
    # subtle: chapter 02 sits below the measurement kit (`minillm.bench.load_model`), so it loads on its own; a
    # missing checkpoint fails its row, and the attention row then times seeded random weights of base's shape.
    models = {name: load_pretrained(name, device=ctx.device)[0] if is_shipped(name) else None
              for name in ("base", "draft")}
    base = models["base"]
    if base is None:
        torch.manual_seed(ctx.seed)
        base = GPT(GPTConfig.from_name("base")).to(ctx.device).eval()
    return [_parity_row(ctx), _attention_row(ctx, base), *_checkpoint_rows(ctx, models)]
