"""Grading a chapter: the reference decides what is graded and what it is worth; a child process runs the student.

What it adds over running pytest on the student's folder:
  * the denominator comes from the reference. `graded_tests()` collects the tests marked `@pytest.mark.graded` in
    the *reference* test files (in a child that imports the reference package), with each test's points
    (`graded(points=N)`, default 1) and the exercises it grades. A graded test function is worth its points when
    every one of its parametrized items passed; a missing, errored, skipped or duplicated report is a failure and
    never changes the total.
  * the student's code runs in a child (`grader_child.py`) that reports each finished test over a pipe the parent
    opened. The parent scores from those messages and writes junit.xml and results.json itself, after the child's
    whole process group is killed, so nothing the child leaves behind (an atexit hook, a process, a rewritten file)
    changes the report.
  * the verdict is not the child's to decide: before the tests, the child runs the chapter's probes
    (`minillm.course.probes`) on a seed the parent drew for this grading and sends their outputs as plain data
    (JSON; no pickle). The parent computed the reference's outputs on the same seed before the child started and
    compares them: a graded test is worth its points only when pytest reported it passed *and* the probe of every
    exercise it grades agreed. Forged reports, a forged end, pytest rewired from the student's code: none of it
    earns a point for an exercise whose outputs are wrong on the probe's inputs (what a probe does not cover is
    listed in `minillm.course.probes`). The seed goes into the report's notes.
  * the child sees only what the grader chose: a temp directory with a fresh copy of the reference tests (hashed
    before and after; a changed copy voids the grade), a copy of the student's `minillm/` package and nothing
    else of the student's folder (no conftest.py, pytest.ini, shadowing modules or plugin entry points), the
    reference's shared assets, `python -I`, PYTEST_DISABLE_PLUGIN_AUTOLOAD=1, `-p no:cacheprovider`, and
    HYPOTHESIS_PROFILE=ci (derandomized property tests, as in CI).
  * outputs are written atomically (temp file + rename) and never through a symlink.

  * isolated (the default where Linux allows it; `isolate=True` insists, `False` turns it off): the child runs in
    `sandbox.py`'s namespaces. The reference repository and the student's original folder are empty read-only
    folders to it, the home directory a scratch tmpfs; it keeps only the Python environment, the shipped
    checkpoints, its own script and its work folder. It has no network (a loopback of its own), runs as `nobody`
    when the grader is root, and every process it starts, `setsid` daemons included, dies with its PID namespace
    before the grade is written. The grade goes beside the student's folder (`hw04-grade/`), not inside it.

What holds without isolation: everything in the list above but the last item. The student's code then runs with
the grader's user rights: it can read any file the grader can (the reference solutions included), use the network,
and leave the process group with `setsid` and outlive grading: it could read the reference's solutions and
return their data to the probes. So grade untrusted submissions isolated (or inside a container). What holds
either way: pytest's own reports can be forged inside the child, but they never decide a point alone (the probes
above).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

import torch

from minillm import chapters
from minillm.core.io import atomic_write_text, check_output_dir
from minillm.course import probes as probing
from minillm.kernels import emulator

C_SUFFIXES = frozenset({".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"})


def is_c_source(path: str) -> bool:
    """Whether `path` (a file, or `file::name` as the chapter texts write it) is C, C++ or CUDA source."""
    return Path(str(path).split("::")[0]).suffix in C_SUFFIXES


PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = PACKAGE_DIR.parent
TESTS_DIR = REPO_ROOT / "tests"
ASSETS_DIR = PACKAGE_DIR / "assets"
CHILD = Path(__file__).resolve().parent / "grader_child.py"
SANDBOX = Path(__file__).resolve().parent / "sandbox.py"
MAX_PIPE_BYTES = 32 << 20  # what the parent reads from a child's pipe at most (the probes' data is well under 1 MB)
NOBODY = 65534  # the user a root grader runs the student's code as (`nobody` on Debian and most distributions)

# The pytest configuration of the grading child (and, with `pythonpath = .`, of a student folder).
PYTEST_INI = """[pytest]
markers =
    graded(points, exercise): a test that grades a chapter exercise, worth `points` (run by `minillm grade`)
    notebook: executes a notebook end to end
    slow: takes more than a few seconds
