"""Every chapter notebook runs top to bottom in a fresh kernel, and every committed one carries real outputs: every
figure its cells draw, kernel metadata, no paths of the machine that ran it, and a first cell that installs minillm
in Colab and does nothing anywhere else."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest

from minillm.course.notebooks import REPO_PLACEHOLDER, execute_notebook, list_notebooks, set_repo

NOTEBOOKS = list_notebooks()


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no NN-slug.ipynb"


# The test proves every cell runs; it need not repeat the committed run's full measurements. These notebooks run
# here with fewer repeats, loads or sizes (the same code; the committed outputs are from the sizes in the notebook,
# and `python -m minillm.course.notebooks run` reproduces them). Each text must occur exactly once in the notebook.
SMALLER = {
    "08-speculative-decoding": [
        ("gamma=gamma), warmup=1, repeats=3)", "gamma=gamma), warmup=0, repeats=1)"),  # the gamma sweep's timing
        ("N = 20_000", "N = 10_000"),  # accept_or_resample draws (its TV bound of 0.02 still holds with margin)
        ("M = 2_000", "M = 1_000"),  # end-to-end sampling runs (its TV bound of 0.06 still holds with margin)
        ("code_prompts(tokenizer, 5)", "code_prompts(tokenizer, 1)"),
        ("[1, 2, 4, 6], repeats=3)", "[1, 2, 4, 6], repeats=1)"),
        ("loads = (1, 2, 4, 8, 16)", "loads = (1, 4)"),
    ],
    "02-gpt": [
        ("val = default_eval_tokens(16_384)", "val = default_eval_tokens(4096)"),  # perplexity tokens
    ],
    "09-quantization": [
        ("val = default_eval_tokens(8192)", "val = default_eval_tokens(2048)"),
        ("steps=10, batch_size=QAT_BATCH", "steps=2, batch_size=QAT_BATCH"),
        ("layer_costs(repeats=3, calls=20)", "layer_costs(repeats=1, calls=5)"),
    ],
    "10-pruning": [
        ("val = default_eval_tokens(8192)", "val = default_eval_tokens(2048)"),
        ("sparsities = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]", "sparsities = [0.3, 0.5, 0.7]"),
        ("recover(pruned, model, steps=20)", "recover(pruned, model, steps=2)"),
        ("generate_ids(m, prompt, params), repeats=3)", "generate_ids(m, prompt, params), repeats=1)"),
        ("layer_costs(repeats=3, calls=20)", "layer_costs(repeats=1, calls=5)"),
    ],
    "11-distillation": [
        ("val = default_eval_tokens(32768)", "val = default_eval_tokens(4096)"),
        ("prompts = val_prompts(8, 32)", "prompts = val_prompts(4, 32)"),
        ("gammas = [1, 2, 4, 6]", "gammas = [1, 4]"),
        ("[1, 4], repeats=3)", "[1, 4], repeats=1)"),
    ],
    "06-continuous-batching": [
        ("num_decodes=16, chunk=16, repeats=3)", "num_decodes=16, chunk=16, repeats=1)"),  # chunked prefill's ITL
    ],
    "12-cuda-kernels": [  # where nvcc is installed: one architecture (tests/test_12 checks both for spills)
        ('build.compile_sources_with_nvcc(("sm_80", "sm_90"), d)', 'build.compile_sources_with_nvcc(("sm_90",), d)'),
    ],
    "13-compilation": [
        ("dec.generate_ids(prompt, params), repeats=3)", "dec.generate_ids(prompt, params), repeats=1)"),
        ("warmup=2, repeats=15)", "warmup=1, repeats=2)"),  # the C++ GEMV against F.linear by rows
        ("generate_ids(fast, prompt, params), repeats=5)", "generate_ids(fast, prompt, params), repeats=1)"),
        ("hf_comparison(m, prompt, 48, repeats=3)", "hf_comparison(m, prompt, 48, repeats=1)"),
        ("run, repeats=5)", "run, repeats=1)"),
    ],
    "15-serving": [
        ("num_prompts=48", "num_prompts=16"),
        ("rates = [2, 4, 8, 16, 32]", "rates = [2, 8, 32]"),
    ],
}


def test_the_smaller_runs_name_notebooks_that_exist_and_are_never_written_back():
    assert set(SMALLER) <= {p.stem for p in NOTEBOOKS}
    path = NOTEBOOKS[0]
    with pytest.raises(ValueError, match="exactly once"):  # checked before any kernel starts
        execute_notebook(path, smaller=[("text that is in no cell", "x")])
    with pytest.raises(ValueError, match="never written back"):
        execute_notebook(path, write=True, smaller=[("import", "import")])


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    # One OpenMP thread: pytest-xdist's other worker shares the cores, and threads waiting on each other make the
    # tiny models' ops many times slower (tests/conftest.py does the same for the test processes).
    execute_notebook(path, timeout=600, write=False, smaller=SMALLER.get(path.stem, ()), threads=1)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_has_outputs(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code, f"{path.name} has no code cells"
    assert all(c.get("execution_count") for c in code), f"{path.name} has cells that were never executed"
    assert any(c.get("outputs") for c in code), f"{path.name} carries no outputs from a real run"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name} was committed with an error output: {errors[0].get('ename')}"


# --- what a reader sees: figures, metadata, no machine paths, the Colab install cell -----------------------------

# A code cell draws a figure when it calls pyplot, an axis' plotting methods, or a package `plot_*` helper.
DRAWS = re.compile(r"\bplt\.|\.plot\(|\.imshow\(|\.barh?\(|\.broken_barh\(|\bplot_\w+\(|\bfig\b")
# Absolute paths of some machine (the build box, a temp dir, a home directory): meaningless to a reader.
MACHINE_PATH = re.compile(r"(?<![\w.~<>-])/(?:work|tmp|root|home|Users)/")
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def load(path):
    return json.loads(path.read_text(encoding="utf-8"))


def code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]


def uncommented(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))


def texts_of(cell):
    """Every piece of text a cell shows: its source, streams, text results and tracebacks."""
    yield "".join(cell["source"])
    for out in cell.get("outputs", []):
        yield "".join(out.get("text", ""))
        for mime, value in out.get("data", {}).items():
            if mime.startswith("text/"):
                yield "".join(value)
        yield "\n".join(out.get("traceback", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_drawing_cell_carries_its_figure(path):
    drawing = [c for c in code_cells(load(path)) if DRAWS.search(uncommented("".join(c["source"])))]
    assert drawing, f"{path.name} draws no figure"
    missing = [c for c in drawing if not any("image/png" in o.get("data", {}) for o in c.get("outputs", []))]
    assert not missing, (f"{path.name}: {len(missing)} cell(s) draw a figure but carry no image/png output "
                         f"(re-run with `python -m minillm.course.notebooks run`), first: "
                         f"{''.join(missing[0]['source'])[:120]!r}")


def test_the_figure_check_can_fail():
    """The check above on a made-up notebook: a drawing cell without an image fails it, with one it passes."""
    cell = {"cell_type": "code", "source": ["fig, ax = plt.subplots()\n", "ax.plot([1, 2])"], "outputs": []}
    assert DRAWS.search(uncommented("".join(cell["source"])))
    assert not any("image/png" in o.get("data", {}) for o in cell["outputs"])
    assert not DRAWS.search(uncommented("import matplotlib.pyplot as plt\nfrom minillm.x import plot_timeline, y"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_metadata(path):
    meta = load(path)["metadata"]
    assert meta.get("kernelspec") == KERNELSPEC, f"{path.name}: kernelspec {meta.get('kernelspec')!r}"
    assert meta.get("language_info", {}).get("name") == "python", f"{path.name}: no python language_info"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_machine_paths(path):
    for i, cell in enumerate(load(path)["cells"]):
        for text in texts_of(cell):
            m = MACHINE_PATH.search(text)
            assert not m, f"{path.name} cell {i} shows a machine path: ...{text[max(0, m.start() - 40):m.end() + 40]!r}..."


def test_the_path_check_can_fail():
    assert MACHINE_PATH.search("warning from /work/main/.venv/lib/python3.11/x.py")
    assert MACHINE_PATH.search("--out /tmp/minillm_runs/base")
    assert not MACHINE_PATH.search("--out runs/base, <venv>/lib/python3.11, chapters/figures/06-frontier.png")


def first_code_source(path) -> str:
    return "".join(code_cells(load(path))[0]["source"])


class FakeIPython:
    """Records the magics a transformed cell would run instead of running them."""

    def __init__(self):
        self.calls = []

    def run_line_magic(self, name, line, *args, **kwargs):
        self.calls.append((name, line))

    def system(self, cmd):
        self.calls.append(("!", cmd))


def run_cell(source: str, ip: FakeIPython) -> dict:
    TransformerManager = pytest.importorskip("IPython.core.inputtransformer2").TransformerManager  # no Jupyter on a GPU box

    namespace = {"get_ipython": lambda: ip}
    exec(TransformerManager().transform_cell(source), namespace)
    return namespace


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_colab_badge_and_install_cell(path, monkeypatch):
    nb = load(path)
    first = "".join(nb["cells"][0]["source"])
    assert nb["cells"][0]["cell_type"] == "markdown" and "colab-badge.svg" in first, f"{path.name}: no Colab badge on top"
    assert f"colab.research.google.com/github/{REPO_PLACEHOLDER}/blob/main/notebooks/{path.name}" in first or \
        f"/blob/main/notebooks/{path.name}" in first, f"{path.name}: the badge does not open this notebook"
    source = first_code_source(path)
    assert 'if "google.colab" in sys.modules:' in source, f"{path.name}: the first code cell is not the Colab install"

    # Here (not Colab) the cell is a no-op: no magic, no shell command, nothing defined but `sys`.
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    ip = FakeIPython()
    namespace = run_cell(source, ip)
    assert ip.calls == [], f"{path.name}: the install cell ran {ip.calls} outside Colab"
    assert set(namespace) - {"__builtins__", "get_ipython"} == {"sys"}

    # In Colab it pip-installs the repository, and refuses the placeholder with a message.
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    if REPO_PLACEHOLDER in source:
        with pytest.raises(RuntimeError, match="MINILLM_REPO"):
            run_cell(source, FakeIPython())
        source = source.replace(REPO_PLACEHOLDER, "someone/minillm")
    ip = FakeIPython()
    namespace = run_cell(source, ip)
    assert ip.calls == [("pip", "install -q git+{MINILLM_REPO}")]
    assert namespace["MINILLM_REPO"].startswith("https://github.com/")


def test_set_repo_fills_the_placeholder(tmp_path):
    copy = tmp_path / NOTEBOOKS[0].name
    copy.write_text(NOTEBOOKS[0].read_text(encoding="utf-8"), encoding="utf-8")
    assert set_repo("someone/minillm", [copy]) == [copy]
    text = copy.read_text(encoding="utf-8")
    assert REPO_PLACEHOLDER not in text and "github/someone/minillm/blob/main/notebooks/" in text
    assert "https://github.com/someone/minillm" in text
    assert set_repo("someone/minillm", [copy]) == []  # nothing left to fill
    with pytest.raises(ValueError, match="owner/name"):
        set_repo("not a repo", [copy])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_asserts_the_equivalences_it_prints(path):
    """A lab that prints "identical tokens: True" also asserts it, so running it top to bottom is a check."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    printed = [s for s in sources if "identical" in s or "exact" in s or "equal" in s]
    asserted = [s for s in printed if "assert " in s]
    assert not printed or asserted, f"{path.name} prints equivalences but asserts none of them"
