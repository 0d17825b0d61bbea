"""The Python entry points of the chapter 12 kernels: `softmax(x, version=4)` and friends.

Each function checks its arguments (TypeError or ValueError naming the bad value) before anything is built or
launched, so a mistake costs no compile and says what to fix; then it allocates the output (unless `out` is given:
the tests pass a NaN-poisoned one) and calls `torch.ops.minillm_kernels.<name>`, which checks again in C++.
Every version of every kernel stays callable: `version` picks one, the default is the last, the one the
chapter builds up to.
What it leaves out: autograd (these are inference kernels) and CPU tensors (use `naive` or `mirror` there).
"""

from __future__ import annotations

import numbers

import torch

from minillm.core.config import (check_choice, check_fits_float, check_has_data, check_int, number_kind, plain_number,
                                 short_repr)
from minillm.kernels.build import load_kernels

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NUM_VERSIONS = {"softmax": 4, "layernorm": 4, "bias_gelu": 2, "attention": 4, "paged_attention_decode": 2,
                "int8_gemv": 3, "kv_cache_write": 1}
MAX_HEAD_SIZE = 128  # attention.cu and paged_attention.cu: at most one dimension per thread of a 128-thread block
# (v1), four per lane of a warp (paged v2), tiles padded to 128 (attention v3, v4)


def versions(op: str) -> range:
    """Every version of `op`, 1..NUM_VERSIONS[op]: what the tests, the benchmark and the tour iterate over."""
    if not isinstance(op, str):
        raise TypeError(f"op must be a kernel name, one of {sorted(NUM_VERSIONS)}, got {type(op).__name__} {op!r}")
    op = check_choice("op", op, NUM_VERSIONS)  # the plain str: a str subclass's == is not consulted
    return range(1, NUM_VERSIONS[op] + 1)


def _tensor(name: str, t, dim: int | None = None, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_has_data(name, t)  # before the device checks: a meta tensor has no values for any kernel
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        allowed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise ValueError(f"{name} must have dtype {allowed}, got {t.dtype}")
    return t


def _same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _version(op: str, version) -> int:
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(f"{op}: version must be an int, got {number_kind(version)}")
    n = NUM_VERSIONS[op]
    version = int.__index__(version)  # the plain int: an int subclass's own comparisons are not consulted
    if not 1 <= version <= n:
        raise ValueError(f"{op}: version must be 1..{n}, got {short_repr(version)}")
    return version


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Every tensor (None skipped) on the first one's device, else a ValueError naming the first that is not (torch
    would fail inside an op, "Tensor on device meta is not on the expected device cpu", naming no argument); a
    TypeError naming any that is not a tensor.
    Shared by the CUDA wrappers, `naive` and the mirrors; `check_same_device(x=x, w=w)`."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor (or None), got {type(t).__name__}")
    for name, t in named[1:]:
        if t.device != named[0][1].device:
            raise ValueError(f"{name} must be on {named[0][0]}'s device {named[0][1].device}, got {t.device}")


def _on_cuda(**tensors: torch.Tensor) -> None:
    """Every tensor on one CUDA device and contiguous (the kernels index raw row-major memory), its values in memory.

    subtle: a negative (or conjugate) view keeps its sign in a bit, not in memory: the raw pointer misses it, and a
    kernel would compute with +x (or write -x as +x into `out`); refused, as the emulator refuses it."""
    for name, t in tensors.items():
        if t.is_neg() or t.is_conj():
            raise ValueError(f"{name} is a negative (or conjugate) view: its sign is a bit the kernels' raw pointer "
                             "misses; call .resolve_neg() (.resolve_conj()) first")
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {t.device} (the CPU twins are in "
                             "minillm.kernels.naive and minillm.kernels.mirror)")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}; "
                             "call .contiguous() first")
    check_same_device(**tensors)


