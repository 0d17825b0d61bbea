"""The chapter texts are written for students, show the code that runs, cite what they quote, and map the course.

- No development notes: no paths outside the repository, no notes about how the work was organised, in the chapter
  texts, the bibliography, the README or the notebooks (read here, never changed).
- Every `references.md#anchor` a text links to exists in `chapters/references.md`.
- Every included code block equals the current source (`python -m minillm.course.includes --write` refreshes
  them), and no block gives an exercise's solution away.
- Every measured table of chapters 08-15 is included from a committed results file, every quoted number inside a
  sentence from that file or a notebook's saved outputs, and they agree (`minillm.course.results`); each results
  file is quoted by a text that shows the command that wrote it.
- "chapter NN" in a chapter text names the manifest's chapter: a link to its text, or the slug in parentheses.
- Each chapter has "Check your understanding" questions with answers, and ends with its appendix.
- The roadmap figure exists, was drawn from the current manifest, and the README and chapter 01 show it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minillm import chapters
from minillm.course import includes, results, roadmap
from minillm.course.assignment import BEGIN, markers

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS_DIR = ROOT / "chapters"
BUILT = chapters.built()
TEXTS = {c.number: ROOT / c.text for c in BUILT}
REFERENCES = CHAPTERS_DIR / "references.md"

FORBIDDEN = [
    (re.compile(r"\.\./"), "a relative path leaving the repository ('../')"),
    (re.compile(r"/work/|/tmp/|/root/|/home/"), "an absolute path outside the repository"),
    (re.compile(r"papers\.md", re.I), "the internal notes file papers.md (cite chapters/references.md)"),
    (re.compile(r"\bthe issue\b|\bissue #|\bthe brief\b", re.I), "a note about how the work was organised"),
    (re.compile(r"\bTODO\b"), "a TODO"),
    (re.compile(r"\bid unverified\b", re.I), "an 'id unverified' remark (check the id, then cite it)"),
]


def student_facing() -> list[tuple[str, str]]:
    """(name, text) of every chapter text, the bibliography, the README and each notebook cell's source."""
    docs = [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8"))
            for p in sorted(CHAPTERS_DIR.glob("*.md"))]
    docs.append(("README.md", (ROOT / "README.md").read_text(encoding="utf-8")))
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] in ("markdown", "code"):
                docs.append((f"{nb.relative_to(ROOT).as_posix()} cell {i}", "".join(cell["source"])))
    return docs


def strip_code(text: str) -> str:
    """The prose of a markdown text: fenced blocks and inline code removed (included source may say anything)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_no_development_notes_or_outside_paths():
    problems = []
    for name, text in student_facing():
        for pattern, why in FORBIDDEN:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{name}:{line}: {why}: {text[max(0, m.start() - 40):m.end() + 20]!r}")
    assert not problems, "student-facing text contains development notes:\n" + "\n".join(problems)


def anchors() -> set[str]:
    return set(re.findall(r'<a id="([\w-]+)"></a>', REFERENCES.read_text(encoding="utf-8")))


def test_references_have_unique_anchors_with_a_source():
    text = REFERENCES.read_text(encoding="utf-8")
    ids = re.findall(r'<a id="([\w-]+)"></a>', text)
    assert len(ids) == len(set(ids)), f"duplicate anchors in references.md: {sorted(i for i in ids if ids.count(i) > 1)}"
    for entry in re.split(r"\n- (?=<a id=)", text)[1:]:
        assert re.search(r"arXiv:\d{4}\.\d{4,5}|https?://|doi:|Journal", entry), f"no arXiv id or URL: {entry[:80]}"


@pytest.mark.parametrize("number", sorted(TEXTS))
def test_citations_resolve(number):
    text = TEXTS[number].read_text(encoding="utf-8")
    cited = re.findall(r"references\.md#([\w-]+)", text)
    assert cited, f"{TEXTS[number].name} cites nothing in references.md"
    missing = sorted(set(cited) - anchors())
    assert not missing, f"{TEXTS[number].name} links to anchors references.md does not define: {missing}"


def test_includes_match_the_source():
    problems = includes.stale()
    assert not problems, ("chapter code blocks differ from the package source:\n" + "\n".join(problems)
                          + "\nrefresh them with: python -m minillm.course.includes --write")


@pytest.mark.parametrize("number", sorted(TEXTS))
def test_each_chapter_shows_its_key_functions(number):
    found = [i for i in includes.find_includes(TEXTS[number]) if not i.path.endswith(".json")]
    assert len(found) >= 2, f"{TEXTS[number].name} includes {len(found)} functions from the package (want 2-4+)"


def solution_lines() -> set[str]:
    """Distinctive lines of every exercise's reference solution (long enough not to occur by chance)."""
    lines: set[str] = set()
    outside: set[str] = set()
    for c in BUILT:
        for rel in c.exercises:
            begin, end = markers(rel)  # `//` in a .cu exercise
            inside = False
            for line in (ROOT / rel).read_text(encoding="utf-8").splitlines():
                s = line.strip()
                if s == begin:
                    inside = True
                elif s == end:
                    inside = False
                elif len(s) >= 30 and not s.startswith(("#", "//")):
                    (lines if inside else outside).add(s)
    return lines - outside


