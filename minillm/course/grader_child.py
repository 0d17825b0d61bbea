"""The grader's side of the grading child: run pytest and report each graded test's outcome over a pipe.

`minillm.course.grading` runs this file as a script (`python -I grader_child.py MODE FD PATH -- PYTEST_ARGS`), never
imports it: in the child, `import minillm` must find the *student's* package, so this file imports nothing from
minillm. Two modes:

    collect  FD ROOT    (run on the reference) collect the tests marked graded and send their ids, points and
                        exercises, one JSON line each
    run      FD STUDENT run the graded tests with STUDENT (the folder holding the student's minillm/) first on
                        sys.path, and send one JSON line per finished test: {"event": "test", "id", "outcome", "output"}

The messages go to file descriptor FD, a pipe the parent opened; the parent scores from what it reads there, never
from a file the child could rewrite afterwards. The descriptor is made non-inheritable (the student's subprocesses
do not get it) and closed after the final {"event": "end"} (an atexit hook of the student's finds it gone); the
parent ignores anything after "end" and fails a test reported twice. This defends against tampering *after the
fact*; code that deliberately rewires pytest inside the child is not defended against (see grading.py).
"""

from __future__ import annotations

import importlib
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


def main(argv: list[str]) -> int:
    mode, fd, path, sep, *pytest_args = argv
    assert sep == "--", "usage: grader_child.py MODE FD PATH -- PYTEST_ARGS"
    pipe = _Pipe(int(fd))
    sys.path.insert(0, str(Path(path).resolve()))
    import pytest

    plugin = Collector(pipe) if mode == "collect" else Reporter(pipe, path)
    code = pytest.main(pytest_args, plugins=[plugin])
    pipe.close()
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
