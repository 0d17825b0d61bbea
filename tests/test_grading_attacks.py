"""Attacks on `minillm grade`, each one found by trying it on the old grader, each now scoring what it should.

The student folders are chapter 01's untouched stubs (which must score 0) plus the attack. The first group runs
without isolation (`isolate=False`): what the grader itself holds on any machine, forged pytest verdicts included
(every report and the end forged, or pytest rewired from the student's code: the probes decide, outside the child).
The second runs isolated (`sandbox.py`'s namespaces), and each of its attacks is also run without isolation first,
to show it is real: reading the reference solutions, a `setsid` daemon that outlives grading, and the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from minillm.course import probes
from minillm.course.assignment import REPO_ROOT, grade, graded_tests, write_assignment
from minillm.course.grading import (GradedTest, GradeReport, _child_env, default_out_dir, isolation_problem,
                                    score_messages)


def _total(nn: str = "01") -> int:
    return sum(t.points for t in graded_tests(nn))


def _stubs_with(tmp_path: Path, init_code: str = "", files: dict[str, str] | None = None) -> Path:
    """Chapter 01's fresh stubs, with `init_code` appended to minillm/__init__.py and extra files in the folder."""
    student = write_assignment("01", tmp_path / "student")
    if init_code:
        init = student / "minillm" / "__init__.py"
        init.write_text(init.read_text() + "\n" + textwrap.dedent(init_code))
    for rel, text in (files or {}).items():
        (student / rel).parent.mkdir(parents=True, exist_ok=True)
        (student / rel).write_text(textwrap.dedent(text))
    return student


# ------------------------------------------------------------------------------------------- scoring, no child
T = (GradedTest("01", "test_a", ("t.py::test_a[1]", "t.py::test_a[2]"), 3, ("f",)),
     GradedTest("01", "test_b", ("t.py::test_b",), 2, ("g",)))


def _msg(i, outcome="passed"):
    return {"event": "test", "id": i, "outcome": outcome, "output": ""}


@pytest.mark.parametrize("messages, score", [
    ([_msg("t.py::test_a[1]"), _msg("t.py::test_a[2]"), _msg("t.py::test_b"), {"event": "end"}], 5),
    ([_msg("t.py::test_a[1]"), _msg("t.py::test_b")], 2),  # an item missing: its function scores 0
    ([_msg("t.py::test_a[1]"), _msg("t.py::test_a[2]"), _msg("t.py::test_a[2]"), _msg("t.py::test_b")], 2),  # twice
    ([_msg("t.py::test_a[1]"), _msg("t.py::test_a[2]", "failed"), _msg("t.py::test_b", "skipped")], 0),
    ([{"event": "end"}, _msg("t.py::test_a[1]"), _msg("t.py::test_a[2]"), _msg("t.py::test_b")], 0),  # after end
    ([_msg("t.py::test_b"), _msg("t.py::test_extra"), _msg("t.py::test_extra2", "failed")], 2),  # extras ignored
    ([], 0),
])
def test_the_total_is_the_references_whatever_the_child_reports(messages, score):
    """A syntax error once scored 0/1 (one collection error counted as one test) and a teardown error became extra
    tests (6/10): the denominator was whatever the JUnit file held. Now it is the reference's points."""
    report = score_messages(GradeReport("01"), T, messages)
    assert (report.score, report.max_score) == (score, 5)


def test_what_the_child_sends_cannot_crash_the_parent():
    """The parent parses and compares what student code may have written: JSON nested past the parser's depth, an
    int too large for a float, a shape that is not a list. Each is a failed comparison, never the grader's crash."""
    from minillm.course.grading import _message
    from minillm.course.probes import difference

    assert _message(b"[" * 100_000 + b"]" * 100_000) is None and _message(b'{"event": "end"}') == {"event": "end"}
    assert "expected 1.0" in difference(1.0, 10**400, 1e-4, 1e-5)
    want = {"tensor": "float32", "shape": [2], "values": [1.0, 2.0]}
    assert "shape" in difference(want, {"tensor": "float32", "shape": 5, "values": 7}, 0.0, 0.0)
    assert difference([1.0, float("nan")], [1.0 + 1e-9, float("nan")], 1e-6, 0.0) is None


