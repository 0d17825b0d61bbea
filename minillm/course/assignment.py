"""Coursework: hand a chapter out as stubs (`minillm assignment NN`) and grade it with its tests (`minillm grade NN`).

The reference source marks each exercise inside a function body, after its docstring:

    def merge(ids, pair, new_id):
        \"\"\"...docstring stays...\"\"\"
        # BEGIN SOLUTION
        ...reference lines, removed from the student copy...
        # END SOLUTION

`write_assignment` copies the whole package and replaces every marked region of the chapter's files with
`raise NotImplementedError`. `grade` runs the chapter's tests marked `@pytest.mark.graded` in a fresh Python whose
`import minillm` finds the student's package, one point per test, and writes JUnit XML and a Gradescope-style
`results.json`. The tests prove the grader can fail: fresh stubs score 0, the reference full marks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from minillm import chapters
from minillm.core.io import atomic_write_text

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = PACKAGE_DIR.parent

# Chapter -> files (relative to the repository root) whose marked functions are that chapter's exercises.
CHAPTER_FILES: dict[str, list[str]] = {c.number: list(c.exercises) for c in chapters.built() if c.exercises}


def _chapter(chapter: str | int) -> str:
    nn = chapters.normalize(chapter)
    if nn not in CHAPTER_FILES:
        raise ValueError(f"chapter {nn} has no exercises; chapters with exercises: {sorted(CHAPTER_FILES)}")
    return nn


def stub_source(source: str, path: str = "<source>") -> tuple[str, int]:
    """Replace each BEGIN/END SOLUTION region by `raise NotImplementedError(...)`; return (text, regions replaced).

    The raise is indented like the BEGIN marker and names the enclosing function, so a student's traceback says
    which exercise is still open.
    """
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    count = 0
    inside = False
    func = "this function"
    for lineno, line in enumerate(lines, 1):
        stripped = line.strip()
        m = re.match(r"\s*(?:async\s+)?def\s+(\w+)", line)
        if m and not inside:
            func = m.group(1)
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"{path}:{lineno}: nested {BEGIN}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("exercise: implement {func}")\n')
            count += 1
        elif stripped == END:
            if not inside:
                raise ValueError(f"{path}:{lineno}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{path}: {BEGIN} without {END}")
    return "".join(out), count


def chapter_test_file(chapter: str, tests_dir: Path | None = None) -> Path:
    """The chapter's test file, as the manifest names it (`tests/test_NN_slug.py`)."""
    tests_dir = tests_dir or REPO_ROOT / "tests"
    path = tests_dir / Path(chapters.get(chapter).test_file).name
    if not path.is_file():
        raise ValueError(f"chapter {chapter}'s test file {path.name} is not in {tests_dir}")
    return path


