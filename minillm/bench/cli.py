"""The command line every chapter benchmark shares: `--device`, `--threads`, `--json`, `--seed`, `--quick`, `--size`.

`bench_parser(prog, description, ...)` builds a benchmark's parser with the shared options (a benchmark adds its own
to it), `add_bench_options(parser, ...)` adds them to a parser that already exists (`minillm bench`, a subcommand);
both give every benchmark the same flags, defaults and help text, which tests/test_bench_kit.py checks module by
module. `--threads` (1 to 4 per core), `--seed` (>= 0) and `--device cuda` (only with a GPU) are checked as they are
parsed (a usage error naming the flag, exit 2). `start(parser, argv)` parses and applies them: it checks the `--json`
path before any work and sets torch's thread count (one thread by default: on a small or shared CPU more threads
than cores stall these small matmuls); `apply_bench_options(args)` does the same for arguments parsed elsewhere.
`cli_type(check, cast)` makes a benchmark's own flag checked at parse time by the library's check (a usage error
naming the flag, not a traceback once the work has started). `write_report(path, report)` writes the JSON report
atomically, naming the CPU; `cpu_description()` names the CPU and the vector instructions PyTorch uses on it, since
CPU timings depend on both; `pick_size(sizes, size)` looks up a benchmark's named workload size, refusing an unknown
name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from minillm.core.config import check_bool, check_choice, check_float, check_int, check_threads, short_repr
from minillm.core.device import DEVICE_CHOICES
from minillm.core.io import atomic_write_text, check_output_file
from minillm.core.sampling import seed_argument
from minillm.core.timing import check_repeats

# The shared options' defaults and help, one place for every benchmark.
DEFAULT_DEVICE = "cpu"  # where a benchmark has a CPU path; a GPU-only one (chapter 12's kernels) defaults to cuda
DEFAULT_THREADS = 1
DEFAULT_SIZE = "full"  # the size a benchmark's command line runs; "quick" is the tour's --quick
DEVICE_HELP = "where to run, one of {choices} ({auto}default {default})"
AUTO_HELP = "auto: cuda when there is a GPU; "
THREADS_HELP = "torch intra-op threads (default 1: on a small or shared CPU more threads than cores stall)"
JSON_HELP = "also write the full report as JSON (atomically)"
SEED_HELP = "seed for random weights, prompts and workloads (default 0)"
SIZE_HELP = "workload size, one of {choices} (default {default}; --quick is --size quick)"


def check_bench_threads(threads: int) -> int:
    """`threads` if it is in [1, 4 x os.cpu_count()] (`check_threads`), else a ValueError naming --threads."""
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    return check_threads("--threads", threads)


def threads_argument(text: str) -> int:
    """`--threads` (argparse `type=`): an int `check_bench_threads` accepts, else a usage error (exit 2) at parse
    time, not torch's MemoryError for 100000 threads."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    try:
        return check_bench_threads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def count_argument(minimum: int) -> Callable[[str], int]:
    """An argparse `type=` for a count flag (--prompt-len, --repeats...): an int >= minimum, else a usage error
    naming the flag at parse time, not a check deep inside that names a dataclass field the user never typed."""
    bound = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "count"  # what argparse names in "invalid count value"
    return parse