@pytest.mark.slow
def test_the_lent_build_cache_never_holds_a_compiled_solution(tmp_path):
    """Chapter 12's child got a copy of the grader's compiled emulator objects, the reference softmax.cu's among
    them: a student's emulator.py could link that object and pass without writing the kernel. Only the objects of
    files without an exercise are lent now."""
    from minillm.course.grading import _lend_build_cache
    from minillm.kernels import emulator

    if emulator.find_cxx() is None:
        pytest.skip("no C++ compiler: the emulator is not built, nothing is lent")
    _lend_build_cache("12", tmp_path)
    lent = {p.name.rsplit("-", 1)[0] for p in (tmp_path / "cache" / "emulator" / "objects").glob("*.o")}
    assert lent and "softmax" not in lent, lent


FLOOD = r'''
import os as _os
_junk = b"x" * (1 << 20)
for _fd in range(3, 64):
    try:
        for _ in range(48):  # 48 MB down every descriptor, the report pipe among them
            _os.write(_fd, _junk)
    except OSError:
        continue
'''


@pytest.mark.slow
def test_a_child_flooding_its_pipe_is_cut_off_and_scores_zero(tmp_path):
    """The parent read whatever the child wrote into memory, and rescanned it all whenever a chunk held "end": a
    flood made grading slow and large. It now stops reading at MAX_PIPE_BYTES and scores what came before."""
    start = time.monotonic()
    report = grade("01", _stubs_with(tmp_path, FLOOD), isolate=False)
    assert (report.score, report.max_score) == (0, _total()) and time.monotonic() - start < 120


def test_the_child_runs_with_the_ci_hypothesis_profile_and_no_plugin_autoload():
    env = _child_env()
    assert env["HYPOTHESIS_PROFILE"] == "ci" and env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
    assert not any(k.startswith("PYTEST_ADDOPTS") or k == "PYTHONPATH" for k in env)


# ------------------------------------------------------------------------------------------- attacks, graded
@pytest.mark.slow
def test_syntax_error_scores_zero_out_of_the_full_total(tmp_path):
    student = _stubs_with(tmp_path, "def broken(:\n")
    report = grade("01", student, isolate=False)
    assert (report.score, report.max_score) == (0, _total())
    assert "SyntaxError" in "\n".join(report.notes)


ATEXIT_ATTACK = r'''
import atexit as _atexit, glob as _glob, json as _json, os as _os, re as _re

def _forge():
    # 1. the old attack: strip <failure> from every JUnit file in reach
    for _p in _glob.glob("/tmp/**/*.xml", recursive=True) + _glob.glob("**/*.xml", recursive=True):
        try:
            _t = open(_p).read()
            open(_p, "w").write(_re.sub(r"<failure.*?</failure>", "", _t, flags=_re.S))
        except OSError:
            pass
    # 2. forge "passed" reports for every test on every open descriptor
    for _fd in range(3, 64):
        for _name in ("test_get_pair_counts_worked_example", "test_merge_worked_example"):
            try:
                _os.write(_fd, (_json.dumps({"event": "test", "outcome": "passed",
                                             "id": "test_01_tokenization.py::" + _name}) + "\n").encode())
            except OSError:
                pass

_atexit.register(_forge)
'''


@pytest.mark.slow
def test_atexit_hook_rewriting_the_report_scores_zero(tmp_path):
    """15 lines of atexit in the student's __init__.py made chapter 01's stubs score 6/6. The parent now scores from
    the pipe, ignores anything after the child's "end", and writes the report itself after the child is gone."""
    report = grade("01", _stubs_with(tmp_path, ATEXIT_ATTACK), isolate=False)
    assert (report.score, report.max_score) == (0, _total())
    assert json.loads((tmp_path / "student-grade" / "results.json").read_text())["score"] == 0


