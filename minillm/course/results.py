"""Measured numbers in the chapter texts, read from where they were measured: a committed results file or a notebook.

A chapter's tables and the figures its prose quotes come from one run of its benchmark, saved with `--json` under
`chapters/results/` (`minillm.bench.cli.write_report` records the module and the command line that wrote it). The
benchmark module turns that report into the pieces a text quotes with a function `quotes(report) -> dict[str, str]`:
named Markdown tables (several lines) and single values ("1.18x", "57.906"). A text shows a table between two
markers, as it shows code (`minillm.course.includes`):

    <!-- include: chapters/results/09-quantization.json::methods -->
    | method | ... |
    <!-- end include -->

and a single number inside a sentence between an inline pair, invisible once the Markdown is rendered:

    int8 decodes <!-- value: chapters/results/09-quantization.json::int8_speedup -->1.18x<!-- end value --> as fast

A number a notebook prints is quoted the same way from the notebook's saved outputs: the notebook prints a line
`name: value` and the text names the notebook and the name,

    <!-- value: notebooks/08-speculative-decoding.ipynb::new tokens -->57<!-- end value -->

`python -m minillm.course.includes --write` rewrites every table and value from its source and `--check` (run by
tests/test_texts.py) fails when a text, a results file and a notebook disagree, so a number is typed once, by the
program that measured it.
"""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path
from typing import Any

from minillm.core.io import read_json_file

RESULTS_DIR = "chapters/results"
# `<!-- value: SOURCE::NAME -->` what is quoted `<!-- end value -->`, within one line.
VALUE_RE = re.compile(r"(?P<open><!-- value: (?P<source>[\w./-]+\.(?:json|ipynb))::(?P<name>[^>\n]+?) -->)"
                      r"(?P<body>[^\n]*?)(?P<close><!-- end value -->)")
VALUE_OPEN_RE = re.compile(r"<!-- value: ")


def _stamp(file: Path) -> tuple[int, int] | None:
    """What says a file changed (modification time, size), None when there is no such file: the cache key below."""
    return (file.stat().st_mtime_ns, file.stat().st_size) if file.is_file() else None


def load_report(path: str, root: Path) -> dict[str, Any]:
    """The JSON report at `path` (relative to the repository root), or a ValueError naming what is wrong with it."""
    file = root / path
    if not file.is_file():
        raise ValueError(f"results file {path} does not exist")
    report = read_json_file(file, "results file")
    if not isinstance(report, dict) or not isinstance(report.get("bench"), str):
        raise ValueError(f"results file {path} does not name the benchmark that wrote it (no 'bench' field)")
    return report


def quotes_of(path: str, root: Path) -> dict[str, str]:
    """Every piece the benchmark that wrote `path` quotes from it: `<bench module>.quotes(report)`, computed once
    per version of the file (a text quotes dozens of values from one report; read them all from one reading)."""
    return _quotes_of(path, root, _stamp(root / path))


@functools.lru_cache(maxsize=64)
def _quotes_of(path: str, root: Path, stamp: tuple[int, int] | None) -> dict[str, str]:
    report = load_report(path, root)
    module_name = report["bench"]
    if not module_name.startswith("minillm."):
        raise ValueError(f"results file {path} names bench {module_name!r}, not a minillm module")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"results file {path} names bench {module_name!r}, which does not import: {e}") from None
    quotes = getattr(module, "quotes", None)
    if quotes is None:
        raise ValueError(f"{module_name} has no quotes(report) for the texts to include")
    return quotes(report)


def quote(path: str, name: str, root: Path) -> str:
    """The named piece of a results file (a table or a value), as the benchmark formats it."""
    pieces = quotes_of(path, root)
    if name not in pieces:
        raise ValueError(f"{path} has no quote {name!r} (it has: {', '.join(sorted(pieces))})")
    return pieces[name]


def notebook_value(path: str, name: str, root: Path) -> str:
    """What the committed notebook printed after `name: ` on an output line (the same on every line that has it)."""
    file = root / path
    if not file.is_file():
        raise ValueError(f"notebook {path} does not exist")
    prefix = f"{name}: "
    found = {line[len(prefix):].strip() for line in _output_lines(file, _stamp(file)) if line.startswith(prefix)}
    if not found:
        raise ValueError(f"{path} prints no line {prefix!r} in its saved outputs")
    if len(found) > 1:
        raise ValueError(f"{path} prints {prefix!r} with different values: {sorted(found)}")
    return found.pop()


@functools.lru_cache(maxsize=32)
def _output_lines(file: Path, stamp: tuple[int, int] | None) -> tuple[str, ...]:
    """Every line of a notebook's saved outputs (streams and plain-text results), read once per version of it."""
    lines: list[str] = []
    for cell in read_json_file(file, "notebook").get("cells", []):
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain") or ""
            lines += ("".join(text) if isinstance(text, list) else text).splitlines()
    return tuple(lines)


def value(source: str, name: str, root: Path) -> str:
    """One quoted number: from a results file's quotes, or from a notebook's saved outputs."""
    if source.endswith(".ipynb"):
        return notebook_value(source, name, root)
    text = quote(source, name, root)
    if "\n" in text.strip():
        raise ValueError(f"{source}::{name} is a table; include it as a block, not as a value")
    return text.strip()


def find_values(text: str, where: str) -> list[tuple[int, str, str, str]]:
    """(line, source, name, quoted text) of every inline value of a markdown text; a marker that does not close on
    its line is a ValueError naming `where` and the line."""
    return [(line, m.group("source"), m.group("name"), m.group("body"))
            for line, m in scan_markers(text, VALUE_RE, VALUE_OPEN_RE, where, "value", "value",
                                        "'<!-- value: chapters/results/F.json::name -->1.18x<!-- end value -->' on "
                                        "one line")]


def scan_markers(text: str, complete: re.Pattern, opener: re.Pattern, where: str, what: str, marker: str,
                 want: str) -> list[tuple[int, re.Match]]:
    """(line, match) of every `complete` marker pair of a markdown text (`includes`' code blocks, the values here).
    An `opener` inside a pair's body (the pair never closed before the next opened) or one no pair starts with (a
    malformed marker) is a ValueError naming `where`, the line and the form wanted."""
    found, starts = [], set()
    for m in complete.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if opener.search(m.group("body")):
            raise ValueError(f"{where}:{line}: {what} not closed before the next one opens")
        found.append((line, m))
        starts.add(m.start())
    for m in opener.finditer(text):
        if m.start() not in starts:
            line = text.count("\n", 0, m.start()) + 1
            raise ValueError(f"{where}:{line}: malformed {marker} marker (want {want})")
    return found


def refresh_values(text: str, root: Path) -> str:
    """The markdown with every inline value rewritten from its source."""
    return VALUE_RE.sub(lambda m: m.group("open") + value(m.group("source"), m.group("name"), root)
                        + m.group("close"), text)
