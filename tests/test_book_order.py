"""Book order is the dependency order (DESIGN.md, "Extraction"): a module uses only names
saved by its own or earlier chapters, and from chapter 6 on a notebook calls only those
too, so the dependency graph is a DAG a reader can draw. The edges that still point
forward are listed here by name, so that no new one appears unnoticed; they are the
"backward edges" of the one-engine issue (part 1), and the list shrinks as it is done."""
import importlib
import json
import re

import pytest

from conftest import REPO

CHAPTERS = sorted(p.parent.name for p in (REPO / "chapters").glob("*/en.ipynb"))
FIRST_STRICT_NOTEBOOK = 5            # index of chapter 6: chapters 1-5 may preview

# (user, name used, the later chapter that saves it)
KNOWN_FORWARD_EDGES = {
    ("agentrl/diagnostics.py", "pack_sequences", "14_scaling"),
    ("agentrl/diagnostics.py", "packed_logits", "14_scaling"),
    ("13_diagnostics/en.ipynb", "pack_sequences", "14_scaling"),     # the saved cell
    ("13_diagnostics/en.ipynb", "packed_logits", "14_scaling"),
}


def module_of(chapter):
    return chapter.split("_", 1)[1]


def home_chapters():
    """Saved name -> index of the chapter whose module defines it."""
    home = {}
    for i, chapter in enumerate(CHAPTERS):
        module = importlib.import_module(f"agentrl.{module_of(chapter)}")
        for name in module.__all__:
            home.setdefault(name, i)
    return home


def arl_names(source):
    """Names used as `arl.<name>` in Python source."""
    return set(re.findall(r"\barl\.([A-Za-z_]\w*)", source))


def forward_edges():
    home = home_chapters()
    edges = set()
    for i, chapter in enumerate(CHAPTERS):
        path = REPO / "agentrl" / f"{module_of(chapter)}.py"
        for name in arl_names(path.read_text()):
            if home.get(name, -1) > i:
                edges.add((f"agentrl/{path.name}", name, CHAPTERS[home[name]]))
        if i < FIRST_STRICT_NOTEBOOK:
            continue
        nb = json.loads((REPO / "chapters" / chapter / "en.ipynb").read_text())
        for cell in nb["cells"]:
            # the setup cell is every chapter's same preamble (on Colab it installs the
            # package's release and loads its artefacts), not the chapter's own code
            if cell["cell_type"] != "code" or cell.get("id") == "setup":
                continue
            for name in arl_names("".join(cell["source"])):
                if home.get(name, -1) > i:
                    edges.add((f"{chapter}/en.ipynb", name, CHAPTERS[home[name]]))
    return edges


def test_no_new_forward_edges():
    new = forward_edges() - KNOWN_FORWARD_EDGES
    assert not new, ("these use a name that a later chapter saves (book order is the "
                     f"dependency order): {sorted(new)}")


def test_the_list_of_known_edges_is_current():
    gone = KNOWN_FORWARD_EDGES - forward_edges()
    assert not gone, f"fixed, so remove them from KNOWN_FORWARD_EDGES: {sorted(gone)}"


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
    # every arrow points up the list (book order), but the known forward edges
    order = list(deps.graph(REPO))
    upward = {(m, u) for m, uses in deps.graph(REPO).items() for u in uses
              if order.index(u) > order.index(m)}
    assert upward == {(user[len("agentrl/"):-len(".py")], module_of(ch))
                      for user, _, ch in KNOWN_FORWARD_EDGES if user.startswith("agentrl/")}
