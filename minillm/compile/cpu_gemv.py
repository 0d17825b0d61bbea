"""A C++ linear layer for batch-1 decode on the CPU, loaded through `torch.utils.cpp_extension`, and a model that
uses it wherever a decode step multiplies a few rows by a weight matrix.

What it adds: `load_cpu_ext()` (JIT-builds the chapter's C++ extension, `csrc/gemv_cpu.cpp` and the whole decode
step of `csrc/decode_cpu.cpp` (see `fused_step`), once per machine into the kernels' cache directory, with AVX2 + FMA
when the CPU has them, and AVX-512 too where PyTorch finds it, for the int8 loop), `gemv(x, w, b)` (checked: a
`ValueError`/`TypeError` naming the argument, never a crash in C++), `int8_gemv(x, q, scale, b)` (the same product
for chapter 09's weight-only int8 codes with one scale per output row, streaming one byte per weight),
`int4_gemv(x, packed, scale, b)` (its group-wise int4 codes, two per byte, one scale per row and group), `FastLinear`
(an `nn.Linear` whose forward takes the C++ path for up to `MAX_ROWS` rows of float32 CPU input under no-grad, and
`F.linear` otherwise) and `fast_cpu_model(model)` (a copy with every block linear and the tied output head swapped
for `FastLinear`, the same parameters).

Why: a decode step at batch 1 is a chain of matrix-vector products, and chapter 13's profile shows `F.linear` at
that shape costing about twice what streaming the same weights takes in this loop (four rows at a time, 8-wide fused
multiply-adds). Prefill (hundreds of rows) stays on PyTorch's GEMM, which is the right tool there. Outputs equal
`F.linear` to float rounding (the sums run in another order), and greedy tokens stay identical (tested).
What it leaves out: several threads, an int8 `FastLinear` (the int8 GEMV serves the fused step, `fused_step`), and
ARM NEON.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.core.model import GPT
from minillm.core.config import check_bool, check_float_tensor, check_linear_args, check_strided, tensor_kind
from minillm.kernels.build import build_lock, cache_dir

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "gemv_cpu.cpp", CSRC / "decode_cpu.cpp")  # one module; cpu_kernels.h is what they share
_NO_BIAS = torch.empty(0)  # what the C++ GEMV takes for "no bias"
MAX_ROWS = 16  # up to this many rows of x take the C++ path (decode batches); more go to F.linear (prefill)

_lock = threading.Lock()
_ext: Any = None


def has_avx2() -> bool:
    """Whether PyTorch's CPU capability check found AVX2 (or AVX-512) on this machine."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def has_avx512() -> bool:
    """Whether PyTorch's CPU capability check found AVX-512 on this machine."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def build_flags() -> tuple[list[str], str]:
    """The compiler flags for this CPU and the build directory's name (one per flag set). AVX-512 widens the int8
    and int4 GEMVs' loops (16 codes widened per instruction instead of 8: measured on `base`, the int8 step's
    products ~7% faster, its tokens/s ~4%) and the float32 product of several rows (a verify's extra rows cost half
    the arithmetic); the one-row float32 GEMV keeps its AVX2 code, which gains nothing from wider registers (it waits
    on memory)."""
    if has_avx512():
        return ["-O3", "-mavx2", "-mfma", "-mavx512f"], "cpu_decode_avx512"
    if has_avx2():
        return ["-O3", "-mavx2", "-mfma"], "cpu_decode_avx2"
    return ["-O3"], "cpu_decode"


def sources_digest() -> str:
    """12 hex digits of the sha256 of the C++ sources (the .cpp files and their shared header): part of the build
    directory's name, so two checkouts with different sources on one machine (a student's edit, another branch)
    each build and load their own module instead of rebuilding one directory in turn under each other."""
    digest = hashlib.sha256()
    for path in (*SOURCES, CSRC / "cpu_kernels.h"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_problem() -> str | None:
    """None when the extension can be built here, else why not (no C++ compiler, no ninja)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on the PATH"
    if shutil.which("ninja") is None:
        return "torch.utils.cpp_extension needs ninja on the PATH (pip install ninja)"
    return None


def load_cpu_ext(verbose: bool = False):
    """The compiled extension (built on first use, then loaded from the cache); RuntimeError saying what is missing.

    It holds `gemv`, `int8_gemv`, `int4_gemv`, `uses_avx2`, `int8_path` and `int4_path` (gemv_cpu.cpp) and the
    `FusedDecoder` class (decode_cpu.cpp). verbose (a bool: a TypeError otherwise) shows the compiler's output when
    it builds."""
    global _ext
    verbose = check_bool("verbose", verbose)
    with _lock:
        if _ext is None:
            why = build_problem()
            if why:
                raise RuntimeError(f"cannot build chapter 13's C++ extension: {why}")
            from torch.utils.cpp_extension import load

            flags, name = build_flags()
            build_dir = cache_dir() / f"{name}-{sources_digest()}"
            build_dir.mkdir(parents=True, exist_ok=True)
            # a build killed earlier left torch's baton: cleared, not waited on forever; one that failed is forgotten
            with build_lock(build_dir, "minillm_cpu_decode"):
                _ext = load(name="minillm_cpu_decode", sources=[str(s) for s in SOURCES], extra_cflags=flags,
                            extra_include_paths=[str(CSRC)], build_directory=str(build_dir), verbose=verbose)
    return _ext


