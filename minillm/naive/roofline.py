"""The physical limit of decoding: FLOPs and bytes per generated token, the machine's rates, the tokens/s bound.

Adds the cost model of one decode step for any `GPTConfig` and dtype, two micro-benchmarks (memory bandwidth from a
large tensor copy, matmul rate from a square matmul), and the roofline bound on tokens/s (Williams, Waterman &
Patterson, "Roofline", CACM 2009). Beside it, the weight-streaming bound measured on the model itself: its weight
matrices multiplied by one vector each, back to back, with nothing else in the loop (`measure_weight_streaming`).
Where the weights fit in the last-level cache (`base`'s 23 MB on a CPU with a 32 MB L3), the copy of a 256 MiB
tensor measures DRAM while a decode step reads cache, and only the second bound tells what a step could reach.
What it leaves out: kernel-launch overhead (what dominates tiny models on a GPU) and batching (chapter 06).

What one ideal decode step at batch 1 must do, for a context of t tokens already processed:

  FLOPs  = 2 · (L · 12C² + V·C)                 every matmul weight is one multiply-add per token
         + L · 4 · C · t                        attention: q·Kᵀ and p·V over t positions, 2·C·t each
  bytes  = b · (all parameters except the unused rows of wpe)     weights read once per step
         + b · 2 · L · C · t                    the KV cache read (K and V of every layer)
         + b · 2 · L · C                        this token's K and V written

and the step cannot take less than max(bytes / bandwidth, FLOPs / matmul rate). Biases, LayerNorms and GELU are
counted in bytes but not FLOPs (they are O(C), not O(C²)). The naive loop of chapter 03 does far more: at context
t it pushes all t tokens through every matmul (`naive_step_flops`), so it is compute-bound long before it is
bandwidth-bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.config import GPTConfig, short_repr
from minillm.core.device import resolve_device
from minillm.core.model import require_model
from minillm.core.timing import check_repeats, measure


def _check_config(config: GPTConfig) -> None:
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")


def dtype_bytes(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def param_count(config: GPTConfig) -> int:
    """Parameters of `GPT(config)`, the tied embedding/head counted once (equals `GPT(config).num_params()`)."""
    _check_config(config)
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    per_layer = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C) + 4 * C  # attn, mlp, 2 LNs
    return V * C + config.block_size * C + L * per_layer + 2 * C  # wte, wpe, blocks, ln_f


@dataclass
class DecodeCost:
    context_len: int  # t: tokens already in the sequence when this token is computed
    flops: int  # floating-point operations of the step (a multiply-add counts 2)
    weight_bytes: int  # parameters read once
    kv_bytes: int  # KV cache read plus this token's K, V written

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved: ~1 for fp16 decode at batch 1, far below any GPU's ridge point."""
        return self.flops / self.bytes


def decode_cost(config: GPTConfig, context_len: int, dtype: torch.dtype = torch.float32) -> DecodeCost:
    """FLOPs and bytes of one ideal (KV-cached) decode step at batch 1 with `context_len` tokens before it."""
    _check_config(config)
    if type(context_len) is not int or context_len < 0:  # True is no length
        raise ValueError(f"context_len must be a non-negative int, got {short_repr(context_len)}")
    b = dtype_bytes(dtype)
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    matmul_params = L * 12 * C * C + V * C  # c_attn 3C², attn c_proj C², c_fc 4C², mlp c_proj 4C², lm_head V·C
    flops = 2 * matmul_params + L * 4 * C * context_len
    weights = (param_count(config) - (config.block_size - 1) * C) * b  # one wpe row is read, not all block_size
    kv = 2 * L * C * context_len * b + 2 * L * C * b
    return DecodeCost(context_len, flops, weights, kv)


def naive_step_flops(config: GPTConfig, seq_len: int) -> int:
    """FLOPs of one step of the naive loop: all seq_len tokens through every matmul, causal attention over them.

    (The naive loop also applies lm_head to every position, V·C per token, though it uses only the last.)
    """
    _check_config(config)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {short_repr(seq_len)}")
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    T = seq_len
    # subtle: SDPA with is_causal still computes the full T×T score matrix on the CPU, so count T², not T²/2.
    return 2 * (L * 12 * C * C + V * C) * T + L * 4 * C * T * T


