"""Chapter 12's benchmark: each kernel version against its naive twin and PyTorch's own op, beside the device's roofs.

For every kernel it first checks each version against the naive twin (a version that disagrees is reported, not
timed), then times the naive op, every version and PyTorch's op (F.softmax, F.layer_norm, F.gelu,
scaled_dot_product_attention, a bf16 F.linear with the dequantized weight, index_copy_) with CUDA events around
back-to-back calls queued behind a spinning kernel (`time_ms` says why): warm-up, then the median of many repeats.
The memory-bound shapes move at least 256 MB a call, so the 50 MB L2 cache of an H100/H200 cannot hold them. It
counts the bytes each op must move at least (and the FLOPs of attention and GEMV), and measures in the same run the
roofs the numbers are read against: device-to-device copy bandwidth, the bf16 matmul rate (tensor cores) and the
fp32 matmul rate with TF32 off (the CUDA cores, the roof of kernels that compute in fp32 FMAs). Rows: {kernel,
version, shape, dtype, ms, GB/s, fraction_of_copy_bw, speedup_vs_naive, and for attention and the GEMVs TFLOP/s and
fraction_of_fp32_matmul}.

    python -m minillm.kernels.bench [--json FILE.json] [--quick]

Runs on CUDA only (the one-time build of the extension took 26 s on an H200). Its JSON report holds these numbers
and the run's provenance ("bench", "command", "date"), but no "cpu": the machine that matters is the GPU, under
"device". Two more modes need no GPU and feed chapter 12's text (`quotes`):

    python -m minillm.kernels.bench --from-report REPORT.md --json FILE.json
    python -m minillm.kernels.bench --ptxas --json FILE.json

`--from-report` reads the table this benchmark printed back out of a committed GPU report (chapters/gpu-reports/)
into the same JSON report, numbers as printed, so a run on another machine is quoted from what it printed;
`--ptxas` compiles every kernel file with nvcc for sm_80 and sm_90 and reports each kernel's registers and spills
as ptxas counts them (the machine that compiled is the report's "cpu").
What it leaves out: sweeps over shapes; flushing the L2 cache between calls (the shapes are too large for it).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from minillm.bench.cli import bench_parser, start, write_report
from minillm.bench.tables import markdown_table
from minillm.core.config import (check_bool, check_float, check_int, check_report, check_sequence,
                                 check_tensor_elements, reads_report, short_repr, tensor_kind)
from minillm.core.io import atomic_write_text, check_output_file
from minillm.core.timing import check_calls, check_repeats, check_warmup
from minillm.kernels import build, naive, ops
from minillm.kernels.build import load_kernels

BENCH = "minillm.kernels.bench"


@dataclass
class Case:
    """One benchmark: a kernel at one shape, its contenders by name, and what one call must move and compute."""

    kernel: str
    shape: str
    dtype: torch.dtype
    bytes_moved: int  # the least traffic one call needs: every input read once, every output written once
    flops: int  # 0 where the op is not about arithmetic
    naive: Callable[[], torch.Tensor | None]
    versions: dict[int, Callable[[], torch.Tensor | None]]
    torch_ops: dict[str, Callable[[], torch.Tensor | None]] = field(default_factory=dict)
    check: Callable[[torch.Tensor | None, torch.Tensor | None], bool] | None = None  # version output vs naive's


def require_cuda(who: str) -> None:
    """A RuntimeError naming `who` unless a CUDA GPU is here: every helper below times (or allocates) on one, and
    without it torch's own AssertionError ("Torch not compiled with CUDA enabled") would be the message."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{who} needs a CUDA GPU: torch.cuda.is_available() is False (the kernels' CPU checks are "
                           "minillm.kernels.mirror and minillm.kernels.emulator)")


@functools.cache
def sleep_cycles_per_ms() -> float:
    """How many cycles `torch.cuda._sleep` spins per millisecond on this GPU (measured once per process)."""
    require_cuda("sleep_cycles_per_ms")
    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm-up: the first launch of any kernel pays for loading it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def time_ms(fn: Callable[[], object], warmup: int, repeats: int, batch_ms: float = 1.0, max_calls: int = 100) -> float:
    """Median GPU milliseconds per call of fn(), over `repeats` samples of back-to-back calls, after `warmup` calls.

    Bracketing a single call with two CUDA events also counts the host's time to launch it: a wrapper that checks
    its arguments in Python takes tens of microseconds, longer than a large softmax runs on an H200, and the GPU
    would sit idle inside the measurement. So each sample first queues `torch.cuda._sleep` (a kernel that spins
    for a number of clock cycles) for longer than the host needs to queue the sample's calls, then records the
    start event, the calls and the end event: the GPU runs the calls back to back, and the events time them alone.
    A sample holds as many calls as fill about `batch_ms` (at most `max_calls`). An fn that waits for the GPU
    itself (a .tolist(), an .item()) drains the queue, and its time then includes its host work, as it would in use.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a function of no arguments, got {type(fn).__name__}")
    warmup = check_warmup("warmup", warmup)
    repeats = check_repeats("repeats", repeats)
    batch_ms = check_float("batch_ms", batch_ms, 0.0, include_minimum=False)
    max_calls = check_calls("max_calls", max_calls)
    require_cuda("time_ms")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host = time.perf_counter()
    fn()  # the host's time to queue one call (all of the call's time, if it waits for the GPU)
    host_ms = (time.perf_counter() - host) * 1e3
    torch.cuda.synchronize()
    cycles_per_ms = sleep_cycles_per_ms()

    def sample(calls: int) -> float:
        """GPU ms per call over `calls` back-to-back calls."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep_ms = min(1.5 * host_ms * calls + 0.05, 200.0)  # the host queues the calls while this spins
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    calls = max(1, min(max_calls, math.ceil(batch_ms / max(sample(1), 1e-4))))
    return statistics.median(sample(calls) for _ in range(repeats))


