"""Coursework mode: stubs come from the markers, the student folder is self-contained, and the grader can fail and pass.

The attacks on the grader are in tests/test_grading_attacks.py; the planted wrong solutions in tests/test_planted.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minillm.course.assignment import (CHAPTER_FILES, MARKER, REPO_ROOT, exercise_functions, grade, graded_tests,
                                       solution_lines, solution_regions, stub_source, write_assignment)
from minillm.course.cli import main
from minillm.course.grading import default_out_dir

CHAPTERS = sorted(CHAPTER_FILES)


def test_stub_source_replaces_marked_body_keeps_docstring():
    src = textwrap.dedent(
        '''
        def f(x):
            """Double x."""
            # BEGIN SOLUTION
            y = x * 2
            return y
            # END SOLUTION

        def g():
            return 1
        '''
    )
    out, n = stub_source(src)
    assert n == 1
    assert '"""Double x."""' in out and "y = x * 2" not in out
    assert 'raise NotImplementedError("exercise: implement f")' in out
    namespace: dict = {}
    exec(compile(out, "<stub>", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="implement f"):
        namespace["f"](1)
    assert namespace["g"]() == 1


def test_stub_source_in_cuda_leaves_a_kernel_that_compiles_and_writes_nothing():
    """A .cu exercise is marked with // comments; its region becomes a comment naming the kernel (a raise would not
    compile), the signature and the comment above it stay, and `#` lines are C preprocessor lines, not markers."""
    src = textwrap.dedent(
        """\
        // v9: one thread per element.
        template <typename T>
        __global__ void scale_kernel(const T* x, T* out, int64_t n) {
            // BEGIN SOLUTION
            const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
        #pragma unroll
            if (i < n) out[i] = x[i] * 2;
            // END SOLUTION
        }

        cudaError_t scale_forward(const float* x, float* out, int64_t n) { return cudaSuccess; }
        """
    )
    out, n = stub_source(src, "minillm/kernels/csrc/scale.cu")
    assert n == 1
    assert out.splitlines()[:4] == [
        "// v9: one thread per element.", "template <typename T>",
        "__global__ void scale_kernel(const T* x, T* out, int64_t n) {",
        "    // exercise: implement scale_kernel (until you do, it compiles and writes nothing)"]
    assert "out[i]" not in out and "#pragma" not in out and "scale_forward(" in out
    assert solution_regions(src, "scale.cu")[0][0] == "scale_kernel"
    assert stub_source(src, "scale.py") == (src, 0)  # Python markers: none here
    with pytest.raises(ValueError, match="// BEGIN SOLUTION without"):
        stub_source("// BEGIN SOLUTION\n", "k.cu")


@pytest.mark.parametrize(
    "src, message",
    [
        ("# BEGIN SOLUTION\n", "without"),
        ("# END SOLUTION\n", "without"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "nested"),
    ],
)
def test_stub_source_rejects_broken_markers(src, message):
    with pytest.raises(ValueError, match=message):
        stub_source(src)


def test_every_listed_file_has_markers():
    for chapter, files in CHAPTER_FILES.items():
        for rel in files:
            _, n = stub_source((REPO_ROOT / rel).read_text(encoding="utf-8"), rel)
            assert n >= 1, f"chapter {chapter}: {rel} has no solution markers"


def test_points_and_exercises_come_from_the_reference_markers():
    """Every exercise is graded by at least one test, every graded test names real exercises of its chapter and
    carries positive integer points; the totals are what the READMEs print."""
    totals = {}
    for nn in CHAPTERS:
        tests = graded_tests(nn)
        funcs = exercise_functions(nn)
        graded = {e for t in tests for e in t.exercises}
        assert set(funcs) <= graded, f"chapter {nn}: exercises without a graded test: {set(funcs) - graded}"
        assert graded <= set(funcs), f"chapter {nn}: graded tests name unknown exercises {graded - set(funcs)}"
        assert all(isinstance(t.points, int) and t.points >= 1 and t.items for t in tests)
        totals[nn] = sum(t.points for t in tests)
    assert all(total >= 10 for total in totals.values()), totals


def test_bad_chapter_and_nonempty_out(tmp_path):
    with pytest.raises(ValueError, match="99"):
        write_assignment("99", tmp_path / "x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        write_assignment("01", tmp_path / "busy")
    with pytest.raises(ValueError, match="minillm package"):
        grade("01", tmp_path / "busy")


def test_out_never_deletes_what_assignment_did_not_create(tmp_path, monkeypatch, capsys):
    """`--out . --force` once emptied the current directory, `--out .. --force` its parent; a file gave a raw
    NotADirectoryError. Now each is refused with a message, and nothing is deleted."""
    work = tmp_path / "parent" / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    (tmp_path / "parent" / "other.txt").write_text("mine too")
    monkeypatch.chdir(work)
    for out, match in ((".", "current directory"), ("..", "current directory"), (str(tmp_path), "current directory")):
        with pytest.raises(ValueError, match=match):
            write_assignment("04", out, force=True)
        assert main(["assignment", "04", "--out", out, "--force"]) == 2
        assert "current directory" in capsys.readouterr().err
    (work / "a_file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        write_assignment("04", "a_file", force=True)
    mine = work / "mine"
    mine.mkdir()
    (mine / "essay.md").write_text("no marker here")
    with pytest.raises(ValueError, match=MARKER):
        write_assignment("04", mine, force=True)
    with pytest.raises(ValueError, match="reference repository"):
        write_assignment("04", REPO_ROOT / "minillm", force=True)
    assert (work / "notes.txt").read_text() == "mine" and (tmp_path / "parent" / "other.txt").exists()
    assert (mine / "essay.md").exists() and (work / "a_file").read_text() == "x"
    # an earlier assignment folder (it has the marker) is replaced by --force
    write_assignment("04", work / "hw04")
    (work / "hw04" / "minillm" / "scratch.py").write_text("old")
    write_assignment("04", work / "hw04", force=True)
    assert not (work / "hw04" / "minillm" / "scratch.py").exists() and (work / "hw04" / MARKER).is_file()
    assert sorted(p.name for p in work.iterdir()) == ["a_file", "hw04", "mine", "notes.txt"]  # no temp dirs left


def _distinctive(lines: list[str], elsewhere: str) -> list[str]:
    """Solution lines long and specific enough to identify it, and not found in the reference outside solutions."""
    return [s for s in (line.strip() for line in lines) if len(s) >= 25 and s not in elsewhere]


def test_student_folder_is_self_contained_and_holds_no_solution_of_this_or_a_later_chapter(tmp_path):
    sources = [*(REPO_ROOT / "minillm").rglob("*.py"), *(REPO_ROOT / "minillm").rglob("*.cu"),
               *(REPO_ROOT / "tests").glob("*.py")]
    outside = "".join(stub_source(p.read_text(encoding="utf-8"), str(p))[0] for p in sources)  # minus solutions
    secrets = {nn: _distinctive([line for rel in files for line in
                                 solution_lines((REPO_ROOT / rel).read_text(encoding="utf-8"), rel)], outside)
               for nn, files in CHAPTER_FILES.items()}
    assert all(secrets.values()), secrets
    for nn in CHAPTERS:
        out = write_assignment(nn, tmp_path / f"hw{nn}")
        text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in out.rglob("*")
                         if p.is_file() and not p.is_symlink() and p.suffix in (".py", ".cu", ".md", ".ini", ".txt"))
        for later, lines in secrets.items():
            leaked = [s for s in lines if s in text]
            if later >= nn:
                assert not leaked, f"assignment {nn} contains chapter {later}'s solution: {leaked[:3]}"
            else:  # earlier chapters' reference code is what the student builds on
                assert leaked, f"assignment {nn} lacks chapter {later}'s reference code"
        # portable: no link points anywhere (into this repository least of all); the checkpoints are the same
        # bytes, hard-linked (or copied across file systems), and whatever else is there stays small
        assert not [p for p in out.rglob("*") if p.is_symlink()], f"assignment {nn} holds symlinks"
        assert not list(out.glob("minillm/course/probes/ch*.py")), "the grader's probes are not the student's"
        checkpoints = out / "minillm" / "assets" / "checkpoints"
        ours = REPO_ROOT / "minillm/assets/checkpoints"
        for f in ours.rglob("*"):
            if f.is_file():
                assert (checkpoints / f.relative_to(ours)).read_bytes() == f.read_bytes()
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and checkpoints not in p.parents)
        assert size < 3_000_000, f"assignment {nn} is {size / 1e6:.1f} MB"
        marker = json.loads((out / MARKER).read_text())
        readme = (out / "README.md").read_text()
        assert marker["max_score"] == sum(t.points for t in graded_tests(nn))
        assert f"{marker['max_score']} points in all" in readme and "python -m pytest -m graded" in readme
        assert "runs isolated" in readme and "academic misconduct" in readme  # what the grader does, honestly
        for func in exercise_functions(nn):
            assert f"| `{func}` |" in readme
        assert (out / "tests" / Path(graded_tests(nn)[0].items[0].split("::")[0]).name).is_file()


@pytest.mark.slow
def test_plain_pytest_in_the_folder_tests_the_student_and_refuses_another_minillm(tmp_path):
    """Plain `pytest` in an assignment folder used to test the installed reference; now pytest.ini puts the folder
    first, and tests/conftest.py stops with a message when `minillm` resolves outside it."""
    out = write_assignment("01", tmp_path / "hw01")
    pytest_exe = str(Path(sys.executable).with_name("pytest"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHONPATH"))}
    run = subprocess.run([pytest_exe, "-m", "graded", "-q", "-x"], cwd=out, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1 and "NotImplementedError: exercise: implement" in run.stdout, run.stdout[-2000:]
    # without the folder on the path (pythonpath emptied), `minillm` is the installed reference: refused
    run = subprocess.run([pytest_exe, "-o", "pythonpath=", "--rootdir", str(out), str(out / "tests"), "-q"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 4 and "not this assignment's package" in run.stdout + run.stderr, run.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_stubs_score_zero_and_reference_scores_full(chapter, tmp_path, capsys):
    student = tmp_path / "student"
    total = sum(t.points for t in graded_tests(chapter))
    assert main(["assignment", chapter, "--out", str(student)]) == 0
    # fresh stubs: every graded test fails, out of the reference's total
    assert main(["grade", chapter, "--student", str(student)]) == 1
    out = default_out_dir(student)  # beside the student's folder, not inside it
    assert out == student.parent / f"{student.name}-grade" and not (student / "grade").exists()
    results = json.loads((out / "results.json").read_text())
    assert results["max_score"] == total and results["score"] == 0, results
    assert len(results["tests"]) == len(graded_tests(chapter))
    assert "failures=" in (out / "junit.xml").read_text()
    # the reference package: full marks
    report = grade(chapter, REPO_ROOT, out_dir=tmp_path / "ref")
    assert report.max_score == total
    assert report.score == report.max_score, [(t.name, t.output[-600:]) for t in report.tests if not t.passed]


def test_grade_refuses_another_chapters_assignment_and_an_out_under_a_file(tmp_path, capsys):
    """Before: `minillm grade 10` on a chapter-09 assignment folder scored 0/15 without a word (the folder's marker
    names its chapter), and an --out under a regular file was a traceback (FileExistsError / NotADirectoryError)."""
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["assignment", "09", "--out", str(tmp_path / "notes.txt" / "hw")]) == 2
    assert "notes.txt' is a file, not a folder" in capsys.readouterr().err
    student = tmp_path / "hw09"
    write_assignment("09", student)
    with pytest.raises(ValueError, match=r"is chapter 09's assignment .* not chapter 10's: run `minillm grade 09"):
        grade("10", student)
    assert main(["grade", "09", "--student", str(student), "--out", str(tmp_path / "notes.txt" / "g"),
                 "--no-isolate"]) == 2
    assert "notes.txt' is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "hw09-grade").exists()