@dataclass
class Machine:
    device: str
    dtype: str
    bandwidth_gbs: float  # measured: bytes read + written per second by a large copy, in 1e9 B/s
    matmul_gflops: float  # measured: 2·n³ / time of an n×n matmul, in 1e9 FLOP/s

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel is compute-bound on this machine."""
        return self.matmul_gflops / self.bandwidth_gbs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_bandwidth(device: torch.device | str = "cpu", nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """GB/s of `dst.copy_(src)` on a tensor of `nbytes`: each byte is read once and written once, so 2·nbytes move.

    Pick nbytes well above the last-level cache (256 MiB by default) or the cache, not DRAM, is what gets measured.
    """
    dev = resolve_device(device) if isinstance(device, str) else device
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=1, repeats=repeats, device=dev)
    return 2 * n * 4 / t.median / 1e9


def measure_matmul(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5
) -> float:
    """GFLOP/s of an n×n by n×n matmul in `dtype`: 2·n³ FLOPs (a multiply and an add per inner-product term)."""
    dev = resolve_device(device) if isinstance(device, str) else device
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    t = measure(lambda: a @ b, warmup=1, repeats=repeats, device=dev)  # (n, n) @ (n, n) -> (n, n)
    return 2 * n**3 / t.median / 1e9


def measure_machine(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, quick: bool = False
) -> Machine:
    """Both rates on `device`; `quick` uses smaller tensors (less accurate, a few hundred ms on a CPU)."""
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    big = dev.type == "cuda"
    nbytes = (1024 if big else 256) * 2**20 // (4 if quick else 1)
    n = (8192 if big else 1024) // (2 if quick else 1)
    return Machine(str(dev), str(dtype).removeprefix("torch."), measure_bandwidth(dev, nbytes),
                   measure_matmul(dev, dtype, n))


@dataclass
class Roofline:
    tokens_per_s: float  # the bound: the smaller of the two below, step by step
    bandwidth_bound_tps: float  # if only bytes moved mattered
    compute_bound_tps: float  # if only FLOPs mattered
    limited_by: str  # "bandwidth" or "compute"
    bytes_per_token: float  # mean over the steps
    flops_per_token: float  # mean over the steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_bound(
    config: GPTConfig, machine: Machine, prompt_len: int, new_tokens: int, dtype: torch.dtype = torch.float32
) -> Roofline:
    """Upper bound on decode tokens/s for generating `new_tokens` after a `prompt_len`-token prompt at batch 1.

    Each step's time is at least max(bytes/bandwidth, FLOPs/rate); the bound is new_tokens over the sum.
    """
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive int, got {short_repr(new_tokens)}")
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be a positive int, got {short_repr(prompt_len)}")
    costs = [decode_cost(config, prompt_len + i, dtype) for i in range(new_tokens)]
    bw, fl = machine.bandwidth_gbs * 1e9, machine.matmul_gflops * 1e9
    t_bw = sum(c.bytes for c in costs) / bw
    t_fl = sum(c.flops for c in costs) / fl
    t_step = sum(max(c.bytes / bw, c.flops / fl) for c in costs)
    return Roofline(
        tokens_per_s=new_tokens / t_step,
        bandwidth_bound_tps=new_tokens / t_bw,
        compute_bound_tps=new_tokens / t_fl,
        limited_by="bandwidth" if t_bw >= t_fl else "compute",
        bytes_per_token=sum(c.bytes for c in costs) / new_tokens,
        flops_per_token=sum(c.flops for c in costs) / new_tokens,
    )


# ----- the weight-streaming bound: the step's own matrices, measured -------------------------------------------


def decode_weights(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of every matrix one decode step multiplies at batch 1: each block's linears, then the head."""
    require_model(model, "decode_weights (model)")
    mats = [(m.weight, m.bias) for m in model.transformer.h.modules() if isinstance(m, nn.Linear)]
    return mats + [(model.lm_head.weight, model.lm_head.bias)]


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of `decode_weights(model)`: what one decode step's products read, biases included."""
    require_model(model, "decode_weight_bytes (model)")
    return sum(w.nbytes + (b.nbytes if b is not None else 0) for w, b in decode_weights(model))


def stream_weights(model: nn.Module) -> Callable[[int], None]:
    """run(steps): each of `decode_weights(model)` times one fixed random vector through `F.linear`, `steps` times
    over, with nothing else in the loop: the products of `steps` decode steps and no other work."""
    require_model(model, "stream_weights (model)")
    mats = decode_weights(model)
    x = {w.shape[1]: torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype) for w, _ in mats}  # (1, in)

    @torch.inference_mode()
    def run(steps: int) -> None:
        for _ in range(steps):
            for w, b in mats:
                F.linear(x[w.shape[1]], w, b)  # (1, in) -> (1, out)

    return run


@dataclass
class WeightStreaming:
    bytes_per_step: int  # every matrix of `decode_weights` (and its bias) read once
    seconds_per_step: float  # the fastest of the repeats: a shared machine only slows it

    @property
    def gbps(self) -> float:
        return self.bytes_per_step / self.seconds_per_step / 1e9

    @property
    def tokens_per_s(self) -> float:
        """What a decode step made of these products alone could reach."""
        return 1 / self.seconds_per_step

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps, "tokens_per_s": self.tokens_per_s}


def measure_weight_streaming(model: nn.Module, repeats: int = 9, steps: int = 20) -> WeightStreaming:
    """The weight-streaming bound of `model` at batch 1 on its device, through `F.linear` (chapter 13 adds a C++
    way): the fastest of `repeats` timed runs of `steps` steps' products."""
    require_model(model, "measure_weight_streaming (model)")
    check_repeats("repeats", repeats)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {short_repr(steps)}")
    run = stream_weights(model)
    device = next(model.parameters()).device
    t = measure(lambda: run(steps), warmup=1, repeats=repeats, device=device)
    return WeightStreaming(decode_weight_bytes(model), t.min / steps)
