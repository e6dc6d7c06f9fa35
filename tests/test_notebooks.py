"""Every chapter notebook keeps the book's conventions: code and printed output that fit the
rendered page (88 columns), the same setup cell (install only when missing, one torch thread),
both languages."""
import ast
import json
import re
from pathlib import Path

import pytest

from conftest import REPO

NOTEBOOKS = sorted((REPO / "chapters").glob("*/*.ipynb"))
MAX_COLUMNS = 88


def code_cells(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [c for c in cells if c["cell_type"] == "code"]


def test_there_are_notebooks_in_both_languages():
    chapters = sorted({p.parent for p in NOTEBOOKS})
    assert chapters, "no chapter notebooks found"
    for folder in chapters:
        assert (folder / "en.ipynb").exists() and (folder / "zh.ipynb").exists(), folder


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_code_lines_fit_the_page(path):
    wide = [f"cell {c.get('id')}: {len(line)} columns: {line.strip()[:60]}"
            for c in code_cells(path)
            for line in "".join(c["source"]).splitlines() if len(line) > MAX_COLUMNS]
    assert not wide, f"{len(wide)} code lines wider than {MAX_COLUMNS} columns:\n" + "\n".join(wide[:20])


def printed_lines(cell):
    """The lines a reader sees printed under a code cell: stream text, and the plain text
    of a result that has no richer form (a figure shows as an image, not as its repr)."""
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if out["output_type"] == "stream":
            text = "".join(out["text"])
        elif "text/plain" in data and not {"image/png", "text/html"} & set(data):
            text = "".join(data["text/plain"])
        else:
            continue
        yield from (line.rsplit("\r", 1)[-1] for line in text.split("\n"))


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem == "en"],
                         ids=lambda p: p.parent.name)
def test_printed_outputs_fit_the_page(path):
    """Printed output is read on the same 88-column page as the code (zh.ipynb holds the
    same outputs: tools/sync.py --check)."""
    wide = [f"cell {c.get('id')}: {len(line)} columns: {line.strip()[:60]}"
            for c in code_cells(path) for line in printed_lines(c) if len(line) > MAX_COLUMNS]
    assert not wide, (f"{len(wide)} printed lines wider than {MAX_COLUMNS} columns:\n"
                      + "\n".join(wide[:20]))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_figure_cells_fold_their_code(path):
    """A cell that only draws a figure shows the figure; its plotting code is folded
    (Jupyter Book's hide-input tag) so the code the prose discusses stays in view."""
    unfolded = [c.get("id") for c in code_cells(path)
                if not "".join(c["source"]).startswith("#@save")
                and re.search(r"plt\.subplots\(|plt\.figure\(", "".join(c["source"]))
                and "hide-input" not in c.get("metadata", {}).get("tags", [])]
    assert not unfolded, f"figure cells without the hide-input tag: {unfolded}"


def figure_cells(path):
    """The code cells whose outputs hold a figure (a PNG image)."""
    return [c for c in code_cells(path)
            if any("image/png" in o.get("data", {}) for o in c.get("outputs", []))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_figure_has_a_caption_and_a_name(path):
    """MyST-NB numbers a figure and prints its caption from the cell's metadata
    (mystnb.figure); the Chinese copy's caption is in Chinese (tools/sync.py --check)."""
    missing = [c.get("id") for c in figure_cells(path)
               if not c.get("metadata", {}).get("mystnb", {}).get("figure", {}).get("caption")
               or not c["metadata"]["mystnb"]["figure"].get("name")]
    assert not missing, f"figures without a caption or a name: {missing}"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_figure_names_are_unique_across_the_book(lang):
    names = [c["metadata"]["mystnb"]["figure"]["name"]
             for path in NOTEBOOKS if path.stem == lang for c in figure_cells(path)
             if c.get("metadata", {}).get("mystnb", {}).get("figure", {}).get("name")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem == "en"],
                         ids=lambda p: p.parent.name)
def test_figures_have_at_most_two_panels_a_row(path):
    """A row of three panels shrinks to the column until its labels cannot be read."""
    wide = [c.get("id") for c in code_cells(path)
            if re.search(r"subplots\(\s*\d+\s*,\s*([3-9]|\d\d)\b|ncols\s*=\s*([3-9]|\d\d)\b",
                         "".join(c["source"]))]
    assert not wide, f"figures with more than two panels a row: {wide}"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem == "en"],
                         ids=lambda p: p.parent.name)