"""


@dataclass(frozen=True)
class GradedTest:
    """One graded test function of the reference: its pytest items (one per parametrization) and its worth."""

    chapter: str
    function: str  # "test_merge_worked_example"
    items: tuple[str, ...]  # node ids relative to the tests folder: "test_01_tokenization.py::test_x[2]"
    points: int
    exercises: tuple[str, ...]  # the exercise functions it grades: ("merge",)


@dataclass
class TestResult:
    name: str  # the graded test function
    passed: bool
    points: int = 1
    output: str = ""

    @property
    def score(self) -> int:
        return self.points if self.passed else 0


@dataclass
class GradeReport:
    chapter: str
    tests: list[TestResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the grader noticed: collection errors, tampering
    probes: dict[str, str | None] = field(default_factory=dict)  # exercise -> None (agreed) or what differed

    @property
    def score(self) -> int:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> int:
        return sum(t.points for t in self.tests)

    def gradescope(self) -> dict:
        """Gradescope's autograder `results.json` layout: a total and one entry per graded test function."""
        notes = "".join(f"\n{n}" for n in self.notes)
        return {
            "score": float(self.score),
            "max_score": float(self.max_score),
            "output": f"chapter {self.chapter}: {self.score}/{self.max_score} points{notes}",
            "tests": [
                {
                    "name": t.name,
                    "score": float(t.score),
                    "max_score": float(t.points),
                    "status": "passed" if t.passed else "failed",
                    "output": t.output[-4000:],
                }
                for t in self.tests
            ],
        }

    def junit_xml(self) -> str:
        suite = ET.Element("testsuite", name=f"minillm-chapter-{self.chapter}", tests=str(len(self.tests)),
                           failures=str(sum(not t.passed for t in self.tests)))
        for t in self.tests:
            case = ET.SubElement(suite, "testcase", classname=f"chapter{self.chapter}", name=t.name,
                                 points=str(t.points))
            if not t.passed:
                ET.SubElement(case, "failure", message=f"0/{t.points} points").text = t.output
        return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode") + "\n"