def check_eps(eps) -> float:
    """layernorm's eps: a number that stays positive, normal and finite as the float32 every version computes in
    (the kernels take it as a C float; `naive`, the mirrors and the emulator do their math in fp32 too, whatever the
    input dtype). A TypeError / ValueError naming eps otherwise; the value as a Python float, which every caller
    passes on (a numpy float32 is read as the number it holds).

    Both ends matter: 1e300 is inf in float32, and var + inf turns every row into its bias; 1e-50 is 0 in float32
    (so is anything below float32's smallest subnormal), and a constant row then has var + eps = 0, rsqrt inf and
    0 * inf = NaN. The floor is float32's smallest normal number, 2**-126 ~ 1.18e-38: below it eps is 0 or a
    subnormal, which flush-to-zero arithmetic (fast-math GPU code, CPUs in FTZ/DAZ mode) also reads as 0."""
    f32 = torch.finfo(torch.float32)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):  # a numpy float is a real number too
        raise TypeError(f"eps must be a real number (a Python or numpy int or float), got {type(eps).__name__} "
                        f"{short_repr(eps)}")
    check_fits_float("eps", eps)  # an int past the float range: float() would be an OverflowError, repr() too long
    value = float(plain_number(eps))  # a float subclass's own __float__ is not consulted
    if not f32.tiny <= value <= f32.max:
        raise ValueError(f"eps must be a finite number in [{f32.tiny:.6g}, {f32.max:.6g}] (positive, normal and "
                         f"finite in float32, the precision every layernorm computes in), got {short_repr(eps)}")
    return value


def check_head_size(name: str, hs: int) -> None:
    """A head size the attention kernels take, 1..MAX_HEAD_SIZE, else a ValueError naming `name`'s last dimension.
    Shared by the CUDA wrappers, the emulator and the mirrors: with hs = 0 the scale 1/sqrt(hs) is a division by
    zero, and past 128 the kernels have no thread (v1) or lane slot (paged v2) for the extra dimensions."""
    hs = plain_number(hs)  # a shape's entry, or a caller's number: its own comparisons are not consulted
    if isinstance(hs, bool) or not isinstance(hs, int):
        raise TypeError(f"head size {name}.shape[-1] must be an int, got {number_kind(hs)}")
    if not 1 <= hs <= MAX_HEAD_SIZE:
        raise ValueError(f"head size {name}.shape[-1] must be 1..{MAX_HEAD_SIZE}, got {short_repr(hs)}")


def check_paged_args(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor) -> None:
    """paged_attention_decode's shapes and dtypes (shared by the CUDA wrapper, the emulator and `naive`): q
    (S, nh, hs) float, pools (nb, bs, nh, hs) of q's dtype, int64 block_tables (S, max_nb) and context_lens (S,);
    a ValueError/TypeError naming the argument. The values (lengths, block ids) are `check_block_tables`'s."""
    _tensor("q", q, dim=3)
    S, nh, hs = q.shape
    _tensor("k_pool", k_pool, dim=4)
    if tuple(k_pool.shape[2:]) != (nh, hs):
        raise ValueError(f"k_pool must be (nb, bs, nh={nh}, hs={hs}), got shape {tuple(k_pool.shape)}")
    _same("k_pool", k_pool, "q", q)
    _same("v_pool", _tensor("v_pool", v_pool, dim=4), "k_pool", k_pool, tuple(k_pool.shape))
    check_paged_tables(S, block_tables, context_lens)
    check_same_device(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, context_lens=context_lens)


