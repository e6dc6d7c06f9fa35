"""The bibliography: every {cite} role in the notebooks resolves, every entry links to the work,
and the English and Chinese markdown cite the same works in the same cells.

Fast: reads references.bib with pybtex and the notebooks as JSON; no Sphinx build.
"""
import json
import re
from pathlib import Path

import pytest
from pybtex.database import parse_file

REPO = Path(__file__).resolve().parents[1]
BIB = REPO / "references.bib"
CHAPTERS = sorted(p for p in (REPO / "chapters").iterdir() if (p / "en.ipynb").exists())

# {cite}`a,b`, {cite:p}`a`, {cite:t}`a`, {cite:year}`a`, {cite:ps}`a` ... (MyST role syntax)
CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]*)`")


def bib_entries():
    return parse_file(str(BIB), bib_format="bibtex").entries


def markdown_cells(nb_path):
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            src = cell["source"]
            yield cell.get("id"), "".join(src) if isinstance(src, list) else src


def cited_keys(text):
    """The keys of every citation role in text, in order (with repeats)."""
    return [k.strip() for group in CITE.findall(text) for k in group.split(",") if k.strip()]


def test_bib_parses_with_unique_keys():
    text = BIB.read_text(encoding="utf-8")
    keys = re.findall(r"^@\w+\{([^,\s]+),", text, flags=re.M)
    assert keys, "references.bib has no entries"
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    assert set(keys) == set(bib_entries()), "pybtex and the regex disagree about the keys"


def test_every_entry_has_a_link_author_title_and_year():
    for key, entry in bib_entries().items():
        f = entry.fields
        assert f.get("url") or f.get("doi"), f"{key}: no url or doi"
        url = f.get("url", "")
        assert not url or url.startswith(("https://", "http://")), f"{key}: odd url {url!r}"
        assert entry.persons.get("author"), f"{key}: no author"
        assert f.get("title"), f"{key}: no title"
        assert re.fullmatch(r"(19|20)\d\d", f.get("year", "")), f"{key}: year {f.get('year')!r}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_cited_keys_exist(chapter):
    keys = set(bib_entries())
    for lang in ("en", "zh"):
        for cid, text in markdown_cells(chapter / f"{lang}.ipynb"):
            missing = [k for k in cited_keys(text) if k not in keys]
            assert not missing, f"{chapter.name}/{lang} cell {cid}: unknown keys {missing}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_zh_cites_what_en_cites(chapter):
    zh = dict(markdown_cells(chapter / "zh.ipynb"))
    for cid, text in markdown_cells(chapter / "en.ipynb"):
        en_keys = sorted(cited_keys(text))
        if not en_keys:
            continue
        assert cid in zh, f"{chapter.name}: cell {cid} cites {en_keys} but has no zh cell"
        assert sorted(cited_keys(zh[cid])) == en_keys, f"{chapter.name} cell {cid}"


def test_pages_cite_the_whole_bibliography():
    for lang in ("en", "zh"):
        text = (REPO / f"references_{lang}.md").read_text(encoding="utf-8")
        assert "```{bibliography}" in text, lang


def test_every_entry_is_cited_somewhere():
    used = set()
    for chapter in CHAPTERS:
        for _, text in markdown_cells(chapter / "en.ipynb"):
            used.update(cited_keys(text))
    unused = sorted(set(bib_entries()) - used)
    assert not unused, f"entries no chapter cites: {unused}"
