"""Every chapter notebook runs top to bottom in a fresh kernel, and every committed one carries real outputs."""

from __future__ import annotations

import json

import pytest

from minillm.course.notebooks import execute_notebook, list_notebooks

NOTEBOOKS = list_notebooks()


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no NN-slug.ipynb"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    execute_notebook(path, timeout=600, write=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_has_outputs(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code, f"{path.name} has no code cells"
    assert all(c.get("execution_count") for c in code), f"{path.name} has cells that were never executed"
    assert any(c.get("outputs") for c in code), f"{path.name} carries no outputs from a real run"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name} was committed with an error output: {errors[0].get('ename')}"
