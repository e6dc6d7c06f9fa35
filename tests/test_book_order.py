"""Book order is the dependency order (DESIGN.md, "Extraction"), with no exceptions:
- a module uses only names saved by modules placed before it: an earlier chapter's, or
  an earlier one of its own chapter (a chapter's modules take their place where the
  chapter completes them, tools/extract.py);
- from chapter 6 on, a notebook (its setup cell included) calls only names saved by its
  own or earlier chapters.
So the dependency graph is a DAG a reader can draw, and a new backward edge fails here."""
import json
import re

import pytest

import agentrl as arl
from conftest import REPO

CHAPTERS = sorted(p.parent.name for p in (REPO / "chapters").glob("*/en.ipynb"))
FIRST_STRICT_NOTEBOOK = 5            # index of chapter 6: chapters 1-5 may preview


def arl_names(source):
    """Names used as `arl.<name>` in Python source."""
    return set(re.findall(r"\barl\.([A-Za-z_]\w*)", source))


def home_modules(order, exports):
    """Saved name -> index (in `order`) of the module that saves it first."""
    home = {}
    for i, module in enumerate(order):
        for name in exports[module]:
            home.setdefault(name, i)
    return home


def module_edges(order, exports, texts):
    """(user module, name, later module) for each `arl.<name>` that a module in `order`
    uses although a module placed after it saves the name."""
    home = home_modules(order, exports)
    return {(f"agentrl/{m}.py", name, order[home[name]])
            for i, m in enumerate(order) for name in arl_names(texts[m])
            if home.get(name, -1) > i}


def chapter_index():
    """Module -> index in CHAPTERS of the chapter that saves it."""
    slugs = [c.split("_", 1)[1] for c in CHAPTERS]
    return {m: slugs.index(slug) for slug, own in arl._BOOK for m in own}


def package():
    order = arl._MODULES
    exports = {m: getattr(arl, m).__all__ for m in order}
    texts = {m: (REPO / "agentrl" / f"{m}.py").read_text() for m in order}
    return order, exports, texts


def notebook_edges():
    """(notebook, name, module) for each `arl.<name>` a notebook of chapter 6 or later
    calls although a later chapter saves it."""
    order, exports, _ = package()
    home, chapter = home_modules(order, exports), chapter_index()
    edges = set()
    for i, name in enumerate(CHAPTERS[FIRST_STRICT_NOTEBOOK:], FIRST_STRICT_NOTEBOOK):
        nb = json.loads((REPO / "chapters" / name / "en.ipynb").read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            for used in arl_names("".join(cell["source"])):
                if used in home and chapter[order[home[used]]] > i:
                    edges.add((f"{name}/en.ipynb", used, order[home[used]]))
    return edges


def test_the_book_lists_every_chapter_with_saved_code_in_order():
    slugs = [c.split("_", 1)[1] for c in CHAPTERS]
    assert [slug for slug, _ in arl._BOOK] == [s for s in slugs if s in dict(arl._BOOK)]
    assert arl._MODULES == tuple(m for _, own in arl._BOOK for m in own)


def test_no_module_uses_a_module_placed_after_it():
    edges = module_edges(*package())
    assert not edges, f"these modules use a name saved after them: {sorted(edges)}"


def test_no_notebook_calls_a_later_chapter():
    edges = notebook_edges()
    assert not edges, f"these notebooks call a name a later chapter saves: {sorted(edges)}"


def test_a_backward_edge_is_caught():
    order = ("a", "b")
    exports = {"a": ["f"], "b": ["g"]}
    assert module_edges(order, exports, {"a": "arl.f()", "b": "arl.f(); arl.g()"}) == set()
    assert module_edges(order, exports, {"a": "x = arl.g", "b": ""}) == {
        ("agentrl/a.py", "g", "b")}


@pytest.mark.parametrize("source, names", [
    ("x = arl.train_rl(a, arl.RLConfig())", {"train_rl", "RLConfig"}),
    ("carl.x; arl_y; 'arl.z'", {"z"}),      # text, not syntax: a string counts too
])
def test_arl_names(source, names):
    assert arl_names(source) == names


def test_readme_module_graph_is_current():
    import sys
    sys.path.insert(0, str(REPO / "tools"))
    import deps
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert deps.block(REPO) in readme, "stale module graph: python tools/deps.py --write"
    order = list(deps.graph(REPO))          # every arrow points up the list (book order)
    upward = {(m, u) for m, uses in deps.graph(REPO).items() for u in uses
              if order.index(u) > order.index(m)}
    assert upward == set()