def write_assignment(chapter: str | int, out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write a student copy of the package into out_dir/minillm with chapter NN's exercises stubbed out.

    The chapter's test file is copied to out_dir/tests so students can run it themselves. Returns out_dir.
    """
    nn = _chapter(chapter)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"output directory {str(out)!r} is not empty (use --force to overwrite)")
    # Build in a sibling temp dir, then move into place, so a failure never leaves half an assignment.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        shutil.copytree(PACKAGE_DIR, tmp / "minillm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        total = 0
        for rel in CHAPTER_FILES[nn]:
            src = REPO_ROOT / rel
            text, n = stub_source(src.read_text(encoding="utf-8"), rel)
            if n == 0:
                raise ValueError(f"{rel} is listed for chapter {nn} but has no {BEGIN} markers")
            (tmp / rel).write_text(text, encoding="utf-8")
            total += n
        (tmp / "tests").mkdir()
        test_file = chapter_test_file(nn)
        shutil.copy2(test_file, tmp / "tests" / test_file.name)
        (tmp / "README.md").write_text(
            f"# minillm chapter {nn} assignment\n\n{total} exercise(s) to implement, marked by "
            f"`raise NotImplementedError` in:\n\n" + "".join(f"- `{r}`\n" for r in CHAPTER_FILES[nn])
            + f"\nGrade your work with `minillm grade {nn} --student {out}` from the minillm repository.\n",
            encoding="utf-8",
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@dataclass
class TestResult:
    name: str
    passed: bool
    output: str = ""


@dataclass
class GradeReport:
    chapter: str
    tests: list[TestResult] = field(default_factory=list)

    @property
    def score(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def max_score(self) -> int:
        return len(self.tests)

    def gradescope(self) -> dict:
        """Gradescope's autograder `results.json` layout: a total and one entry per test."""
        return {
            "score": float(self.score),
            "max_score": float(self.max_score),
            "output": f"chapter {self.chapter}: {self.score}/{self.max_score} graded tests passed",
            "tests": [
                {
                    "name": t.name,
                    "score": 1.0 if t.passed else 0.0,
                    "max_score": 1.0,
                    "status": "passed" if t.passed else "failed",
                    "output": t.output[-4000:],
                }
                for t in self.tests
            ],
        }


def _parse_junit(path: Path) -> list[TestResult]:
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        problems = [c for c in case if c.tag in ("failure", "error")]
        skipped = any(c.tag == "skipped" for c in case)
        output = "\n".join((c.get("message") or "") + "\n" + (c.text or "") for c in problems)
        results.append(TestResult(name=name, passed=not problems and not skipped, output=output.strip()))
    return results


def grade(
    chapter: str | int,
    student_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    timeout: float = 900.0,
) -> GradeReport:
    """Run chapter NN's graded tests against the package in student_dir/minillm; write JUnit XML + results.json."""
    nn = _chapter(chapter)
    student = Path(student_dir).resolve()
    if not (student / "minillm" / "__init__.py").is_file():
        raise ValueError(f"{str(student)!r} does not contain a minillm package (student_dir/minillm/__init__.py)")
    out = Path(out_dir) if out_dir is not None else student / "grade"
    out.mkdir(parents=True, exist_ok=True)
    test_file = chapter_test_file(nn)
    env = dict(os.environ)
    # subtle: the student's package must shadow the installed one. `python -m` puts the working directory first on
    # sys.path, and PYTHONPATH comes before site-packages (and any editable-install hook), so both point there.
    env["PYTHONPATH"] = os.pathsep.join([str(student)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    probe = subprocess.run(
        [sys.executable, "-c", "import minillm, sys; sys.stdout.write(minillm.__file__)"],
        cwd=student, env=env, capture_output=True, text=True, timeout=120,
    )
    if probe.returncode != 0 or not Path(probe.stdout).resolve().is_relative_to(student):
        raise ValueError(f"could not import the student's package from {student}: {probe.stdout}{probe.stderr}")
    with tempfile.TemporaryDirectory() as tmp:
        junit_tmp = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", str(test_file), "-m", "graded", "-q", "-p", "no:cacheprovider",
               f"--rootdir={REPO_ROOT}", f"--junitxml={junit_tmp}", "-o", "junit_family=xunit1"]
        try:
            proc = subprocess.run(cmd, cwd=student, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ValueError(f"grading chapter {nn} took longer than {timeout:.0f} s (an infinite loop?)") from exc
        if not junit_tmp.exists():
            raise ValueError(f"pytest produced no report (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
        report = GradeReport(nn, _parse_junit(junit_tmp))
        atomic_write_text(out / "junit.xml", junit_tmp.read_text(encoding="utf-8"))
    if not report.tests:
        raise ValueError(f"chapter {nn} has no tests marked graded in {test_file.name}")
    atomic_write_text(out / "results.json", json.dumps(report.gradescope(), indent=2) + "\n")
    return report


def _cmd_assignment(args: argparse.Namespace) -> int:
    out = write_assignment(args.chapter, args.out, force=args.force)
    print(f"wrote the chapter {_chapter(args.chapter)} assignment to {out}")
    return 0


def _cmd_grade(args: argparse.Namespace) -> int:
    report = grade(args.chapter, args.student, args.out)
    for t in report.tests:
        print(f"{'1' if t.passed else '0'}/1  {t.name}")
    out = Path(args.out) if args.out else Path(args.student) / "grade"
    print(f"score: {report.score}/{report.max_score}  (JUnit: {out / 'junit.xml'}, Gradescope: {out / 'results.json'})")
    return 0 if report.score == report.max_score else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("assignment", help="write a student package with a chapter's exercises stubbed out")
    p.add_argument("chapter", metavar="NN")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the student package")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty DIR")
    p.set_defaults(handler=_cmd_assignment)
    g = sub.add_parser("grade", help="grade a student package with the chapter's tests (JUnit + results.json)")
    g.add_argument("chapter", metavar="NN")
    g.add_argument("--student", required=True, metavar="DIR", help="directory holding the student's minillm/")
    g.add_argument("--out", metavar="DIR", help="where to write junit.xml and results.json (default DIR/grade)")
    g.set_defaults(handler=_cmd_grade)
