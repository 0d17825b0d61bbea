"""The shared machinery: command line, tour table, timing, atomic writes, devices."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from minillm.bench.cli import cpu_description
from minillm.chapters import built as built_chapters
from minillm.course.cli import build_parser, main
from minillm.core.device import resolve_device
from minillm.core.io import atomic_save_safetensors, atomic_write_bytes, atomic_write_text
from minillm.core.timing import compare, interleave, measure
from minillm.course.tour import available_chapters, run_tour
from minillm.core.rows import Row, TourContext, format_table, rows_to_json, summary_line


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("tour", "assignment", "grade"):
        assert command in out
    # every registered subcommand has a one-line help
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for action in sub._choices_actions:
        assert action.help, f"subcommand {action.dest} has no help line"


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_every_tour_entry_has_title_and_run():
    entries = available_chapters()
    assert "01" in entries
    for ch, module in entries.items():
        assert isinstance(module.TITLE, str) and module.TITLE
        assert callable(module.run)


def test_tour_rejects_unknown_chapter():
    with pytest.raises(ValueError, match="99"):
        run_tour(TourContext(device=torch.device("cpu")), ["99"], progress=False)
    with pytest.raises(ValueError, match="abc"):
        run_tour(TourContext(device=torch.device("cpu")), ["abc"], progress=False)


def test_failing_chapter_becomes_failed_row(monkeypatch):
    import minillm.course.tour as tour

    class Broken:
        TITLE = "broken"

        @staticmethod
        def run(ctx):
            raise RuntimeError("boom")

    monkeypatch.setattr(tour, "available_chapters", lambda: {"42": Broken})
    rows, seconds = run_tour(TourContext(device=torch.device("cpu")), progress=False)
    assert len(rows) == 1 and not rows[0].check_passed and "boom" in rows[0].check
    assert set(seconds) == {"42"}


def test_tour_sets_and_restores_threads(monkeypatch):
    import minillm.course.tour as tour

    seen = []

    class Probe:
        TITLE = "probe"

        @staticmethod
        def run(ctx):
            seen.append(torch.get_num_threads())
            return []

    monkeypatch.setattr(tour, "available_chapters", lambda: {"42": Probe})
    before = torch.get_num_threads()
    run_tour(TourContext(device=torch.device("cpu"), threads=1), progress=False)
    assert seen == [1] and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        TourContext(device=torch.device("cpu"), threads=0)


def test_tour_cli_exit_code_and_json(monkeypatch, tmp_path, capsys):
    import minillm.course.tour as tour

    class Ok:
        TITLE = "ok"

        @staticmethod
        def run(ctx):
            return [Row("42", "t", "b", "o", "identical", True, "speed-up", 2.0, "x", str(ctx.device))]

    class Bad:
        TITLE = "bad"

        @staticmethod
        def run(ctx):
            return [Row("43", "t", "b", "o", "different", False, "speed-up", 1.0, "x", str(ctx.device))]

    monkeypatch.setattr(tour, "available_chapters", lambda: {"42": Ok, "43": Bad})
    out = tmp_path / "rows.json"
    assert main(["tour", "--chapter", "42", "--device", "cpu", "--json", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert data[0]["chapter"] == "42" and data[0]["check_passed"] is True
    for key in ("chapter", "technique", "check_passed", "metric", "value", "device"):
        assert key in data[0]
    assert main(["tour", "--device", "cpu", "--no-progress", "--threads", "2"]) == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "1 passed, 0 skipped, 1 failed on cpu" in printed
    assert f"CPU: {cpu_description()}, 2 torch thread(s)" in printed  # where the figures were measured


def test_row_validation_and_table():
    with pytest.raises(TypeError, match="check_passed"):
        Row("01", "t", "b", "o", "c", "yes", "m", 1.0)
    rows = [Row("01", "bpe", "naive", "incremental", "identical merges", True, "speed-up", 12.345, "x")]
    table = format_table(rows)
    assert "12.35x" in table and "PASS  identical merges" in table
    assert json.loads(rows_to_json(rows))[0]["value"] == pytest.approx(12.345)


def test_table_fits_120_columns_and_wraps_inside_cells():
    long = "a check whose evidence is much longer than its column " * 3
    rows = [Row("04", "KV cache, 256 new tokens (prompt 1), the longest technique name", "HF generate(use_cache=True)",
                "o", long, True, "per-step speed-up", 8.64, "x")]
    lines = format_table(rows).splitlines()
    assert max(len(line) for line in lines) <= 120
    assert len(lines) > 3  # the long cells wrapped onto extra lines instead of widening the table
    assert "".join(lines).replace(" ", "").count("evidence") == 3  # nothing was cut


def test_a_check_that_did_not_run_is_skip_never_pass():
    skip = Row("01", "GPT-2 ranks", "tiktoken", "ours", "no GPT-2 rank file", False, "MB", float("nan"), skipped=True)
    ok = Row("01", "t", "b", "o", "fine", True, "m", 1.0)
    bad = Row("01", "t", "b", "o", "broken", False, "m", 1.0)
    assert (skip.status, ok.status, bad.status) == ("SKIP", "PASS", "FAIL")
    assert not skip.failed and bad.failed
    assert "SKIP  no GPT-2 rank file" in format_table([skip]) and "PASS" not in format_table([skip])
    assert summary_line([skip, ok, bad]) == "1 passed, 1 skipped, 1 failed"
    with pytest.raises(ValueError, match="skipped and passed"):
        Row("01", "t", "b", "o", "c", True, "m", 1.0, skipped=True)


def test_tour_silences_hugging_face_advice_but_restores_it():
    import logging

    from minillm.course.tour import quiet_third_party_logs

    logger = logging.getLogger("transformers")
    before = logger.level
    with quiet_third_party_logs():
        assert logger.level == logging.ERROR and os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    assert logger.level == before


def test_measure_and_compare_count_calls():
    calls = {"a": 0, "b": 0}

    def a():
        calls["a"] += 1

    def b():
        calls["b"] += 1

    t = measure(a, warmup=2, repeats=3)
    assert calls["a"] == 5 and len(t.times) == 3 and t.median >= 0
    c = compare(a, b, warmup=1, repeats=4)
    assert calls["b"] == 5 and len(c.baseline.times) == len(c.candidate.times) == 4
    with pytest.raises(ValueError, match="repeats"):
        measure(a, repeats=0)


def test_interleave_runs_the_callables_in_turn():
    order: list[str] = []
    timings = interleave([lambda: order.append("a"), lambda: order.append("b"), lambda: order.append("c")],
                         warmup=1, repeats=2)
    assert order == list("abc" * 3) and [len(t.times) for t in timings] == [2, 2, 2]
    with pytest.raises(ValueError, match="at least one"):
        interleave([])


def test_atomic_writes_leave_no_temp_files(tmp_path):
    p = atomic_write_text(tmp_path / "sub" / "a.txt", "hello")
    assert p.read_text() == "hello"
    atomic_write_bytes(p, b"bye")
    assert p.read_bytes() == b"bye"
    assert sorted(os.listdir(p.parent)) == ["a.txt"]
    umask = os.umask(0)
    os.umask(umask)
    assert (p.stat().st_mode & 0o777) == 0o666 & ~umask  # like open(), not mkstemp's 0600
    with pytest.raises(TypeError, match="bytes"):
        atomic_write_bytes(p, "not bytes")
    from safetensors.torch import load_file

    t = {"w": torch.arange(6.0).view(2, 3).t()}  # non-contiguous on purpose
    atomic_save_safetensors(t, tmp_path / "w.safetensors")
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], t["w"])


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    p = atomic_write_text(tmp_path / "a.txt", "old")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(p, "new")
    assert p.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]


def test_cpu_description_names_the_cpu_torch_and_its_vector_kernels(monkeypatch, tmp_path):
    """Every benchmark report names the machine it ran on: which PyTorch and which kernel ISA; without /proc/cpuinfo
    the name comes from `platform`, never an exception."""
    from minillm.bench import cli

    text = cli.cpu_description()
    assert torch.__version__ in text and torch.backends.cpu.get_cpu_capability() in text
    cli.write_report(str(tmp_path / "r.json"), {"rows": [1]})
    report = json.loads((tmp_path / "r.json").read_text())  # run under pytest, not `python -m`: no bench or command
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", report.pop("date")) and report == {"rows": [1], "cpu": text}
    cli.write_report(str(tmp_path / "s.json"), {"cpu": "named by the benchmark"})  # a report's own name is kept
    assert json.loads((tmp_path / "s.json").read_text())["cpu"] == "named by the benchmark"
    monkeypatch.setattr(cli.Path, "is_file", lambda self: False)
    monkeypatch.setattr(cli.platform, "processor", lambda: "")
    monkeypatch.setattr(cli.platform, "machine", lambda: "")
    assert cli.cpu_description().startswith("unknown CPU (torch ")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError, match="tpu"):
        resolve_device("tpu")
    with pytest.raises(TypeError):
        resolve_device(3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")


def test_tools_learn_the_chapter_map_from_the_manifest():
    """Tour, assignment, notebooks and the GPU report all read `minillm.chapters`; none keeps its own map."""
    from minillm import chapters
    from minillm.course.assignment import CHAPTER_FILES, chapter_test_file
    from minillm.course.gpu_report import chapter_table
    from minillm.course.notebooks import NOTEBOOK_DIR, list_notebooks

    built = chapters.built()
    assert list(available_chapters()) == [c.number for c in built]
    assert all(available_chapters()[c.number].__name__ == c.tour for c in built)
    assert CHAPTER_FILES == {c.number: list(c.exercises) for c in built if c.exercises}
    # The built chapters' labs, plus the lab of a chapter under construction once it is on disk.
    drafted = [c for c in chapters.CHAPTERS if not c.built and (NOTEBOOK_DIR / f"{c.name}.ipynb").is_file()]
    assert [p.name for p in list_notebooks()] == [c.name + ".ipynb" for c in chapters.CHAPTERS
                                                  if c.built or c in drafted]
    assert all(chapter_test_file(c.number).name == c.test_file.split("/")[-1] for c in built)
    rows = [Row("01", "t", "b", "o", "ok", True, "m", 1.0), Row("02", "t", "b", "o", "bad", False, "m", 1.0)]
    table = chapter_table(rows)
    assert "| 01-tokenization | 1/1 | verified |" in table and "| 02-gpt | 0/1 | FAILED |" in table
    assert "| 03-naive-inference | 0/0 | not run |" in table
    assert "| 15-serving | 0/0 | not run |" in table and len(table) == 2 + len(chapters.CHAPTERS)


def test_public_surface():
    """What the README promises at `import minillm` keeps working, whatever the layout underneath."""
    import minillm
    from minillm.disagg.llm import DisaggregatedLLM
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm import LLM

    assert (minillm.LLM, minillm.EngineConfig, minillm.DisaggregatedLLM) == (LLM, EngineConfig, DisaggregatedLLM)
    assert set(minillm.__all__) >= {"GPT", "GPTConfig", "SamplingParams", "LLM", "EngineConfig",
                                    "DisaggregatedLLM", "load", "load_tokenizer"}
    with pytest.raises(AttributeError, match="no_such_name"):
        minillm.no_such_name
    assert minillm.load_tokenizer().vocab_size == 4096


@pytest.mark.slow
@pytest.mark.parametrize("chapter", [c.number for c in built_chapters()])
def test_every_chapter_tour_check_passes(chapter):
    """Each built chapter's real tour entry, run end to end (--quick sizes): every check passes or says why it
    could not run. One test per chapter (5-65 s each here), so pytest-xdist spreads them over its workers; that
    every built chapter has an entry is checked above. Timings are reported by the tour and never asserted here."""
    rows, seconds = run_tour(TourContext(device=torch.device("cpu"), quick=True), chapters=[chapter], progress=False)
    assert list(seconds) == [chapter]
    assert rows and {r.chapter for r in rows} == {chapter}, "the chapter produced no row"
    failed = [f"{r.chapter} {r.technique}: {r.check}" for r in rows if r.failed]
    assert not failed, "\n".join(failed)


def test_output_paths_are_checked_before_the_work(tmp_path, capsys):
    """A directory given where a file goes is refused at once, naming the flag, not after minutes of work."""
    from minillm.core.io import atomic_save_figure, check_output_file

    with pytest.raises(ValueError, match="--plot .* is a directory"):
        check_output_file(tmp_path, "--plot", (".png",))
    with pytest.raises(ValueError, match="must end in .json"):
        check_output_file(tmp_path / "x.txt", "--json", (".json",))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_output_file(tmp_path / "file" / "out.json", "--json", (".json",))
    assert check_output_file(None, "--json") is None
    assert check_output_file(tmp_path / "new" / "r.json", "--json", (".json",)) == tmp_path / "new" / "r.json"
    # the commands check before loading a model: these return at once with a clear error
    assert main(["bench", "--plot", str(tmp_path), "--random-init", "--model", "tiny"]) == 2
    assert main(["tour", "--json", str(tmp_path), "--chapter", "01"]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "--json" in err and "is a directory" in err
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    out = atomic_save_figure(fig, tmp_path / "f.png")
    plt.close(fig)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp*"))


def test_gpu_report_runs_the_gpu_benchmarks_and_states_the_budget(tmp_path, monkeypatch):
    """The report's own logic on any machine: a GPU stubbed in (environment, tour), the benchmarks replaced by small
    stdlib commands (one writes its JSON report, one fails, one runs out of time). Every outcome is recorded, a
    failed or stuck benchmark fails the report without stopping it, and the wall time is set against the budget."""
    from minillm.course import gpu_report

    monkeypatch.setattr(gpu_report.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_report, "environment", lambda: {"date": "2026-12-01T00:00:00+00:00", "gpu": "Test GPU"})
    monkeypatch.setattr(gpu_report, "run_tour", lambda ctx, progress: (
        [Row("13", "t", "b", "o", "ok", True, "m", 1.0)], {"13": 0.1}))
    stuck = gpu_report.run_benchmark("stuck", "timeit", ("-n", "1", "import time; time.sleep(30)"), timeout=2,
                                     workdir=tmp_path)
    assert stuck["timed_out"] and stuck["exit_code"] is None and stuck["seconds"] < 20
    source = tmp_path / "figures.json"
    source.write_text('{"speed-up": 2.5}')
    monkeypatch.setattr(gpu_report, "GPU_BENCHMARKS", (("passes", "json.tool", (str(source), "{json}")),
                                                       ("fails", "json.tool", (str(tmp_path / "missing.json"),))))
    md, passed = gpu_report.run_report(run_tests=False, out_dir=tmp_path / "reports", bench_timeout=60)
    text = md.read_text()
    assert not passed and "**FAILED**" in text  # the second benchmark reads a file that does not exist
    assert "## Benchmark: passes" in text and "## Benchmark: fails" in text and "exit code 2" in text
    assert "within the 8-minute budget" in text
    data = json.loads(md.with_suffix(".json").read_text())
    assert [b["exit_code"] for b in data["benchmarks"]] == [0, 2] and data["budget_seconds"] == 480
    assert data["benchmarks"][0]["report"] == {"speed-up": 2.5}  # the benchmark's own JSON, read back
    md, passed = gpu_report.run_report(run_tests=False, out_dir=tmp_path / "reports", benchmarks=False)
    assert passed and "## Benchmark" not in md.read_text()


def test_every_source_file_the_package_compiles_is_package_data():
    """A non-editable install (pip install git+..., as in Colab) ships only what package-data names: every C++ and
    CUDA file the kernels, the emulator and the CPU decode step compile must match one of its patterns."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["minillm"]
    package = root / "minillm"
    shipped = {p for pattern in patterns for p in package.glob(pattern)}  # globbed as setuptools does: * stops at /
    sources = [p for ext in ("*.cu", "*.cuh", "*.h", "*.cpp") for p in package.rglob(ext)]
    assert sources
    missing = sorted(p.relative_to(package).as_posix() for p in sources if p not in shipped)
    assert not missing, f"not in package-data {patterns}: {missing}"


