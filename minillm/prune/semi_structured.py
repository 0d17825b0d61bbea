"""2:4 semi-structured sparsity: the one pattern of zeros that today's GPUs turn into time, and what it stores.

What it adds:
  - `stored_bytes(weight, fmt)`: the bytes a pruned matrix takes in each storage format, from its actual zeros:
        dense       every element (zeros included)
        bitmask     the nonzero values + one bit per element saying which are nonzero
        csr         the nonzero values + a 32-bit column index each + one 32-bit row pointer per row (+1)
        2:4         half the values + 2 bits of metadata per kept value (its position among 4): 9/16 of dense in
                    fp16, 17/32 in fp32 — the layout NVIDIA's sparse tensor cores read (Mishra et al. 2021)
  - `SemiStructuredLinear`: on a CUDA GPU of compute capability 8.0+ (Ampere, Hopper), an fp16/bf16 linear layer
    whose weight is PyTorch's `to_sparse_semi_structured` of a 2:4-pruned weight; `F.linear` then runs the sparse
    tensor-core kernel (cuSPARSELt or CUTLASS). It checks the pattern before converting.
  - `layer_speed(...)`: one pruned linear, dense against 2:4-sparse, timed on the GPU at a batch-1 (decode) and a
    many-token (prefill) shape, with its outputs compared.

On a CPU there is no 2:4 kernel: a 2:4-pruned model runs as dense (`semi_structured_support` says why), which is
why chapter 10 measures 2:4's quality everywhere and its speed only where a GPU says so. The NVIDIA paper and
the Wanda paper report about 1.6x for large linear layers and 1.2-1.3x end to end; at batch 1 the sparse kernel has
too little work to gain (the chapter says so).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.config import check_choice, check_has_data, check_int, check_strided, short_repr
from minillm.core.sampling import check_seed
from minillm.core.timing import check_calls, check_repeats, compare
from minillm.prune.masks import is_nm_sparse, nm_mask

FORMATS = ("dense", "bitmask", "csr", "2:4")


def stored_bytes(weight: torch.Tensor, fmt: str, element_bytes: int | None = None) -> int:
    """Bytes of `weight` (out, in) in storage format `fmt` (see the module docstring), its values `element_bytes`
    wide (default: the tensor's own dtype). "2:4" needs a weight that is 2:4 sparse."""
    if not isinstance(weight, torch.Tensor) or check_strided("weight", weight).dim() != 2:
        raise TypeError(f"weight must be a matrix (out, in), got {type(weight).__name__} "
                        f"{tuple(getattr(weight, 'shape', ()))}")
    fmt = check_choice("format", fmt, FORMATS)
    if element_bytes is not None:  # the plain int, within the float range: an int subclass's comparisons lie
        element_bytes = check_int("element_bytes", element_bytes)
    eb = weight.element_size() if element_bytes is None else element_bytes
    if fmt == "dense":
        return weight.numel() * eb  # the shape alone: a meta weight has one too
    check_has_data("weight", weight)  # the sparse formats count its nonzeros
    n, nnz = weight.numel(), int((weight != 0).sum())
    if fmt == "bitmask":
        return nnz * eb + (n + 7) // 8
    if fmt == "csr":
        return nnz * (eb + 4) + (weight.shape[0] + 1) * 4
    if not is_nm_sparse(weight, 2, 4):
        raise ValueError("the 2:4 format stores only weights with at most 2 nonzeros in every 4 consecutive inputs")
    kept = n // 2  # exactly half the positions are stored (a group with fewer nonzeros stores zeros)
    return kept * eb + (kept * 2 + 7) // 8  # values + a 2-bit position per stored value


def semi_structured_support(device: torch.device | str | None = None) -> str | None:
    """None when PyTorch can run 2:4 sparse matmuls on `device` (default: the current CUDA device), else why not.

    `device` is None, a torch.device, a device string or a CUDA index; one torch does not know (e.g. "tpu") or a
    CUDA index past the GPUs present is a ValueError, a wrong type a TypeError, both naming device. A known device
    that is not CUDA gets its reason like the others."""
    if isinstance(device, bool) or (device is not None and not isinstance(device, (str, torch.device, int))):
        raise TypeError(f"device must be None, a torch.device, a device string or a CUDA index, got "
                        f"{type(device).__name__} {short_repr(device)}")
    if isinstance(device, int):  # the plain index, >= 0 and within the float range: 2**64 overflows inside torch
        device = check_int("device", device, 0)
    try:
        dev = None if device is None else torch.device("cuda", device) if isinstance(device, int) else \
            torch.device(device)
    except (RuntimeError, ValueError, OverflowError) as e:
        raise ValueError(f"device={short_repr(device)} is not a device torch knows: {str(e).splitlines()[0]}") from None
    if dev is not None and dev.type != "cuda":
        return f"device {dev} is not a CUDA device: 2:4 sparse kernels run on NVIDIA GPUs of compute capability 8.0+"
    if not torch.cuda.is_available():
        return "no CUDA device: 2:4 sparse kernels run on NVIDIA GPUs of compute capability 8.0+ only"
    if not hasattr(torch.sparse, "to_sparse_semi_structured"):
        return f"torch {torch.__version__} has no torch.sparse.to_sparse_semi_structured"
    if dev is not None and dev.index is not None and not 0 <= dev.index < torch.cuda.device_count():
        raise ValueError(f"device={device!r}: this machine has CUDA devices 0..{torch.cuda.device_count() - 1}")
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0: no sparse tensor cores"
    return None


class SemiStructuredLinear(nn.Module):
    """A linear layer whose 2:4-sparse fp16/bf16 weight is stored compressed and multiplied by sparse tensor cores."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"SemiStructuredLinear needs an nn.Linear, got {type(linear).__name__}")
        why = semi_structured_support(linear.weight.device if linear.weight.is_cuda else None)
        if why:
            raise RuntimeError(why)
        w = linear.weight.detach()
        if not w.is_cuda or w.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"SemiStructuredLinear needs a CUDA fp16/bf16 weight, got {w.dtype} on {w.device}")
        if not is_nm_sparse(w, 2, 4):
            raise ValueError("the weight is not 2:4 sparse: prune it with nm_mask first")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(torch.sparse.to_sparse_semi_structured(w), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@torch.inference_mode()
def layer_speed(in_features: int = 4096, out_features: int = 4096, tokens: tuple[int, ...] = (1, 16, 2048),
                dtype: torch.dtype = torch.float16, calls: int = 50, repeats: int = 9, seed: int = 0
                ) -> list[dict[str, Any]]:
    """Per token count M: dense F.linear vs the 2:4 layer (same pruned weight) on CUDA, ms per call and max error.

    The pruned weight is 2:4 by magnitude; the dense baseline multiplies that same weight with its zeros, so the
    two compute the same function and only the kernel differs.
    """
    in_features = check_int("in_features", in_features)
    out_features = check_int("out_features", out_features)
    if in_features % 4:
        raise ValueError(f"2:4 groups 4 consecutive inputs: in_features={in_features} is not a multiple of 4")
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise ValueError(f"tokens must be a non-empty tuple of token counts, got {tokens!r}")
    tokens = [check_int(f"tokens[{i}]", t) for i, t in enumerate(tokens)]  # the plain ints
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16 (the 2:4 kernels' types), got {dtype!r}")
    calls = check_calls("calls", calls)
    repeats = check_repeats("repeats", repeats)
    seed = check_seed(check_int("seed", seed, 0))  # [0, 2**64): past it manual_seed overflows after the checks
    why = semi_structured_support()
    if why:
        raise RuntimeError(why)
    g = torch.Generator(device="cuda").manual_seed(seed)
    lin = nn.Linear(in_features, out_features, device="cuda", dtype=dtype)
    lin.weight.copy_(torch.randn(out_features, in_features, device="cuda", dtype=dtype, generator=g) * 0.02)
    lin.weight.mul_(nm_mask(lin.weight.float().abs(), 2, 4))
    sparse = SemiStructuredLinear(lin)
    rows = []
    for M in tokens:
        x = torch.randn(M, in_features, device="cuda", dtype=dtype, generator=g)
        want, got = lin(x).float(), sparse(x).float()
        cmp = compare(lambda: [lin(x) for _ in range(calls)], lambda: [sparse(x) for _ in range(calls)],
                      warmup=1, repeats=repeats, device="cuda")
        rows.append({"tokens": M, "shape": [out_features, in_features], "dtype": str(dtype).replace("torch.", ""),
                     "dense_ms": cmp.baseline.median / calls * 1e3, "sparse_ms": cmp.candidate.median / calls * 1e3,
                     "speedup": cmp.speedup, "max_abs_err": float((want - got).abs().max()),
                     "max_abs_ref": float(want.abs().max())})
    return rows