def test_no_text_gives_an_exercise_away():
    secret = solution_lines()
    assert secret, "found no exercise solutions to guard"
    for number, path in TEXTS.items():
        for inc in includes.find_includes(path):
            leaked = [s for s in secret if s in inc.body]
            assert not leaked, f"{path.name}:{inc.line} shows solution lines of an exercise: {leaked[:2]}"


def test_includes_stub_exercises_and_dedent():
    code, stubbed = includes.extract("minillm/tokenizer/basics.py", "merge")
    assert stubbed and 'raise NotImplementedError("exercise: implement merge")' in code
    assert BEGIN not in code and code.startswith("def merge(")
    code, stubbed = includes.extract("minillm/kvcache/generate.py", "decode_step")
    assert not stubbed and "def decode_step(" in code and "raise NotImplementedError" not in code
    with pytest.raises(ValueError, match="no 'Nope'"):
        includes.extract("minillm/kvcache/cache.py", "ContiguousKVCache.Nope")


KERNEL = """\
// unrelated: the file's header
#include "common.cuh"

cudaError_t twice_forward(const float* x, float* y, int64_t n);  // a declaration: skipped

// Doubles x; a brace in a comment } and in a string "}" and a char '{' are not code.
template <typename T>
__global__ void twice_kernel(const T* x, T* y, int64_t n) {
    const char* s = "}";
    // BEGIN SOLUTION
    const int64_t i = threadIdx.x;
    if (i < n) { y[i] = x[i] * 2; }
    // END SOLUTION
}

void host_loop(float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        // BEGIN INCLUDE inner
        y[i] += 1;
#pragma unroll
        if (y[i] > 0) {
            y[i] *= 2;
        }
        // END INCLUDE inner
    }
}
"""


def test_includes_c_functions_by_name_and_regions_by_marker(tmp_path):
    """A function by name (its template line and the comment above it, closed at its own brace, a declaration of the
    same shape skipped), an exercise in it stubbed, a region dedented (a `#pragma` in column 0 does not stop that)
    without its marker lines, and the fence's language from the suffix."""
    (tmp_path / "k.cu").write_text(KERNEL)
    code, stubbed = includes.extract("k.cu", "twice_kernel", root=tmp_path)
    assert stubbed and code.startswith("// Doubles x;") and code.endswith("}\n") and "host_loop" not in code
    assert "// exercise: implement twice_kernel" in code and "y[i] = x[i] * 2" not in code
    code, stubbed = includes.extract("k.cu", "inner", root=tmp_path)
    assert not stubbed and code == "y[i] += 1;\n#pragma unroll\nif (y[i] > 0) {\n    y[i] *= 2;\n}\n"
    code, _ = includes.extract("k.cu", "host_loop", root=tmp_path)
    assert "INCLUDE" not in code and code.startswith("void host_loop(") and code.count("\n") == 9
    with pytest.raises(ValueError, match="no function 'twice_forward'"):
        includes.extract("k.cu", "twice_forward", root=tmp_path)
    (tmp_path / "k.cpp").write_text(KERNEL)
    assert includes.render("k.cpp", "inner", root=tmp_path).startswith("```cpp\n// k.cpp\ny[i] += 1;")
    assert includes.render("k.cu", "twice_kernel", root=tmp_path).startswith(
        "```cuda\n// k.cu  (the exercise's solution is left out: it is yours to write)\n// Doubles x;")
    (tmp_path / "bad.cu").write_text("// BEGIN INCLUDE open\nint x;\n")
    with pytest.raises(ValueError, match="without"):
        includes.extract("bad.cu", "open", root=tmp_path)
    md = tmp_path / "99-x.md"
    md.write_text(f"<!-- include: k.cu::inner -->\n{includes.render('k.cu', 'inner', root=tmp_path)}"
                  "<!-- end include -->\n")
    assert includes.stale([md], root=tmp_path) == []