def check_paged_tables(S: int, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """int64 block_tables (S, max_nb) and context_lens (S,) holding values; a TypeError / ValueError naming the
    argument (a complex or float table included). Shared by `check_paged_args` and the mirror, which takes pools of
    any floating dtype but the tables the kernels take."""
    S = check_int("S", S, 0)  # compared with shapes below: a tensor's == is no bool
    _tensor("block_tables", block_tables, dim=2, dtypes=(torch.int64,))
    if block_tables.shape[0] != S:
        raise ValueError(f"block_tables must have S={S} rows (one per query), got shape {tuple(block_tables.shape)}")
    _tensor("context_lens", context_lens, dim=1, dtypes=(torch.int64,))
    if tuple(context_lens.shape) != (S,):
        raise ValueError(f"context_lens must have shape ({S},), got {tuple(context_lens.shape)}")


def check_slot_range(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot of slot_mapping (T,) is -1 (skipped) or a pool row 0..num_slots-1, and none is named twice
    (`check_distinct_slots`); two host syncs on a GPU (`check_slots=False` in `kv_cache_write` skips both)."""
    _tensor("slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,))  # a float slot would compare as a number
    num_slots = check_int("num_slots", num_slots, 0)  # True would read as one slot
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            allowed = f"-1 or slots 0..{num_slots - 1}" if num_slots else "only -1 (the pool has no slots)"
            raise ValueError(f"slot_mapping must hold {allowed}, got values in [{lo}, {hi}]")
    _check_distinct(slot_mapping)


def check_distinct_slots(slot_mapping: torch.Tensor) -> None:
    """No pool slot named twice in slot_mapping (T,) (-1, skipped, may repeat): two tokens written to one slot race
    on a GPU, and which one lands is up to the scheduler. A ValueError naming the slot (one host sync); a TypeError
    / ValueError unless slot_mapping is a 1-D int64 tensor."""
    _tensor("slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,))
    _check_distinct(slot_mapping)


def _check_distinct(slot_mapping: torch.Tensor) -> None:
    kept = slot_mapping[slot_mapping >= 0]
    if kept.numel() > 1:
        slots, counts = torch.unique(kept, return_counts=True)
        if bool((counts > 1).any()):
            i = int((counts > 1).nonzero()[0])
            raise ValueError(f"slot_mapping names slot {int(slots[i])} {int(counts[i])} times: each token needs a "
                             "slot of its own")


def check_block_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int,
                       block_size: int) -> None:
    """Every context length fits its table (0..max_nb * bs) and every block id a sequence reads (its first
    ceil(len / bs) entries) is a block of the pool 0..num_blocks-1. block_tables (S, max_nb), context_lens (S,).
    num_blocks (>= 0: an empty pool makes every block id read a bad one) and block_size (>= 1) are ints within int64
    (the tables' dtype), checked as the plain ints. Both tables int64 tensors holding values (a TypeError / ValueError
    naming them otherwise)."""
    _tensor("block_tables", block_tables, dim=2, dtypes=(torch.int64,))
    _tensor("context_lens", context_lens, dim=1, dtypes=(torch.int64,))
    num_blocks, block_size = check_int("num_blocks", num_blocks, 0), check_int("block_size", block_size)
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if value >= 2**63:
            raise ValueError(f"{name} must be below 2**63 (the block tables are int64), got {value}")
    S, max_nb = block_tables.shape
    if tuple(context_lens.shape) != (S,):
        raise ValueError(f"context_lens must have shape ({S},), one length per row of block_tables, got "
                         f"{tuple(context_lens.shape)}")
    if not S:
        return
    lo, hi = int(context_lens.min()), int(context_lens.max())
    if lo < 0 or hi > max_nb * block_size:
        raise ValueError(f"context_lens must be in [0, {max_nb * block_size}] (max_nb={max_nb} blocks of "
                         f"{block_size}), got values in [{lo}, {hi}]")
    needed = (context_lens.unsqueeze(1) + block_size - 1) // block_size  # (S, 1) blocks each sequence reads
    used = torch.arange(max_nb, device=block_tables.device).unsqueeze(0) < needed  # (S, max_nb)
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        s, b = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_tables[{s}, {b}] = {int(block_tables[s, b])} is outside the pool [0, {num_blocks}) "
                         f"and sequence {s} (context length {int(context_lens[s])}) reads it")


def _out(out, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _tensor("out", out)
    _same("out", out, "the input", like, shape)
    return out


def softmax(x: torch.Tensor, version: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dimension of x (..., C); versions 1..4 (csrc/softmax.cu)."""
    _tensor("x", x)
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension, got shape {tuple(x.shape)}")
    version = _version("softmax", version)
    out = _out(out, x, tuple(x.shape))
    _on_cuda(x=x, out=out)
    C = x.shape[-1]
    if x.numel() == 0:
        return out
    load_kernels().softmax(x.view(-1, C), out.view(-1, C), version)
    return out


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, version: int = 4,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm over the last dimension of x (..., C) with weight, bias (C,); versions 1..4 (csrc/layernorm.cu).
    A row past fp32's range for its squares (|x| past ~1e19) is not refused and gives no meaningful output (see
    `naive.layernorm`)."""
    _tensor("x", x)
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    _same("weight", _tensor("weight", weight), "x", x, (C,))
    _same("bias", _tensor("bias", bias), "x", x, (C,))
    eps = check_eps(eps)
    version = _version("layernorm", version)
    out = _out(out, x, tuple(x.shape))
    _on_cuda(x=x, weight=weight, bias=bias, out=out)
    if x.numel() == 0:
        return out
    load_kernels().layernorm(x.view(-1, C), weight, bias, out.view(-1, C), float(eps), version)
    return out


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, version: int = 2, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(x + bias) for x (..., C), bias (C,); versions 1..2 (csrc/bias_gelu.cu)."""
    _tensor("x", x)
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension, got shape {tuple(x.shape)}")
    C = x.shape[-1]
    _same("bias", _tensor("bias", bias), "x", x, (C,))
    version = _version("bias_gelu", version)
    out = _out(out, x, tuple(x.shape))
    _on_cuda(x=x, bias=bias, out=out)
    if x.numel() == 0:
        return out
    load_kernels().bias_gelu(x.view(-1, C), bias, out.view(-1, C), version)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, version: int = 4,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention, scale 1/sqrt(hs): q, k, v (B, nh, T, hs), hs <= 128; versions 1..4 (csrc/attention.cu)."""
    _tensor("q", q, dim=4)
    check_head_size("q", q.shape[-1])
    _same("k", _tensor("k", k, dim=4), "q", q, tuple(q.shape))
    _same("v", _tensor("v", v, dim=4), "q", q, tuple(q.shape))
    version = _version("attention", version)
    out = _out(out, q, tuple(q.shape))
    _on_cuda(q=q, k=k, v=v, out=out)
    load_kernels().attention(q, k, v, out, version)
    return out


def paged_attention_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, version: int = 2,
                           out: torch.Tensor | None = None, check_tables: bool = True) -> torch.Tensor:
    """Decode attention over chapter 05's pools: q (S, nh, hs), k_pool/v_pool (nb, bs, nh, hs), block_tables
    (S, max_nb) int64 (-1 padded), context_lens (S,) int64 -> (S, nh, hs); versions 1..2 (csrc/paged_attention.cu).

    The pools must have q's dtype (PagedKVCache(dtype=...) matching the model's). `check_tables` verifies that
    every context length fits its table and every block id a sequence reads is a block of the pool, a ValueError
    naming the entry (one device sync: a caller that validated the tables once, as the benchmark's timed loop
    does, passes False). The kernel itself makes such a sequence's output NaN rather than read outside the pool."""
    _tensor("q", q, dim=3)
    check_head_size("q", q.shape[-1])
    check_paged_args(q, k_pool, v_pool, block_tables, context_lens)
    version = _version("paged_attention_decode", version)
    if not isinstance(check_tables, bool):
        raise TypeError(f"check_tables must be a bool, got {type(check_tables).__name__}")
    if check_tables:
        check_block_tables(block_tables, context_lens, k_pool.shape[0], k_pool.shape[1])
    out = _out(out, q, tuple(q.shape))
    _on_cuda(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, context_lens=context_lens, out=out)
    load_kernels().paged_attention_decode(q, k_pool, v_pool, block_tables, context_lens, out, version)
    return out


