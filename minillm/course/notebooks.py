"""Executing the chapter notebooks: top to bottom, in a fresh kernel, failing on the first error.

`python -m minillm.course.notebooks run notebooks/04-kv-cache.ipynb` re-executes a notebook and writes its outputs back
(atomically), which is how the committed notebooks get the outputs of a real run. The test suite calls
`execute_notebook` without writing, so every notebook is proven to run on a fresh checkout.
`python -m minillm.course.notebooks set-repo OWNER/NAME` points every notebook's "Open in Colab" badge and Colab
install cell (and the README's badge) at the repository once it is published.

The kernel draws with matplotlib's inline backend, so every figure a cell draws is stored in the notebook as an
`image/png` output, as it would be in Jupyter or Colab (a non-interactive backend such as Agg would run the cells
but drop the pictures). Written outputs are scrubbed of this machine's paths (the repository, the virtual
environment, the home and temporary directories), which mean nothing to a reader.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from minillm import chapters
from minillm.core.config import check_int
from minillm.core.io import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
# What `%matplotlib inline` selects in Jupyter: figures become image/png outputs of the cell that drew them.
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
# The course's GitHub repository as "owner/name" is not known until it is published, so each notebook's Colab badge
# and Colab install cell, and the README's badge, carry this placeholder until `set-repo` fills it in.
REPO_PLACEHOLDER = "YOUR-GITHUB-USER/minillm"


def list_notebooks(directory: str | os.PathLike = NOTEBOOK_DIR) -> list[Path]:
    """The lab of every built chapter of the manifest (`minillm.chapters`), in chapter order, and the lab of a chapter
    under construction (built=False) once it exists, so it is executed and checked like the others."""
    directory = Path(directory)
    return [directory / Path(c.notebook).name for c in chapters.CHAPTERS
            if c.built or (directory / Path(c.notebook).name).is_file()]


def execute_notebook(path: str | os.PathLike, timeout: int = 600, write: bool = False, kernel_name: str = "python3",
                     smaller: Sequence[tuple[str, str]] = (), threads: int | None = None):
    """Run every cell of the notebook at `path` in a new kernel whose working directory is the notebook's folder.

    Raises `nbclient.exceptions.CellExecutionError` on the first failing cell. With `write=True` the executed
    notebook (with its outputs) replaces the file atomically. Returns the executed `nbformat.NotebookNode`.

    `smaller`: (old, new) pairs applied to the code cells' text before the run, each `old` found exactly once, so a
    test can run a measurement with fewer repeats or sizes (the same code path, in seconds instead of minutes). Such
    a run is never written back: the committed outputs are always those of the notebook as it stands.
    `threads`: the kernel's OpenMP threads (OMP_NUM_THREADS), e.g. 1 where other processes share the cores.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no notebook at {str(path)!r}")
    if write and smaller:
        raise ValueError("a run with `smaller` sizes is never written back as the notebook's outputs")
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    for old, new in smaller:
        hits = [c for c in code if old in c.source]
        if len(hits) != 1 or hits[0].source.count(old) != 1:
            raise ValueError(f"{path.name}: {old!r} must occur exactly once in the code cells, found "
                             f"{sum(c.source.count(old) for c in code)}")
        hits[0].source = hits[0].source.replace(old, new)
    # The kernel inherits this environment: the inline backend captures figures even when the caller's shell sets
    # MPLBACKEND=Agg (CI often does); the test process's own environment is left alone.
    env = {**os.environ, "MPLBACKEND": INLINE_BACKEND}
    if threads is not None:
        threads = check_int("threads", threads)
        env["OMP_NUM_THREADS"] = str(threads)
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    if write:
        scrub_paths(nb)
        atomic_write_text(path, nbformat.writes(nb) + "\n")
    return nb


def machine_paths() -> list[tuple[str, str]]:
    """(path prefix of this machine, what a reader sees instead), longest first so the most specific one wins."""
    pairs = {str(REPO_ROOT): "<repo>", sys.prefix: "<venv>", str(Path.home()): "~", tempfile.gettempdir(): "<tmp>"}
    return sorted(((p, r) for p, r in pairs.items() if len(p) > 1), key=lambda pr: -len(pr[0]))


def scrub_text(text: str) -> str:
    for prefix, replacement in machine_paths():
        text = re.sub(re.escape(prefix) + r"(?=/|\b|$)", replacement, text)
    return text


def scrub_paths(nb) -> None:
    """Replace this machine's paths in every output (streams, text results, tracebacks) in place."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = scrub_text(out["text"])
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    out["data"][mime] = scrub_text(value)
            if "traceback" in out:
                out["traceback"] = [scrub_text(line) for line in out["traceback"]]


def set_repo(repo: str, paths: list[Path] | None = None) -> list[Path]:
    """Replace `REPO_PLACEHOLDER` by `repo` ("owner/name" on GitHub) in the notebooks and the README; returns the
    files changed. The Colab install cell then installs `git+https://github.com/<repo>`."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", repo):
        raise ValueError(f"repo must look like owner/name (a GitHub repository), got {repo!r}")
    paths = paths if paths is not None else [*list_notebooks(), REPO_ROOT / "README.md"]
    changed = []
    for p in paths:
        text = Path(p).read_text(encoding="utf-8")
        if REPO_PLACEHOLDER in text:
            atomic_write_text(p, text.replace(REPO_PLACEHOLDER, repo))
            changed.append(Path(p))
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.course.notebooks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks and write their outputs back")
    run.add_argument("paths", nargs="*", help="notebooks (default: all in notebooks/)")
    run.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    setrepo = sub.add_parser("set-repo", help="point the Colab badges and install cells at the published repository")
    setrepo.add_argument("repo", help="the GitHub repository as owner/name")
    args = parser.parse_args(argv)
    if args.command == "set-repo":
        try:
            changed = set_repo(args.repo)
        except ValueError as e:
            parser.error(str(e))
        for p in changed:
            print(f"updated {p.name}")
        return 0
    paths = [Path(p) for p in args.paths] or list_notebooks()
    for p in paths:
        t0 = time.perf_counter()
        execute_notebook(p, timeout=args.timeout, write=True)
        print(f"executed {p} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