def require_cpu_tensors(dtype: torch.dtype, **tensors: Any) -> None:
    """TypeError naming the first of `tensors` that is not a strided (dense, not sparse) `dtype` CPU tensor: the
    checked entry points of the C++ extension (`gemv` here, `cpu_paged.paged_decode_attention`) test their arguments
    here before C++ sees them (and pass them through `as_cpp_reads`)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (the one the C++ loop reads), got {type(dtype).__name__}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu":
            kind = str(dtype).removeprefix("torch.")
            raise TypeError(f"{name} must be {'an' if kind[0] in 'aeio' else 'a'} {kind} CPU tensor, got "
                            f"{tensor_kind(t)} on {getattr(t, 'device', '-')}")
        check_strided(name, t)


def as_cpp_reads(t: torch.Tensor) -> torch.Tensor:
    """`t` as the C++ side reads it, through a raw pointer: contiguous, and holding its values in memory.

    subtle: a negative view (`torch._neg_view(x)`, what some ops hand back for -x) keeps its sign in a bit, not in
    memory, and `.contiguous()` keeps the bit: the C++ loop would read +x. `resolve_neg()` writes the sign out (a
    copy only when the bit is set). A TypeError for anything but a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a tensor, got {tensor_kind(t)}")
    return t.resolve_neg().contiguous()


