"""Coursework mode: stubs are generated from the markers, and the grader can both fail and pass."""

from __future__ import annotations

import json
import textwrap

import pytest

from minillm.course.assignment import CHAPTER_FILES, REPO_ROOT, grade, stub_source, write_assignment
from minillm.course.cli import main


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


def test_bad_chapter_and_nonempty_out(tmp_path):
    with pytest.raises(ValueError, match="99"):
        write_assignment("99", tmp_path / "x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        write_assignment(next(iter(CHAPTER_FILES)), tmp_path / "busy")
    with pytest.raises(ValueError, match="minillm package"):
        grade(next(iter(CHAPTER_FILES)), tmp_path / "busy")


@pytest.mark.slow
@pytest.mark.parametrize("chapter", sorted(CHAPTER_FILES))
def test_stubs_score_zero_and_reference_scores_full(chapter, tmp_path, capsys):
    student = tmp_path / "student"
    assert main(["assignment", chapter, "--out", str(student)]) == 0
    # fresh stubs: every graded test fails
    assert main(["grade", chapter, "--student", str(student)]) == 1
    results = json.loads((student / "grade" / "results.json").read_text())
    assert results["max_score"] >= 1 and results["score"] == 0, results
    assert (student / "grade" / "junit.xml").exists()
    # the reference package: full marks
    report = grade(chapter, REPO_ROOT, out_dir=tmp_path / "ref")
    assert report.max_score == results["max_score"]
    assert report.score == report.max_score, [t.name for t in report.tests if not t.passed]
