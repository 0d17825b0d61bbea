"""The pictures of chapters 08-13: each text shows its diagram and its notebook's plots, and both are current.

- Every figure a notebook marks (`# chapter figure: NN-name`) is in `chapters/figures/` with the very bytes of the
  notebook's saved output (`python -m minillm.course.figures` copies them), and its chapter text shows it.
- Every diagram of `minillm.course.diagrams` exists, was drawn by the current code (the digest in its PNG text), is
  drawn the same way twice, and its chapter text shows it.
- Chapters 08-13 each embed at least one diagram and one measured figure, each with a caption that says where it
  came from. No notebook is executed here: the notebook tests do that.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from pathlib import Path

import pytest

from minillm import chapters
from minillm.course import diagrams, figures
from minillm.course.labels import label_points
from minillm.course.notebooks import list_notebooks

ROOT = Path(__file__).resolve().parent.parent
PICTURED = ["08", "09", "10", "11", "12", "13"]  # the chapters this file holds to a diagram and a measured figure
# An image line, a blank line, then its caption in italics (one paragraph, wrapped like the rest of the text).
EMBED = re.compile(r"^!\[[^\]]+\]\(figures/([\w-]+)\.png\)\n\n\*((?:[^*\n]|\n(?!\n))+)\*$", re.M)


@functools.lru_cache(maxsize=1)
def measured() -> dict[str, bytes]:
    """name -> PNG bytes of every figure the chapter notebooks mark (read once)."""
    return figures.all_figures()


def embedded(number: str) -> dict[str, str]:
    """figure name -> caption of every picture chapter `number`'s text embeds as an image line, blank line, *caption*."""
    text = (ROOT / chapters.get(number).text).read_text(encoding="utf-8")
    return {name: " ".join(caption.split()) for name, caption in EMBED.findall(text)}


def test_extracted_figures_equal_their_notebooks():
    assert measured(), "no notebook marks a chapter figure"
    problems = figures.stale()
    assert not problems, ("chapters/figures differs from the notebooks:\n" + "\n".join(problems)
                          + "\ncopy them again with: python -m minillm.course.figures")


@pytest.mark.parametrize("number", PICTURED)
def test_chapter_shows_a_diagram_and_a_measured_figure(number):
    shown = embedded(number)
    mine_measured = {n for n in measured() if n.startswith(number + "-")}
    mine_diagrams = {n for n in diagrams.DIAGRAMS if n.startswith(number + "-")}
    assert mine_measured & set(shown), f"chapter {number} shows none of its notebook's figures {sorted(mine_measured)}"
    assert mine_diagrams & set(shown), f"chapter {number} shows none of its diagrams {sorted(mine_diagrams)}"
    assert not mine_measured - set(shown), f"chapter {number} does not show {sorted(mine_measured - set(shown))}"
    assert not mine_diagrams - set(shown), f"chapter {number} does not show {sorted(mine_diagrams - set(shown))}"
    notebook = Path(chapters.get(number).notebook).as_posix()
    for name, caption in shown.items():
        assert (figures.FIGURES / f"{name}.png").is_file(), f"chapter {number} shows {name}.png, which does not exist"
        if name in measured():
            assert notebook in caption and "minillm.course.figures" in caption, (
                f"{name}'s caption should name {notebook} and `python -m minillm.course.figures`: {caption[:100]!r}")
        elif name in diagrams.DIAGRAMS:
            assert "minillm.course.diagrams" in caption, f"{name}'s caption should say what draws it: {caption[:100]!r}"


@pytest.mark.parametrize("name", sorted(diagrams.DIAGRAMS))
def test_diagram_is_current(name):
    from PIL import Image

    path = diagrams.FIGURES / f"{name}.png"
    assert path.is_file(), "draw it with: python -m minillm.course.diagrams"
    with Image.open(path) as im:
        drawn = im.text.get(diagrams.PNG_KEY)
    assert drawn == diagrams.source_digest(), (f"{name}.png was drawn by another version of minillm.course.diagrams: "
                                               "python -m minillm.course.diagrams")


