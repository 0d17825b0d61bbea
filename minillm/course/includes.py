"""Code in the chapter texts, included from the package: the source a student reads is the source that runs.

A chapter text shows a function, method or class of `minillm` between two markers:

    <!-- include: minillm/kvcache/cache.py::ContiguousKVCache.attend -->
    ```python
    ...the current source of that method...
    ```
    <!-- end include -->

`python -m minillm.course.includes --write` rewrites every block from the current source; `--check` (the default)
exits 1 and names every block that no longer matches, and `tests/test_texts.py` runs the same check, so a change to
an included function fails the tests until the texts are refreshed. Nothing is copied by hand, so nothing drifts.

C, C++ and CUDA sources (`.cu`, `.cuh`, `.cpp`, `.h`, ...) are included the same way, in a ```cuda or ```cpp
block, by a name:

    <!-- include: minillm/kernels/csrc/attention.cu::attention_v2_tiles -->

is the region between the source's lines `// BEGIN INCLUDE attention_v2_tiles` and `// END INCLUDE
attention_v2_tiles` if it marks one, else the function of that name with its `template` line and the comment right
above it. A region is a few lines out of a longer function (a loop, a method's core); its marker lines are plain
comments, so the compiled code is the same with or without them. A function is found by its definition, an
unindented line `... name(` that opens a body (a declaration, ending in `;`, is skipped), and ends at the brace that
closes that body, counted outside comments and string literals.

Exercises are never given away: a function that holds `# BEGIN SOLUTION` / `# END SOLUTION` regions (`//` in C)
is shown with each region replaced by the stub a student receives (`minillm.course.assignment.stub_source`, the
same replacement `minillm assignment` makes).

Measured tables are included the same way from a committed results file (`chapters/results/NN-*.json`), and single
numbers inside a sentence by an inline `<!-- value: ... -->` pair: `minillm.course.results` says how; `--write`
and `--check` treat them like code.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from minillm.core.config import short_repr
from minillm.core.io import atomic_write_text
from minillm.course import results
from minillm.course.assignment import C_DEF, is_c_source, markers, stub_source

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
CHAPTERS_DIR = REPO_ROOT / "chapters"

# `<!-- include: PATH::QUALNAME -->`, anything (the rendered block), `<!-- end include -->`.
BLOCK_RE = re.compile(
    r"(?P<open><!-- include: (?P<path>[\w./-]+\.(?:py|c|cc|cpp|cu|cuh|h|hpp|json))::(?P<qualname>[\w.]+) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- end include -->)",
    re.DOTALL,
)
OPEN_RE = re.compile(r"<!-- include: ")
CLOSE = "<!-- end include -->"


@dataclass(frozen=True)
class Include:
    text: Path  # the markdown file holding the block
    line: int  # line of the opening marker (1-based)
    path: str  # source file, relative to the repository root
    qualname: str  # "merge", "ContiguousKVCache.attend"
    body: str  # what is between the markers now


def _find_node(tree: ast.Module, qualname: str, path: str) -> ast.AST:
    """The def or class named by a dotted qualified name, walking class bodies (`Class.method`)."""
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise ValueError(f"{path} has no {qualname!r} (no {part!r} at that level)")
        scope = node.body  # type: ignore[attr-defined]
    assert node is not None
    return node


# Blanked before counting braces: // and /* */ comments, string and character literals (a brace inside one is text).
_C_SKIP = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)
_C_INCLUDE_MARK = re.compile(r"\s*// (?:BEGIN|END) INCLUDE \S+\s*$")


def _c_body_end(source: str, start: int) -> int | None:
    """Offset just past the `}` that closes the body opened after `start` (a definition's first line), or None when
    a `;` comes before any `{` (a declaration) or the body never closes."""
    code = _C_SKIP.sub(lambda m: " " * len(m.group()), source[start:])  # same offsets, comments and literals blank
    depth = 0
    for k, ch in enumerate(code):
        if ch == ";" and depth == 0:
            return None
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return start + k + 1
    return None


def _c_dedent(lines: list[str]) -> str:
    """Remove the indentation the code lines share; preprocessor lines (`#pragma unroll` sits in column 0 inside a
    loop) and blank lines do not count, and keep whatever indentation they have beyond it."""
    code = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    cut = min((len(ln) - len(ln.lstrip(" "))) for ln in code) if code else 0
    out = []
    for ln in lines:
        if not ln.strip():
            out.append(ln.lstrip(" \t"))  # a blank line stays blank
        else:
            out.append(ln[cut:] if ln.startswith(" " * cut) else ln)
    return "".join(out)


def extract_c(source: str, name: str, path: str) -> str:
    """The lines of region `name` of a C/C++/CUDA source (between `// BEGIN INCLUDE name` and `// END INCLUDE name`),
    or else of the function `name` (its definition, with the `template` and `//` lines right above it); dedented,
    without the lines of any INCLUDE marker. An unknown name, or a region marked twice or never closed, is a
    ValueError naming `path`."""
    lines = source.splitlines(keepends=True)
    begin, end = f"// BEGIN INCLUDE {name}", f"// END INCLUDE {name}"
    starts = [i for i, ln in enumerate(lines) if ln.strip() == begin]
    if len(starts) > 1:
        raise ValueError(f"{path} marks the region {name!r} {len(starts)} times")
    if starts:
        stop = next((i for i in range(starts[0] + 1, len(lines)) if lines[i].strip() == end), None)
        if stop is None:
            raise ValueError(f"{path}: {begin!r} without {short_repr(end)}")
        body = lines[starts[0] + 1: stop]
    else:
        offsets = [0]
        for ln in lines:
            offsets.append(offsets[-1] + len(ln))
        body = []
        for i, ln in enumerate(lines):
            m = C_DEF.match(ln)
            close = _c_body_end(source, offsets[i]) if m and m.group(1) == name else None
            if close is not None:
                first = i
                while first > 0 and lines[first - 1].startswith(("//", "template")):
                    first -= 1
                body = lines[first: source.count("\n", 0, close - 1) + 1]
                break
        if not body:
            raise ValueError(f"{path} has no function {name!r} and no region marked {begin!r}")
    return _c_dedent([ln for ln in body if not _C_INCLUDE_MARK.match(ln)])


def extract(path: str, qualname: str, root: Path = REPO_ROOT) -> tuple[str, bool]:
    """(source of `qualname` in `path`, was an exercise stubbed?): decorators included, dedented, every
    BEGIN/END SOLUTION region replaced by the student's stub. In a C, C++ or CUDA file `qualname` names a region
    or a function (`extract_c`)."""
    file = root / path
    if not file.is_file():
        raise ValueError(f"included file {path} does not exist")
    source = file.read_text(encoding="utf-8")
    if is_c_source(path):
        segment = extract_c(source, qualname, path)
    else:
        segment = _extract_python(source, qualname, path)
    stubbed = markers(path)[0] in segment
    if stubbed:
        segment, _ = stub_source(segment, f"{path}::{qualname}")
    return (segment if segment.endswith("\n") else segment + "\n"), stubbed


def _extract_python(source: str, qualname: str, path: str) -> str:
    """The def or class `qualname` of a Python source, decorators included, dedented."""
    node = _find_node(ast.parse(source, filename=path), qualname, path)
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    all_lines = source.splitlines(keepends=True)
    end = node.end_lineno or first
    # subtle: ast ends a def at its last statement, so a trailing `# END SOLUTION` comment (deeper than the def)
    # lies past end_lineno; take such comment lines along.
    indent = len(all_lines[first - 1]) - len(all_lines[first - 1].lstrip())
    while end < len(all_lines) and all_lines[end].lstrip().startswith("#") \
            and len(all_lines[end]) - len(all_lines[end].lstrip()) > indent:
        end += 1
    lines = all_lines[first - 1: end]
    return textwrap.dedent("".join(lines))


def render(path: str, qualname: str, root: Path = REPO_ROOT) -> str:
    """The block as it belongs between the markers: a fenced block (python, cuda for .cu/.cuh, else cpp) headed by
    a comment saying where the code lives; for a results file (.json), the named table as its benchmark formats it."""
    if path.endswith(".json"):
        table = results.quote(path, qualname, root)
        return table if table.endswith("\n") else table + "\n"
    code, stubbed = extract(path, qualname, root)
    suffix = Path(path).suffix
    language = "python" if suffix == ".py" else "cuda" if suffix in (".cu", ".cuh") else "cpp"
    comment = "#" if language == "python" else "//"
    head = f"{comment} {path}" + ("  (the exercise's solution is left out: it is yours to write)" if stubbed else "")
    return f"```{language}\n{head}\n{code}```\n"


def find_includes(text_path: Path) -> list[Include]:
    """Every include block of one markdown file; an unclosed or malformed marker is a ValueError naming the line."""
    text = text_path.read_text(encoding="utf-8")
    want = f"'<!-- include: path.py::Qual.name -->' or 'path.cu::name' ... '{CLOSE}'"
    return [Include(text_path, line, m.group("path"), m.group("qualname"), m.group("body"))
            for line, m in results.scan_markers(text, BLOCK_RE, OPEN_RE, text_path.name, "include block", "include",
                                                want)]


def refresh_text(text: str, root: Path = REPO_ROOT, problems: list[str] | None = None) -> str:
    """The markdown with every include block rewritten from the current source, and every inline value from its
    results file or notebook. A block or value whose source fails (a missing results file, an unknown name) raises
    its ValueError, or, when a `problems` list is given, stays as it is and its message is appended there."""

    def redo(m: re.Match, new: Callable[[], str]) -> str:
        try:
            return new()
        except ValueError as e:
            if problems is None:
                raise
            problems.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {e}")
            return m.group(0)

    text = BLOCK_RE.sub(lambda m: redo(m, lambda: m.group("open") + render(m.group("path"), m.group("qualname"), root)
                                       + m.group("close")), text)
    return results.VALUE_RE.sub(lambda m: redo(m, lambda: m.group("open") + results.value(m.group("source"),
                                                                                          m.group("name"), root)
                                               + m.group("close")), text)


def text_files(chapters_dir: Path = CHAPTERS_DIR) -> list[Path]:
    return sorted(chapters_dir.glob("[0-9][0-9]-*.md"))


def stale(files: list[Path] | None = None, root: Path = REPO_ROOT) -> list[str]:
    """One message per block whose text differs from the current source (empty: all in sync)."""
    problems = []
    for f in files if files is not None else text_files():
        for inc in find_includes(f):
            try:
                want = render(inc.path, inc.qualname, root)
            except ValueError as e:
                problems.append(f"{f.name}:{inc.line}: {e}")
                continue
            if inc.body != want:
                problems.append(f"{f.name}:{inc.line}: {inc.path}::{inc.qualname} differs from the source")
        try:
            values = results.find_values(f.read_text(encoding="utf-8"), f.name)
        except ValueError as e:
            problems.append(str(e))
            continue
        for line, source, name, quoted in values:
            try:
                want = results.value(source, name, root)
            except ValueError as e:
                problems.append(f"{f.name}:{line}: {e}")
                continue
            if quoted != want:
                problems.append(f"{f.name}:{line}: {source}::{name} is {want!r} there, {quoted!r} here")
    return problems


def write(files: list[Path] | None = None, root: Path = REPO_ROOT, problems: list[str] | None = None) -> list[Path]:
    """Rewrite the include blocks and values of the given texts (default: every chapter); returns the files that
    changed. With a `problems` list, a block whose source fails is left as it was and named there (the others are
    still rewritten); without one, the first failure raises."""
    changed = []
    for f in files if files is not None else text_files():
        old = f.read_text(encoding="utf-8")
        found: list[str] | None = [] if problems is not None else None
        new = refresh_text(old, root, found)
        if problems is not None:
            problems += [f"{f.name}:{p}" for p in found or []]
        if new != old:
            atomic_write_text(f, new)
            changed.append(f)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.course.includes", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if a block differs from the source (default)")
    mode.add_argument("--write", action="store_true", help="rewrite every block from the current source")
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: chapters/NN-*.md)")
    args = parser.parse_args(argv)
    files = [f.resolve() for f in args.files] or None
    if args.write:
        problems: list[str] = []
        changed = write(files, problems=problems)
        for f in changed:
            print(f"refreshed {f.relative_to(REPO_ROOT) if f.is_relative_to(REPO_ROOT) else f}")
        print(f"{len(changed)} file(s) changed")
        for p in problems:
            print(f"left as it was: {p}")
        return 1 if problems else 0
    problems = stale(files)
    for p in problems:
        print(p)
    if problems:
        print("refresh with: python -m minillm.course.includes --write")
        return 1
    count = sum(len(find_includes(f)) for f in (files or text_files()))
    print(f"{count} include block(s) in sync")
    return 0


if __name__ == "__main__":
    sys.exit(main())