def test_include_check_fails_on_a_stale_block(tmp_path):
    md = tmp_path / "99-x.md"
    block = includes.render("minillm/kvcache/generate.py", "decode_step")
    md.write_text(f"<!-- include: minillm/kvcache/generate.py::decode_step -->\n{block}<!-- end include -->\n")
    assert includes.stale([md]) == []
    md.write_text(md.read_text().replace("def decode_step(", "def decode_step_old("))
    assert includes.stale([md]) and includes.main(["--check", str(md)]) == 1
    includes.write([md])
    assert includes.stale([md]) == [] and includes.main(["--check", str(md)]) == 0


MENTION = re.compile(r"(?<!-)\b[Cc]hapter (\d{2})\b")  # not `--chapter 04` (a command)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


@pytest.mark.parametrize("number", sorted(TEXTS))
def test_chapter_mentions_name_the_manifest(number):
    """A built chapter is a link to its text (or carries its slug); a coming one carries its slug: "chapter 08
    (speculative-decoding)"."""
    prose = strip_code(TEXTS[number].read_text(encoding="utf-8"))
    problems = []

    def check_link(m: re.Match) -> str:
        for nn in MENTION.findall(m.group(1)):
            c = chapters.get(nn)
            if m.group(2).split("#")[0] != f"{c.name}.md":
                problems.append(f"link {m.group(0)!r} should point to {c.name}.md")
            elif not c.built:
                problems.append(f"link {m.group(0)!r} points to a chapter not written yet")
        return " " * len(m.group(0))

    rest = LINK.sub(check_link, prose)
    for m in MENTION.finditer(rest):
        c = chapters.get(m.group(1))
        if not re.match(rf"\s+\({re.escape(c.slug)}\)", rest[m.end():]):
            line = rest.count("\n", 0, m.start()) + 1
            want = f"[chapter {c.number}]({c.name}.md)" if c.built else f"chapter {c.number} ({c.slug})"
            problems.append(f"line {line}: {rest[m.start():m.end() + 25]!r} -> write {want!r}")
    assert not problems, f"{TEXTS[number].name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("number", sorted(TEXTS))
def test_check_your_understanding_and_appendix(number):
    text = TEXTS[number].read_text(encoding="utf-8")
    heads = re.findall(r"^## (?:\d+\. )?(.+)$", strip_code(text), flags=re.M)  # "## 9. Check ..." counts too
    assert any(h.startswith("Check your understanding") for h in heads), f"{TEXTS[number].name}: no such section"
    section = re.split(r"^## (?:\d+\. )?Check your understanding", text, flags=re.M)[1].split("\n## ", 1)[0]
    n = section.count("<details>")
    assert 3 <= n <= 6 and n == section.count("</details>"), f"{TEXTS[number].name}: {n} answered questions"
    assert heads[-1].startswith("Appendix"), f"{TEXTS[number].name} should end with its appendix, ends with {heads[-1]!r}"


def test_roadmap_covers_the_manifest():
    assert set(roadmap.ADDS) == {c.number for c in chapters.CHAPTERS}
    assert all(set(parts) <= set(roadmap.PARTS) for parts in roadmap.ADDS.values())
    summary = roadmap.summary()
    for c in chapters.CHAPTERS:
        assert f"{c.number} {c.slug} {'built' if c.built else 'coming'}" in summary


def test_roadmap_figure_is_current():
    from PIL import Image

    assert roadmap.FIGURE.is_file(), "draw it with: python -m minillm.course.roadmap"
    with Image.open(roadmap.FIGURE) as im:
        drawn = im.text.get(roadmap.PNG_KEY)
    assert drawn == roadmap.summary(), "the roadmap figure is older than the manifest: python -m minillm.course.roadmap"


def test_readme_and_chapter_01_show_the_roadmap():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## Roadmap" in readme
    section = readme.split("## Roadmap", 1)[1].split("\n## ", 1)[0]
    assert "chapters/figures/roadmap.png" in section
    ch01 = TEXTS["01"].read_text(encoding="utf-8")
    assert "figures/roadmap.png" in ch01
    for c in chapters.CHAPTERS:
        assert re.search(rf"\b{c.number}\b.*{re.escape(c.slug)}", section), f"README roadmap lacks chapter {c.number}"
        assert c.slug in ch01, f"chapter 01's roadmap lacks chapter {c.number} ({c.slug})"


RESULTS_DIR = ROOT / results.RESULTS_DIR
FACTS = "<!-- facts, not measurements -->"  # the line above a table of definitions or arithmetic, not of a run
MODULE_MAP = re.compile(r"^\| file \| what \|")