FORGE_AT_IMPORT = r'''
import json as _json, os as _os
for _fd in range(3, 64):  # pre-report every graded test as passed, before the real reports arrive
    for _name in ("test_get_pair_counts_worked_example", "test_merge_worked_example",
                  "test_encode_chunk_worked_example", "test_encode_chunk_merge_order_decides_the_ids",
                  "test_encode_chunk_matches_tiktoken_on_shipped_ranks",
                  "test_training_and_encoding_match_the_golden_files"):
        try:
            _os.write(_fd, (_json.dumps({"event": "test", "outcome": "passed",
                                         "id": "test_01_tokenization.py::" + _name}) + "\n").encode())
        except OSError:
            pass
'''


@pytest.mark.slow
def test_forged_reports_written_to_the_pipe_count_as_duplicates(tmp_path):
    report = grade("01", _stubs_with(tmp_path, FORGE_AT_IMPORT), isolate=False)
    assert (report.score, report.max_score) == (0, _total())


# Every graded item reported passed, then a forged end, then the child exits before pytest runs anything: with the
# verdict taken from the pipe alone, chapter 01's untouched stubs scored full marks.
FORGE_EVERYTHING = r'''
import json as _json, os as _os
for _fd in range(3, 64):
    try:
        for _id in %r:
            _line = _json.dumps({"event": "test", "outcome": "passed", "id": _id, "output": ""}) + "\n"
            _os.write(_fd, _line.encode())
        _os.write(_fd, (_json.dumps({"event": "end", "exitstatus": 0}) + "\n").encode())
    except OSError:
        continue
_os._exit(0)
'''

# pytest rewired from the student's package: every report, whatever happened, becomes "passed".
REWIRE_PYTEST = r'''
import _pytest.reports as _reports
_make = _reports.TestReport.from_item_and_call.__func__
def _always_passed(cls, item, call):
    report = _make(cls, item, call)
    report.outcome, report.longrepr = "passed", None
    return report
_reports.TestReport.from_item_and_call = classmethod(_always_passed)
'''


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["forge-everything", "rewire-pytest"])
def test_forged_verdicts_earn_nothing_because_the_probes_decide(attack, tmp_path, monkeypatch):
    """Both attacks make pytest's word alone a full score (checked below on the very messages the child sent). The
    probes, compared outside the child with the reference's data on a seed drawn for this grading, give 0."""
    from minillm.course import grading

    sent = []
    score = grading.score_messages
    monkeypatch.setattr(grading, "score_messages", lambda report, expected, messages, *args, **kw: (
        sent.append(messages), score(report, expected, messages, *args, **kw))[1])
    items = [i for t in graded_tests("01") for i in t.items]
    code = FORGE_EVERYTHING % (items,) if attack == "forge-everything" else REWIRE_PYTEST
    report = grade("01", _stubs_with(tmp_path, code), isolate=False)
    assert score(GradeReport("01"), graded_tests("01"), sent[0]).score == _total()  # the forgery is complete
    assert (report.score, report.max_score) == (0, _total())
    assert report.probes and all(problem is not None for problem in report.probes.values()), report.probes


CONFTEST_ATTACK = '''
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
'''


@pytest.mark.slow
def test_conftest_pytest_ini_and_plugin_in_the_student_folder_are_not_loaded(tmp_path):
    """A conftest.py that turns every report into a pass, in the folder and in its tests/, a pytest.ini loading it as
    a plugin, an entry-point plugin (a *.dist-info with pytest11) and a module shadowing pytest's: all ignored, since
    the child sees only a copy of the student's minillm/ package."""
    student = _stubs_with(tmp_path, files={
        "conftest.py": CONFTEST_ATTACK,
        "tests/conftest.py": CONFTEST_ATTACK,
        "evil_plugin.py": CONFTEST_ATTACK,
        "pytest.ini": "[pytest]\naddopts = -p evil_plugin\n",
        "evil-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n",
        "evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evil_plugin\n",
        "_hypothesis_pytestplugin.py": CONFTEST_ATTACK,
    })
    report = grade("01", student, isolate=False)
    assert (report.score, report.max_score) == (0, _total())