def test_figures_are_png_at_twice_the_pixel_density(path):
    """tools/execute.py draws figures as 'retina' PNG: twice the pixels of the size
    they are shown at (the output's width metadata, which MyST-NB puts on the img)."""
    import base64
    import struct
    low = []
    for cell in figure_cells(path):
        for out in cell["outputs"]:
            if "image/png" not in out.get("data", {}):
                continue
            png = base64.b64decode(out["data"]["image/png"])
            pixels = struct.unpack(">I", png[16:20])[0]         # the IHDR width
            shown = out.get("metadata", {}).get("image/png", {}).get("width")
            if not shown or pixels < 2 * shown - 1:
                low.append(f"{cell.get('id')}: {pixels} px shown at {shown}")
    assert not low, low


FOLD_OVER = 40     # lines: a longer saved cell is folded, the page shows prose and results


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_long_saved_cells_are_folded_under_a_line_that_links_their_api(path):
    """A #@save cell over FOLD_OVER lines carries hide-input, and the markdown cell just
    before it names every public function and class it saves with a link to the API
    reference ({py:obj}`~agentrl.module.name`)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    problems = []
    for before, cell in zip(cells, cells[1:]):
        source = "".join(cell["source"])
        if (cell["cell_type"] != "code" or not source.startswith("#@save")
                or len(source.splitlines()) <= FOLD_OVER):
            continue
        if "hide-input" not in cell.get("metadata", {}).get("tags", []):
            problems.append(f"{cell.get('id')}: not folded (hide-input)")
        # the module-level functions and classes (not a `def` inside a program string)
        names = [node.name for node in ast.parse(source).body
                 if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                 and not node.name.startswith("_")]
        linked = re.findall(r"\{py:obj\}`~agentrl\.\w+\.(\w+)`", "".join(before["source"]))
        if before["cell_type"] != "markdown" or not set(names) <= set(linked):
            problems.append(f"{cell.get('id')}: the cell before does not link "
                            f"{sorted(set(names) - set(linked))}")
    assert not problems, problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_setup_cell_installs_only_when_missing_and_sets_one_thread(path):
    setup = code_cells(path)[0]
    source = "".join(setup["source"])
    assert setup.get("id") == "setup"
    assert source.startswith("try:\n    import agentrl as arl\nexcept ImportError:")
    assert "arl.set_torch_threads()" in source
    # the chapter's cost, printed from the timing record (issue: a reader's first run)
    assert f"print(arl.chapter_cost('{path.parent.name}'))" in source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_setup_cell_installs_the_release_of_this_version_and_loads_its_artefacts(path):
    """On Colab the setup cell installs the package at the tag of pyproject's version (the
    release workflow makes it) and loads that release's artefact bundle, not main's code."""
    import tomllib
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    source = "".join(code_cells(path)[0]["source"])
    url = "https://github.com/agentrl-from-scratch/agentic-rl-from-scratch"
    assert f"REPO = '{url}'" in source
    assert f'%pip install -q "agentrl-from-scratch @ git+{{REPO}}@v{version}"' in source
    # chapter 1's helper: that release's bundle, or a message and a cold run (tested there)
    assert "arl.load_release_artifacts(REPO)" in source


@pytest.mark.parametrize("page, lang", [("index.md", "en"), ("index_zh.md", "zh")])
def test_landing_page_lists_exactly_the_written_chapters(page, lang):
    """Each site's landing page (index.md: English, index_zh.md: Chinese) says which chapters
    exist: every notebook in its language is linked, every link exists."""
    import re
    index = (REPO / page).read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((chapters/[^)]+\.ipynb)\)", index))
    on_disk = {str(p.relative_to(REPO)) for p in NOTEBOOKS if p.stem == lang}
    assert linked == on_disk, (f"not linked: {sorted(on_disk - linked)}; "
                               f"missing: {sorted(linked - on_disk)}")


# A chapter's overview, its summary and its exercises are its only unnumbered sections.
UNNUMBERED_SECTIONS = {"Summary", "Exercises", "小结", "练习", "Where the bytes are",
                       "字节都花在哪里"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_sections_follow_one_numbering_scheme(path):
    """Every section of chapter N is `## N.M Title`, M = 1, 2, ... in order (both
    languages): one scheme across the book, so that "section 14.4" means one place."""
    chapter = int(path.parent.name[:2])
    nb = json.loads(path.read_text(encoding="utf-8"))
    headings = [line for c in nb["cells"] if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("## ")]
    numbered = [h for h in headings if h[3:].strip() not in UNNUMBERED_SECTIONS]
    wanted = [f"## {chapter}.{m} " for m in range(1, len(numbered) + 1)]
    assert [h[:len(w)] for h, w in zip(numbered, wanted)] == wanted, numbered
    assert not any(re.match(r"## \d", h) for h in headings if h not in numbered)
