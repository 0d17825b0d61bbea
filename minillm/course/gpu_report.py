"""`minillm gpu-report`: verify every chapter on a CUDA GPU in one command and write a dated report.

It runs the tour with `--device cuda` (every chapter's check against its baseline, and its benchmark), the chapter
benchmarks that only mean something on a GPU (`GPU_BENCHMARKS`: chapter 12's kernel versions against the device's
copy bandwidth, chapter 13's decode modes with the CUDA graph and its batched steps, chapter 14's tensor-parallel
decode on NCCL launched by torchrun, chapter 15's server on CUDA under a short load), and the test suite (whose
device-parametrized tests add CUDA variants when a GPU is present), then writes Markdown and JSON into `chapters/gpu-reports/`, named by date
and GPU, recording the GPU, driver, torch/CUDA versions, the git commit, and the wall time against the 8-minute
budget a GPU session allows. Without a GPU it refuses with a clear error rather than writing a CPU report under a
GPU name.
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
import tempfile
import time
from pathlib import Path

import torch

from minillm import chapters
from minillm.core.io import atomic_write_text
from minillm.course.tour import TourContext, format_table, run_tour

REPO_ROOT = Path(__file__).resolve().parents[2]
REPORT_DIR = REPO_ROOT / "chapters" / "gpu-reports"
BUDGET_S = 8 * 60  # what the whole report should take on one H200 (a borrowed GPU's session is short)

# (title, module run with `python -m`, its arguments; "{json}" becomes a file the report reads back)
GPU_BENCHMARKS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("chapter 12: every kernel version against its naive twin and the copy bandwidth", "minillm.kernels.bench",
     ("--json", "{json}")),
    ("chapter 13: decode modes on cuda, the CUDA graph among them", "minillm.compile.bench",
     ("--device", "cuda", "--quick", "--json", "{json}")),
    ("chapter 13: compiled and captured steps at batch 1 and 8 and a prefill, on cuda", "minillm.compile.sweep",
     ("--device", "cuda", "--quick", "--threads-list", "1", "--json", "{json}")),
    # torchrun itself (`python -m torch.distributed.run`), one rank per GPU on NCCL: world size 1 on one GPU
    ("chapter 14: tensor-parallel greedy decode on NCCL, one rank per GPU, against one process",
     "torch.distributed.run", ("--standalone", "--nproc-per-node", "gpu", "-m", "minillm.parallel.generate",
                               "--device", "cuda", "--check", "--max-new-tokens", "16")),
    ("chapter 15: minillm serve on cuda in a child process, under a short bench-serve load against the offline engine",
     "minillm", ("bench-serve", "--serve", "--device", "cuda", "--num-prompts", "32", "--output-len", "32",
                 "--max-concurrency", "16", "--compare-offline", "--json", "{json}")),
)


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


def run_benchmark(title: str, module: str, args: tuple[str, ...], timeout: int, workdir: Path) -> dict:
    """`python -m module args` with a wall-clock limit: its exit code, seconds, output tail and JSON report (if any).

    A benchmark that fails or runs out of time is recorded as such, never raised: the report still gets written."""
    out_json = workdir / (module.replace(".", "_") + ".json")
    cmd = [sys.executable, "-m", module, *[a.replace("{json}", str(out_json)) for a in args]]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        code, output, timed_out = proc.returncode, proc.stdout + proc.stderr[-4000:], False
    except subprocess.TimeoutExpired as e:  # what it printed before the limit, bytes or str by Python version
        code, timed_out = None, True
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    result = {"title": title, "command": " ".join(["python", "-m", module, *args]), "exit_code": code,
              "timed_out": timed_out, "seconds": round(time.perf_counter() - t0, 1), "output": output[-12000:]}
    if out_json.is_file():
        result["report"] = json.loads(out_json.read_text())
    return result


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
               test_timeout: int = 300, benchmarks: bool = True, bench_timeout: int = 180) -> tuple[Path, bool]:
    """Run tour, GPU benchmarks and tests on the GPU; write `<date>-<gpu>.md/.json` into out_dir.

    Returns (markdown path, all passed)."""
    if not torch.cuda.is_available():
        raise ValueError("gpu-report needs a CUDA GPU, but torch.cuda.is_available() is False")

    env = environment()
    start = t0 = time.perf_counter()
    rows, seconds = run_tour(TourContext(device=torch.device("cuda"), quick=quick), progress=False)
    tour_s = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    benches = []
    if benchmarks:
        with tempfile.TemporaryDirectory() as tmp:
            benches = [run_benchmark(title, module, args, bench_timeout, Path(tmp))
                       for title, module, args in GPU_BENCHMARKS]
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
    passed = (not any(r.failed for r in rows) and (not run_tests or tests["exit_code"] == 0)
              and all(b["exit_code"] == 0 for b in benches))
    total_s = time.perf_counter() - start
    slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
    stem = f"{env['date'][:10]}-{slug}"
    data = {"environment": env, "passed": passed, "total_seconds": round(total_s, 1), "budget_seconds": BUDGET_S,
            "tour_seconds": round(tour_s, 1), "chapter_seconds": seconds, "rows": [r.to_dict() for r in rows],
            "benchmarks": benches, "tests": tests}
    md = [f"# GPU verification: {env['gpu']}, {env['date'][:10]}", "",
          "| field | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in env.items()] + [
          "", f"Overall: **{'PASSED' if passed else 'FAILED'}**. Command: `minillm gpu-report`. Wall time "
          f"{total_s:.0f} s, {'within' if total_s <= BUDGET_S else 'over'} the {BUDGET_S // 60}-minute budget.", "",
          "## Chapters", "", *chapter_table(rows),
          "", f"## Tour on cuda ({tour_s:.0f} s)", "", "```", format_table(rows), "```", ""]
    for b in benches:
        state = "timed out" if b["timed_out"] else f"exit code {b['exit_code']}"
        md += [f"## Benchmark: {b['title']}", "", f"`{b['command']}`: {state}, {b['seconds']} s", "", "```",
               b["output"].rstrip(), "```", ""]
    if run_tests:
        md += ["## Test suite on a machine with CUDA (notebooks excluded)", "",
               f"exit code {tests['exit_code']}: {tests['summary']} ({tests['seconds']} s)", ""]
        if tests["failures"]:
            md += ["Failures:", "", "```", *tests["failures"], "```", ""]
    atomic_write_text(out_dir / f"{stem}.json", json.dumps(data, indent=2, default=str) + "\n")
    md_path = atomic_write_text(out_dir / f"{stem}.md", "\n".join(md) + "\n")
    return md_path, passed


def _cmd(args: argparse.Namespace) -> int:
    path, passed = run_report(quick=args.quick, run_tests=not args.no_tests, workers=args.workers,
                              test_timeout=args.test_timeout, benchmarks=not args.no_benchmarks,
                              bench_timeout=args.bench_timeout)
    print(f"report written to {path} ({'passed' if passed else 'FAILED'})")
    return 0 if passed else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu-report", help="verify every chapter on a CUDA GPU and write a dated report")
    p.add_argument("--quick", action="store_true", help="the tour's quick workloads")
    p.add_argument("--no-tests", action="store_true", help="not the test suite")
    p.add_argument("--no-benchmarks", action="store_true", help="not the GPU benchmarks (chapters 12 and 13)")
    p.add_argument("--bench-timeout", type=int, default=180, help="seconds each GPU benchmark may take")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="pytest-xdist processes for the test suite (default: min(8, CPUs))")
    p.add_argument("--test-timeout", type=int, default=300, help="seconds before one test counts as stuck")
    p.set_defaults(handler=_cmd)
