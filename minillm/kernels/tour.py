"""Tour entry for chapter 12: each kernel's algorithm against its naive twin, on every machine; on a CUDA GPU, each
kernel's versions against the naive op, timed.

On the CPU: one row per kernel, `<kernel> mirror`. The check is that the pure-PyTorch mirror of the kernel's tiled
algorithm (`minillm.kernels.mirror`: online softmax over tiles, FlashAttention's tiles, the block-table walk,
lane-strided warp sums, the slot scatter) equals the naive op (`minillm.kernels.naive`) on odd shapes in fp32 and
bf16, within the dtype's tolerance. The metric is the largest error relative to the output's magnitude.
Then one row, `every kernel version, emulated`: each version's own C++ run on the CPU by `minillm.kernels.emulator`
(skipped where no C++ compiler is installed), against the naive op on the same shapes; the metric is how many
versions agree.
On CUDA (when `torch.cuda.is_available()`), one row per kernel version, `<kernel> v<N>`, from the benchmark's quick
shapes. The check is that the version equals the naive op. The metric is the fraction of the measured copy bandwidth
for the memory-bound kernels, and the speed-up over the naive op for attention.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from minillm.core.config import check_choice
from minillm.core.rows import Row, TourContext
from minillm.core.sampling import check_seed
from minillm.kernels import emulator, mirror, naive, ops
from minillm.kernels.bench import relative_error, run as run_bench

TITLE = "CUDA kernels (CPU mirrors; versions on a GPU)"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative to the output's largest magnitude (one rounding)


def kv_write_as_output(fn: Callable) -> Callable:
    """The in-place KV write as a function returning what it wrote: both pools after writing into zeroed ones."""
    def run(key, value, k_shape, slots):
        k_pool = torch.zeros(k_shape, dtype=key.dtype)
        v_pool = torch.zeros(k_shape, dtype=key.dtype)
        fn(key, value, k_pool, v_pool, slots)
        return torch.cat([k_pool, v_pool])
    return run


def cases(g: torch.Generator) -> list[tuple[str, str, Callable, Callable, tuple]]:
    """[(kernel, shape label, mirror fn, naive fn, fp32 args)]: odd shapes, scattered blocks, skipped slots."""
    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    out = []
    for R, C in ((7, 1000), (33, 130)):
        out.append(("softmax", f"({R}, {C})", lambda x: mirror.softmax_online(x, 8, 4), naive.softmax,
                    (rnd(R, C, scale=4),)))
        out.append(("layernorm", f"({R}, {C})", mirror.layernorm_warp, naive.layernorm,
                    (rnd(R, C) + 3, rnd(C), rnd(C))))
        out.append(("layernorm", f"({R}, {C}) in packs of 8", lambda x, w, b: mirror.layernorm_warp(x, w, b, pack=8),
                    naive.layernorm, (rnd(R, C) + 3, rnd(C), rnd(C))))
        out.append(("bias_gelu", f"({R}, {C})", mirror.bias_gelu, naive.bias_gelu, (rnd(R, C), rnd(C))))
    for shape in ((2, 3, 37, 24), (1, 2, 130, 64)):
        out.append(("attention", str(shape), lambda q, k, v: mirror.flash_attention(q, k, v, 16, 16), naive.attention,
                    (rnd(*shape), rnd(*shape), rnd(*shape))))
        out.append(("attention", f"{shape} v3", mirror.flash_attention_v3, naive.attention,
                    (rnd(*shape), rnd(*shape), rnd(*shape))))
        out.append(("attention", f"{shape} v4 (P in the input dtype)",
                    lambda q, k, v: mirror.flash_attention_v3(q, k, v, p_dtype=q.dtype), naive.attention,
                    (rnd(*shape), rnd(*shape), rnd(*shape))))
    for bs in (1, 16):
        S, nh, hs, ctx = 5, 4, 32, 70
        nblk = -(-ctx // bs)
        tables = torch.randperm(S * nblk, generator=g).view(S, nblk)  # scattered blocks, as a real pool ends up
        args = (rnd(S, nh, hs), rnd(S * nblk, bs, nh, hs), rnd(S * nblk, bs, nh, hs), tables,
                torch.tensor([1, 17, 33, 64, ctx]))
        out.append(("paged_attention_decode", f"S={S} nh={nh} hs={hs} bs={bs}", mirror.paged_attention_decode,
                    naive.paged_attention_decode, args))
        out.append(("paged_attention_decode", f"S={S} nh={nh} hs={hs} bs={bs} over 4 warps",
                    lambda *a: mirror.paged_attention_decode(*a, num_warps=4), naive.paged_attention_decode, args))
    for M, N, K in ((1, 130, 1000), (4, 33, 257)):
        args = (rnd(M, K), torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8),
                torch.rand(N, generator=g) / 64, rnd(N))
        out.append(("int8_gemv", f"M={M} N={N} K={K}", mirror.int8_gemv, naive.int8_gemv, args))
        out.append(("int8_gemv", f"M={M} N={N} K={K} in packs of 16",
                    lambda x, w, sc, b: mirror.int8_gemv(x, w, sc, b, pack=16), naive.int8_gemv, args))
    T, nh, hs, nb, bs = 40, 4, 16, 12, 4
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[::7] = -1  # padding tokens: skipped
    out.append(("kv_cache_write", f"T={T} pool=({nb}, {bs})", kv_write_as_output(mirror.kv_cache_write),
                kv_write_as_output(naive.kv_cache_write), (rnd(T, nh, hs), rnd(T, nh, hs), (nb, bs, nh, hs), slots)))
    return out


def cast(args: tuple, dtype: torch.dtype) -> tuple:
    """The floating-point tensors of args (a tuple) in `dtype` (a floating torch.dtype); integer tensors (codes,
    tables, slots) and shapes unchanged. A TypeError naming either otherwise."""
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of a kernel's arguments, got {type(args).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {type(dtype).__name__} {dtype!r:.80}")
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def compare(kernel: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """(agrees, error relative to the output's largest finite magnitude, `bench.relative_error`); the KV write, a
    copy, must agree exactly. kernel: one of the chapter's kernels (`ops.versions`' names). got and ref must have the
    same shape: a ValueError naming both otherwise (subtracting them would broadcast, and a (1, C) output would
    "agree" with every row of a (R, C) reference); empty outputs agree. dtype: one of TOL's."""
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a kernel name (a str), got {type(kernel).__name__} {kernel!r}")
    kernel = check_choice("kernel", kernel, ops.NUM_VERSIONS)  # a typo of "kv_cache_write" would drop its exact rule
    err = relative_error(got, ref)
    if not isinstance(dtype, torch.dtype) or dtype not in TOL:  # the type first: an array is no key
        raise ValueError(f"dtype must be one of {list(TOL)} (the tolerances the tour knows), got {dtype!r}")
    exact = kernel == "kv_cache_write"
    return not bool(torch.isnan(got).any()) and (err == 0.0 if exact else err <= TOL[dtype]), err


