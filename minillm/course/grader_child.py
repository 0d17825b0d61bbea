"""The grader's side of the grading child: run pytest and report each graded test's outcome over a pipe.

`minillm.course.grading` runs this file as a script (`python -I grader_child.py MODE FD PATH PROBES -- PYTEST_ARGS`),
never imports it: in the child, `import minillm` must find the *student's* package, so this file imports nothing from
minillm. Two modes:

    collect  FD ROOT    (run on the reference; PROBES is "-") collect the tests marked graded and send their ids,
                        points and exercises, one JSON line each
    run      FD STUDENT with STUDENT (the folder holding the student's minillm/) first on sys.path: first the
                        chapter's probes, PROBES being {"dir", "chapter", "seed"} as JSON (the grader's own probes
                        package, loaded by path), each in a forked process with a time limit (a crash or a hang
                        costs that exercise only), one {"event": "probe", "exercise", "data" or "error"} line each;
                        then the graded tests, one {"event": "test", "id", "outcome", "output"} line per finished test

The messages go to file descriptor FD, a pipe the parent opened; the parent scores from what it reads there, never
from a file the child could rewrite afterwards. The descriptor is made non-inheritable (the student's subprocesses
do not get it) and closed after the final {"event": "end"} (an atexit hook of the student's finds it gone); the
parent ignores anything after "end" and fails a test reported twice. This defends against tampering *after the
fact*. Code that deliberately forges the test reports (or rewires pytest) is defeated by the probes instead: the
parent compares their data with the reference's, computed on a seed drawn for this grading (see
`minillm.course.probes`), and a test whose exercises' probes disagree is worth nothing whatever pytest said.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path


class _Pipe:
    def __init__(self, fd: int):
        self.fd = fd
        os.set_inheritable(fd, False)

    def send(self, **msg) -> None:
        if self.fd < 0:
            return
        data = (json.dumps(msg) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Collector:
    """pytest plugin: after collection, send each graded item's id, points and exercises."""

    def __init__(self, pipe: _Pipe):
        self.pipe = pipe

    def pytest_collectreport(self, report):
        if report.failed:
            self.pipe.send(event="collect_error", where=report.nodeid, output=str(report.longrepr)[-4000:])

    def pytest_collection_finish(self, session):
        for item in session.items:
            marker = item.get_closest_marker("graded")
            if marker is None:
                continue
            exercise = marker.kwargs.get("exercise", ())
            exercises = [exercise] if isinstance(exercise, str) else list(exercise)
            function = getattr(item, "originalname", None) or item.name.split("[")[0]
            self.pipe.send(event="item", id=item.nodeid, file=item.nodeid.split("::")[0].split("/")[-1],
                           function=function, points=marker.kwargs.get("points", 1), exercises=exercises)


class Reporter:
    """pytest plugin: one message per finished test; failed in any phase (setup, call, teardown) is failed."""

    def __init__(self, pipe: _Pipe, student: str):
        self.pipe = pipe
        self.student = Path(student).resolve()
        self.state: dict[str, tuple[str, list[str]]] = {}

    def pytest_sessionstart(self, session):
        # The *student's* package, found through sys.path (not a layer of this one, so not an import statement):
        # checked before any test runs.
        where = Path(importlib.import_module("minillm").__file__).resolve()
        if not where.is_relative_to(self.student):
            self.pipe.send(event="wrong_package", output=f"`import minillm` found {where}, not the student's")
            self.pipe.close()
            os._exit(3)

    def pytest_collectreport(self, report):
        if report.failed:
            self.pipe.send(event="collect_error", where=report.nodeid, output=str(report.longrepr)[-4000:])

    def pytest_runtest_logreport(self, report):
        outcome, texts = self.state.get(report.nodeid, ("pending", []))
        if report.failed:
            outcome = "failed"
            texts.append(f"[{report.when}] {report.longreprtext}"[-4000:])
        elif report.skipped and outcome != "failed":
            outcome = "skipped"
            texts.append(f"[{report.when}] skipped: {report.longreprtext}"[-1000:])
        elif report.when == "call" and outcome == "pending":
            outcome = "passed"
        self.state[report.nodeid] = (outcome, texts)

    def pytest_runtest_logfinish(self, nodeid, location):
        outcome, texts = self.state.pop(nodeid, ("failed", ["no report"]))
        self.pipe.send(event="test", id=nodeid, outcome=outcome if outcome != "pending" else "failed",
                       output="\n".join(texts)[-4000:])

    def pytest_sessionfinish(self, session, exitstatus):
        self.pipe.send(event="end", exitstatus=int(exitstatus))
        self.pipe.close()


PROBES_PACKAGE = "minillm_grading_probes"  # the grader's probes, under a name the student's package cannot shadow


def send_probes(pipe: _Pipe, spec: dict) -> None:
    """Run the chapter's probes (the grader's copy, loaded from spec["dir"]) on the student's package; send each
    exercise's data or error."""
    student = Path(sys.path[0])
    mine = Path(importlib.import_module("minillm").__file__).resolve()
    if not mine.is_relative_to(student):  # probes of another minillm would be the reference's data
        pipe.send(event="wrong_package", output=f"`import minillm` found {mine}, not the student's")
        pipe.close()
        os._exit(3)
    where = Path(spec["dir"]) / "__init__.py"
    found = importlib.util.spec_from_file_location(PROBES_PACKAGE, where, submodule_search_locations=[spec["dir"]])
    package = importlib.util.module_from_spec(found)
    sys.modules[PROBES_PACKAGE] = package
    found.loader.exec_module(package)
    chapter = package.chapter_module(spec["chapter"], PROBES_PACKAGE)
    for exercise, result in package.run_probes(chapter.PROBES, int(spec["seed"]), isolate=True).items():
        pipe.send(event="probe", exercise=exercise, **result)


def main(argv: list[str]) -> int:
    mode, fd, path, probes, sep, *pytest_args = argv
    assert sep == "--", "usage: grader_child.py MODE FD PATH PROBES -- PYTEST_ARGS"
    pipe = _Pipe(int(fd))
    sys.path.insert(0, str(Path(path).resolve()))
    if mode == "run":
        send_probes(pipe, json.loads(probes))
    import pytest

    plugin = Collector(pipe) if mode == "collect" else Reporter(pipe, path)
    code = pytest.main(pytest_args, plugins=[plugin])
    pipe.close()
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