# --------------------------------------------------------------------------------------------- the child process
def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # One OpenMP thread: the graded tests use small tensors, and gradings often share a machine (an autograder's
    # queue, CI's parallel workers), where threads waiting on each other make small ops many times slower.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST", "HYPOTHESIS"))}
    env.update(HYPOTHESIS_PROFILE="ci", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONDONTWRITEBYTECODE="1",
               OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def _lend_build_cache(nn: str, work: Path) -> dict[str, str]:
    """The child's own kernel build cache folder (`work/cache`) and its environment pointing there: whatever the
    student's code writes there (a planted library, say) is gone with the work folder and never reaches the grader's
    builds. For a chapter with a C/CUDA exercise (chapter 12's graded kernel runs through the emulator, whose library
    is compiled from every .cu file, about 20 s on two cores) the folder starts with a copy of the grader's compiled
    objects of the reference (built first, once per machine: it is cached), so the child compiles only the student's
    file and links. A copy, not a link and not the grader's own cache. Never lent: the objects of a file that holds
    an exercise (chapter 12's softmax.cu), which are the reference's solution compiled; the child builds the
    student's own."""
    cache = work / "cache"
    objects = cache / "emulator" / "objects"
    objects.mkdir(parents=True)
    if any(is_c_source(f) for f in chapters.get(nn).exercises) and emulator.find_cxx():
        emulator.build()
        mine = emulator.object_cache()
        exercise_units = {Path(f).stem for f in chapters.get(nn).exercises if is_c_source(f)}
        for obj in sorted(mine.glob("*.o")) if mine.is_dir() else []:
            if obj.name.rsplit("-", 1)[0] not in exercise_units:
                shutil.copyfile(obj, objects / obj.name)
    return {"MINILLM_KERNELS_CACHE": str(cache)}


def _plugin_args() -> list[str]:
    # Entry-point plugins are off (a student folder on the path could register one); hypothesis's is wanted.
    return ["-p", "_hypothesis_pytestplugin"] if find_spec("_hypothesis_pytestplugin") else []


def _run_child(mode: str, path: Path, cwd: Path, pytest_args: list[str], timeout: float,
               jail: dict | None = None, env: dict[str, str] | None = None,
               probes: dict | None = None) -> tuple[list[dict], str, bool]:
    """Run grader_child.py (inside `sandbox.py`'s namespaces when `jail` is a spec; the probes first when `probes`
    is {"dir", "chapter", "seed"}); return (messages up to "end", the child's stdout+stderr tail, timed out)."""
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as log:
        spec = json.dumps(probes) if probes is not None else "-"
        command = [sys.executable, "-I", "-B", str(CHILD), mode, str(write_fd), str(path), spec, "--", *pytest_args]
        if jail is not None:
            spec = json.dumps({**jail, "pass_fds": [write_fd]})
            command = [*_unshare_command(), sys.executable, "-I", "-B", str(SANDBOX), spec, "--", *command]
        proc = subprocess.Popen(
            command,
            cwd=cwd, env=_child_env(env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            pass_fds=(write_fd,), start_new_session=True,
        )
        os.close(write_fd)
        buf, timed_out, scanned, flooded = b"", False, 0, False
        deadline = time.monotonic() + timeout
        try:
            while True:
                if time.monotonic() > deadline:  # checked first: a child that writes without pause still stops
                    timed_out = True
                    break
                ready, _, _ = select.select([read_fd], [], [], 0.2)
                if ready:
                    chunk = os.read(read_fd, 1 << 16)
                    if len(buf) + len(chunk) > MAX_PIPE_BYTES:  # a flood: what came so far is all that counts
                        flooded = True
                        break
                    if not chunk:
                        # End of file without an "end": the child died or closed the pipe early. Wait for it to
                        # exit (no longer polling the closed pipe) so its last output reaches the log.
                        try:
                            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                        except subprocess.TimeoutExpired:
                            timed_out = True
                        break
                    buf += chunk
                    complete = buf.rfind(b"\n") + 1  # only the lines not looked at yet, each once
                    if b'"end"' in buf[scanned:complete] and any(_is_end(_message(line))
                                                                 for line in buf[scanned:complete].splitlines()):
                        # After "end" nothing counts, so the interpreter's shutdown (torch's teardown takes a
                        # second) is not waited for: `finally` kills the group.
                        break
                    scanned = complete
                    continue
                if proc.poll() is not None:
                    break
        finally:
            # The child and everything it started go, before the parent reads the rest or writes any report.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            drain_until = time.monotonic() + 1.0  # a daemon holding the pipe open cannot keep the parent here
            while (not flooded and len(buf) <= MAX_PIPE_BYTES and time.monotonic() < drain_until
                   and select.select([read_fd], [], [], 0.05)[0]):
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
            os.close(read_fd)
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - 8000))
        tail = log.read().decode(errors="replace")
    messages = []
    for line in buf.splitlines():
        msg = _message(line)
        if msg is None:
            continue
        messages.append(msg)
        if _is_end(msg):
            break  # anything after the end (an atexit hook writing to the pipe) is ignored
    return messages, tail, timed_out


def _message(line: bytes) -> dict | None:
    """One line of the child's pipe as its JSON object, or None when it is not one (noise is skipped)."""
    try:
        msg = json.loads(line.decode(errors="replace"))
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return None
    return msg if isinstance(msg, dict) else None


def _is_end(msg: dict | None) -> bool:
    """Is this message the child's final {"event": "end"}?"""
    return msg is not None and msg.get("event") == "end"


# --------------------------------------------------------------------------------------------- isolation
def _unshare_command() -> list[str]:
    """util-linux's unshare: new mount, network and PID namespaces (the tree dies with its first process); a user
    namespace too when the grader is not root."""
    cmd = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    return cmd if os.geteuid() == 0 else [*cmd, "--user", "--map-root-user"]


