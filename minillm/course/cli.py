"""The `minillm` command line (`minillm ...` or `python -m minillm ...`).

The tour command lives here. The others come from their own modules: each module in `COMMAND_MODULES` exposes
`add_commands(subparsers)`, which calls `subparsers.add_parser(name, help=...)` for each
command and sets `handler=` on it via `set_defaults`; the handler takes the parsed args and returns an exit code.
"""

from __future__ import annotations

import argparse
import sys

import torch

from minillm.bench.cli import bench_seed_argument, cpu_description, threads_argument
from minillm.core.device import DEVICE_CHOICES, resolve_device
from minillm.core.io import atomic_write_text, check_output_file
from minillm.core.corpus import load_corpus
from minillm.course import assignment, gpu_report
from minillm.core.rows import summary_line
from minillm.course.tour import TourContext, format_table, rows_to_json, run_tour
from minillm.gpt import train
from minillm.kvcache.generate import generate as kv_cache_generate
from minillm.naive import bench
from minillm.serve import cli as serve_cli
from minillm.serve import loadgen
from minillm.tokenizer import commands as tokenizer_commands

# Modules that add subcommands (each exposes `add_commands(subparsers)`).
COMMAND_MODULES = [assignment, train, gpu_report, tokenizer_commands, bench, serve_cli, loadgen]

# `minillm bench --generators naive,kv-cache,...`: chapter 03's harness times any generator registered here. Each
# later chapter's generator joins it in this one place (the harness sits below the chapters that add them).
bench.register_generator("kv-cache", kv_cache_generate, overwrite=True)


def _cmd_tour(args: argparse.Namespace) -> int:
    if args.json == "":  # check_output_file passes "" as "no file"; here it would run the tour and write nothing
        raise ValueError("--json must name a .json file, got an empty string")
    check_output_file(args.json, "--json", (".json",))
    if args.corpus is not None:  # read once now: a missing or non-UTF-8 file is a usage error, not a FAIL row later
        try:
            load_corpus(args.corpus)
        except ValueError as e:
            raise ValueError(f"--corpus: {e}") from None
    ctx = TourContext(device=resolve_device(args.device), quick=args.quick, corpus_path=args.corpus, seed=args.seed,
                      threads=args.threads)
    rows, seconds = run_tour(ctx, args.chapter, progress=not args.no_progress)
    print(format_table(rows))
    total = sum(seconds.values())
    print(f"\n{summary_line(rows)} on {ctx.device} in {total:.0f} s "
          + "(" + ", ".join(f"ch{c} {s:.0f}s" for c, s in seconds.items()) + ")")
    # The machine, so a figure copied from this run can say where it was measured (CPU timings, int8 above all,
    # change from one CPU to the next).
    gpu = f"; GPU: {torch.cuda.get_device_name(ctx.device)}" if ctx.device.type == "cuda" else ""
    print(f"CPU: {cpu_description()}, {ctx.threads} torch thread(s){gpu}")
    if args.json:
        atomic_write_text(args.json, rows_to_json(rows) + "\n")
        print(f"rows written to {args.json}")
    return 1 if any(r.failed for r in rows) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minillm",
        description="LLM inference optimization, built from scratch and checked against naive baselines.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    tour = sub.add_parser("tour", help="run every chapter's check against its baseline and its benchmark")
    tour.add_argument("--chapter", action="append", metavar="NN", help="only this chapter (repeatable)")
    tour.add_argument("--device", default="auto", choices=DEVICE_CHOICES, help="where to run (default: auto)")
    tour.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    tour.add_argument("--quick", action="store_true", help="smaller workloads, for a fast smoke run")
    tour.add_argument("--corpus", metavar="PATH", help="a UTF-8 text file to use instead of the default corpus")
    tour.add_argument("--seed", type=bench_seed_argument, default=0,
                      help="seed for every random choice, >= 0 (default 0)")
    tour.add_argument("--threads", type=threads_argument, default=1,
                      help="torch CPU threads for the whole tour (default 1: small models, fair on a shared machine)")
    tour.add_argument("--no-progress", action="store_true", help="no progress bar")
    tour.set_defaults(handler=_cmd_tour)
    for module in COMMAND_MODULES:
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:  # user errors: one clear line, no traceback
        print(f"minillm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