@pytest.mark.slow
def test_student_code_cannot_change_the_reference_tests_or_outlive_grading(tmp_path):
    """The student's code once appended a line to the reference's tests/test_04_kv_cache.py (kept for every later
    student) and left a process running. Now the child runs a hashed copy (a changed copy voids the grade), the
    repository's file is untouched, and the child's whole process group is killed when grading ends."""
    pid_file = tmp_path / "pid"
    attack = f'''
    import os as _os, subprocess as _sp, sys as _sys
    _p = _sp.Popen(["sleep", "300"])
    open({str(pid_file)!r}, "w").write(str(_p.pid))
    for _root, _dirs, _files in _os.walk(_os.getcwd()):
        for _f in _files:
            if _f.startswith("test_01"):
                _path = _os.path.join(_root, _f)
                _os.chmod(_path, 0o644)
                open(_path, "a").write("\\n# the student was here\\n")
    '''
    reference = REPO_ROOT / "tests" / "test_01_tokenization.py"
    before = hashlib.sha256(reference.read_bytes()).hexdigest()
    report = grade("01", _stubs_with(tmp_path, attack), isolate=False)
    assert hashlib.sha256(reference.read_bytes()).hexdigest() == before
    assert report.score == 0 and any("modified" in n for n in report.notes), report.notes
    pid = int(pid_file.read_text())
    for _ in range(50):  # killed at once; give the reaper a moment
        state = Path(f"/proc/{pid}/stat")
        if not state.exists() or state.read_text().split(") ")[-1].startswith("Z"):
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail(f"the student's process {pid} outlived grading")