@functools.lru_cache(maxsize=None)
def isolation_problem() -> str | None:
    """None when `--isolate` can run here, else why not (not Linux, no `unshare`, namespaces not permitted)."""
    if sys.platform != "linux":
        return f"isolation needs Linux namespaces; this is {sys.platform}"
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"isolation needs util-linux's `{tool}` on the PATH"
    # The probe does what a grading does: a tmpfs over a folder, the loopback up, and (as root) becoming nobody.
    with tempfile.TemporaryDirectory(prefix="minillm-probe-") as covered:
        spec = json.dumps({"scratch": [covered], "drop_to": NOBODY if os.geteuid() == 0 else None})
        try:
            probe = subprocess.run([*_unshare_command(), sys.executable, "-I", "-B", str(SANDBOX), spec, "--", "true"],
                                   capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"`unshare` could not run: {e}"
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return f"this machine does not permit the namespaces isolation needs: {why}"
    return None


def jail_spec(student: Path, work: Path) -> dict:
    """What the grading child may not see: the reference repository (its solutions and tests), the student's
    original folder, the home directory (a scratch tmpfs instead); what it keeps: the Python environment, the
    shipped checkpoints, the child's own script (grader_child.py), the probes, the kernel emulator they run chapter
    12's kernel with, and its work folder. As root it runs
    as `nobody`."""
    home = Path(os.path.expanduser("~"))
    hide = sorted({str(REPO_ROOT), str(student.resolve())})
    scratch = [str(home)] if home.is_dir() and home != Path("/") else []
    keep = sorted({sys.prefix, sys.base_prefix, str(ASSETS_DIR), str(CHILD), str(probing.PROBES_DIR),
                   str(probing.GRADER_FILES_DIR / "kernels" / "emulator.py")})
    return {"hide": hide, "scratch": scratch, "keep": keep, "keep_rw": [str(work)],
            "drop_to": NOBODY if os.geteuid() == 0 else None}


def _open_to(work: Path, uid: int) -> None:
    """Let `uid` read the work folder and write its run folder and build cache (the child runs as that user)."""
    work.chmod(0o755)
    for p in work.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            p.chmod(p.stat().st_mode | 0o755)
    os.chown(work / "run", uid, -1)
    for p in [work / "cache", *(work / "cache").rglob("*")] if (work / "cache").is_dir() else []:
        os.chown(p, uid, -1, follow_symlinks=False)


@functools.lru_cache(maxsize=None)
def _collect_all() -> dict[str, tuple[GradedTest, ...]]:
    files = [chapters.get(nn).test_file for nn in CHAPTERS_WITH_EXERCISES]
    messages, tail, _ = _run_child("collect", REPO_ROOT, REPO_ROOT,
                                   [*files, "--collect-only", "-q", "-m", "graded", "-p", "no:cacheprovider",
                                    *_plugin_args()], timeout=600)
    errors = [m for m in messages if m.get("event") == "collect_error"]
    if errors:
        raise RuntimeError(f"the reference tests do not collect: {errors[0]}")
    by_file: dict[str, dict[str, list[dict]]] = {}
    for m in messages:
        if m.get("event") == "item":
            by_file.setdefault(m["file"], {}).setdefault(m["function"], []).append(m)
    out = {}
    for nn in CHAPTERS_WITH_EXERCISES:
        name = Path(chapters.get(nn).test_file).name
        tests = []
        for function, items in by_file.get(name, {}).items():
            points = items[0]["points"]
            if not isinstance(points, int) or isinstance(points, bool) or points < 1:
                raise RuntimeError(f"{name}::{function}: graded(points=...) must be a positive int, got {points!r}")
            if not items[0]["exercises"]:  # its verdict would rest on pytest's word alone: no probe gates it
                raise RuntimeError(f"{name}::{function}: graded(...) must name the exercise(s) it grades")
            ids = tuple(i["id"].split("/")[-1] for i in items)  # relative to the tests folder
            tests.append(GradedTest(nn, function, ids, points, tuple(items[0]["exercises"])))
        if not tests:
            raise RuntimeError(f"chapter {nn} has no tests marked graded in {name}: {tail[-2000:]}")
        out[nn] = tuple(tests)
    return out


CHAPTERS_WITH_EXERCISES = tuple(c.number for c in chapters.built() if c.exercises)


def exercise_chapter(chapter: str | int) -> str:
    """"1" -> "01" for a chapter with exercises; any other chapter is a ValueError listing those that have them."""
    nn = chapters.normalize(chapter)
    if nn not in CHAPTERS_WITH_EXERCISES:
        raise ValueError(f"chapter {nn} has no exercises; chapters with exercises: {list(CHAPTERS_WITH_EXERCISES)}")
    return nn


def chapter_test_file(chapter: str, tests_dir: Path | None = None) -> Path:
    """The chapter's test file, as the manifest names it (`tests/test_NN_slug.py`)."""
    tests_dir = tests_dir or TESTS_DIR
    path = tests_dir / Path(chapters.get(chapter).test_file).name
    if not path.is_file():
        raise ValueError(f"chapter {chapter}'s test file {path.name} is not in {tests_dir}")
    return path


def graded_tests(chapter: str) -> tuple[GradedTest, ...]:
    """The reference's graded test functions of a chapter, with points: the denominator of its grade."""
    return _collect_all()[chapter]


# --------------------------------------------------------------------------------------------- files, safely
def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if {"__pycache__", ".hypothesis"} & set(p.relative_to(root).parts):
            continue  # pytest's and hypothesis's own caches
        h.update(str(p.relative_to(root)).encode())
        if p.is_symlink():
            h.update(b"->" + os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


# The file `minillm assignment` writes into a student folder: {"chapter": "09", "graded": [...], "max_score": ...}
ASSIGNMENT_MARKER = ".minillm-assignment"


def check_assignment_chapter(student: Path, nn: str) -> None:
    """A ValueError when student's folder is another chapter's assignment (its marker names that chapter): graded as
    chapter nn it would score 0 on tests of code it never had to write. A folder without a readable marker (the
    student's own copy of the repository) is graded as asked."""
    try:
        marker = json.loads((student / ASSIGNMENT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none, unreadable or not JSON: nothing says which chapter it is
        return
    written = marker.get("chapter") if isinstance(marker, dict) else None
    if isinstance(written, str) and written != nn:
        raise ValueError(f"{str(student)!r} is chapter {written}'s assignment (its {ASSIGNMENT_MARKER} says so), not "
                         f"chapter {nn}'s: run `minillm grade {written} --student ...`")


def _prepare_out_dir(out: Path) -> Path:
    if out.is_symlink():
        raise ValueError(f"refusing to write the grade into {str(out)!r}: it is a symlink (the grader never "
                         f"writes through one); remove it or pass another --out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    check_output_dir(out, "--out")  # a path under a file: named, not mkdir's NotADirectoryError
    out.mkdir(parents=True, exist_ok=True)
    return out


def _copy_student_package(student: Path, dest: Path) -> None:
    """Copy student/minillm (files only, symlinks followed, no assets) and link the reference's shared assets."""
    try:
        shutil.copytree(student / "minillm", dest / "minillm",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "assets"))
    except (shutil.Error, OSError) as e:
        raise ValueError(f"could not copy the student's package from {student / 'minillm'}: {e}") from e
    (dest / "minillm" / "assets").symlink_to(ASSETS_DIR, target_is_directory=True)


def support_files() -> list[Path]:
    """The test suite's shared modules every chapter test may import: conftest.py and helpers (not test_*.py)."""
    return sorted(p for p in TESTS_DIR.glob("*.py") if not p.name.startswith("test_"))


def copy_tests(nn: str, tests: Path) -> None:
    """Copy chapter nn's test file, the shared support files and tests/data into a new folder `tests`."""
    tests.mkdir()
    for src in (*support_files(), chapter_test_file(nn)):
        shutil.copy2(src, tests / src.name)
    if (TESTS_DIR / "data").is_dir():
        shutil.copytree(TESTS_DIR / "data", tests / "data")


def _copy_reference_tests(nn: str, dest: Path) -> None:
    tests = dest / "tests"
    copy_tests(nn, tests)
    (dest / "pytest.ini").write_text(PYTEST_INI, encoding="utf-8")
    for p in [dest / "pytest.ini", *tests.rglob("*")]:
        if p.is_file():
            p.chmod(0o444)


# --------------------------------------------------------------------------------------------- grading
def run_graded(nn: str, student: Path, timeout: float = 900.0, isolate: bool = False) -> GradeReport:
    """Grade student/minillm on chapter nn's reference tests; the report only (no files written). `isolate` runs
    the child in `sandbox.py`'s namespaces (see `isolation_problem`)."""
    expected = graded_tests(nn)
    report = GradeReport(nn)
    if isolate and isolation_problem() is not None:
        raise ValueError(f"cannot isolate the grading child: {isolation_problem()}")
    # The reference's probe data, on a seed drawn now, before any of the student's code runs.
    seed = secrets.randbelow(2**31)
    probes = probing.chapter_module(nn).PROBES
    want = reference_probe_data(nn, probes, seed)
    with tempfile.TemporaryDirectory(prefix=f"minillm-grade-{nn}-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        _copy_student_package(student, work / "student")
        (work / "run").mkdir()
        _copy_reference_tests(nn, work / "run")
        before = _tree_hash(work / "run")
        build_env = _lend_build_cache(nn, work)
        reference = [*support_files(), chapter_test_file(nn)]
        # what the student's code must not change
        watched = [*reference, *sorted(probing.PROBES_DIR.glob("*.py")),
                   probing.GRADER_FILES_DIR / "kernels" / "emulator.py"]
        repo_before = _files_hash(watched)
        test_path = f"tests/{reference[-1].name}"
        jail = jail_spec(student, work) if isolate else None
        if jail is not None and jail["drop_to"] is not None:
            _open_to(work, jail["drop_to"])
        messages, tail, timed_out = _run_child(
            "run", work / "student", work / "run",
            [test_path, "-m", "graded", "-q", "--tb=short", "-p", "no:cacheprovider", *_plugin_args(),
             "-c", str(work / "run" / "pytest.ini"), "--rootdir", str(work / "run"),
             "--confcutdir", str(work / "run"), "-o", "addopts="],
            timeout=timeout, jail=jail, env=build_env,
            probes={"dir": str(probing.PROBES_DIR), "chapter": nn, "seed": seed},
        )
        tampered = _tree_hash(work / "run") != before
        if _files_hash(watched) != repo_before:
            report.notes.append(f"warning: the reference's {test_path}, its helpers or the probes changed while the "
                                f"student's code ran; check with `git diff tests/ minillm/course/probes/` before "
                                f"grading anyone else")
    if timed_out:
        stop = f"grading stopped after {timeout:.0f} s (an infinite loop?)"
        messages = [*messages, {"event": "timeout", "output": stop}]
    if not any(m.get("event") in ("end", "timeout") for m in messages):
        early = f"the test run ended early; its output:\n{tail[-3000:]}"
        messages = [*messages, {"event": "early_exit", "output": early}]
    report.probes = judge_probes(probes, want, messages)
    report.notes.append(f"probes drawn with seed {seed}")
    score_messages(report, expected, messages, tampered, report.probes)
    return report


def reference_probe_data(nn: str, probes: dict[str, probing.Probe], seed: int) -> dict[str, dict]:
    """The reference's probe outputs for chapter nn on `seed`; a probe that fails on the reference is the grader's
    bug (a RuntimeError), never the student's."""
    missing = sorted({e for t in graded_tests(nn) for e in t.exercises} - set(probes))
    if missing:
        raise RuntimeError(f"chapter {nn}'s exercises {missing} have no probe in minillm/course/probes/ch{nn}.py")
    # As the child runs them: one thread (its OMP_NUM_THREADS), float32 by default, whatever this process had set.
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    try:
        want = probing.run_probes(probes, seed)
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
    broken = {e: r["error"] for e, r in want.items() if "error" in r}
    if broken:
        raise RuntimeError(f"chapter {nn}'s probes fail on the reference (seed {seed}): {broken}")
    return want


def judge_probes(probes: dict[str, probing.Probe], want: dict[str, dict], messages: list[dict]
                 ) -> dict[str, str | None]:
    """{exercise: None when the child's probe data equals the reference's, else what went wrong}. Only messages
    before the child's "end" count; an exercise reported twice or not at all has failed."""
    got: dict[str, list[dict]] = {}
    for m in messages:
        if _is_end(m):
            break
        if m.get("event") == "probe":
            got.setdefault(str(m.get("exercise")), []).append(m)
    verdicts: dict[str, str | None] = {}
    for exercise, probe in probes.items():
        sent = got.get(exercise, [])
        if len(sent) != 1:
            verdicts[exercise] = "its probe did not run" if not sent else f"its probe was reported {len(sent)} times"
        elif "error" in sent[0]:
            verdicts[exercise] = f"on this grading's inputs it raised {str(sent[0]['error'])[:500]}"
        else:
            problem = probing.difference(want[exercise]["data"], sent[0].get("data"), probe.rtol, probe.atol)
            verdicts[exercise] = None if problem is None else f"on this grading's inputs, {problem[:1000]}"
        skipped = want[exercise]["data"]
        if isinstance(skipped, dict) and "skipped" in skipped:  # the reference could not run it: nothing to agree on
            verdicts[exercise] = f"its probe cannot run on this machine: {skipped['skipped']}"
    return verdicts


def score_messages(report: GradeReport, expected: tuple[GradedTest, ...], messages: list[dict],
                   tampered: bool = False, probes: dict[str, str | None] | None = None) -> GradeReport:
    """Fill `report` from the child's messages: each expected test function passes when every one of its items was
    reported exactly once, as passed, and (when `probes`, {exercise: problem or None}, is given) the probe of every
    exercise it grades agreed with the reference. Unexpected ids are ignored; the total is the expected points."""
    seen: dict[str, list[dict]] = {}
    for m in messages:
        if m.get("event") == "end":
            break
        if m.get("event") == "test":
            seen.setdefault(str(m.get("id", "")).split("/")[-1], []).append(m)
    general = [str(m.get("output", "")) for m in messages
               if m.get("event") in ("collect_error", "wrong_package", "timeout", "early_exit")]
    if tampered:
        report.notes.append("the reference tests were modified while the student's code ran: every test scores 0")
    report.notes.extend(general)
    for test in expected:
        problems = []
        for item in test.items:
            got = seen.get(item, [])
            if len(got) != 1:
                problems.append(f"{item}: {'not run' if not got else f'reported {len(got)} times'}")
            elif got[0].get("outcome") != "passed":
                problems.append(f"{item}: {got[0].get('outcome')}\n{got[0].get('output', '')}")
        if tampered:
            problems.append("the reference tests were modified during grading")
        for exercise in test.exercises if probes is not None else ():
            if probes.get(exercise, "it has no probe") is not None:
                problems.append(f"{exercise}: {probes.get(exercise, 'it has no probe')}")
        if problems and not any(seen.get(i) for i in test.items):
            problems.extend(general)
        report.tests.append(TestResult(test.function, not problems, test.points, "\n".join(problems).strip()))
    return report


def _files_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes() if p.is_file() else b"missing")
    return h.hexdigest()


def default_out_dir(student_dir: str | os.PathLike) -> Path:
    """Where a grade goes unless told: a folder beside the student's, never inside it ("hw04" -> "hw04-grade")."""
    student = Path(student_dir).resolve()
    return student.parent / f"{student.name}-grade"


def grade(
    chapter: str | int,
    student_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    timeout: float = 900.0,
    isolate: bool | None = None,
) -> GradeReport:
    """Grade student_dir/minillm on chapter NN's reference tests; write junit.xml + results.json into out_dir
    (default: `default_out_dir`, beside the student's folder). `isolate`: True runs the student's code in
    `sandbox.py`'s namespaces (a ValueError where that is impossible), False never, None (the default) when the
    machine allows it; the report's notes say which."""
    nn = exercise_chapter(chapter)
    student = Path(student_dir).resolve()
    if not (student / "minillm" / "__init__.py").is_file():
        raise ValueError(f"{str(student)!r} does not contain a minillm package (student_dir/minillm/__init__.py)")
    check_assignment_chapter(student, nn)
    if isolate is not None and not isinstance(isolate, bool):
        raise TypeError(f"isolate must be True, False or None, got {isolate!r}")
    out = Path(out_dir) if out_dir is not None else default_out_dir(student)
    _prepare_out_dir(out)  # refuse a bad --out before spending minutes on the tests
    problem = isolation_problem()
    if isolate and problem is not None:
        raise ValueError(f"cannot isolate the grading child: {problem}")
    isolated = problem is None if isolate is None else isolate
    report = run_graded(nn, student, timeout, isolated)
    report.notes.insert(0, "isolated: the student's code ran without the reference, the network or a way to "
                           "outlive grading" if isolated else
                        f"not isolated ({problem or 'turned off'}): the student's code ran with the grader's rights")
    _prepare_out_dir(out)  # again: the student's code ran in between and may have planted a symlink
    # atomic_write_text renames into place, so a symlink planted at either name is replaced, never followed.
    atomic_write_text(out / "junit.xml", report.junit_xml())
    atomic_write_text(out / "results.json", json.dumps(report.gradescope(), indent=2) + "\n")
    return report
