"""The measured figures of the chapter texts, copied byte for byte out of the committed notebooks.

A notebook cell whose plot a chapter text shows starts with a marker line naming the figure:

    # chapter figure: 09-frontier

`python -m minillm.course.figures` reads every chapter notebook, takes the `image/png` output of each marked cell
(the one its last run saved) and writes it to `chapters/figures/<name>.png`, so the picture in the text is exactly
the one in the notebook. `--check` writes nothing and exits 1 when a file is missing or differs from its notebook
(`tests/test_figures.py` runs the same check). Re-run a notebook first (`python -m minillm.course.notebooks run`),
then this. What it leaves out: drawing anything (the notebooks measure and draw; `minillm.course.diagrams` draws
the explanatory diagrams).
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
from pathlib import Path

from minillm.core.io import atomic_write_bytes
from minillm.course.notebooks import list_notebooks

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
FIGURES = REPO_ROOT / "chapters" / "figures"
# The marker: a whole line of the cell's source, the figure's name starting with the notebook's chapter number.
MARKER = re.compile(r"^# chapter figure: (\S+)[ \t]*$", re.M)
NAME = re.compile(r"\d{2}-[a-z0-9]+(?:-[a-z0-9]+)*")


def marked_figures(path: str | Path) -> dict[str, bytes]:
    """name -> PNG bytes of every marked cell of the notebook at `path`, in cell order.

    A ValueError names the notebook and cell when a marker's name is malformed or lacks the notebook's chapter
    number, when a name is used twice, or when a marked cell carries no image or more than one (the figure a text
    shows must be one picture that exists)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no notebook at {str(path)!r}")
    number = path.name[:2]
    found: dict[str, bytes] = {}
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        if cell["cell_type"] != "code":
            continue
        names = MARKER.findall("".join(cell["source"]))
        if not names:
            continue
        where = f"{path.name} cell {i}"
        if len(names) > 1:
            raise ValueError(f"{where}: one figure marker per cell, got {names}")
        name = names[0]
        if not NAME.fullmatch(name) or not name.startswith(number + "-"):
            raise ValueError(f"{where}: figure name must look like {number}-some-name (lowercase, digits, dashes), "
                             f"got {name!r}")
        if name in found:
            raise ValueError(f"{where}: figure name {name!r} is used by an earlier cell too")
        images = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        if len(images) != 1:
            raise ValueError(f"{where}: the cell marked {name!r} carries {len(images)} image/png outputs, want 1 "
                             f"(re-run it with `python -m minillm.course.notebooks run {path.name}`)")
        data = images[0]
        found[name] = base64.b64decode("".join(data) if isinstance(data, list) else data)
    return found


def all_figures(notebooks: list[Path] | None = None) -> dict[str, bytes]:
    """name -> PNG bytes of every marked cell of every chapter notebook (all of them by default)."""
    figures: dict[str, bytes] = {}
    for nb in notebooks if notebooks is not None else list_notebooks():
        figures.update(marked_figures(nb))
    return figures


def write(notebooks: list[Path] | None = None, directory: Path = FIGURES) -> list[Path]:
    """Write every marked figure to `directory/<name>.png` (atomically); returns the paths written."""
    return [atomic_write_bytes(Path(directory) / f"{name}.png", data) for name, data in all_figures(notebooks).items()]


def stale(notebooks: list[Path] | None = None, directory: Path = FIGURES) -> list[str]:
    """One line per figure whose file is missing or differs from its notebook's output; [] when all match."""
    problems = []
    for name, data in all_figures(notebooks).items():
        path = Path(directory) / f"{name}.png"
        if not path.is_file():
            problems.append(f"{name}: no {path.name} in {Path(directory).name}/")
        elif path.read_bytes() != data:
            problems.append(f"{name}: {path.name} differs from the notebook's output")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.course.figures", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to read (default: every chapter's)")
    parser.add_argument("--out", type=Path, default=FIGURES, help="folder to write to (default chapters/figures)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a figure is missing or stale")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or None
    if args.check:
        problems = stale(notebooks, args.out)
        print("\n".join(problems) if problems else "every figure matches its notebook")
        return 1 if problems else 0
    for path in write(notebooks, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