@contextlib.contextmanager
def cpp_errors_as_value_errors() -> Iterator[None]:
    """The C++ side's own checks (TORCH_CHECK: a RuntimeError) re-raised as the ValueError the rest of the package
    raises for a bad value, with the C++ message's first line (it names the value)."""
    try:
        yield
    except RuntimeError as e:
        raise ValueError(str(e).split("\n")[0]) from None


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T + b (N,) -> (M, N), float32 CPU tensors, through the C++ loop."""
    require_cpu_tensors(torch.float32, x=x, w=w, **({"b": b} if b is not None else {}))
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be (M, K) and w (N, K) with the same K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"b must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    return load_cpu_ext().gemv(as_cpp_reads(x), as_cpp_reads(w), _NO_BIAS if b is None else as_cpp_reads(b))


def check_finite_scale(scale: torch.Tensor) -> None:
    """A ValueError unless every scale of an int8/int4 GEMV is finite, as chapter 09's QuantLinear requires of its
    own (`check_values`): an inf scale times a zero code is NaN, and the C++ loop would return it without a word.
    A TypeError for anything but a floating-point tensor."""
    check_float_tensor("scale", scale)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"scale must hold finite values, got {scale[~torch.isfinite(scale)][0].item()} among its "
                         f"{scale.numel()}")


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ (q (N, K) int8 codes)^T * scale + b (N,) -> (M, N) through the C++ int8 loop: x, scale and b float32,
    scale one per output row, (N,) or chapter 09's `QuantLinear.scale` layout (N, 1). Equals that layer's
    weight-only int8 forward to float rounding."""
    require_cpu_tensors(torch.float32, x=x, scale=scale, **({"b": b} if b is not None else {}))
    require_cpu_tensors(torch.int8, q=q)
    if x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"x must be (M, K) and q (N, K) with the same K, got {tuple(x.shape)} and {tuple(q.shape)}")
    if tuple(scale.shape) not in ((q.shape[0],), (q.shape[0], 1)):
        raise ValueError(f"scale must have shape ({q.shape[0]},) or ({q.shape[0]}, 1), one per row of q, got "
                         f"{tuple(scale.shape)}")
    if b is not None and b.shape != (q.shape[0],):
        raise ValueError(f"b must have shape ({q.shape[0]},), got {tuple(b.shape)}")
    check_finite_scale(scale)
    return load_cpu_ext().int8_gemv(as_cpp_reads(x), as_cpp_reads(q), as_cpp_reads(scale.reshape(-1)),
                                    _NO_BIAS if b is None else as_cpp_reads(b))


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None = None
              ) -> torch.Tensor:
    """x (M, K) @ W^T + b (N,) -> (M, N) through the C++ int4 loop, W given as chapter 09's symmetric group-wise int4
    codes: `packed` (N, K/2) uint8, two 4-bit two's complement codes per byte (`pack_int4`), and `scale` (N, groups)
    float32, one per row and group of K/groups columns (an even number). x, scale and b float32. Equals that
    `QuantLinear`'s forward (F.linear on the de-quantized weight) to float rounding."""
    require_cpu_tensors(torch.float32, x=x, scale=scale, **({"b": b} if b is not None else {}))
    require_cpu_tensors(torch.uint8, packed=packed)
    if x.dim() != 2 or packed.dim() != 2 or x.shape[1] != 2 * packed.shape[1]:
        raise ValueError(f"x must be (M, K) and packed (N, K/2), two codes per byte, got {tuple(x.shape)} and "
                         f"{tuple(packed.shape)}")
    K, N = x.shape[1], packed.shape[0]
    if scale.dim() != 2 or scale.shape[0] != N or not 1 <= scale.shape[1] <= K or K % scale.shape[1] \
            or (K // scale.shape[1]) % 2:
        raise ValueError(f"scale must be (N, groups) = ({N}, groups) with groups dividing K = {K} into even groups, "
                         f"got {tuple(scale.shape)}")
    if b is not None and b.shape != (N,):
        raise ValueError(f"b must have shape ({N},), got {tuple(b.shape)}")
    check_finite_scale(scale)
    return load_cpu_ext().int4_gemv(as_cpp_reads(x), as_cpp_reads(packed), as_cpp_reads(scale),
                                    _NO_BIAS if b is None else as_cpp_reads(b))


class FastLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose few-row float32 CPU forward runs the C++ GEMV (on a
    contiguous weight and bias; a strided one, e.g. a transposed view, takes F.linear, which reads any strides, and
    so does a negative view of x, the weight or the bias, whose sign is a bit the C++ loop would miss, see
    `as_cpp_reads`, and a sparse x, which `check_input` refuses).

    subtle: this forward runs 25 times per decode step, so it checks only what decides the path (and x's width, one
    int compare) and leaves the rest to the C++ side's own checks, TypeError/ValueError naming x, w or bias (`gemv`
    above is the checked entry point for other callers): at ~60 µs per call, every microsecond of Python here is
    visible in tokens/s. The F.linear path checks x against the weight first (`check_input`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None):
        args = check_linear_args(in_features, out_features, bias, device, dtype)  # nn.Linear checks none of them
        super().__init__(*args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):  # one type test: the rest is left to the paths below
            raise TypeError(f"x must be a tensor (..., in_features={self.in_features}), got {tensor_kind(x)}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:  # else `rows` would regroup x's numbers into new rows
            raise ValueError(f"x must be (..., in_features={self.in_features}), got shape {tuple(x.shape)}")
        rows = x.numel() // self.in_features
        w, b = self.weight, self.bias
        if (0 < rows <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
                and x.layout == torch.strided and not x.is_neg() and w.is_contiguous() and not w.is_neg()
                and (b is None or (b.is_contiguous() and not b.is_neg()))):  # else F.linear's: flag reads, no copy
            ext = _ext if _ext is not None else load_cpu_ext()
            y = ext.gemv(x.reshape(rows, self.in_features).contiguous(), w, _NO_BIAS if b is None else b)  # (rows, out)
            return y.view(*x.shape[:-1], self.out_features)
        self.check_input(x)
        return F.linear(x, self.weight, self.bias)

    def check_input(self, x: torch.Tensor) -> None:
        """The F.linear path's dtype and device check, so a mismatch names x (or the bias) instead of reaching torch:
        x must be a strided (dense) tensor of the weight's dtype (unless autocast is on, which casts) and device, the
        bias of the weight's dtype, and x of shape (..., in_features)."""
        w, b = self.weight, self.bias
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {tensor_kind(x)}")
        check_strided("x", x)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must be (..., in_features={self.in_features}), got shape {tuple(x.shape)}")
        if x.device != w.device:
            raise ValueError(f"x is on {x.device} but the layer's weight is on {w.device}; move x (or the model)")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x is {x.dtype} but the layer's weight is {w.dtype}; cast x (or the model) first")
        if b is not None and b.dtype != w.dtype:
            raise TypeError(f"bias is {b.dtype} but the weight is {w.dtype}: a layer holds one dtype")


def fast_cpu_model(model: GPT) -> GPT:
    """A copy of `model` whose plain block linears and output head are `FastLinear`s; other layers (chapter 09's
    quantized ones, a quantized head) are kept as they are, and so is the head's tie to the embedding, or its own
    weight where it has one (deepcopy copies a shared Parameter once, and keeps it shared)."""
    if not isinstance(model, GPT):
        raise TypeError(f"fast_cpu_model needs a minillm GPT, got {type(model).__name__}")
    load_cpu_ext()  # build (or load) now, so a missing compiler fails here, not at the first token
    out = copy.deepcopy(model)
    for m in [*out.transformer.h.modules(), out.lm_head]:
        if type(m) is nn.Linear:
            m.__class__ = FastLinear  # same parameters and buffers; only forward changes
    return out.eval()
