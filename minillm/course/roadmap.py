"""The course map: which chapter adds what to which part of the system, drawn from the manifest.

`python -m minillm.course.roadmap` writes `chapters/figures/roadmap.png`: one column per chapter of
`minillm.chapters.CHAPTERS` (built chapters filled, chapters still to come hatched), one row per part of the
system, and in each cell the piece that chapter adds. `--text` prints the same map as a Markdown table. The figure
records the map it shows in a PNG text field (`minillm-roadmap`), so `tests/test_texts.py` can tell a figure drawn
from an older manifest from a current one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minillm import chapters
from minillm.core.io import atomic_save_figure

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
FIGURE = REPO_ROOT / "chapters" / "figures" / "roadmap.png"
PNG_KEY = "minillm-roadmap"

# The parts of the system, top (what the user sees) to bottom (what the hardware runs).
PARTS: tuple[str, ...] = (
    "server", "scheduler", "workers", "KV cache", "decoding", "model", "tokenizer", "kernels", "compression",
)

# Chapter -> {part: what the chapter adds to it}. Every chapter of the manifest has an entry (a test holds this).
ADDS: dict[str, dict[str, str]] = {
    "01": {"tokenizer": "byte-level BPE"},
    "02": {"model": "GPT-2 model,\ntraining"},
    "03": {"decoding": "sampling, naive\nloop, metrics,\nroofline"},
    "04": {"KV cache": "contiguous cache", "decoding": "prefill / decode,\nstatic batch"},
    "05": {"KV cache": "blocks, sharing,\nprefix caching"},
    "06": {"scheduler": "iteration-level,\npreemption,\nchunked prefill"},
    "07": {"workers": "prefill and decode\nworkers,\nKV transfer"},
    "08": {"decoding": "draft + verify"},
    "09": {"compression": "int8 / int4,\nKV quantization"},
    "10": {"compression": "magnitude, Wanda,\n2:4"},
    "11": {"compression": "logit and feature\nKD, distilled\ndraft"},
    "12": {"kernels": "CUDA: flash,\npaged decode"},
    "13": {"kernels": "torch.compile,\nCUDA graphs"},
    "14": {"workers": "tensor, pipeline,\nsequence\nparallelism"},
    "15": {"server": "OpenAI API,\nstreaming,\ngoodput"},
}


def summary() -> str:
    """One line per chapter: number, slug, built or coming, the parts it touches. Stored in the PNG."""
    lines = []
    for c in chapters.CHAPTERS:
        parts = ", ".join(ADDS.get(c.number, {}))
        lines.append(f"{c.number} {c.slug} {'built' if c.built else 'coming'}: {parts}")
    return "\n".join(lines)


def markdown_table(link_prefix: str = "chapters/") -> str:
    """The map as a Markdown table (chapter, part, what it adds); built chapters link to their text, relative to
    where the table sits (`chapters/` from the README, nothing from a chapter text)."""
    rows = ["| # | chapter | part of the system | what it adds |", "|---|---|---|---|"]
    for c in chapters.CHAPTERS:
        adds = ADDS.get(c.number, {})
        parts = ", ".join(adds)
        what = "; ".join(v.replace("\n", " ") for v in adds.values())
        name = f"[{c.slug}]({link_prefix}{c.name}.md)" if c.built else f"{c.slug} (coming)"
        rows.append(f"| {c.number} | {name} | {parts} | {what} |")
    return "\n".join(rows)


def draw(path: Path = FIGURE) -> Path:
    """Draw the map into `path` (PNG) and return it."""
    import matplotlib  # subtle: imported here so `minillm` never needs matplotlib unless a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    missing = [c.number for c in chapters.CHAPTERS if c.number not in ADDS]
    if missing:
        raise ValueError(f"roadmap has no entry for chapter(s) {missing}: add them to minillm.course.roadmap.ADDS")
    chs = chapters.CHAPTERS
    fig, ax = plt.subplots(figsize=(0.95 * len(chs) + 1.8, 0.55 * len(PARTS) + 1.4), dpi=120)
    plt.rcParams["hatch.color"] = "#b8cde2"
    for j, c in enumerate(chs):
        for part, what in ADDS[c.number].items():
            i = PARTS.index(part)
            face = "#cfe3f7" if c.built else "white"
            ax.add_patch(Rectangle((j + 0.04, i + 0.06), 0.92, 0.88, facecolor=face, edgecolor="#2a5d8f",
                                   hatch=None if c.built else "///", linewidth=1.0,
                                   linestyle="-" if c.built else "--"))
            ax.text(j + 0.5, i + 0.5, what, ha="center", va="center", fontsize=5.6,
                    color="black" if c.built else "#555555",
                    bbox=None if c.built else dict(facecolor="white", edgecolor="none", pad=0.5))
    ax.set_xlim(0, len(chs))
    ax.set_ylim(len(PARTS), 0)
    ax.set_xticks([j + 0.5 for j in range(len(chs))])
    ax.set_xticklabels([f"{c.number}\n" + c.slug.replace("-", "-\n", 1) for c in chs], fontsize=6.5)
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.5 for i in range(len(PARTS))])
    ax.set_yticklabels(PARTS, fontsize=8)
    ax.tick_params(length=0)
    for j in range(len(chs) + 1):
        ax.axvline(j, color="#eeeeee", linewidth=0.6, zorder=0)
    for i in range(len(PARTS) + 1):
        ax.axhline(i, color="#eeeeee", linewidth=0.6, zorder=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.legend(handles=[Patch(facecolor="#cfe3f7", edgecolor="#2a5d8f", label="built"),
                       Patch(facecolor="white", edgecolor="#2a5d8f", hatch="///", linestyle="--",
                             label="coming")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title("minillm: which chapter adds what to which part of the system", fontsize=9, pad=28)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save_figure(fig, path, metadata={PNG_KEY: summary(), "Software": "minillm.course.roadmap"})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.course.roadmap", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIGURE, help=f"PNG to write (default {FIGURE.name} in "
                        "chapters/figures)")
    parser.add_argument("--text", action="store_true", help="print the Markdown table instead of drawing")
    parser.add_argument("--link-prefix", default="chapters/", help="prefix of the chapter links in --text")
    args = parser.parse_args(argv)
    if args.text:
        print(markdown_table(args.link_prefix))
        return 0
    print(f"wrote {draw(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