def int8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              version: int = 3, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ (w (N, K) int8 * scale (N,))^T + bias (N,) -> (M, N); versions 1..3 (csrc/int8_gemv.cu)."""
    _tensor("x", x, dim=2)
    _tensor("w", w, dim=2, dtypes=(torch.int8,))
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be (N, K={x.shape[1]}) to match x {tuple(x.shape)}, got {tuple(w.shape)}")
    N = w.shape[0]
    _same("scale", _tensor("scale", scale), "x", x, (N,))
    tensors = {"x": x, "w": w, "scale": scale}
    if bias is not None:
        _same("bias", _tensor("bias", bias), "x", x, (N,))
        tensors["bias"] = bias
    version = _version("int8_gemv", version)
    out = _out(out, x, (x.shape[0], N))
    _on_cuda(**tensors, out=out)
    load_kernels().int8_gemv(x, w, scale, bias, out, version)
    return out


def check_kv_write_args(key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """kv_write's shapes and dtypes (shared by the CUDA wrapper and the emulator): key/value (T, nh, hs), pools
    (nb, bs, nh, hs) of key's dtype, int64 slot_mapping (T,); a ValueError/TypeError naming the argument."""
    _tensor("key", key, dim=3)
    _tensor("value", value, dim=3)
    if key.shape != value.shape:  # which one is wrong, only the pools can tell: both are named
        raise ValueError(f"key and value must have the same shape (T, nh, hs), got key {tuple(key.shape)} and "
                         f"value {tuple(value.shape)}")
    _same("value", value, "key", key, tuple(key.shape))
    _tensor("k_pool", k_pool, dim=4)
    if tuple(k_pool.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"k_pool must be (nb, bs, nh={key.shape[1]}, hs={key.shape[2]}) to hold key "
                         f"{tuple(key.shape)}, got shape {tuple(k_pool.shape)}")
    _same("k_pool", k_pool, "key", key)
    _same("v_pool", _tensor("v_pool", v_pool, dim=4), "k_pool", k_pool, tuple(k_pool.shape))
    _tensor("slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,))
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must have one slot per token ({key.shape[0]}), got {slot_mapping.shape[0]}")
    check_same_device(key=key, value=value, k_pool=k_pool, v_pool=v_pool, slot_mapping=slot_mapping)
    # subtle: the write reads key/value while it writes the pools; memory they share makes the result depend on the
    # order the threads run in (k_pool is v_pool: every key overwritten by its value)
    named = {"key": key, "value": value, "k_pool": k_pool, "v_pool": v_pool}
    for a, b in (("k_pool", "v_pool"), ("key", "k_pool"), ("key", "v_pool"), ("value", "k_pool"), ("value", "v_pool")):
        if tensors_overlap(named[a], named[b]):
            raise ValueError(f"{a} and {b} share memory: the write would overwrite what it reads (or one pool the "
                             "other); give them separate tensors")


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes two strided tensors can address intersect (their [first, last] byte ranges; exact for
    contiguous tensors, which is what the kernels take). No host sync: pointers only."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors_overlap: {name} must be a torch.Tensor, got {type(t).__name__}")
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        lo = hi = t.data_ptr()
        for size, stride in zip(t.shape, t.stride()):
            reach = (size - 1) * stride * t.element_size()
            lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
        return lo, hi + t.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    return a_lo < b_hi and b_lo < a_hi


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   slot_mapping: torch.Tensor, version: int = 1, check_slots: bool = True) -> None:
    """In place: row t of key/value (T, nh, hs) into pool slot slot_mapping[t] (pools (nb, bs, nh, hs)), -1 skipped
    (csrc/kv_write.cu). `check_slots` verifies every slot is -1 or inside the pool (one device sync); the kernel
    itself skips out-of-range slots instead of writing past the pool."""
    check_kv_write_args(key, value, k_pool, v_pool, slot_mapping)
    version = _version("kv_cache_write", version)
    if not isinstance(check_slots, bool):  # 'no' or a tensor read as a truth value
        raise TypeError(f"check_slots must be a bool, got {type(check_slots).__name__} {short_repr(check_slots)}")
    if check_slots:
        check_slot_range(slot_mapping, k_pool.shape[0] * k_pool.shape[1])
    _on_cuda(key=key, value=value, k_pool=k_pool, v_pool=v_pool, slot_mapping=slot_mapping)
    load_kernels().kv_cache_write(key, value, k_pool, v_pool, slot_mapping)