def bench_seed_argument(text: str) -> int:
    """`--seed` (argparse `type=`): `seed_argument`'s int, and non-negative, as the benchmarks' generators and
    calibration windows require (`check_int("seed", seed, 0)`), else a usage error naming the flag at parse time,
    not a traceback after the models loaded."""
    value = seed_argument(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative int, got {value}")
    return value


class DeviceAction(argparse.Action):
    """`--device` given on the command line: "cuda" (or "cuda:N") on a machine without a GPU is a usage error naming
    the flag at parse time, not `resolve_device`'s traceback after the work had started. An action, not a type:
    argparse runs a type on a default too, and a GPU-only benchmark's default "cuda" is its own to report."""

    def __call__(self, parser, namespace, values, option_string=None):
        if str(values).startswith("cuda") and not torch.cuda.is_available():
            parser.error(f"argument {option_string}: device {values!r} requested but torch.cuda.is_available() is "
                         "False (use --device cpu)")
        setattr(namespace, self.dest, values)


def add_bench_options(ap: argparse.ArgumentParser, quick_help: str | None = None,
                      sizes: Mapping[str, Any] | None = None, devices: Sequence[str] = DEVICE_CHOICES,
                      seed: bool = True) -> argparse.ArgumentParser:
    """Add the shared options to `ap` and return it.

    `devices` narrows `--device` for a benchmark that runs on fewer devices (its default stays "cpu" when "cpu" is
    one of them). `quick_help` says what `--quick` shrinks (plain text: a "%" in it is kept as written, not taken for
    argparse's formatting); without it there is no `--quick`. A benchmark with named
    `sizes` gets `--size` (default "full") and `--quick` as a short way to write `--size quick`. `seed=False` leaves
    out `--seed` for a benchmark with nothing random in it."""
    devices = tuple(devices)
    bad = [d for d in devices if d not in DEVICE_CHOICES]
    if not devices or bad:
        raise ValueError(f"devices must be some of {DEVICE_CHOICES}, got {devices!r}")
    default_device = DEFAULT_DEVICE if DEFAULT_DEVICE in devices else devices[0]
    # a GPU-only benchmark (no "cpu" among its devices) says itself that it needs a GPU, and has modes without one
    ap.add_argument("--device", default=default_device, choices=devices,
                    action=DeviceAction if "cpu" in devices else "store",
                    help=DEVICE_HELP.format(choices=", ".join(devices), auto=AUTO_HELP if "auto" in devices else "",
                                            default=default_device))
    ap.add_argument("--threads", type=threads_argument, default=DEFAULT_THREADS, help=THREADS_HELP)
    ap.add_argument("--json", metavar="FILE", help=JSON_HELP)
    if seed:
        ap.add_argument("--seed", type=bench_seed_argument, default=0, help=SEED_HELP)
    quick_help = None if quick_help is None else quick_help.replace("%", "%%")  # argparse %-formats help strings
    if sizes is not None:
        if DEFAULT_SIZE not in sizes or "quick" not in sizes:
            raise ValueError(f"sizes must name {DEFAULT_SIZE!r} and 'quick', got {list(sizes)}")
        ap.add_argument("--size", default=DEFAULT_SIZE, choices=list(sizes),
                        help=SIZE_HELP.format(choices=", ".join(sizes), default=DEFAULT_SIZE))
        # subtle: --quick writes the same dest as --size, so the last of the two on the command line wins.
        ap.add_argument("--quick", dest="size", action="store_const", const="quick",
                        help=(quick_help or "the smallest size") + " (--size quick)")
    elif quick_help is not None:
        ap.add_argument("--quick", action="store_true", help=quick_help)
    return ap


def cli_type(check: Callable[[Any], Any] | None = None, cast: Callable[[str], Any] = str) -> Callable[[str], Any]:
    """An argparse `type=` for a flag whose value a library call checks: `cast(text)`, then `check(value)`, both at
    parse time; their TypeError / ValueError becomes a usage error that argparse prefixes with the flag (exit 2, no
    traceback), instead of a traceback once the work has started."""
    def parse(text: str) -> Any:
        try:
            value = cast(text)
            if check is not None:
                check(value)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    return parse


class CheckedParser(argparse.ArgumentParser):
    """argparse's parser, whose `parse_args` / `parse_known_args` take only None or a list (or tuple) of str: a
    caller's `main([1, 2])` was argparse's own "'int' object is not subscriptable" from inside its loop."""

    def parse_known_args(self, args: Any = None, namespace: Any = None):  # parse_args calls this one too
        if args is not None and (not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args)):
            raise TypeError(f"argv must be None or a list of str command-line arguments, got {type(args).__name__} "
                            f"{short_repr(args)}")
        return super().parse_known_args(args, namespace)


def bench_parser(prog: str, description: str, quick_help: str | None = None, sizes: Mapping[str, Any] | None = None,
                 devices: Sequence[str] = DEVICE_CHOICES, seed: bool = True) -> argparse.ArgumentParser:
    """A parser with the shared options (`add_bench_options`); a benchmark adds its own options to it."""
    return add_bench_options(CheckedParser(prog=prog, description=description), quick_help, sizes,
                             devices, seed)


