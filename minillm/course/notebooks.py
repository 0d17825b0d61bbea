"""Executing the chapter notebooks: top to bottom, in a fresh kernel, failing on the first error.

`python -m minillm.course.notebooks run notebooks/04-kv-cache.ipynb` re-executes a notebook and writes its outputs back
(atomically), which is how the committed notebooks get the outputs of a real run. The test suite calls
`execute_notebook` without writing, so every notebook is proven to run on a fresh checkout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from minillm import chapters
from minillm.core.io import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"


def list_notebooks(directory: str | os.PathLike = NOTEBOOK_DIR) -> list[Path]:
    """The lab of every built chapter of the manifest (`minillm.chapters`), in chapter order."""
    return [Path(directory) / Path(c.notebook).name for c in chapters.built()]


def execute_notebook(path: str | os.PathLike, timeout: int = 600, write: bool = False, kernel_name: str = "python3"):
    """Run every cell of the notebook at `path` in a new kernel whose working directory is the notebook's folder.

    Raises `nbclient.exceptions.CellExecutionError` on the first failing cell. With `write=True` the executed
    notebook (with its outputs) replaces the file atomically. Returns the executed `nbformat.NotebookNode`.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no notebook at {str(path)!r}")
    nb = nbformat.read(path, as_version=4)
    # Non-interactive matplotlib and a fixed thread count keep runs repeatable and headless.
    env_before = {k: os.environ.get(k) for k in ("MPLBACKEND",)}
    os.environ["MPLBACKEND"] = "Agg"
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if write:
        atomic_write_text(path, nbformat.writes(nb) + "\n")
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.course.notebooks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks and write their outputs back")
    run.add_argument("paths", nargs="*", help="notebooks (default: all in notebooks/)")
    run.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.paths] or list_notebooks()
    for p in paths:
        t0 = time.perf_counter()
        execute_notebook(p, timeout=args.timeout, write=True)
        print(f"executed {p} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