@pytest.mark.slow
def test_the_grader_never_writes_through_a_symlink(tmp_path):
    """With the output folder a symlink, the grader overwrote a results.json in another directory."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "results.json").write_text("precious")
    student = _stubs_with(tmp_path)
    out = default_out_dir(student)
    out.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="symlink"):
        grade("01", student, isolate=False)
    # planted by the student's code while the tests run: refused too
    out.unlink()
    init = student / "minillm" / "__init__.py"
    init.write_text(init.read_text() + textwrap.dedent(f'''
        import os as _os
        if not _os.path.islink({str(out)!r}):
            _os.rmdir({str(out)!r})  # the grader made it, empty, before the tests ran
            _os.symlink({str(elsewhere)!r}, {str(out)!r})
    '''))
    with pytest.raises(ValueError, match="symlink"):
        grade("01", student, isolate=False)
    assert (elsewhere / "results.json").read_text() == "precious"
    # a symlink *inside* a real output directory is replaced, not followed
    chosen = tmp_path / "out"
    chosen.mkdir()
    (chosen / "results.json").symlink_to(elsewhere / "results.json")
    out.unlink()
    init.write_text(init.read_text().split("import os as _os\nif not")[0])  # the attack removed again
    grade("01", student, out_dir=chosen, isolate=False)
    assert not (chosen / "results.json").is_symlink() and (elsewhere / "results.json").read_text() == "precious"


# ------------------------------------------------------------------------------------------- attacks, isolated
needs_isolation = pytest.mark.skipif(isolation_problem() is not None,
                                     reason=f"grading isolation is not available here: {isolation_problem()}")

# Copies the reference's own tokenizer code over the stubs when the reference can be read: found the way the
# original attack found it (the installed distribution's direct_url.json), or by the repository's path.
READ_REFERENCE = r'''
import importlib as _il, json as _json, os as _os
def _reference_root():
    try:
        from importlib import metadata as _md
        _url = _json.loads(_md.distribution("minillm").read_text("direct_url.json") or "{}").get("url", "")
        if _url.startswith("file://") and _os.path.isdir(_url[7:] + "/minillm/tokenizer"):
            return _url[7:]
    except Exception:
        pass
    return %r if _os.path.isdir(%r + "/minillm/tokenizer") else None
_root = _reference_root()
if _root is not None:
    _changed = {}
    for _name in ("minillm.tokenizer.basics", "minillm.tokenizer.encode"):
        _m = _il.import_module(_name)
        _src = open(_os.path.join(_root, *_name.split(".")) + ".py").read()
        exec(compile(_src, _m.__file__, "exec"), _m.__dict__)
        _changed[_name] = _m
    import sys as _sys
    for _mname, _p in list(_sys.modules.items()):  # names imported from them before the copy: pointed at it
        if not _mname.startswith("minillm") or _p is None or _mname in _changed:
            continue
        for _k, _v in list(vars(_p).items()):
            _src_mod = _changed.get(getattr(_v, "__module__", None))
            if callable(_v) and _src_mod is not None and hasattr(_src_mod, _k):
                setattr(_p, _k, getattr(_src_mod, _k))
''' % (str(REPO_ROOT), str(REPO_ROOT))


@needs_isolation
@pytest.mark.slow
def test_isolated_student_code_cannot_read_the_reference(tmp_path):
    """The student's package found the reference through the installed distribution and ran its solutions: full
    marks without solving anything. Isolated, the repository is an empty folder to the child: 0."""
    student = _stubs_with(tmp_path, READ_REFERENCE)
    assert grade("01", student, out_dir=tmp_path / "open", isolate=False).score == _total()  # the attack is real
    report = grade("01", student, out_dir=tmp_path / "closed", isolate=True)
    assert (report.score, report.max_score) == (0, _total()) and report.notes[0].startswith("isolated")


@needs_isolation
@pytest.mark.slow
def test_isolated_student_code_cannot_outlive_grading(tmp_path):
    """A daemon (double fork + setsid: out of the child's process group) wrote after grading had ended; it could
    have rewritten the grade. Isolated, it dies with the child's PID namespace."""
    drops = {phase: Path(tempfile.mkdtemp(prefix=f"minillm-drop-{phase}-")) for phase in ("open", "closed")}
    try:
        reports = {}
        for phase, isolate in (("open", False), ("closed", True)):
            drop = drops[phase]
            drop.chmod(0o777)  # the isolated child may run as another user
            daemon = (f"import os, time\nparent = os.getppid()\nwhile os.getppid() == parent:\n    time.sleep(0.05)\n"
                      f"open({str(drop)!r} + '/' + str(os.getpid()), 'w').write('late')")  # once grading has ended
            attack = f'''
            import subprocess as _sp, sys as _sys
            _sp.Popen([_sys.executable, "-c", {daemon!r}], start_new_session=True, stdin=_sp.DEVNULL,
                      stdout=_sp.DEVNULL, stderr=_sp.DEVNULL)
            '''
            student = _stubs_with(tmp_path / phase, attack)
            reports[phase] = grade("01", student, out_dir=tmp_path / f"{phase}-grade", isolate=isolate)
        assert _wait_for(lambda: any(drops["open"].iterdir()), 15)  # the attack is real: it wrote after grading
        time.sleep(3)  # time for an isolated daemon to write, had any survived its grading child
        assert not any(drops["closed"].iterdir()) and reports["closed"].score == 0
    finally:
        for drop in drops.values():
            shutil.rmtree(drop, ignore_errors=True)


@needs_isolation
@pytest.mark.slow
def test_isolated_student_code_has_no_network(tmp_path):
    """A listener on this machine's loopback stands for the network: reached from the child without isolation,
    unreachable with it (the child's network namespace has its own loopback and no route out)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    attack = f'''
    import socket as _s
    try:
        _s.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"solutions please")
    except OSError:
        pass
    '''
    student = _stubs_with(tmp_path, attack)
    try:
        grade("01", student, out_dir=tmp_path / "open", isolate=False)
        assert _accepted(server)  # the attack is real
        grade("01", student, out_dir=tmp_path / "closed", isolate=True)
        assert not _accepted(server)
    finally:
        server.close()


def _accepted(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except socket.timeout:
        return False
    conn.close()
    return True


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_isolate_refuses_what_it_cannot_do(tmp_path, monkeypatch):
    from minillm.course import grading
    student = _stubs_with(tmp_path)
    with pytest.raises(TypeError, match="isolate"):
        grade("01", student, isolate="yes")
    monkeypatch.setattr(grading, "isolation_problem", lambda: "no namespaces on this test's machine")
    with pytest.raises(ValueError, match="no namespaces on this test's machine"):
        grade("01", student, isolate=True)


def _segfault(seed):
    os.kill(os.getpid(), signal.SIGSEGV)


def _hang(seed):
    time.sleep(60)


def _exit_silently(seed):
    os._exit(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="probes run in forked processes only where os.fork exists")
def test_a_crashing_or_hanging_exercise_costs_its_own_probe_only():
    """In the grading child each probe runs in a forked process with a time limit: a student's kernel that
    segfaults, loops or exits costs that exercise, and the probes after it still run."""
    started = time.monotonic()
    got = probes.run_probes({"crash": probes.Probe(_segfault), "hang": probes.Probe(_hang),
                             "exit": probes.Probe(_exit_silently), "fine": probes.Probe(lambda seed: [seed, 1.5]),
                             "raises": probes.Probe(lambda seed: 1 / 0)}, seed=7, isolate=True, seconds=2)
    assert time.monotonic() - started < 30
    assert "SIGSEGV" in got["crash"]["error"]
    assert "longer than 2 s" in got["hang"]["error"]
    assert "without its data" in got["exit"]["error"]
    assert got["fine"] == {"data": [7, 1.5]}
    assert got["raises"]["error"].startswith("ZeroDivisionError")
    assert probes.run_probes({"fine": probes.Probe(lambda seed: seed)}, seed=3) == {"fine": {"data": 3}}


# Chapter 12's kernel exercise answered in Python: the student's own emulator.py returns torch's softmax for
# version 2 and never compiles softmax.cu, whose body stays the empty stub. pytest's tests call that emulator.py.
EMULATOR_BYPASS = r'''
import torch as _torch
from minillm.kernels import emulator as _emulator
_real = _emulator.softmax
def _softmax(x, version, reverse=False, lib=None):
    return _torch.softmax(x.float(), dim=-1).to(x.dtype) if version == 2 else _real(x, version, reverse, lib)
_emulator.softmax = _softmax
'''


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None and not os.environ.get("CXX"),
                    reason="chapter 12's kernel probe needs a C++ compiler for the emulator")
def test_a_kernel_answered_by_the_students_emulator_python_earns_nothing(tmp_path, monkeypatch):
    """pytest passes the softmax kernel's tests (checked on the child's own messages), but the probe compiles the
    student's softmax.cu with the grader's emulator, loaded by path, so the exercise earns 0."""
    from minillm.course import grading

    sent = []
    score = grading.score_messages
    monkeypatch.setattr(grading, "score_messages", lambda report, expected, messages, *args, **kw: (
        sent.append(messages), score(report, expected, messages, *args, **kw))[1])
    student = write_assignment("12", tmp_path / "student")
    init = student / "minillm" / "__init__.py"
    init.write_text(init.read_text() + "\n" + EMULATOR_BYPASS)
    report = grade("12", student, isolate=False)
    kernel_tests = [m for m in sent[0] if m.get("event") == "test" and "softmax_v2_kernel" in m.get("id", "")]
    assert kernel_tests and all(m["outcome"] == "passed" for m in kernel_tests), kernel_tests  # the bypass works
    assert report.probes["softmax_v2_kernel"] is not None, report.probes
    assert report.score == 0, (report.score, report.probes)
