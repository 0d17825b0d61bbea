"""The command line every chapter benchmark shares: `--device`, `--threads`, `--quick`, `--seed`, `--json`.

`bench_parser(prog, description, quick_help)` builds the parser (a benchmark adds its own options to it);
`start(parser, argv)` parses, checks `--threads` and applies it (one thread by default: on a small or shared CPU more
threads than cores stall these small matmuls); `write_report(path, report)` writes the JSON report atomically,
naming the CPU; `cpu_description()` names the CPU and the vector instructions PyTorch uses on it, since CPU timings
depend on both; `pick_size(sizes, size)` looks up a benchmark's named workload size, refusing an unknown name.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import torch

from minillm.core.device import DEVICE_CHOICES
from minillm.core.io import atomic_write_text


def bench_parser(prog: str, description: str, quick_help: str) -> argparse.ArgumentParser:
    """A parser with the shared options; `quick_help` says what `--quick` shrinks for this benchmark."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--device", default="cpu", choices=DEVICE_CHOICES)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="also write the full report as JSON (atomically)")
    return ap


def start(ap: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse argv, refuse --threads < 1 (a usage error naming the value), and set torch's thread count."""
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    return args


S = TypeVar("S")


def pick_size(sizes: Mapping[str, S], size: str) -> S:
    """`sizes[size]`, or a ValueError naming the choices: a benchmark's `run_all(size=...)` checks before any work."""
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}, got {size!r}")
    return sizes[size]


def write_report(path: str | None, report: dict[str, Any]) -> None:
    """The report as indented JSON at `path` (atomically), with the machine under "cpu" unless the report already
    names it; nothing when path is None."""
    if path:
        atomic_write_text(path, json.dumps({**report, "cpu": report.get("cpu") or cpu_description()}, indent=2,
                                           default=str) + "\n")


def cpu_description() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo, else `platform`) and the vector instruction set PyTorch's CPU
    kernels were dispatched to, e.g. "AMD EPYC (torch 2.13.0+cpu, AVX512)". Whether a kernel such as
    `torch._int_mm` is fast depends on both: the same command can give opposite answers on two machines."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name or 'unknown CPU'} (torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()})"