def apply_bench_options(args: argparse.Namespace) -> argparse.Namespace:
    """Check the shared options before any work (a ValueError naming the bad value) and set torch's thread count."""
    check_bench_threads(args.threads)  # again: arguments parsed elsewhere may not have had the flag's type
    if args.json == "":  # subtle: check_output_file lets "" pass as "no file", and write_report would skip it
        raise ValueError("--json must name a file, got '' (leave the flag out for no report)")
    check_output_file(args.json, "--json", (".json",))
    torch.set_num_threads(args.threads)
    return args


def start(ap: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse argv and apply the shared options; a bad value is a usage error (exit 2) naming it."""
    args = ap.parse_args(argv)
    try:
        return apply_bench_options(args)
    except ValueError as e:
        ap.error(str(e))


S = TypeVar("S")


MAX_SIZE = 10**7  # a benchmark's count (tokens, prompts, steps, calls): far past any size a run here takes


def check_sizes(sizes: Any) -> None:
    """Every field of a benchmark's `Sizes` record (a frozen dataclass) checked by its annotation and stored as the
    plain value, from its `__post_init__`: an int is a count in [1, MAX_SIZE] (a field named "...steps" may be 0:
    no training; "...repeats" as `check_repeats`), "int | None" also None, a bool a bool, a tuple of floats
    fractions in (0, 1) and a tuple of ints counts (neither empty). A TypeError / ValueError naming
    `Sizes.field` when the record is built, not a failure minutes into the run that reads it."""
    for f in dataclasses.fields(sizes):
        name, value, kind = f"{type(sizes).__name__}.{f.name}", getattr(sizes, f.name), str(f.type)
        if kind == "bool":
            value = check_bool(name, value)
        elif kind in ("int", "int | None") and not (value is None and kind == "int | None"):
            value = check_repeats(name, value) if f.name.endswith("repeats") else _count(name, value, f.name)
        elif kind in ("tuple[float, ...]", "tuple[int, ...]"):
            if not isinstance(value, tuple) or not value:
                raise TypeError(f"{name} must be a non-empty tuple, got {type(value).__name__} {short_repr(value)}")
            value = tuple(check_float(f"{name}[{i}]", v, 0.0, 1.0, include_minimum=False, include_maximum=False)
                          if kind == "tuple[float, ...]" else _count(f"{name}[{i}]", v, "") for i, v in
                          enumerate(value))
        elif kind != "int | None":
            raise TypeError(f"{name}: check_sizes has no rule for a field of type {kind}")  # a new field needs one
        object.__setattr__(sizes, f.name, value)  # frozen: the plain value, as the checks return it


def _count(name: str, value: Any, field: str) -> int:
    value = check_int(name, value, 0 if field.endswith("steps") else 1)
    if value > MAX_SIZE:
        raise ValueError(f"{name} must be at most {MAX_SIZE:,}, got {short_repr(value)}")
    return value


def pick_size(sizes: Mapping[str, S], size: str) -> S:
    """`sizes[size]`, or a ValueError naming the choices: a benchmark's `run_all(size=...)` checks before any work."""
    return sizes[check_choice("size", size, sizes)]  # the type first: an array is no key


def write_report(path: str | None, report: dict[str, Any]) -> None:
    """The report as indented JSON at `path` (atomically), with the machine under "cpu" unless the report already
    names it, and, when run as `python -m MODULE`, the module under "bench" and the command line under "command"
    (what a chapter text's results include needs: `minillm.course.results`); nothing when path is None."""
    if path:
        provenance = {"cpu": report.get("cpu") or cpu_description(), "date": time.strftime("%Y-%m-%d", time.gmtime())}
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name.startswith("minillm.") and not spec.name.endswith("__main__"):
            provenance["bench"] = spec.name
            provenance["command"] = shlex.join(["python", "-m", spec.name, *sys.argv[1:]])
        atomic_write_text(path, json.dumps({**report, **{k: v for k, v in provenance.items() if k not in report
                                                          or k == "cpu"}}, indent=2, default=str) + "\n")


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