def _mirror_rows(seed: int) -> list[Row]:
    by_kernel: dict[str, dict] = {}
    for kernel, label, fn_mirror, fn_naive, args in cases(torch.Generator().manual_seed(seed)):
        r = by_kernel.setdefault(kernel, {"worst": 0.0, "ok": True, "shapes": []})
        r["shapes"].append(label)
        for dtype in (torch.float32, torch.bfloat16):
            ok, err = compare(kernel, fn_mirror(*cast(args, dtype)), fn_naive(*cast(args, dtype)), dtype)
            r["ok"] = r["ok"] and ok
            r["worst"] = max(r["worst"], err)
    return [Row("12", f"{kernel} mirror", f"naive.{kernel}", f"mirror of {kernel}.cu's algorithm",
                ("every element equal" if kernel == "kv_cache_write" else "equal within the dtype's tolerance (fp32 "
                 "1e-5, bf16 1e-2 of the output's magnitude)") + f" on {', '.join(r['shapes'])}, fp32 and bf16",
                r["ok"], "max error / max |output|",
                r["worst"], "", "cpu", details={"shapes": r["shapes"]})
            for kernel, r in by_kernel.items()]


# Each kernel's emulated call, by version, taking the same arguments as its mirror in `cases`.
EMULATED: dict[str, Callable] = {
    "softmax": lambda ver, x: emulator.softmax(x, ver),
    "layernorm": lambda ver, x, w, b: emulator.layernorm(x, w, b, ver),
    "bias_gelu": lambda ver, x, b: emulator.bias_gelu(x, b, ver),
    "attention": lambda ver, q, k, v: emulator.attention(q, k, v, ver),
    "paged_attention_decode": lambda ver, *args: emulator.paged_attention_decode(*args, version=ver),
    "int8_gemv": lambda ver, x, w, scale, bias: emulator.int8_gemv(x, w, scale, bias, ver),
    "kv_cache_write": lambda ver, *args: kv_write_as_output(emulator.kv_cache_write)(*args),
}


