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


# --- the bibliography's labels (tools/sphinx_bib_style.py) ------------------------------------
# The list labels each work as the text cites it ("Agarwal et al., 2024"), with a, b, ... after
# the year where two works would share a label; the in-text citations print the same suffix.

def formatted_entries():
    """Every entry of references.bib as the book's bibliography formats it (sorted, labelled)."""
    import pybtex.plugin

    import sphinx_bib_style
    sphinx_bib_style.register()
    style = pybtex.plugin.find_plugin("pybtex.style.formatting", sphinx_bib_style.NAME)()
    return list(style.format_entries(bib_entries().values()))


def surname(person):
    """A person's surname in plain text, read here from the raw .bib name (not through the
    style): "von Werra", "Dósa" (from D{\\'o}sa), "Open Compute Project" (from {...})."""
    import codecs

    import latexcodec  # noqa: F401  (registers the "ulatex" codec)
    raw = " ".join(person.prelast_names + person.last_names)
    return codecs.decode(raw, "ulatex").replace("{", "").replace("}", "")


def expected_base_label(entry):
    """What the author_year citation prints: "A, 1999", "A and B, 1999", "A et al., 1999"."""
    names = [surname(p) for p in entry.persons["author"]]
    who = (names[0] if len(names) == 1 else " and ".join(names) if len(names) == 2
           else names[0] + " et al.")
    return f"{who}, {entry.fields['year']}"


def test_labels_are_author_year_with_suffixes_only_where_needed():
    entries = formatted_entries()
    data = bib_entries()
    assert len(entries) == len(data)
    bases = {fe.key: expected_base_label(data[fe.key]) for fe in entries}
    repeated = {b for b in bases.values() if list(bases.values()).count(b) > 1}
    suffixes = {}
    for fe in entries:
        base = bases[fe.key]
        if base in repeated:
            assert fe.label[:-1] == base and fe.label[-1] in "abcdefgh", (fe.key, fe.label)
            suffixes.setdefault(base, []).append(fe.label[-1])
        else:
            assert fe.label == base, (fe.key, fe.label)
    # a, b, ... in the list's order, each repeated label once per work
    for base, letters in suffixes.items():
        assert letters == list("abcdefgh"[:len(letters)]), (base, letters)
    labels = [fe.label for fe in entries]
    assert len(labels) == len(set(labels)), sorted(lab for lab in labels if labels.count(lab) > 1)
    for label in labels:
        assert not set(label) & set("{}\\"), label


def test_labels_of_known_entries():
    labels = {fe.key: fe.label for fe in formatted_entries()}
    assert labels["wilson1927probable"] == "Wilson, 1927"
    assert labels["agarwal2024policy"] == "Agarwal et al., 2024"
    assert labels["efron1993bootstrap"] == "Efron and Tibshirani, 1993"
    assert labels["dosa2007tight"] == "Dósa, 2007"  # D{\'o}sa in the .bib
    assert labels["vonwerra2020trl"] == "von Werra et al., 2020"
    assert labels["huggingface2024fixing"] == "Hugging Face, 2024"  # {Hugging Face}
    assert {labels["ocp2023ofp8"], labels["ocp2023mx"]} == {
        "Open Compute Project, 2023a", "Open Compute Project, 2023b"}
    assert {labels["liu2025prorl"], labels["liu2025understanding"]} == {
        "Liu et al., 2025a", "Liu et al., 2025b"}


def test_list_is_in_label_order():
    import unicodedata

    def fold(s):
        return "".join(c for c in unicodedata.normalize("NFD", s)
                       if not unicodedata.combining(c)).casefold()
    labels = [fe.label for fe in formatted_entries()]
    authors = [fold(label.rsplit(", ", 1)[0]) for label in labels]
    assert authors == sorted(authors), labels
    # organisations among the people, not after them
    assert labels.index("Hugging Face, 2022") < labels.index("Jacob et al., 2018")


class _Builder:
    """What sphinxcontrib-bibtex's reference node asks of a Sphinx HTML builder."""
    name = "html"

    def get_relative_uri(self, from_, to):
        return to + ".html"


@pytest.mark.parametrize("role, wrap", [
    ("p", lambda label: f"[{label}]"),
    ("t", lambda label: "{} [{}]".format(*label.rsplit(", ", 1))),
    ("year", lambda label: label.rsplit(", ", 1)[1]),
])
def test_in_text_citations_print_the_label(role, wrap):
    """{cite:p}, {cite:t} and {cite:year} as the book's referencing style renders them to docutils:
    the same author and year as the list's label, suffix included."""
    import pybtex_docutils
    from sphinxcontrib.bibtex.plugin import find_plugin
    from sphinxcontrib.bibtex.style.referencing import format_references
    from sphinxcontrib.bibtex.style.template import SphinxReferenceInfo

    import sphinx_bib_style
    sphinx_bib_style.register()
    style = find_plugin("sphinxcontrib.bibtex.style.referencing", sphinx_bib_style.NAME)()
    backend = pybtex_docutils.Backend()
    data = bib_entries()
    for fe in formatted_entries():
        info = SphinxReferenceInfo(builder=_Builder(), fromdocname="chapter",
                                   todocname="references_en", citation_id="id0", title=None,
                                   pre_text="", post_text="")
        text = format_references(style, role, [(data[fe.key], fe, info)])
        rendered = "".join(n.astext() for n in text.render(backend))
        assert rendered == wrap(fe.label), (fe.key, role, rendered)


def test_a_citation_of_several_works_separates_them_with_semicolons():
    import pybtex_docutils
    from sphinxcontrib.bibtex.style.referencing import format_references
    from sphinxcontrib.bibtex.style.template import SphinxReferenceInfo

    import sphinx_bib_style
    entries = {fe.key: fe for fe in formatted_entries()}
    info = SphinxReferenceInfo(builder=_Builder(), fromdocname="chapter", todocname="references_en",
                               citation_id="id0", title=None, pre_text="", post_text="")
    refs = [(bib_entries()[k], entries[k], info) for k in ("ocp2023ofp8", "ocp2023mx")]
    text = format_references(sphinx_bib_style.ReferenceStyle(), "p", refs)
    rendered = "".join(n.astext() for n in text.render(pybtex_docutils.Backend()))
    assert rendered == f"[{entries['ocp2023ofp8'].label}; {entries['ocp2023mx'].label}]"


def test_both_sites_select_the_book_style():
    import yaml
    for name in ("_config.yml", "_config_zh.yml"):
        sphinx = yaml.safe_load((REPO / name).read_text(encoding="utf-8"))["sphinx"]
        assert sphinx["local_extensions"].get("sphinx_bib_style") == "tools", name
        assert sphinx["config"]["bibtex_default_style"] == "book_author_year", name
        assert sphinx["config"]["bibtex_reference_style"] == "book_author_year", name


HTML = REPO / "_build" / "html"
LABEL = re.compile(r'<span class="label"><span class="fn-bracket">\[</span>(.*?)'
                   r'<span class="fn-bracket">\]</span></span>')


@pytest.mark.skipif(not (HTML / "zh" / "references_zh.html").exists(),
                    reason="the book is not built (make book)")
@pytest.mark.parametrize("page", ["references_en.html", "zh/references_zh.html"])
def test_built_bibliography_shows_the_labels_in_their_order(page):
    import html
    text = (HTML / page).read_text(encoding="utf-8")
    assert [html.unescape(lab) for lab in LABEL.findall(text)] == [
        fe.label for fe in formatted_entries()]
