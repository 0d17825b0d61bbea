"""The house: one room per chapter, named by one manifest, with imports that only point down the layers.

These tests parse every module of the package (without importing it) and hold the layout that
`minillm/chapters.py` describes: each import of a minillm module sits at the top of its module (no import hidden in
a function), points to the same layer or a lower one, and the module graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from minillm import chapters
from minillm.course.assignment import markers

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minillm"
# The package's own entry points sit above every layer: `import minillm` gives the public surface
# (load, load_tokenizer, GPT, LLM, ...), `python -m minillm` runs the command line.
TOP = {"minillm", "minillm.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """Index into `chapters.LAYERS` (bottom 0); the manifest itself imports nothing and counts as the bottom."""
    if module == "minillm.chapters":
        return -1
    if module in TOP:
        return len(chapters.LAYERS)
    for i, layer in enumerate(chapters.LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    raise AssertionError(f"module {module} belongs to no layer of minillm.chapters.LAYERS")


def resolve(name: str) -> str:
    """The module an import names: `minillm.core.model` stays, `minillm.core.model.GPT` -> `minillm.core.model`."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(imported minillm module, line, at module top level?) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from minillm.core import model` imports the module minillm.core.model
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name == "minillm" or name.startswith("minillm."):
                found.append((resolve(name), node.lineno, id(node) in top_level))
    return found


GRAPH = {mod: {m for m, _, _ in imports_of(path) if m != mod} for mod, path in MODULES.items()}


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_point_down_the_layers():
    wrong = []
    for module, path in MODULES.items():
        for imported, line, _ in imports_of(path):
            if imported in MODULES and layer_of(imported) > layer_of(module):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({chapters.LAYERS[layer_of(module)] if module not in TOP else 'top'}) "
                             f"imports {imported}, a higher layer")
    assert not wrong, "\n".join(wrong)


def test_minillm_imports_sit_at_the_top_of_each_module():
    """An import inside a function is how a cycle hides; the package keeps every minillm import at the top."""
    hidden = sorted({f"{path.relative_to(ROOT)}:{line} imports {imported} inside a function or block"
                     for module, path in MODULES.items() if module not in TOP
                     for imported, line, top in imports_of(path) if not top})
    assert not hidden, "\n".join(hidden)


def test_module_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for nxt in sorted(GRAPH.get(module, ())):
            if nxt not in MODULES:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module)


def test_the_checker_sees_a_planted_upward_import_and_cycle(tmp_path):
    """The parser is not vacuous: an upward import, a hidden import and a cycle in a toy file are all found."""
    src = tmp_path / "toy.py"
    src.write_text("from minillm.engine.llm import LLM\n\ndef f():\n    from minillm.core import model\n")
    found = imports_of(src)
    assert ("minillm.engine.llm", 1, True) in found and ("minillm.core.model", 4, False) in found
    assert layer_of("minillm.engine.llm") > layer_of("minillm.core.model")


@pytest.mark.parametrize("chapter", chapters.CHAPTERS, ids=lambda c: c.name)
def test_manifest_names_real_files_for_built_chapters(chapter):
    if not chapter.built:
        assert not (PACKAGE / chapter.package_dir.split("/", 1)[1]).exists() or chapter.package in chapters.LAYERS
        return
    for rel in (chapter.text, chapter.notebook, chapter.test_file, *chapter.exercises):
        assert (ROOT / rel).is_file(), f"chapter {chapter.number}: {rel} is missing"
    assert (ROOT / chapter.package_dir / "__init__.py").is_file()
    assert (ROOT / chapter.package_dir / "tour.py").is_file(), f"chapter {chapter.number} has no tour entry"
    for rel in chapter.exercises:
        begin, _ = markers(rel)  # `# BEGIN SOLUTION`, or `// BEGIN SOLUTION` in a C, C++ or CUDA source
        assert begin in (ROOT / rel).read_text(encoding="utf-8"), f"{rel} has no exercise"


def test_manifest_matches_the_curriculum_slugs_and_files_on_disk():
    numbers = [c.number for c in chapters.CHAPTERS]
    assert numbers == [f"{i:02d}" for i in range(1, 16)]
    # A chapter under construction (built=False, its package already on disk) may have its tests before its text,
    # and then its text and notebook, which come together: both or neither.
    in_progress = [c for c in chapters.CHAPTERS if not c.built and (ROOT / c.package_dir / "__init__.py").is_file()]
    texts = {p.stem for p in (ROOT / "chapters").glob("[0-9][0-9]-*.md")}
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    drafted = {c.name for c in in_progress if c.name in texts | notebooks}
    assert texts - drafted == {c.name for c in chapters.built()}, "a chapter text exists that the manifest does not list"
    assert notebooks == texts, "a chapter has its text without its notebook, or its notebook without its text"
    tests = {p.name for p in (ROOT / "tests").glob("test_[0-9][0-9]_*.py")}
    in_progress_tests = {Path(c.test_file).name for c in in_progress}
    assert tests - in_progress_tests == {Path(c.test_file).name for c in chapters.built()}
    assert in_progress_tests <= tests, "a chapter's package exists without its test file"
    with pytest.raises(ValueError, match="16"):
        chapters.get(16)
    with pytest.raises(ValueError, match="x"):
        chapters.normalize("x")
    assert chapters.get("15").slug == "serving" and chapters.get(15).built


@pytest.mark.parametrize("package", sorted({m for m in MODULES if (MODULES[m].name == "__init__.py"
                                                                    and m != "minillm")}))
def test_package_docstring_names_every_module_and_no_missing_one(package):
    """A package's docstring is its table of contents: every module is in it, and no bullet names one that is gone."""
    import re

    path = MODULES[package]
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    modules = {p.stem for p in path.parent.glob("*.py") if p.stem != "__init__"}
    missing = sorted(m for m in modules if not re.search(rf"\b{m}\b", doc))
    assert not missing, f"{package}'s docstring does not mention {missing}"
    bullets = set(re.findall(r"^- `(\w+)`", doc, flags=re.M))
    assert bullets <= modules, f"{package}'s docstring lists modules that do not exist: {sorted(bullets - modules)}"