def test_a_diagram_is_drawn_the_same_twice(tmp_path):
    """Fixed metadata and a seeded example: the same code gives the same bytes (here, in one environment)."""
    first = diagrams.draw("09-int4-groups", tmp_path / "a")
    second = diagrams.draw("09-int4-groups", tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()
    with pytest.raises(ValueError, match="'09-nope'"):
        diagrams.draw("09-nope", tmp_path)


# --- the extraction on a made-up notebook ---------------------------------------------------------------------------

PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


def notebook(tmp_path, cells, name="09-x.ipynb") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def cell(source, images=1):
    out = [{"output_type": "display_data", "data": {"image/png": base64.b64encode(PNG).decode() + "\n"}}] * images
    return {"cell_type": "code", "source": source, "outputs": out, "metadata": {}, "execution_count": 1}


def test_marked_cells_are_copied_byte_for_byte(tmp_path):
    nb = notebook(tmp_path, [cell(["# chapter figure: 09-one\n", "plt.plot([1])"]), cell("plt.plot([2])")])
    assert figures.marked_figures(nb) == {"09-one": PNG}
    out = tmp_path / "figs"
    assert figures.stale([nb], out) == ["09-one: no 09-one.png in figs/"]
    assert [p.name for p in figures.write([nb], out)] == ["09-one.png"]
    assert (out / "09-one.png").read_bytes() == PNG and figures.stale([nb], out) == []
    (out / "09-one.png").write_bytes(PNG + b"x")
    assert figures.stale([nb], out) == ["09-one: 09-one.png differs from the notebook's output"]
    assert figures.main(["--check", "--out", str(out), str(nb)]) == 1


@pytest.mark.parametrize("cells, message", [
    ([cell("# chapter figure: 10-wrong\n")], "10-wrong"),
    ([cell("# chapter figure: 09-Bad_Name\n")], "09-Bad_Name"),
    ([cell("# chapter figure: 09-a\n"), cell("# chapter figure: 09-a\n")], "used by an earlier cell"),
    ([cell("# chapter figure: 09-a\n", images=0)], "carries 0 image/png outputs"),
    ([cell("# chapter figure: 09-a\n", images=2)], "carries 2 image/png outputs"),
])
def test_bad_markers_are_refused_naming_the_cell(tmp_path, cells, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        figures.marked_figures(notebook(tmp_path, cells))


def test_every_chapter_notebook_marks_figures_by_its_own_number():
    for nb in list_notebooks():
        for name in figures.marked_figures(nb):
            assert name.startswith(nb.name[:2] + "-")


# --- point labels ----------------------------------------------------------------------------------------------------

def test_labels_of_nearby_points_do_not_overlap():
    """Two points a hair apart (like int8 weight-only and W8A8 on the quantization frontier): a fixed offset stacks
    their names; `label_points` puts them apart, inside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    xs, ys = [9.31, 9.31, 6.18, 23.4], [0.0, 0.04, 0.045, 0.0]
    ax.scatter(xs, ys)
    ax.margins(x=0.1, y=0.2)
    anns = label_points(ax, xs, ys, ["int8 weight-only", "W8A8", "int8 weight-only + head", "fp32"])
    renderer = fig.canvas.get_renderer()
    boxes = [a.get_window_extent(renderer) for a in anns]
    frame = ax.get_window_extent(renderer)
    for i in range(len(boxes)):
        assert frame.contains(boxes[i].x0, boxes[i].y0) and frame.contains(boxes[i].x1, boxes[i].y1)
        for j in range(i):
            assert not boxes[i].overlaps(boxes[j]), f"labels {i} and {j} overlap"
    with pytest.raises(ValueError, match="lengths 2, 1, 1"):
        label_points(ax, [1, 2], [1], ["a"])
    with pytest.raises(TypeError, match="labels must be strings"):
        label_points(ax, [1], [1], [3])
    plt.close(fig)
