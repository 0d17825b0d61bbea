"""`minillm gpu-report`: verify every chapter on a CUDA GPU in one command and write a dated report.

It runs the tour with `--device cuda` (every chapter's check against its baseline, and its benchmark) and the
test suite (whose device-parametrized tests add CUDA variants when a GPU is present), then writes Markdown and
JSON into `chapters/gpu-reports/`, named by date and GPU, recording the GPU, driver, torch/CUDA versions and the
git commit. Without a GPU it refuses with a clear error rather than writing a CPU report under a GPU name.
"""

from __future__ import annotations

import argparse
import importlib.util
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from minillm import chapters
from minillm.core.io import atomic_write_text
from minillm.course.tour import TourContext, format_table, run_tour

REPO_ROOT = Path(__file__).resolve().parents[2]
REPORT_DIR = REPO_ROOT / "chapters" / "gpu-reports"


def _git_commit() -> str:
    """HEAD (with -dirty), or MINILLM_COMMIT when the tree was copied to the GPU machine without its .git."""
    if os.environ.get("MINILLM_COMMIT"):
        return os.environ["MINILLM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _pytest_command(workers: int, test_timeout: int) -> list[str]:
    """The suite without notebooks (no Jupyter on a GPU box), in `workers` processes when pytest-xdist is there."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not notebook",
           f"--timeout={test_timeout}", "-rfE"]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    return cmd


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "compute_capability": f"{props.major}.{props.minor}",
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": _git_commit(),
    }


def chapter_table(rows: list) -> list[str]:
    """Markdown lines: every chapter of the manifest with its tour checks, so a report says what still awaits a GPU."""
    lines = ["| chapter | tour checks passed | status |", "| --- | --- | --- |"]
    for c in chapters.CHAPTERS:
        mine = [r for r in rows if r.chapter == c.number]
        ok = sum(r.status == "PASS" for r in mine)
        status = ("not built yet" if not c.built else "not run" if not mine
                  else "FAILED" if any(r.failed for r in mine) else "verified" if ok == len(mine)
                  else f"verified, {len(mine) - ok} skipped")
        lines.append(f"| {c.name} | {ok}/{len(mine)} | {status} |")
    return lines


def run_report(quick: bool = False, run_tests: bool = True, out_dir: Path = REPORT_DIR, workers: int = 1,
               test_timeout: int = 300) -> tuple[Path, bool]:
    """Run tour + tests on the GPU; write `<date>-<gpu>.md/.json` into out_dir. Returns (markdown path, all passed)."""
    if not torch.cuda.is_available():
        raise ValueError("gpu-report needs a CUDA GPU, but torch.cuda.is_available() is False")

    env = environment()
    t0 = time.perf_counter()
    rows, seconds = run_tour(TourContext(device=torch.device("cuda"), quick=quick), progress=False)
    tour_s = time.perf_counter() - t0
    tests = {"ran": False}
    if run_tests:
        t0 = time.perf_counter()
        proc = subprocess.run(_pytest_command(workers, test_timeout), cwd=REPO_ROOT, capture_output=True, text=True)
        lines = proc.stdout.splitlines()
        summary = next((line for line in reversed(lines) if re.search(r"passed|failed", line)), "")
        tests = {"ran": True, "exit_code": proc.returncode, "summary": summary.strip("= "),
                 "seconds": round(time.perf_counter() - t0, 1),
                 "failures": [line for line in lines if line.startswith(("FAILED ", "ERROR "))],
                 "tail": proc.stdout[-20000:] + proc.stderr[-4000:]}
    passed = not any(r.failed for r in rows) and (not run_tests or tests["exit_code"] == 0)
    slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
    stem = f"{env['date'][:10]}-{slug}"
    data = {"environment": env, "passed": passed, "tour_seconds": round(tour_s, 1), "chapter_seconds": seconds,
            "rows": [r.to_dict() for r in rows], "tests": tests}
    md = [f"# GPU verification: {env['gpu']}, {env['date'][:10]}", "",
          "| field | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in env.items()] + [
          "", f"Overall: **{'PASSED' if passed else 'FAILED'}**. Command: `minillm gpu-report`.", "",
          "## Chapters", "", *chapter_table(rows),
          "", f"## Tour on cuda ({tour_s:.0f} s)", "", "```", format_table(rows), "```", ""]
    if run_tests:
        md += ["## Test suite on a machine with CUDA (notebooks excluded)", "",
               f"exit code {tests['exit_code']}: {tests['summary']} ({tests['seconds']} s)", ""]
        if tests["failures"]:
            md += ["Failures:", "", "```", *tests["failures"], "```", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / f"{stem}.json", json.dumps(data, indent=2, default=str) + "\n")
    md_path = atomic_write_text(out_dir / f"{stem}.md", "\n".join(md) + "\n")
    return md_path, passed


def _cmd(args: argparse.Namespace) -> int:
    path, passed = run_report(quick=args.quick, run_tests=not args.no_tests, workers=args.workers,
                              test_timeout=args.test_timeout)
    print(f"report written to {path} ({'passed' if passed else 'FAILED'})")
    return 0 if passed else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu-report", help="verify every chapter on a CUDA GPU and write a dated report")
    p.add_argument("--quick", action="store_true", help="the tour's quick workloads")
    p.add_argument("--no-tests", action="store_true", help="only the tour, not the test suite")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="pytest-xdist processes for the test suite (default: min(8, CPUs))")
    p.add_argument("--test-timeout", type=int, default=300, help="seconds before one test counts as stuck")
    p.set_defaults(handler=_cmd)