def check_same_shape(got: object, ref: object) -> None:
    """A ValueError naming got and ref unless both are tensors of one shape. subtle: comparing them would broadcast,
    and a (1, C) output would "agree" with every row of a (R, C) reference (`close` here, `tour.compare`)."""
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else tensor_kind(t) for t in (got, ref)]
    if not all(isinstance(t, torch.Tensor) for t in (got, ref)) or shapes[0] != shapes[1]:
        raise ValueError(f"got and ref must be tensors of the same shape, got {shapes[0]} and {shapes[1]}")


def finite_scale(ref: torch.Tensor) -> float:
    """max(1, the largest finite |ref|): what a tolerance is relative to (1 for an empty ref). subtle: an infinity
    in ref must not enter it, or every error would pass ([inf, 1000] "agreeing" with [inf, 0])."""
    finite = ref[torch.isfinite(ref)]
    return max(1.0, finite.abs().max().item()) if finite.numel() else 1.0


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |got - ref| where ref is not infinite, over `finite_scale(ref)`; inf unless got holds ref's
    infinities, sign included, where ref has them; 0.0 for empty tensors; NaN where either has a NaN. got and ref:
    tensors of one shape (`check_same_shape`)."""
    check_same_shape(got, ref)
    g, r = got.float(), ref.float()
    inf = torch.isinf(r)
    if not torch.equal(g[inf], r[inf]):
        return math.inf
    return (g[~inf] - r[~inf]).abs().max().item() / finite_scale(r) if r[~inf].numel() else 0.0


def close(tol: float) -> Callable[[torch.Tensor | None, torch.Tensor | None], bool]:
    """A check(got, ref): every element of got within tol of ref, relative to ref's largest finite magnitude (at
    least 1), and ref's infinities exactly where ref has them; a NaN never agrees; empty tensors agree. tol >= 0 (a
    ValueError naming it otherwise); got and ref of different shapes are a ValueError naming both."""
    tol = check_float("tol", tol, 0.0)

    def check(got, ref) -> bool:
        check_same_shape(got, ref)
        g, r = got.float(), ref.float()
        inf = torch.isinf(r)
        return torch.equal(g[inf], r[inf]) and bool(torch.allclose(g[~inf], r[~inf], rtol=tol,
                                                                    atol=tol * finite_scale(r)))
    return check


def copy_bandwidth(num_bytes: int, warmup: int, repeats: int) -> float:
    """GB/s of a device-to-device copy of num_bytes (read + write counted: 2 * num_bytes per copy)."""
    num_bytes = check_int("num_bytes", num_bytes)
    check_tensor_elements("num_bytes", (num_bytes,))
    warmup, repeats = check_warmup("warmup", warmup), check_repeats("repeats", repeats)
    require_cuda("copy_bandwidth")
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, repeats)
    return 2 * num_bytes / ms / 1e6


def matmul_tflops(n: int, warmup: int, repeats: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """TFLOP/s of an n x n x n matmul: bf16 on the tensor cores; fp32 with TF32 off, the CUDA cores' fp32 roof that
    kernels doing their math in fp32 FMAs (attention, the GEMVs) are read against."""
    n = check_int("n", n)
    check_tensor_elements("n", (n, n))
    warmup, repeats = check_warmup("warmup", warmup), check_repeats("repeats", repeats)
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {short_repr(dtype)}")
    require_cuda("matmul_tflops")
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ms = time_ms(lambda: a @ b, warmup, repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return 2 * n**3 / ms / 1e9


def cases(quick: bool) -> list[Case]:
    """The shapes: decode- and prefill-sized work for a GPT-2-small-to-medium model, in bf16."""
    require_cuda("cases")
    bf16 = torch.bfloat16
    out: list[Case] = []
    esz = 2

    def randn(*shape):
        return torch.randn(*shape, device="cuda").to(bf16)

    R, C = (8192, 8192) if quick else (16384, 8192)
    x = randn(R, C) * 4
    out.append(Case("softmax", f"({R}, {C})", bf16, 2 * R * C * esz, 0, lambda: naive.softmax(x),
                    {v: (lambda v=v: ops.softmax(x, version=v)) for v in ops.versions("softmax")},
                    {"F.softmax": lambda: F.softmax(x, dim=-1)}, close(1e-2)))

    R, C = (16384, 4096) if quick else (32768, 4096)
    xl, w, b = randn(R, C) + 3, randn(C), randn(C)
    out.append(Case("layernorm", f"({R}, {C})", bf16, (2 * R * C + 2 * C) * esz, 0,
                    lambda: naive.layernorm(xl, w, b),
                    {v: (lambda v=v: ops.layernorm(xl, w, b, version=v)) for v in ops.versions("layernorm")},
                    {"F.layer_norm": lambda C=C: F.layer_norm(xl, (C,), w, b)}, close(1e-2)))

    R, C = (16384, 4096) if quick else (32768, 4096)
    xg, bg = randn(R, C), randn(C)
    out.append(Case("bias_gelu", f"({R}, {C})", bf16, (2 * R * C + C) * esz, 0, lambda: naive.bias_gelu(xg, bg),
                    {v: (lambda v=v: ops.bias_gelu(xg, bg, version=v)) for v in ops.versions("bias_gelu")},
                    {"F.gelu(x + b)": lambda: F.gelu(xg + bg, approximate="tanh")}, close(1e-2)))

    B, H, T, D = (2, 16, 2048, 64) if quick else (4, 16, 2048, 64)  # T = 2048: where the chapter sets its target
    q, k, v = randn(B, H, T, D), randn(B, H, T, D), randn(B, H, T, D)
    out.append(Case("attention", f"({B}, {H}, {T}, {D})", bf16, 4 * B * H * T * D * esz,
                    2 * 2 * B * H * T * (T + 1) // 2 * D,  # two matmuls over the causal half (T(T+1)/2 pairs)
                    lambda: naive.attention(q, k, v),
                    {ver: (lambda ver=ver: ops.attention(q, k, v, version=ver)) for ver in ops.versions("attention")},
                    {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}, close(2e-2)))

    S, nh, hs, bs, ctx = (64, 32, 128, 16, 1024) if quick else (128, 32, 128, 16, 1024)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(ctx // 2, ctx + 1, (S,), generator=g)
    nblk = -(-int(lens.max()) // bs)
    nb = S * nblk
    perm = torch.randperm(nb, generator=g)  # scattered blocks, as a real pool ends up
    tables = perm.view(S, nblk).to("cuda")
    context_lens = lens.to("cuda")
    k_pool, v_pool = randn(nb, bs, nh, hs), randn(nb, bs, nh, hs)
    qd = randn(S, nh, hs)
    kv_bytes = 2 * int(lens.sum()) * nh * hs * esz
    out.append(Case("paged_attention_decode", f"S={S} nh={nh} hs={hs} bs={bs} ctx<={ctx}", bf16,
                    kv_bytes + 2 * S * nh * hs * esz, 2 * 2 * int(lens.sum()) * nh * hs,
                    lambda: naive.paged_attention_decode(qd, k_pool, v_pool, tables, context_lens),
                    # the tables are valid by construction: the timed calls skip the check's device sync
                    {ver: (lambda ver=ver: ops.paged_attention_decode(qd, k_pool, v_pool, tables, context_lens,
                                                                      version=ver, check_tables=False))
                     for ver in ops.versions("paged_attention_decode")},
                    {}, close(2e-2)))

    M, N, K = 4, 32768, 8192  # a 70B-class model's MLP matrix: 256 MB in int8
    xq = randn(M, K)
    wq = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
    sq, bq = (torch.rand(N, device="cuda") / 64).to(bf16), randn(N)
    w_deq = (wq.float() * sq.float()[:, None]).to(bf16)  # what a bf16 model would hold: twice the bytes
    out.append(Case("int8_gemv", f"M={M} N={N} K={K}", bf16, N * K + (M * K + 2 * N + M * N) * esz, 2 * M * N * K,
                    lambda: naive.int8_gemv(xq, wq, sq, bq),
                    {ver: (lambda ver=ver: ops.int8_gemv(xq, wq, sq, bq, version=ver))
                     for ver in ops.versions("int8_gemv")},
                    {"F.linear bf16 weight": lambda: F.linear(xq, w_deq, bq)}, close(2e-2)))

    T, nh, hs, nb, bs = (8192, 32, 128, 1024, 16) if quick else (16384, 32, 128, 2048, 16)
    key, value = randn(T, nh, hs), randn(T, nh, hs)
    kp, vp = randn(nb, bs, nh, hs), randn(nb, bs, nh, hs)
    kp_n, vp_n = kp.clone(), vp.clone()  # the naive op writes its own copy; the check compares the pools
    slots = torch.randperm(nb * bs, generator=g)[:T].to("cuda")

    def naive_write():
        naive.kv_cache_write(key, value, kp_n, vp_n, slots)
        return kp_n

    def kernel_write():
        ops.kv_cache_write(key, value, kp, vp, slots, check_slots=False)
        return kp

    out.append(Case("kv_cache_write", f"T={T} nh={nh} hs={hs} pool=({nb}, {bs})", bf16, 2 * 2 * T * nh * hs * esz, 0,
                    naive_write, {1: kernel_write}, {},
                    lambda got, ref: torch.equal(got, ref) and torch.equal(vp, vp_n)))
    return out


def run(quick: bool = False, verbose: bool = True) -> dict:
    """Check, then time, every case; return {device, torch, cuda, copy_GBps, matmul_bf16_TFLOPs,
    matmul_fp32_TFLOPs, seconds, quick, rows}. quick and verbose must be bools (a TypeError otherwise)."""
    quick, verbose = check_bool("quick", quick), check_bool("verbose", verbose)
    require_cuda("the chapter 12 benchmark")
    load_kernels()
    began = time.perf_counter()
    warmup, repeats = (2, 10) if quick else (5, 30)
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth((256 if quick else 1024) * 2**20, warmup, repeats)
    mm_tflops = matmul_tflops(4096 if quick else 8192, warmup, repeats)
    mm32_tflops = matmul_tflops(4096 if quick else 8192, warmup, repeats, torch.float32)
    rows = []
    for case in cases(quick):
        ref = case.naive()
        naive_ms = time_ms(case.naive, warmup, repeats)
        contenders: list[tuple[str, Callable, bool]] = [("naive", case.naive, True)]
        for v, fn in case.versions.items():
            ok = True
            if case.check is not None:
                ok = case.check(fn(), ref)
            contenders.append((f"v{v}", fn, ok))
        contenders += [(name, fn, True) for name, fn in case.torch_ops.items()]
        for name, fn, ok in contenders:
            row = {"kernel": case.kernel, "version": name, "shape": case.shape,
                   "dtype": str(case.dtype).split(".")[-1], "ms": None, "GB/s": None, "fraction_of_copy_bw": None,
                   "speedup_vs_naive": None, "correct": ok}
            if ok:  # a version that disagrees with the naive twin is not worth timing
                ms = naive_ms if name == "naive" else time_ms(fn, warmup, repeats)
                gbps = case.bytes_moved / ms / 1e6
                row.update({"ms": round(ms, 5), "GB/s": round(gbps, 1),
                            "fraction_of_copy_bw": round(gbps / copy_gbps, 3),
                            "speedup_vs_naive": round(naive_ms / ms, 2)})
                if case.flops:
                    row["TFLOP/s"] = round(case.flops / ms / 1e9, 2)
                    row["fraction_of_fp32_matmul"] = round(case.flops / ms / 1e9 / mm32_tflops, 3)
            rows.append(row)
        del ref
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "copy_GBps": round(copy_gbps, 1), "matmul_bf16_TFLOPs": round(mm_tflops, 1),
            "matmul_fp32_TFLOPs": round(mm32_tflops, 1),
            "seconds": round(time.perf_counter() - began, 1), "quick": quick, "rows": rows}


REPORT_KEYS = ("device", "torch", "copy_GBps", "matmul_bf16_TFLOPs", "rows")  # what every report holds


def format_table(result: dict) -> str:
    """The report as the benchmark prints it: the device and its roofs, then one line per row (`parse_table` reads
    such a table back; a report read from a GPU report may lack the fp32 roof and the run's seconds). `result`: a
    report of `run` or `from_report` (a TypeError / ValueError naming it otherwise)."""
    if not isinstance(result, dict):
        raise TypeError(f"result must be a report dict of run() or from_report(), got {type(result).__name__}")
    missing = [key for key in REPORT_KEYS if key not in result]
    if missing:
        raise ValueError(f"result must be a report of run() or from_report(), holding {list(REPORT_KEYS)}; it "
                         f"lacks {missing}")
    fp32 = f"fp32 matmul {result['matmul_fp32_TFLOPs']} TFLOP/s  " if "matmul_fp32_TFLOPs" in result else ""
    seconds = f"({result['seconds']} s)" if result.get("seconds") is not None else ""
    lines = [f"{result['device']}  torch {result['torch']}  copy {result['copy_GBps']} GB/s  "
             f"bf16 matmul {result['matmul_bf16_TFLOPs']} TFLOP/s  {fp32}{seconds}".rstrip(),
             f"{'kernel':<24}{'version':<22}{'ms':>10}{'GB/s':>10}{'of copy':>9}{'TFLOP/s':>9}{'of fp32':>9}"
             f"{'x naive':>9}  shape"]
    def num(value, fmt: str) -> str:
        return format(value, fmt) if value is not None else format("-", fmt.split(".")[0].rstrip("f") or "")

    for r in result["rows"]:
        flag = "" if r["correct"] else "  WRONG (disagrees with naive): not timed"
        lines.append(f"{r['kernel']:<24}{r['version']:<22}{num(r['ms'], '>10.4f')}{num(r['GB/s'], '>10.1f')}"
                     f"{num(r['fraction_of_copy_bw'], '>9.3f')}{num(r.get('TFLOP/s'), '>9.2f')}"
                     f"{num(r.get('fraction_of_fp32_matmul'), '>9.3f')}{num(r['speedup_vs_naive'], '>9.2f')}"
                     f"  {r['shape']}{flag}")
    return "\n".join(lines)


# The printed table's columns (format_table's header, split at two spaces or more) and the report field each holds.
PRINTED_COLUMNS = {"ms": "ms", "GB/s": "GB/s", "of copy": "fraction_of_copy_bw", "TFLOP/s": "TFLOP/s",
                   "of fp32": "fraction_of_fp32_matmul", "x naive": "speedup_vs_naive"}
WRONG = "  WRONG (disagrees with naive): not timed"


def parse_table(text: str) -> list[dict]:
    """The rows of a table `format_table` printed (its header line starts with "kernel"), as `run` reports them;
    a number printed as "-" was not measured (no TFLOP/s for a memory-bound op) and is left out of the row. The
    columns are read from the header, so a table of an older version of the benchmark, without "of fp32", reads
    too. Numbers keep the digits they were printed with. A ValueError when there is no such table or a line does not
    fit its header; a TypeError unless `text` is a str."""
    if not isinstance(text, str):
        raise TypeError(f"text must be the benchmark's printed output (a str), got {tensor_kind(text)}")
    lines = str.__str__(text).splitlines()  # the plain str: a subclass's own methods are not consulted
    start_at = next((i for i, line in enumerate(lines) if line.split()[:2] == ["kernel", "version"]), None)
    if start_at is None:
        raise ValueError("no table printed by minillm.kernels.bench (a header line 'kernel  version  ms ...')")
    header = re.split(r"\s{2,}", lines[start_at].strip())
    numeric = header[2:-1]
    if header[-1] != "shape" or not numeric or any(c not in PRINTED_COLUMNS for c in numeric):
        raise ValueError(f"unexpected columns in the benchmark's table: {header}")
    # kernel, version (it may hold spaces: "F.gelu(x + b)"), one number or "-" per column, the shape (spaces too)
    row_re = re.compile(r"(\w+)\s+(.+?)" + r"\s+(-|\d+(?:\.\d+)?)" * len(numeric) + r"\s+(.+)")
    rows = []
    for line in lines[start_at + 1:]:
        if not line.strip() or line.startswith("```"):
            break
        m = row_re.fullmatch(line.rstrip())
        if m is None:
            raise ValueError(f"a line of the benchmark's table does not fit its header {header}: {line!r}")
        shape, correct = m.group(len(numeric) + 3), True
        if shape.endswith(WRONG):
            shape, correct = shape[: -len(WRONG)], False
        row = {"kernel": m.group(1), "version": m.group(2), "shape": shape,
               "dtype": "bfloat16",  # every case of `cases` is bf16
               "ms": None, "GB/s": None, "fraction_of_copy_bw": None, "speedup_vs_naive": None, "correct": correct}
        for column, value in zip(numeric, m.groups()[2:-1]):
            if value != "-":
                row[PRINTED_COLUMNS[column]] = float(value)
        rows.append(row)
    if not rows:
        raise ValueError("the benchmark's table has a header and no rows")
    return rows


def from_report(text: str, source: str) -> dict[str, Any]:
    """A report in `run`'s format read from a committed GPU report (Markdown) that holds the benchmark's printed
    table: the rows (`parse_table`), the device and torch from the report's field table, the date, the command that
    measured ("measured_with") and the roofs the report states beside the table (copy GB/s, bf16 matmul TFLOP/s).
    Only what the report prints: no "seconds", and no fp32 roof unless the table has it. A ValueError naming what is
    missing; a TypeError unless text and source are str."""
    for name, value in (("text", text), ("source", source)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    fields = dict(re.findall(r"^\| (\w+) \| (.+?) \|$", text, re.MULTILINE))

    def find(pattern: str, what: str) -> re.Match:
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"{source}: cannot find {what}")
        return m

    for name in ("date", "gpu", "torch"):
        if name not in fields:
            raise ValueError(f"{source}: no '| {name} | ... |' line in the report's field table")
    date = re.match(r"\d{4}-\d\d-\d\d", fields["date"])
    if date is None:
        raise ValueError(f"{source}: the report's date {fields['date']!r} does not start YYYY-MM-DD")
    measured_with = find(r"`(python -m minillm\.kernels\.bench[^`]*)`", "the benchmark's command").group(1)
    report = {"bench": BENCH, "source": source, "measured_with": measured_with, "date": date.group(0),
              "device": fields["gpu"].split(" (")[0].split(",")[0],  # "NVIDIA H200 (sm_90), driver ..."
              "torch": fields["torch"].split(",")[0]}  # "2.11.0+cu130, nvcc 13.0"
    if m := re.search(r"nvcc ([\d.]+)", fields["torch"]):
        report["cuda"] = m.group(1)
    report["copy_GBps"] = float(find(r"copy \(([\d.]+) GB/s\)", "the copy bandwidth, '(N GB/s)'").group(1))
    report["matmul_bf16_TFLOPs"] = float(find(r"bf16 \d+³ matmul \(([\d.]+) TFLOP/s\)",
                                              "the bf16 matmul rate, '(N TFLOP/s)'").group(1))
    report["seconds"] = None
    report["quick"] = "--quick" in shlex.split(measured_with)
    report["rows"] = parse_table(text)
    return report


# The chapter's names for the kernels, and the ones its ladder table gives in milliseconds rather than as a fraction
# of copy bandwidth: attention's work is arithmetic, not bytes, and paged decode has no PyTorch op to set beside it.
KERNEL_LABELS = {"softmax": "softmax", "layernorm": "layernorm", "bias_gelu": "bias + GELU", "attention": "attention",
                 "paged_attention_decode": "paged decode", "int8_gemv": "int8 GEMV", "kv_cache_write": "KV write"}
IN_MS = ("attention", "paged_attention_decode")
ROW_KEYS = ("kernel", "version", "shape", "correct", "ms", "fraction_of_copy_bw")  # what the ladder reads of a row
PTXAS_KEYS = ("source", "name", "arch", "registers", "spill_stores", "spill_loads")  # of a `ptxas_rows` row


def contender_key(version: str) -> str:
    """A row's short name in `quotes`: "naive", "v1".., or "torch" for PyTorch's own op."""
    if not isinstance(version, str):
        raise TypeError(f"version must be a row's version name (a str such as 'v1'), got {type(version).__name__}")
    version = str.__str__(version)  # the plain str: a subclass's == is not consulted
    return version if version == "naive" or re.fullmatch(r"v\d+", version) else "torch"


def percent(fraction: float) -> str:
    """A fraction as a percentage with one decimal ("12.5%")."""
    return f"{100 * check_float('fraction', fraction):.1f}%"


def times(ratio: float) -> str:
    """A ratio with two significant digits ("0.23x", "9.1x"), whole above 10 ("93x")."""
    ratio = check_float("ratio", ratio, 0.0)
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"


@reads_report
def ladder_cell(row: dict) -> str:
    if not row["correct"]:
        return "wrong"
    return f"{row['ms']:.3g} ms" if row["kernel"] in IN_MS else percent(row["fraction_of_copy_bw"])


@reads_report
def ladder_table(report: dict) -> str:
    """One line per kernel: the naive op, each version and PyTorch's own op, as a percentage of the run's copy
    bandwidth (milliseconds for `IN_MS`); an empty cell where the run had no such version. A report without its
    rows (`ROW_KEYS`) is a TypeError / ValueError naming it (`check_report`)."""
    check_report("report", report, ("rows",), "rows", ROW_KEYS)
    by_kernel: dict[str, dict[str, dict]] = {}
    for r in report["rows"]:
        by_kernel.setdefault(r["kernel"], {})[contender_key(r["version"])] = r
    versions = sorted({k for rows in by_kernel.values() for k in rows if k.startswith("v")}, key=lambda v: int(v[1:]))
    table = []
    for kernel, rows in by_kernel.items():
        shape = rows["naive"]["shape"] if "naive" in rows else next(iter(rows.values()))["shape"]
        label = f"{KERNEL_LABELS.get(kernel, kernel)} {shape if shape.startswith('(') else f'({shape})'}"
        cells = [ladder_cell(rows[k]) if k in rows else "" for k in ("naive", *versions)]
        torch_op = rows.get("torch")
        cells.append(f"{ladder_cell(torch_op)} (`{torch_op['version']}`)" if torch_op else "")
        table.append([label, *cells])
    return markdown_table(["kernel (shape)", "naive", *versions, "PyTorch's own"], table)


@reads_report
def ladder_quotes(report: dict) -> dict[str, str]:
    """The values of a timing report: the device and its roofs, each row's ms, µs and % of copy
    ("softmax_v4_of_copy" = "20.4%"), how many times as fast each contender of a kernel (naive, v1.., torch) runs
    as each other one ("int8_gemv_v2_vs_v1" = "6.9x", "paged_attention_decode_v1_vs_naive" = "9.1x": the second's
    ms over the first's), the range of PyTorch's own ops as a fraction of copy over the kernels the ladder gives as one
    ("torch_of_copy_range" = "24-33%") and the best version there ("best_version_of_copy")."""
    out = {"ladder": ladder_table(report)}  # checks the rows first
    check_report("report", report, ("device", "date", "copy_GBps", "matmul_bf16_TFLOPs"))
    out |= {"device": report["device"], "date": report["date"],
            "copy_GBps": f"{report['copy_GBps']:,.0f}", "matmul_bf16_TFLOPs": f"{report['matmul_bf16_TFLOPs']:,.0f}"}
    if "matmul_fp32_TFLOPs" in report:
        out["matmul_fp32_TFLOPs"] = f"{report['matmul_fp32_TFLOPs']:,.1f}"
    timed: dict[str, dict[str, dict]] = {}
    for r in report["rows"]:
        if r["correct"]:
            timed.setdefault(r["kernel"], {})[contender_key(r["version"])] = r
    for kernel, rows in timed.items():
        for key, r in rows.items():
            name = f"{kernel}_{key}"
            out.update({f"{name}_ms": f"{r['ms']:.3g}", f"{name}_us": f"{1e3 * r['ms']:,.0f}",
                        f"{name}_of_copy": percent(r["fraction_of_copy_bw"])})
            for other, o in rows.items():
                if other != key:
                    out[f"{name}_vs_{other}"] = times(o["ms"] / r["ms"])
    fractions = [(r["fraction_of_copy_bw"], r) for rows in timed.values() for r in rows.values()
                 if r["kernel"] not in IN_MS]
    torch_ops = [f for f, r in fractions if contender_key(r["version"]) == "torch"]
    if torch_ops:
        out["torch_of_copy_range"] = f"{100 * min(torch_ops):.0f}-{100 * max(torch_ops):.0f}%"
    versions = [(f, r) for f, r in fractions if contender_key(r["version"]).startswith("v")]
    if versions:
        f, r = max(versions, key=lambda fr: fr[0])
        out["best_version_of_copy"] = f"{KERNEL_LABELS.get(r['kernel'], r['kernel'])} {r['version']} at {percent(f)}"
    return out


def nvcc_release() -> str:
    """The CUDA release of the nvcc on the PATH ("13.0"), from `nvcc --version`; a RuntimeError without one."""
    nvcc = build.find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc is not on the PATH (nor under CUDA_HOME): cannot compile the kernels")
    version = build.run_compiler([nvcc, "--version"], "nvcc --version", 60.0)
    m = re.search(r"release ([\d.]+)", version)
    if m is None:
        raise RuntimeError(f"nvcc --version names no release: {version!r:.200}")
    return m.group(1)


def ptxas_rows(resources: list[build.KernelResources]) -> list[dict]:
    """ptxas's report of each kernel instantiation as a JSON row, with the kernel's short name from `build.KERNELS`
    ("softmax_v1_kernel") beside its mangled one. A TypeError for anything but a list of `KernelResources`."""
    if not isinstance(resources, list) or not all(isinstance(r, build.KernelResources) for r in resources):
        raise TypeError(f"resources must be a list of build.KernelResources (ptxas's report), got "
                        f"{type(resources).__name__}")
    rows = []
    for r in resources:
        names = [n for n in build.KERNELS.get(r.source, ()) if n in r.kernel]
        rows.append({"source": r.source, "name": names[0] if len(names) == 1 else None, "arch": r.arch,
                     "kernel": r.kernel, "registers": r.registers, "spill_stores": r.spill_stores,
                     "spill_loads": r.spill_loads, "stack_frame": r.stack_frame})
    return rows


def ptxas_report(archs: tuple[str, ...] = ("sm_80", "sm_90")) -> dict[str, Any]:
    """Compile every kernel file alone with nvcc for `archs` (`build.compile_sources_with_nvcc`, in a temporary
    folder) and report {nvcc, archs, kernels}: every instantiation's registers per thread and spill bytes."""
    with tempfile.TemporaryDirectory() as out:
        resources = build.compile_sources_with_nvcc(archs, out)
    return {"nvcc": nvcc_release(), "archs": list(archs), "kernels": ptxas_rows(resources)}


def version_of(name: str) -> str:
    """A kernel's version in its name: "softmax_v1_kernel" -> "v1", "bias_gelu_tail_kernel" -> "tail"; a TypeError
    naming `name` unless it is a str."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a kernel's name (a str), got {tensor_kind(name)}")
    return name.removesuffix("_kernel").rsplit("_", 1)[-1]


def version_order(name: str) -> tuple:
    """v1, v2, .., then the helpers (a tail kernel), whatever order ptxas reported them in."""
    v = version_of(name)
    return (0, int(v[1:]), "") if re.fullmatch(r"v\d+", v) else (1, 0, v)


def span(values: list[int]) -> str:
    """Counts (registers per thread) as one number or a range "lo-hi"; "" for none."""
    if isinstance(values, (list, tuple)) and not values:
        return ""
    values = [check_int(f"values[{i}]", v, 0) for i, v in enumerate(check_sequence("values", values))]
    return "" if not values else str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"


@reads_report
def register_table(report: dict) -> str:
    """One line per kernel file: each version's registers per thread for each architecture (a range over its
    instantiations: dtypes, 16-byte loads or not, head sizes), and the file's spill bytes (stores and loads) over
    all of them. A report without them is a TypeError / ValueError naming it (`check_report`)."""
    check_report("report", report, ("archs", "kernels"), "kernels", PTXAS_KEYS)
    archs = report["archs"]
    rows = []
    sources = list(dict.fromkeys(k["source"] for k in report["kernels"]))
    for source in sources:
        mine = [k for k in report["kernels"] if k["source"] == source]
        names = sorted(dict.fromkeys(k["name"] for k in mine), key=version_order)
        versions = " / ".join(version_of(n) for n in names)
        regs = [" / ".join(span([k["registers"] for k in mine if k["name"] == n and k["arch"] == a]) for n in names)
                for a in archs]
        spills = sum(k["spill_stores"] + k["spill_loads"] for k in mine)
        rows.append([f"`{source}`", versions, *regs, str(spills)])
    return markdown_table(["file", "kernel", *(f"registers {a}" for a in archs), "spill bytes"], rows,
                          "ll" + "r" * (len(archs) + 1))


@reads_report
def register_quotes(report: dict) -> dict[str, str]:
    """The values of a ptxas report: nvcc's release, the compiling machine, how many instantiations, their spill
    bytes in all, and the kernel with the most registers per thread ("most_registers" = "161",
    "most_registers_kernel" = "attention v3")."""
    table = register_table(report)  # checks the rows first
    check_report("report", report, ("nvcc", "cpu"))
    kernels = report["kernels"]
    if not kernels:
        raise ValueError("report['kernels'] is empty: a --ptxas report has a row per kernel instantiation")
    top = max(kernels, key=lambda k: k["registers"])
    name = top["name"].removesuffix("_kernel").rsplit("_", 1)  # ["attention", "v3"]
    return {"registers": table, "nvcc": report["nvcc"], "cpu": report["cpu"],
            "instantiations": str(len(kernels)),
            "spill_bytes": str(sum(k["spill_stores"] + k["spill_loads"] for k in kernels)),
            "most_registers": str(top["registers"]),
            "most_registers_kernel": f"{name[0].replace('_', ' ')} {name[1]}"}


@reads_report
def quotes(report: dict[str, Any]) -> dict[str, str]:
    """What chapter 12's text quotes from a report of this module (`minillm.course.results`): from a timing report
    (a run, or one read back with --from-report) the table "ladder" and the values of `ladder_quotes`; from a
    --ptxas report the table "registers" and the values of `register_quotes`."""
    check_report("report", report, ())
    return register_quotes(report) if "kernels" in report else ladder_quotes(report)


def command_line(argv: list[str] | None) -> str:
    """How this module was run, as a reader would type it: `python -m minillm.kernels.bench ...`; `argv` the
    arguments after the module (None: this process's), a list of str (a TypeError otherwise)."""
    if argv is not None and (not isinstance(argv, list) or not all(isinstance(a, str) for a in argv)):
        raise TypeError(f"argv must be a list of str arguments (or None), got {type(argv).__name__}")
    return shlex.join(["python", "-m", BENCH, *(sys.argv[1:] if argv is None else argv)])


def out_flag(text: str) -> str:
    """`--out`, the older name of `--json`: checked at parse time under the name typed (the shared check after
    parsing would name --json, a flag the user never gave)."""
    if not isinstance(text, str):
        raise TypeError(f"--out must be a path (a str), got {type(text).__name__}")
    try:
        path = check_output_file(text, "--out", (".json",))
        if path is None:  # '' (a variable left unset): a file named 'None' would be written
            raise ValueError("--out must name a .json file, got ''")
        return str(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser("python -m minillm.kernels.bench", __doc__.splitlines()[0], "smaller shapes and fewer repeats",
                      devices=("cuda",), seed=False)
    ap.add_argument("--out", dest="json", type=out_flag, help=argparse.SUPPRESS)  # --json's older name, still taken
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--from-report", metavar="REPORT.md",
                      help="no GPU: read the table this benchmark printed back out of a GPU report into the report "
                           "format (numbers as printed)")
    mode.add_argument("--ptxas", action="store_true",
                      help="no GPU: compile every kernel with nvcc for sm_80 and sm_90 and report registers and spills")
    return ap


def read_report(path: str) -> dict[str, Any]:
    """`from_report` of the Markdown file at `path`; a path that is no regular file (missing, a folder, a FIFO that
    would block the read), an unreadable file or one without the table is a ValueError naming --from-report."""
    try:
        if not Path(path).is_file():
            raise ValueError(f"no report file at {path!r}")
        return from_report(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"--from-report: {e}") from e


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = start(ap, argv)
    if args.from_report:
        try:
            result = read_report(args.from_report)
        except ValueError as e:
            ap.error(str(e))
        result["command"] = command_line(argv)
        print(format_table(result))
        if args.json:
            atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")
        return 0
    if args.ptxas:
        report = ptxas_report()
        print(register_table(report), end="")
        write_report(args.json, report)  # here "cpu" is right: the machine that compiled
        return 0
    if not torch.cuda.is_available():
        print("minillm.kernels.bench needs a CUDA GPU (torch.cuda.is_available() is False); the kernels' CPU "
              "checks are in tests/test_12_cuda_kernels.py", file=sys.stderr)
        return 2
    result = run(quick=args.quick)
    result.update(bench=BENCH, command=command_line(argv), date=time.strftime("%Y-%m-%d", time.gmtime()))
    print(format_table(result))
    if args.json:
        # subtle: not write_report, whose "cpu" field would name the host of a GPU benchmark.
        atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")
    return 0 if all(r["correct"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