def emulator_row(seed: int) -> Row:
    """Every version of every kernel, its own C++ run on the CPU, against the naive op on the first shape of each
    kernel's `cases`, in fp32 and bf16. `seed` is checked as the tour's seeds are (`check_seed`)."""
    seed = check_seed(seed)
    row = dict(chapter="12", technique="every kernel version, emulated", baseline="naive ops",
               optimized="the .cu files on CPU fibers (minillm.kernels.emulator)", metric="versions equal to naive",
               unit="", device="cpu")
    if emulator.find_cxx() is None:
        return Row(**row, check="no C++ compiler (g++ or clang++) here to build the emulator", check_passed=False,
                   value=float("nan"), skipped=True)
    began = time.perf_counter()
    emulator.load()
    build_s = time.perf_counter() - began
    first: dict[str, tuple] = {}
    for kernel, _, _, fn_naive, args in cases(torch.Generator().manual_seed(seed)):
        first.setdefault(kernel, (fn_naive, args))
    passed, total, worst, wrong = 0, 0, 0.0, []
    for kernel, (fn_naive, args) in first.items():
        for ver in ops.versions(kernel):
            ok_all = True
            for dtype in (torch.float32, torch.bfloat16):
                a = cast(args, dtype)
                ok, err = compare(kernel, EMULATED[kernel](ver, *a), fn_naive(*a), dtype)
                ok_all, worst = ok_all and ok, max(worst, err)
            total += 1
            passed += ok_all
            if not ok_all:
                wrong.append(f"{kernel} v{ver}")
    check = f"{passed}/{total} versions equal to the naive op in fp32 and bf16 (largest error {worst:.1e} of the " \
            "output's magnitude)" + (f"; wrong: {', '.join(wrong)}" if wrong else "")
    return Row(**row, check=check,
               check_passed=passed == total, value=passed,
               details={"total": total, "wrong": wrong, "build_and_load_s": round(build_s, 1),
                        "seconds": round(time.perf_counter() - began, 1)})


def gpu_rows() -> list[Row]:
    result = run_bench(quick=True, verbose=False)
    rows = []
    for r in result["rows"]:
        if not r["version"].startswith("v"):  # the naive op and PyTorch's own are the yardsticks, not rows
            continue
        attention = r["kernel"] == "attention"
        value = (r["speedup_vs_naive"] if attention else 100 * r["fraction_of_copy_bw"]) if r["correct"] else 0.0
        rows.append(Row("12", f"{r['kernel']} {r['version']}", f"naive.{r['kernel']}",
                        f"{r['kernel']}.cu {r['version']}",
                        f"equal to the naive op: {r['correct']}; {r['shape']} {r['dtype']}; {r['ms']} ms, "
                        f"{r['GB/s']} GB/s against {result['copy_GBps']} GB/s copy; {r['speedup_vs_naive']}x naive",
                        bool(r["correct"]), "speed-up" if attention else "fraction of copy bandwidth", value,
                        "x" if attention else "%", "cuda",
                        details={**r, "device": result["device"], "copy_GBps": result["copy_GBps"]}))
    return rows


def run(ctx: TourContext) -> list[Row]:
    rows = _mirror_rows(ctx.seed) + [emulator_row(ctx.seed)]
    if torch.cuda.is_available():
        rows += gpu_rows()
    return rows