@pytest.mark.parametrize("argv, says", [
    (["bench", "--random-init", "--model", "tiny", "--prompt-len", "0"],
     "argument --prompt-len: must be a positive int"),
    (["bench", "--random-init", "--model", "tiny", "--repeats", "x"], "argument --repeats: must be a positive int"),
    (["bench", "--random-init", "--model", "tiny", "--warmup", "-1"], "argument --warmup: must be a non-negative int"),
    (["tour", "--seed", "-1"], "argument --seed: must be a non-negative int"),
])
def test_count_and_seed_flags_are_usage_errors_naming_the_flag(argv, says, capsys):
    """Before: `minillm bench --prompt-len 0` named BenchCase.prompt_len, a field the user never typed, and
    `minillm tour --seed -1` started the tour and failed every chapter."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_tour_reads_its_corpus_before_the_first_chapter(tmp_path, capsys, monkeypatch):
    """Before: a missing or binary --corpus was ignored by chapters that read none, or met as a FAIL row later."""
    import minillm.course.cli as cli

    monkeypatch.setattr(cli, "run_tour", lambda *a, **k: pytest.fail("the tour started"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    for path, says in ((tmp_path / "none.txt", "corpus file not found"), (tmp_path / "bin.txt", "is not valid UTF-8"),
                       (tmp_path, "corpus file not found")):
        assert main(["tour", "--corpus", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("minillm tour: error: --corpus: ") and says in err


def test_tour_json_must_name_a_file(capsys, monkeypatch):
    """Before: `minillm tour --json ""` ran the whole tour, exited 0 and wrote nothing."""
    import minillm.course.cli as cli

    monkeypatch.setattr(cli, "run_tour", lambda *a, **k: pytest.fail("the tour started"))
    assert main(["tour", "--json", ""]) == 2
    assert "--json must name a .json file, got an empty string" in capsys.readouterr().err