def tables_outside_includes(text: str) -> list[tuple[int, str]]:
    """(line, header) of every Markdown table that is neither inside an include block, nor a module map, nor
    marked as facts on the line above it."""
    found, inside, previous, in_table = [], False, "", False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("<!-- include: "):
            inside = True
        elif line.startswith(includes.CLOSE):
            inside = False
        starts = line.startswith("|") and not in_table
        if starts and not inside and not MODULE_MAP.match(line) and previous.strip() != FACTS:
            found.append((number, line[:80]))
        in_table = line.startswith("|")
        previous = line
    return found


@pytest.mark.parametrize("number", [n for n in sorted(TEXTS) if "08" <= n <= "15"])
def test_measured_tables_are_included_from_a_results_file(number):
    loose = tables_outside_includes(TEXTS[number].read_text(encoding="utf-8"))
    assert not loose, (f"{TEXTS[number].name} has tables typed by hand (include them from chapters/results/, or mark "
                       f"a table of facts with {FACTS!r} above it):\n" + "\n".join(f"line {n}: {h}" for n, h in loose))


def test_every_results_file_is_quoted_with_its_command():
    texts = {p.name: p.read_text(encoding="utf-8") for p in TEXTS.values()}
    files = sorted(RESULTS_DIR.glob("*.json"))
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        report = results.load_report(rel, ROOT)
        quoting = [name for name, text in texts.items() if rel + "::" in text]
        assert quoting, f"{rel} is quoted by no chapter text"
        command = report.get("command")
        assert isinstance(command, str) and command.startswith("python -m minillm."), f"{rel} names no command"
        shown = command.replace(" --json " + rel, " --json FILE.json").split(" --json ")[0]
        assert any(shown in texts[name] for name in quoting), (
            f"{rel} was written by {command!r}; the text quoting it ({quoting}) never shows {shown!r}")


def test_results_and_notebook_values_are_checked(tmp_path, monkeypatch):
    """The mechanism itself: a stale table or value is found, --write fixes it, a missing name is named."""
    (tmp_path / "chapters/results").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "chapters/results/r.json").write_text(json.dumps({"bench": "minillm.fake_bench", "x": 1.5}))
    cells = [{"cell_type": "code", "outputs": [{"output_type": "stream", "name": "stdout",
                                                "text": ["new tokens: 57\n", "other: 1\n"]}]}]
    (tmp_path / "notebooks/n.ipynb").write_text(json.dumps({"cells": cells}))
    fake = type("FakeBench", (), {"quotes": staticmethod(lambda r: {"t": f"| x |\n|---|\n| {r['x']} |\n",
                                                                     "v": f"{r['x']:.2f}x"})})
    monkeypatch.setattr(results.importlib, "import_module", lambda name: fake)
    text = ("We saw <!-- value: notebooks/n.ipynb::new tokens -->64<!-- end value --> tokens, "
            "<!-- value: chapters/results/r.json::v -->1.40x<!-- end value --> faster.\n"
            "<!-- include: chapters/results/r.json::t -->\n| x |\n|---|\n| 1.4 |\n<!-- end include -->\n")
    page = tmp_path / "01-x.md"
    page.write_text(text)
    problems = includes.stale([page], tmp_path)
    assert len(problems) == 3 and "'57' there, '64' here" in " ".join(problems), problems
    includes.write([page], tmp_path)
    assert includes.stale([page], tmp_path) == []
    assert "-->57<!--" in page.read_text() and "| 1.5 |" in page.read_text() and "-->1.50x<!--" in page.read_text()
    page.write_text("<!-- value: chapters/results/r.json::nope -->1<!-- end value -->\n"
                    "<!-- value: notebooks/n.ipynb::absent -->1<!-- end value -->\n")
    problems = includes.stale([page], tmp_path)
    assert "has no quote 'nope'" in problems[0] and "prints no line 'absent: '" in problems[1], problems
    page.write_text("<!-- value: chapters/results/r.json::v -->1.50x\n")
    assert "malformed value marker" in includes.stale([page], tmp_path)[0]
    page.write_text("<!-- value: chapters/results/r.json::nope -->1<!-- end value -->\n"
                    "<!-- value: chapters/results/r.json::v -->1.40x<!-- end value -->\n")
    found: list[str] = []
    assert includes.write([page], tmp_path, problems=found) == [page]  # the good value is refreshed, the bad one kept
    assert page.read_text().endswith("-->1.50x<!-- end value -->\n") and "::nope -->1<!--" in page.read_text()
    assert len(found) == 1 and found[0].startswith("01-x.md:line 1:") and "'nope'" in found[0], found
