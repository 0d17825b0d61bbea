"""Coursework: hand a chapter out as stubs (`minillm assignment NN`) and grade it with its tests (`minillm grade NN`).

The reference source marks each exercise inside a function body, after its docstring:

    def merge(ids, pair, new_id):
        \"\"\"...docstring stays...\"\"\"
        # BEGIN SOLUTION
        ...reference lines, removed from the student copy...
        # END SOLUTION

A C, C++ or CUDA source marks its exercises with `// BEGIN SOLUTION` / `// END SOLUTION`, and the region becomes
a comment instead of a raise: the function must compile without it (a kernel body that writes nothing), so its
tests fail on the output the stub leaves unwritten (chapter 12's `softmax_v2_kernel`).

`write_assignment` writes a self-contained student folder: the package with the marked regions of chapter NN *and
of every later chapter* replaced by `raise NotImplementedError` (earlier chapters' code is what the student builds
on), the chapter's test file, a pytest configuration that imports the folder's own package (and stops if `minillm`
resolves anywhere else), a README with the exercises and their points, and a marker file `.minillm-assignment`.
The shared checkpoints are hard-linked (copied across file systems): no link points back into the repository. `--force` only ever replaces a folder that carries that marker; the
current directory, its parents and files are refused.

Grading (`minillm grade`) lives in `grading.py`: the reference's graded tests and points are the denominator, and
the student's code runs in a child process that cannot touch the report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from minillm import chapters
from minillm.core.io import check_output_dir
from minillm.course import probes as probing
from minillm.course.grading import (ASSETS_DIR, ASSIGNMENT_MARKER, PACKAGE_DIR, PYTEST_INI, REPO_ROOT, TESTS_DIR,
                                    GradeReport, GradedTest, TestResult, chapter_test_file, copy_tests,
                                    default_out_dir, grade, graded_tests, is_c_source)
from minillm.course.grading import exercise_chapter as _chapter

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
C_BEGIN, C_END = "// BEGIN SOLUTION", "// END SOLUTION"
# A function definition in C/C++/CUDA as these sources lay it out: an unindented line (no preprocessor line, no
# comment, no closing brace) whose first `(` follows the function's name: `__global__ void softmax_v1_kernel(`.
C_DEF = re.compile(r"^(?![\s#/}])[^;(]*?\b(\w+)\s*\(")
MARKER = ASSIGNMENT_MARKER  # the file that says "this folder was written by `minillm assignment`", and its chapter
__all__ = ["CHAPTER_FILES", "GradeReport", "GradedTest", "TestResult", "chapter_test_file", "grade", "graded_tests",
           "stub_source", "write_assignment", "solution_lines", "markers", "is_c_source"]

# Chapter -> files (relative to the repository root) whose marked functions are that chapter's exercises.
CHAPTER_FILES: dict[str, list[str]] = {c.number: list(c.exercises) for c in chapters.built() if c.exercises}


def markers(path: str) -> tuple[str, str]:
    """The solution markers of a source: `// BEGIN SOLUTION` / `// END SOLUTION` in C, C++ and CUDA, else `#`."""
    return (C_BEGIN, C_END) if is_c_source(path) else (BEGIN, END)


def _scan(source: str, path: str):
    """Yield (line, enclosing function, kind) for each line, kind being "begin", "end", "inside" or "outside" of a
    BEGIN/END SOLUTION region (the markers `path`'s language comments with); a nested, unopened or unclosed region
    is a ValueError naming `path` and the line."""
    begin, end = markers(path)
    func_def = C_DEF if is_c_source(path) else re.compile(r"\s*(?:async\s+)?def\s+(\w+)")
    func, inside = "this function", False
    for lineno, line in enumerate(source.splitlines(keepends=True), 1):
        m = func_def.match(line)
        if m and not inside:
            func = m.group(1)
        if line.strip() == begin:
            if inside:
                raise ValueError(f"{path}:{lineno}: nested {begin}")
            inside = True
            yield line, func, "begin"
        elif line.strip() == end:
            if not inside:
                raise ValueError(f"{path}:{lineno}: {end} without {begin}")
            inside = False
            yield line, func, "end"
        else:
            yield line, func, "inside" if inside else "outside"
    if inside:
        raise ValueError(f"{path}: {begin} without {end}")


def stub_source(source: str, path: str = "<source>") -> tuple[str, int]:
    """Replace each BEGIN/END SOLUTION region by `raise NotImplementedError(...)`; return (text, regions replaced).

    The raise is indented like the BEGIN marker and names the enclosing function, so a student's traceback says
    which exercise is still open. In a C, C++ or CUDA `path` (`is_c_source`) the region becomes a comment naming
    the function instead: the body compiles and does nothing, and the tests fail on the output it never wrote.
    """
    out: list[str] = []
    count = 0
    c_source = is_c_source(path)
    for line, func, kind in _scan(source, path):
        if kind == "begin":
            indent = line[: len(line) - len(line.lstrip())]
            if c_source:
                out.append(f"{indent}// exercise: implement {func} (until you do, it compiles and writes nothing)\n")
            else:
                out.append(f'{indent}raise NotImplementedError("exercise: implement {func}")\n')
            count += 1
        elif kind == "outside":
            out.append(line)
    return "".join(out), count


def solution_regions(source: str, path: str = "<source>") -> list[tuple[str, list[str]]]:
    """(function name, the lines between its BEGIN/END SOLUTION markers) for each marked region of a source."""
    regions: list[tuple[str, list[str]]] = []
    for line, func, kind in _scan(source, path):
        if kind == "begin":
            regions.append((func, []))
        elif kind == "inside":
            regions[-1][1].append(line.splitlines()[0])  # without its line ending
    return regions


def solution_lines(source: str, path: str = "<source>") -> list[str]:
    """Every line of every marked region of a source (what a student copy must not contain); `path` says which
    markers the source uses (`markers`)."""
    return [line for _, lines in solution_regions(source, path) for line in lines]


def exercise_functions(chapter: str | int) -> dict[str, str]:
    """Exercise function name -> the file (from the repository root) holding it, for one chapter."""
    nn = _chapter(chapter)
    return {func: rel for rel in CHAPTER_FILES[nn]
            for func, _ in solution_regions((REPO_ROOT / rel).read_text(encoding="utf-8"), rel)}


def stubbed_files(chapter: str | int) -> list[str]:
    """The files stubbed in chapter NN's student copy: the exercises of NN and of every later chapter."""
    nn = _chapter(chapter)
    return [rel for c, files in sorted(CHAPTER_FILES.items()) if c >= nn for rel in files]


# A student folder's tests/conftest.py starts with this guard, then the reference's conftest.
GUARD = '''"""Test setup of this assignment folder. First: the tests must exercise *this folder's* minillm package."""

from pathlib import Path

import pytest

import minillm

_FOLDER = Path(__file__).resolve().parent.parent
if not Path(minillm.__file__).resolve().is_relative_to(_FOLDER):
    pytest.exit(
        f"`import minillm` found {minillm.__file__}, not this assignment's package in {_FOLDER / 'minillm'}. "
        f"Run the tests from {_FOLDER} with `python -m pytest` (or `pytest`, which reads pytest.ini here).",
        returncode=4,
    )

# ---- the reference test suite's conftest follows --------------------------------------------------------------
'''


def _check_out(out: Path, force: bool) -> None:
    """Refuse any --out whose replacement could delete what `minillm assignment` did not create, or that lies
    under a file (named, not mkdir's FileExistsError)."""
    here = Path.cwd().resolve()
    target = out.resolve()
    if target == here or target in here.parents:
        raise ValueError(f"--out {str(out)!r} is the current directory or one of its parents; "
                         "name a new folder for the assignment")
    for protected in (REPO_ROOT, PACKAGE_DIR):
        if target == protected or target in protected.parents or target.is_relative_to(PACKAGE_DIR):
            raise ValueError(f"--out {str(out)!r} would overwrite the reference repository {str(REPO_ROOT)!r}")
    if out.is_symlink():
        raise ValueError(f"--out {str(out)!r} is a symlink; name a real folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    check_output_dir(out, "--out")  # a path under a file
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"output directory {str(out)!r} is not empty (use --force to replace an earlier "
                             f"assignment folder)")
        if not (out / MARKER).is_file():
            raise ValueError(f"output directory {str(out)!r} is not empty and has no {MARKER} file, so it was not "
                             f"written by `minillm assignment`; --force only replaces assignment folders")


def _readme(nn: str, out: Path, tests: tuple[GradedTest, ...]) -> str:
    chapter = chapters.get(nn)
    funcs = exercise_functions(nn)
    points = {f: 0 for f in funcs}
    for t in tests:
        for e in t.exercises:
            if e in points:
                points[e] += t.points
    total = sum(t.points for t in tests)
    rows = "".join(f"| `{f}` | `{rel}` | {points[f]} |\n" for f, rel in funcs.items())
    c_stubs = any(is_c_source(rel) for rel in funcs.values())
    also = (",\nand the C++/CUDA bodies that hold only a comment `// exercise: implement ...` (each compiles and does "
            "nothing\nuntil you write it; the comment above the function states its contract)") if c_stubs else ""
    test_rows = "".join(f"| `{t.function}` | {', '.join(f'`{e}`' for e in t.exercises) or '-'} | {t.points} |\n"
                        for t in tests)
    return f"""# minillm chapter {nn} assignment: {chapter.title}

Implement the bodies that raise `NotImplementedError("exercise: ...")`{also}. Read `chapters/{chapter.name}.md` of the
course for the technique; each function's docstring states its contract (and any hook it must call).

| exercise | file | points (tests that use it) |
|---|---|---|
{rows}
Graded tests ({total} points in all; a test function earns its points when all of its cases pass):

| test | grades | points |
|---|---|---|
{test_rows}
## Testing your work here

    cd {out}
    python -m pytest -m graded          # the graded tests of tests/{Path(chapter.test_file).name}
    python -m pytest                    # all of the chapter's tests

`pytest.ini` puts this folder first on the import path, and `tests/conftest.py` stops with a clear message if
`import minillm` finds any other copy (for example an installed reference). Code of earlier chapters is the
reference implementation; exercises of later chapters are stubbed too, so only this chapter's tests are meaningful.

## How it is graded

Your instructor runs `minillm grade {nn} --student <this folder>` with the reference tests, which may include
tests you have not seen. The points come from the reference: a test that is missing, errors, is skipped or fails
scores 0 and the total stays {total}. Only your `minillm/` package is used; nothing else in this folder (no
conftest.py, pytest.ini or plugin) is loaded. Your code runs in a child process; the score is computed by the
grader's parent process from what that child reports test by test, and the report files are written by the parent
after the child and everything it started have been stopped.

Where the machine allows it, your code runs isolated: without the reference solutions, without the network, and
with nothing it starts outliving the tests. Deliberately tampering with the test run is academic misconduct,
whatever the grader can or cannot rule out on its own.
"""


def _link_or_copy(src: str, dst: str) -> str:
    """A hard link to src at dst (no space, no path back into this repository: the folder stays portable), or a copy
    where links cannot be made (another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "assets")


def _not_for_students(folder: str, names: list[str]) -> set[str]:
    """What `copytree` leaves out of a student's package: caches, the assets (linked separately) and the grader's
    probes of each chapter (`course/probes/chNN.py`: some hold the reference's rules, and the grader runs its own
    copy anyway)."""
    skip = set(_IGNORED(folder, names))
    if Path(folder).resolve() == probing.PROBES_DIR:
        skip |= {n for n in names if re.fullmatch(r"ch\d\d\.py", n)}
    return skip


def write_assignment(chapter: str | int, out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write a self-contained student folder for chapter NN into out_dir (see the module docstring); returns it."""
    nn = _chapter(chapter)
    out = Path(out_dir)
    _check_out(out, force)
    tests = graded_tests(nn)
    # Build in a sibling temp dir, then move into place, so a failure never leaves half an assignment.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    old = None
    try:
        pkg = tmp / "minillm"
        shutil.copytree(PACKAGE_DIR, pkg, ignore=_not_for_students)
        (pkg / "assets").mkdir()
        for item in ASSETS_DIR.iterdir():  # small files are copied; the checkpoints (34 MB) hard-linked
            if item.is_dir():
                shutil.copytree(item, pkg / "assets" / item.name, copy_function=_link_or_copy)
            else:
                shutil.copy2(item, pkg / "assets" / item.name)
        for rel in stubbed_files(nn):
            text, n = stub_source((REPO_ROOT / rel).read_text(encoding="utf-8"), rel)
            if n == 0:
                raise ValueError(f"{rel} is listed as exercises but has no {BEGIN} markers")
            (tmp / rel).write_text(text, encoding="utf-8")
        copy_tests(nn, tmp / "tests")  # conftest.py is rewritten below, with the guard in front
        conftest = (TESTS_DIR / "conftest.py").read_text(encoding="utf-8").replace(
            "from __future__ import annotations\n", "")  # the guard has it, and it must come first
        (tmp / "tests" / "conftest.py").write_text(GUARD + conftest, encoding="utf-8")
        (tmp / "pytest.ini").write_text(
            PYTEST_INI + "pythonpath = .\ntestpaths = tests\naddopts = -p no:cacheprovider\n", encoding="utf-8")
        (tmp / "README.md").write_text(_readme(nn, out, tests), encoding="utf-8")
        (tmp / MARKER).write_text(json.dumps({
            "chapter": nn,
            "graded": [{"test": t.function, "points": t.points, "exercises": list(t.exercises)} for t in tests],
            "max_score": sum(t.points for t in tests),
        }, indent=2) + "\n", encoding="utf-8")
        if out.exists():  # an earlier assignment folder (checked by _check_out): set aside, then replaced
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old."))
            os.replace(out, old / "x")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old / "x", out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


def _cmd_assignment(args: argparse.Namespace) -> int:
    try:
        out = write_assignment(args.chapter, args.out, force=args.force)
    except ValueError as e:
        print(f"minillm assignment: {e}", file=sys.stderr)
        return 2
    print(f"wrote the chapter {_chapter(args.chapter)} assignment to {out} (see {out / 'README.md'})")
    return 0


def _cmd_grade(args: argparse.Namespace) -> int:
    try:
        report = grade(args.chapter, args.student, args.out, isolate=args.isolate)
    except ValueError as e:
        print(f"minillm grade: {e}", file=sys.stderr)
        return 2
    for t in report.tests:
        print(f"{t.score}/{t.points}  {t.name}")
    for note in report.notes:
        print(note)
    out = Path(args.out) if args.out else default_out_dir(args.student)
    print(f"score: {report.score}/{report.max_score}  (JUnit: {out / 'junit.xml'}, Gradescope: {out / 'results.json'})")
    return 0 if report.score == report.max_score else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("assignment", help="write a self-contained student folder with a chapter's exercises stubbed")
    p.add_argument("chapter", metavar="NN")
    p.add_argument("--out", required=True, metavar="DIR", help="a new folder for the student copy")
    p.add_argument("--force", action="store_true", help="replace DIR if it is an earlier assignment folder")
    p.set_defaults(handler=_cmd_assignment)
    g = sub.add_parser("grade", help="grade a student folder with the chapter's reference tests (JUnit + results.json)")
    g.add_argument("chapter", metavar="NN")
    g.add_argument("--student", required=True, metavar="DIR", help="directory holding the student's minillm/")
    g.add_argument("--out", metavar="DIR",
                   help="where to write junit.xml and results.json (default: DIR-grade, beside the student's folder)")
    iso = g.add_mutually_exclusive_group()
    iso.add_argument("--isolate", dest="isolate", action="store_const", const=True, default=None,
                     help="run the student's code without the reference, the network or a way to outlive grading "
                          "(Linux namespaces); fail if this machine cannot (default: isolate when it can)")
    iso.add_argument("--no-isolate", dest="isolate", action="store_const", const=False,
                     help="run the student's code with the grader's own rights")
    g.set_defaults(handler=_cmd_grade)
