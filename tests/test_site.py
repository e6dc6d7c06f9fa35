"""The website: two sites (English in _build/html, Chinese in _build/html/zh) built by `make book`
from the same notebooks, each page linked to its translation, published by a GitHub workflow.

The tests read the configs, tables of contents, Makefile and workflow (no Sphinx run); the last
ones read the built pages and are skipped until `make book` has run."""
import inspect
import posixpath
import re
from pathlib import Path

import pytest
import yaml

import nbtools
import sphinx_lang_switch as ls
from conftest import REPO

SITE_URL = "https://agentrl-from-scratch.github.io/agentic-rl-from-scratch/"
HTML = REPO / "_build" / "html"
# Where each site lands in the published tree (the Makefile copies the Chinese build to zh/).
SITE_DIR = {"en": "", "zh": "zh/"}


def load(name):
    return yaml.safe_load((REPO / name).read_text(encoding="utf-8"))


def toc(lang):
    return load({"en": "_toc.yml", "zh": "_toc_zh.yml"}[lang])


def config(lang):
    return load({"en": "_config.yml", "zh": "_config_zh.yml"}[lang])


def chapters(lang):
    """The chapter folders of a site's toc, in order (entries `chapters/<folder>/<lang>`)."""
    files = nbtools.toc_files(REPO, {"en": nbtools.EN_TOC, "zh": nbtools.ZH_TOC}[lang])
    found = [re.fullmatch(rf"chapters/([^/]+)/{lang}", f) for f in files]
    assert all(m or not f.startswith("chapters/") for m, f in zip(found, files)), files
    return [m.group(1) for m in found if m]


def makefile_recipe(target):
    """The command lines of a Makefile target (continuation lines joined)."""
    text = (REPO / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    recipe = re.search(rf"^{target}:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.M)
    assert recipe, f"no `{target}` target in the Makefile"
    return [" ".join(line.split()) for line in recipe.group(1).splitlines()]


# --- the two tables of contents -------------------------------------------------------------

def test_each_english_chapter_has_its_chinese_counterpart_in_the_same_place():
    en, zh = chapters("en"), chapters("zh")
    assert en, "no chapters in _toc.yml"
    assert en == zh, f"only English: {sorted(set(en) - set(zh))}; only Chinese: {sorted(set(zh) - set(en))}"
    for folder in en:
        assert (REPO / "chapters" / folder / "en.ipynb").exists(), folder
        assert (REPO / "chapters" / folder / "zh.ipynb").exists(), folder


def test_tocs_roots_and_last_pages():
    assert toc("en")["root"] == "index" and toc("zh")["root"] == "index_zh"
    assert nbtools.toc_files(REPO)[-1] == "references_en"
    assert nbtools.toc_files(REPO, nbtools.ZH_TOC)[-1] == "references_zh"
    for lang in ("en", "zh"):
        for entry in nbtools.toc_files(REPO, {"en": nbtools.EN_TOC, "zh": nbtools.ZH_TOC}[lang]):
            assert any((REPO / f"{entry}{ext}").exists() for ext in (".md", ".ipynb")), entry
            # No page of the other language leaks into a site (prev/next stays in one language).
            other = ls.other_docname(entry, "zh" if lang == "en" else "en")
            assert other is not None, f"{entry}: no translation by name"


# The parts of the book (the captions of each site's toc), in order; a last part holds the pages
# that are not chapters (the API reference, the references).
PART_CAPTIONS = {"en": ("Part I: ", "Part II: ", "Part III: ", "Part IV: "),
                 "zh": ("第一部分　", "第二部分　", "第三部分　", "第四部分　")}


def toc_parts(lang):
    """[(caption, [entries])] of a site's toc, whose entries all sit in parts."""
    parsed = toc(lang)
    assert "chapters" not in parsed, "with parts:, every entry is in a part"
    return [(part.get("caption"), [str(c["file"]) for c in part["chapters"]]) for part in parsed["parts"]]


def test_both_tocs_have_the_same_four_parts_of_chapters():
    folders = {}
    for lang in ("en", "zh"):
        parts = toc_parts(lang)
        *chapter_parts, (last_caption, last) = parts
        assert len(chapter_parts) == 4, [caption for caption, _ in parts]
        assert last_caption and last == [f"api_{lang}", f"references_{lang}"], last
        folders[lang] = []
        for (caption, entries), start in zip(chapter_parts, PART_CAPTIONS[lang]):
            assert caption and caption.startswith(start) and caption != start, caption
            assert entries and all(re.fullmatch(rf"chapters/[^/]+/{lang}", e) for e in entries), entries
            folders[lang].append([e.split("/")[1] for e in entries])
    assert folders["en"] == folders["zh"]  # the same chapters in each part, in the same order
    # every chapter of the book is in one of the parts
    assert [f for part in folders["en"] for f in part] == chapters("en")
    assert sorted(chapters("en")) == [p.parent.name for p in sorted(REPO.glob("chapters/*/en.ipynb"))]


def test_extract_reads_the_english_book_order():
    assert nbtools.toc_chapters(REPO) == [REPO / "chapters" / c for c in chapters("en")]


def test_references_pages():
    for lang, title in [("en", "# References"), ("zh", "# 参考文献")]:
        text = (REPO / f"references_{lang}.md").read_text(encoding="utf-8")
        assert text.startswith(title + "\n") and "```{bibliography}" in text, lang


AUTOMODULE = re.compile(r"^```\{eval-rst\}\n\.\. automodule:: agentrl\.(\w+)\n   :members:\n```$", re.M)


def notebook_title(folder, lang):
    """A chapter's title: the first `# ` heading of its notebook's first cell."""
    import json
    cell = json.loads((REPO / "chapters" / folder / f"{lang}.ipynb").read_text(encoding="utf-8"))["cells"][0]
    return next(line[2:].strip() for line in "".join(cell["source"]).splitlines() if line.startswith("# "))


@pytest.mark.parametrize("lang, title", [("en", "# API reference"), ("zh", "# API 参考")])
def test_api_pages_document_every_module_in_book_order(lang, title):
    """api_<lang>.md: under each chapter's title (`## 7. The RL loop`, from its notebook), an
    automodule for each module it saves; together exactly agentrl._MODULES, in that order."""
    import agentrl as arl
    text = (REPO / f"api_{lang}.md").read_text(encoding="utf-8")
    assert text.startswith(title + "\n")
    assert AUTOMODULE.findall(text) == list(arl._MODULES)
    assert text.count("automodule::") == len(arl._MODULES)  # and no other automodule
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    own = dict(arl._BOOK)
    assert len(sections) == len(own) == len(chapters(lang))
    for section, folder in zip(sections, chapters(lang)):
        assert section.splitlines()[0] == notebook_title(folder, lang), folder
        assert AUTOMODULE.findall(section) == list(own[nbtools.chapter_slug(folder)]), folder
        assert f"](chapters/{folder}/{lang}.ipynb)" in section, folder
    # Every function and class the package exports is defined in one of those modules, so
    # autodoc lists it (a module's `__all__` decides what `:members:` shows).
    modules = {f"agentrl.{m}" for m in arl._MODULES}
    for name in arl.__all__:
        obj = getattr(arl, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__module__ in modules, (name, obj.__module__)
            assert inspect.getdoc(obj), f"{name}: no docstring, so autodoc would not list it"


def test_both_configs_document_the_package_with_autodoc():
    for lang in ("en", "zh"):
        sphinx = config(lang)["sphinx"]
        assert "sphinx.ext.autodoc" in sphinx["extra_extensions"]
        assert sphinx["config"]["autodoc_member_order"] == "bysource"


# --- the two configs ------------------------------------------------------------------------

# The only keys in which the Chinese config may differ from the English one.
ZH_ONLY = [("title",), ("html", "baseurl"), ("sphinx", "config", "language"),
           ("sphinx", "config", "lang_switch_to"), ("sphinx", "config", "lang_switch_root"),
           ("sphinx", "config", "html_theme_options"), ("sphinx", "config", "html_search_options")]
# ... and the Chinese interface's strings that come from config values, and its author line.
ZH_INTERFACE = ["nb_code_prompt_show", "nb_code_prompt_hide", "togglebutton_hint",
                "togglebutton_hint_hide"]
ZH_ONLY += [("author",)] + [("sphinx", "config", key) for key in ZH_INTERFACE]
# ... and MathJax: the Chinese site (in zh/) loads the English site's copy through mathjax_path,
# without sphinx-mathjax-offline, which would copy a second one into zh/_static.
ZH_ONLY += [("sphinx", "extra_extensions"), ("sphinx", "config", "mathjax_path")]


def pop(cfg, path):
    for key in path[:-1]:
        cfg = cfg[key]
    return cfg.pop(path[-1])


def test_configs_differ_only_in_the_language_settings():
    en, zh = config("en"), config("zh")
    for key in ("html_theme_options", "html_search_options", *ZH_INTERFACE):
        en["sphinx"]["config"].setdefault(key, None)
    en["sphinx"]["config"].setdefault("mathjax_path", None)
    en_only = {path: pop(en, path) for path in ZH_ONLY}
    zh_only = {path: pop(zh, path) for path in ZH_ONLY}
    assert en == zh, "_config_zh.yml must be _config.yml except " + ", ".join(map(".".join, ZH_ONLY))
    assert en_only[("sphinx", "config", "language")] == "en"
    assert zh_only[("sphinx", "config", "language")] == "zh_CN"
    # Each site points at the other: its URL and its place in the tree.
    # the same theme options (one search field, the language link in the header), but the
    # search field's placeholder
    zh_theme = dict(zh_only[("sphinx", "config", "html_theme_options")])
    assert zh_theme.pop("search_bar_text") == "搜索本书..."
    assert zh_theme == en_only[("sphinx", "config", "html_theme_options")]
    # MathJax: one copy, the English site's
    en_ext = en_only[("sphinx", "extra_extensions")]
    assert "sphinx-mathjax-offline" in en_ext
    assert en_only[("sphinx", "config", "mathjax_path")] is None
    assert zh_only[("sphinx", "extra_extensions")] == [
        e for e in en_ext if e != "sphinx-mathjax-offline"]
    assert (REPO / zh_only[("sphinx", "config", "html_search_options")]["dict"]).is_file()
    assert en_only[("html", "baseurl")] == SITE_URL
    assert zh_only[("html", "baseurl")] == SITE_URL + "zh/"
    assert en_only[("sphinx", "config", "lang_switch_to")] == "zh"
    assert zh_only[("sphinx", "config", "lang_switch_to")] == "en"
    assert en_only[("sphinx", "config", "lang_switch_root")] == SITE_DIR["zh"]
    assert zh_only[("sphinx", "config", "lang_switch_root")] == "../"
    # The author line in each language; the English site keeps the packages' English strings.
    assert en_only[("author",)] == "The Agentic RL from Scratch authors"
    assert zh_only[("author",)] == "《从零实现智能体强化学习》作者团队"
    assert all(en_only[("sphinx", "config", key)] is None for key in ZH_INTERFACE)


def test_both_configs_load_the_extension_and_the_bibliography():
    for lang in ("en", "zh"):
        cfg = config(lang)
        assert cfg["sphinx"]["local_extensions"] == {"sphinx_lang_switch": "tools",
                                                     "sphinx_provenance": "tools",
                                                     "sphinx_zh": "tools",
                                                     "sphinx_bib_style": "tools",
                                                     "sphinx_api": "tools"}
        assert cfg["bibtex_bibfiles"] == ["references.bib"]
    assert (REPO / "references.bib").exists()


def test_jieba_is_in_the_book_extra_with_a_lower_bound_only():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    book = re.search(r"^book = \[(.*?)^\]", text, re.M | re.S).group(1)
    jieba = re.findall(r'"(jieba[^"]*)"', book)
    assert len(jieba) == 1 and re.fullmatch(r"jieba>=[\d.]+", jieba[0]), jieba


# --- the language switch --------------------------------------------------------------------

@pytest.mark.parametrize("en, zh", [
    ("index", "index_zh"),
    ("chapters/07_rl_loop/en", "chapters/07_rl_loop/zh"),
    ("references_en", "references_zh"),
    ("api_en", "api_zh"),
])
def test_other_docname_maps_both_ways(en, zh):
    assert ls.other_docname(en, "zh") == zh
    assert ls.other_docname(zh, "en") == en


def test_other_docname_of_pages_without_a_translation():
    for page in ("search", "genindex", "chapters/07_rl_loop/zh"):
        assert ls.other_docname(page, "zh") is None
    assert ls.other_docname("chapters/07_rl_loop/en", "en") is None
    with pytest.raises(ValueError):
        ls.other_docname("index", "fr")


def test_every_page_of_each_toc_links_to_its_translation_in_the_published_tree():
    """From each page's place in _build/html, the switch URL lands on the translation's file."""
    for lang, other_lang in [("en", "zh"), ("zh", "en")]:
        root = config(lang)["sphinx"]["config"]["lang_switch_root"]
        for page in nbtools.toc_files(REPO, {"en": nbtools.EN_TOC, "zh": nbtools.ZH_TOC}[lang]):
            other = ls.other_docname(page, other_lang)
            url = ls.switch_url(page, other, root)
            here = posixpath.dirname(SITE_DIR[lang] + page)
            assert posixpath.normpath(posixpath.join(here, url)) == SITE_DIR[other_lang] + other + ".html"
    assert ls.switch_url("chapters/07_rl_loop/en", "chapters/07_rl_loop/zh", "zh/") == \
        "../../zh/chapters/07_rl_loop/zh.html"
    assert ls.switch_url("index_zh", "index", "../") == "../index.html"


def _app(to, root, baseurl=SITE_URL):
    """What the extensions' html-page-context handlers read of a Sphinx app."""
    from types import SimpleNamespace
    config = SimpleNamespace(lang_switch_to=to, lang_switch_root=root, html_baseurl=baseurl)
    return SimpleNamespace(config=config, builder=SimpleNamespace(out_suffix=".html"))


def test_the_switch_is_a_text_link_in_the_header():
    """The link reads "中文" on the English site and "English" on the Chinese one (no 🌐, a blank
    box where no emoji font is installed), and goes to the page's translation."""
    en = ls.switch_link("chapters/07_rl_loop/en", "zh", "zh/")
    assert en["url"] == "../../zh/chapters/07_rl_loop/zh.html"
    assert (en["label"], en["hreflang"]) == ("中文", "zh-CN")
    zh = ls.switch_link("chapters/07_rl_loop/zh", "en", "../")
    assert zh["url"] == "../../../chapters/07_rl_loop/en.html"
    assert (zh["label"], zh["hreflang"]) == ("English", "en")
    # a page without a translation by name (Sphinx's search page) goes to the other landing page
    assert ls.switch_link("search", "zh", "zh/")["url"] == "zh/index_zh.html"
    template = (ls.TEMPLATES / "lang-switch.html").read_text(encoding="utf-8")
    assert "🌐" not in template
    assert not any("🌐" in t for t in [*ls.LABELS.values(), *ls.TITLES.values()])


def test_add_switch_fills_the_template_context_and_the_head_not_the_body():
    context = {"body": "<p>text</p>", "metatags": ""}
    ls.add_switch(_app("zh", "zh/"), "chapters/07_rl_loop/en", "page.html", context, None)
    assert context["body"] == "<p>text</p>"
    assert context["lang_switch"]["url"] == "../../zh/chapters/07_rl_loop/zh.html"
    assert context["metatags"] == ('\n<link rel="alternate" hreflang="zh-CN" '
                                   f'href="{SITE_URL}zh/chapters/07_rl_loop/zh.html" />')
    # Sphinx's generated pages have no body: the header link, no alternate
    search = {"metatags": ""}
    ls.add_switch(_app("en", "../", SITE_URL + "zh/"), "search", "search.html", search, None)
    assert search["lang_switch"]["url"] == "../index.html" and search["metatags"] == ""
    # a site without lang_switch_to: nothing
    none = {"body": ""}
    ls.add_switch(_app("", ""), "index", "page.html", none, None)
    assert "lang_switch" not in none


def test_the_template_renders_the_link():
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ls.TEMPLATES)), autoescape=False)
    template = env.get_template("lang-switch.html")
    html = template.render(lang_switch=ls.switch_link("index", "zh", "zh/"))
    assert re.fullmatch(r'\s*<a class="lang-switch" href="zh/index_zh.html" hreflang="zh-CN" '
                        r'lang="zh-CN" title="[^"]+"[^>]*>中文</a>\s*', html), html
    assert template.render().strip() == ""  # no link, no markup (the theme then drops the slot)


def test_the_templates_folder_joins_templates_path_once():
    from types import SimpleNamespace
    config = SimpleNamespace(templates_path=["tools/templates_zh"])
    ls.add_templates(None, config)
    ls.add_templates(None, config)
    assert config.templates_path == ["tools/templates_zh", str(ls.TEMPLATES)]


def test_both_configs_show_one_search_field_and_the_switch_in_the_header():
    """pydata-sphinx-theme puts a second search field into an otherwise empty top bar unless
    navbar_persistent is set; the article header's end slot starts with the language link."""
    for lang in ("en", "zh"):
        theme = config(lang)["sphinx"]["config"]["html_theme_options"]
        assert theme["navbar_persistent"] == []
        assert theme["article_header_end"] == ["lang-switch.html", "article-header-buttons.html"]
    assert (ls.TEMPLATES / "lang-switch.html").is_file()


def test_the_chinese_site_loads_the_english_sites_mathjax():
    """mathjax_path is relative to the site's _static; from zh/_static it reaches _static/mathjax
    of the English site, the copy sphinx-mathjax-offline makes (its tex-chtml.js)."""
    import importlib.util
    path = config("zh")["sphinx"]["config"]["mathjax_path"]
    published = posixpath.normpath(posixpath.join(SITE_DIR["zh"] + "_static", path))
    assert published == "_static/mathjax/tex-chtml.js"
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    assert (Path(spec.origin).parent / "static" / "mathjax" / "tex-chtml.js").is_file()


# --- the run record under each chapter (tools/sphinx_provenance.py) ---------------------------

REPO_URL = "https://github.com/agentrl-from-scratch/agentic-rl-from-scratch"
RECORD = dict(version="0.1.0", commit="86016af76f65+changes", code="261f09394cb39bda",
              date="2026-12-06")


def test_provenance_links_the_commit_and_says_uncommitted_changes_in_words():
    import sphinx_provenance as prov
    assert prov.commit_html("86016af76f65+changes", REPO_URL + "/") == (
        f'<a href="{REPO_URL}/commit/86016af76f65">86016af76f65</a>', True)
    assert prov.commit_html("86016af76f65", "") == ("86016af76f65", False)
    assert prov.commit_html("unknown", REPO_URL) == ("unknown", False)  # not a commit: no link
    en = prov.provenance_html(RECORD, "en", REPO_URL)
    assert (f'at commit <a href="{REPO_URL}/commit/86016af76f65">86016af76f65</a> with uncommitted '
            "changes (code 261f09394cb39bda) on 2026-12-06.") in en
    assert "+changes" not in en and "other package code" not in en
    zh = prov.provenance_html(RECORD, "zh_CN", REPO_URL)
    assert f'/commit/86016af76f65">86016af76f65</a>，含未提交的改动' in zh and "+changes" not in zh
    clean = prov.provenance_html(dict(RECORD, commit="86016af76f65"), "en", REPO_URL)
    assert "uncommitted" not in clean


def test_provenance_flags_a_chapter_run_on_other_code_than_most_of_the_book():
    import sphinx_provenance as prov
    assert prov.majority_code(["a", "a", "b"]) == "a"
    assert prov.majority_code(["a", "b"]) is None  # no code that most chapters share
    assert prov.majority_code(["a", "unknown", None, "a", "b"]) == "a"
    assert prov.majority_code([]) is None
    other = dict(RECORD, code="e21fb807a27bdc6f")
    en = prov.provenance_html(other, "en", REPO_URL, majority="261f09394cb39bda")
    assert "executed on other package code than the rest of the book" in en
    assert "261f09394cb39bda" in en  # the book's code, named
    zh = prov.provenance_html(other, "zh_CN", REPO_URL, majority="261f09394cb39bda")
    assert "与本书其余各章不同" in zh
    same = prov.provenance_html(RECORD, "en", REPO_URL, majority="261f09394cb39bda")
    assert "other package code" not in same
    assert "other package code" not in prov.provenance_html(other, "en", REPO_URL, majority=None)


def test_provenance_handlers_read_the_sites_notebooks(tmp_path):
    """env-updated finds the code most notebooks ran on; html-page-context flags the others and
    links the commit into the theme's repository_url."""
    import json
    from types import SimpleNamespace

    import sphinx_provenance as prov
    codes = {"a/en": "c0de", "b/en": "c0de", "c/en": "0the", "d/en": None}
    for doc, code in codes.items():
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        meta = {"agentrl": dict(RECORD, code=code)} if code else {}
        (tmp_path / f"{doc}.ipynb").write_text(json.dumps({"metadata": meta, "cells": []}))
    (tmp_path / "index.md").write_text("# Index")
    docs = {**{d: 0 for d in codes}, "index": 0}
    env = SimpleNamespace(all_docs=docs, doc2path=lambda d: str(
        tmp_path / (f"{d}.md" if d == "index" else f"{d}.ipynb")))
    app = SimpleNamespace(env=env, config=SimpleNamespace(
        language="en", html_theme_options={"repository_url": REPO_URL}))
    assert prov.find_majority(app, env) == []  # the first build: every page is written anyway
    assert env.agentrl_code_majority == "c0de"
    bodies = {}
    for doc in docs:
        context = {"body": ""}
        prov.add_provenance(app, doc, "page.html", context, None)
        bodies[doc] = context["body"]
    assert bodies["index"] == ""  # not a notebook
    assert "predate" in bodies["d/en"]
    assert [d for d in codes if "other package code" in bodies[d]] == ["c/en"]
    assert f"{REPO_URL}/commit/86016af76f65" in bodies["a/en"]
    # a later build whose majority changed writes every notebook page again (new flags)
    (tmp_path / "a/en.ipynb").write_text(json.dumps(
        {"metadata": {"agentrl": dict(RECORD, code="0the")}, "cells": []}))
    assert prov.find_majority(app, env) == list(codes)  # 0the (a, c) against c0de (b)
    assert env.agentrl_code_majority == "0the"
    assert prov.find_majority(app, env) == []  # unchanged since


# --- building and publishing ----------------------------------------------------------------

def test_make_book_builds_both_sites_and_checks_them():
    recipe = makefile_recipe("book")
    english = [c for c in recipe if "jupyter-book build" in c and "--config" not in c]
    chinese = [c for c in recipe if "jupyter-book build" in c and "--config _config_zh.yml" in c]
    assert len(english) == 1 and len(chinese) == 1, recipe
    assert "--toc _toc_zh.yml" in chinese[0]
    flags = re.search(r"^JB_FLAGS := (.*)$", (REPO / "Makefile").read_text(), re.M).group(1)
    for command in english + chinese:
        # warnings are errors in both
        assert "-W" in command.replace("$(JB_FLAGS)", flags).split(), command
    assert any(c.startswith("cp ") and c.endswith("_build/html/zh") for c in recipe), recipe
    for site in ("_build/html", "_build/html/zh"):
        assert f"$(PY) tools/check_offline.py {site}" in recipe


def test_workflow_builds_with_make_book_and_deploys_to_pages():
    workflow = load(".github/workflows/book.yml")
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads the key `on` as True
    assert triggers["push"]["branches"] == ["main"]
    assert workflow["permissions"]["pages"] == "write"
    assert workflow["permissions"]["id-token"] == "write"
    steps = [s for job in workflow["jobs"].values() for s in job["steps"]]
    commands = [s["run"].strip() for s in steps if "run" in s]
    assert commands == ["make book"], commands  # the build command is the Makefile's
    assert makefile_recipe("book")  # ... and the Makefile has it
    uses = [s["uses"].split("@")[0] for s in steps if "uses" in s]
    for action in ("actions/configure-pages", "actions/upload-pages-artifact", "actions/deploy-pages"):
        assert action in uses, action
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-pages-artifact"))
    assert upload["with"]["path"] == "_build/html"



def test_release_workflow_tags_the_version_and_attaches_make_artifacts_bundle():
    """A push to main with a new pyproject version is tagged v<version> (before the long build,
    so that the setup cells' pinned install works at once), then `make artifacts` builds the
    bundle that the setup cells load, attached to that release."""
    workflow = load(".github/workflows/release.yml")
    triggers = workflow.get("on", workflow.get(True))
    assert triggers["push"]["branches"] == ["main"]
    assert workflow["permissions"]["contents"] == "write"
    steps = workflow["jobs"]["release"]["steps"]
    runs = [s["run"] for s in steps if "run" in s]
    version = next(r for r in runs if "pyproject.toml" in r)
    assert "['project']['version']" in version and 'tag=v$version' in version
    build = next(s for s in steps if s.get("run", "").strip() == "make artifacts")
    assert build["env"]["TORCH_INDEX"] == CPU_INDEX and makefile_recipe("artifacts")
    order = [r.split()[0:3] for r in runs if r.startswith("gh release")]
    assert order == [["gh", "release", "create"], ["gh", "release", "upload"]]
    bundle = re.search(r"^ARTIFACTS \?= (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert runs[-1].strip().endswith(f"{bundle}/bundle/*")

def test_the_site_url_is_where_readers_look():
    for name in ("README.md", "index.md", "index_zh.md"):
        assert SITE_URL in (REPO / name).read_text(encoding="utf-8"), name
    assert SITE_URL + "zh/" in (REPO / "index.md").read_text(encoding="utf-8")


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_environment_installs_the_makefiles_cpu_torch_first():
    pip = next(d["pip"] for d in load("environment.yml")["dependencies"] if isinstance(d, dict))
    spec = re.search(r"^TORCH_SPEC \?= (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    # a reader's conda env gets the CPU build from PyTorch's index, as `make venv` can
    assert pip == [f"--extra-index-url {CPU_INDEX}", spec, "-e .[dev]"]
    assert CPU_INDEX in (REPO / "Makefile").read_text()


def test_the_workflow_builds_with_the_cpu_torch():
    step = next(s for s in load(".github/workflows/book.yml")["jobs"]["build"]["steps"]
                if s.get("run") == "make book")
    assert step["env"]["TORCH_INDEX"] == CPU_INDEX


# --- the built site (after `make book`) -----------------------------------------------------

built = pytest.mark.skipif(not (HTML / "zh" / "index_zh.html").exists(),
                           reason="the book is not built (make book)")
# the language link in the article header (tools/_templates/lang-switch.html)
SWITCH = re.compile(r'<a class="lang-switch" href="([^"]+)" hreflang="([^"]+)"')
PREV_NEXT = re.compile(r'<a class="(?:left-prev|right-next)"\s+href="([^"]+)"')


def pages(site):
    root = HTML / SITE_DIR[site]
    found = sorted(p for p in root.rglob("*.html") if "_static" not in p.parts)
    return [p for p in found if site == "zh" or not p.relative_to(HTML).as_posix().startswith("zh/")]


@built
@pytest.mark.parametrize("lang, page, html_lang, other", [
    ("en", "chapters/07_rl_loop/en.html", 'lang="en"', "zh-CN"),
    ("zh", "chapters/07_rl_loop/zh.html", 'lang="zh-CN"', "en"),
])
def test_built_chapter_page(lang, page, html_lang, other):
    text = (HTML / SITE_DIR[lang] / page).read_text(encoding="utf-8")
    assert f"<html {html_lang}" in text
    assert text.count("const THEBE_JS_URL") == 1
    links = SWITCH.findall(text)
    assert len(links) == 1 and links[0][1] == other
    if lang == "zh":  # the theme's interface in Chinese
        assert 'placeholder="搜索本书..."' in text and "上一页" in text and "下一页" in text
    else:
        assert 'placeholder="Search this book..."' in text and "previous page" in text


def in_zh(path):
    return path.relative_to(HTML.resolve()).as_posix().startswith("zh/")


@built
@pytest.mark.parametrize("site", ["en", "zh"])
def test_every_built_page_links_to_an_existing_page_of_the_other_site(site):
    checked = 0
    for page in pages(site):
        text = page.read_text(encoding="utf-8")
        # the Chinese site's index.html (a redirect to index_zh.html); Sphinx's generated pages
        # (search, general index) have the header link too, to the other site's landing page
        if 'http-equiv="Refresh"' in text:
            continue
        links = SWITCH.findall(text)
        assert len(links) == 1, page
        target = (page.parent / links[0][0]).resolve()
        assert target.exists(), f"{page}: {links[0][0]}"
        assert in_zh(target) == (site == "en")
        # previous / next stay in this site's language
        for href in PREV_NEXT.findall(text):
            linked = (page.parent / href).resolve()
            assert in_zh(linked) == (site == "zh"), f"{page}: {href}"
            docname = linked.relative_to((HTML / SITE_DIR[site]).resolve()).with_suffix("")
            assert ls.other_docname(docname.as_posix(), "zh" if site == "en" else "en"), href
        checked += 1
    assert checked > 20


@built
@pytest.mark.parametrize("site", ["en", "zh"])
def test_built_api_page_documents_the_package_and_fills_the_general_index(site):
    import agentrl as arl
    root = HTML / SITE_DIR[site]
    api = (root / f"api_{site}.html").read_text(encoding="utf-8")
    for name in ("rl_update", "train_rl", "pack_sequences", "TeacherStore", "WalWriter"):
        target = f'id="{getattr(arl, name).__module__}.{name}"'
        assert target in api, target
    assert "rl_update" in (root / "genindex.html").read_text(encoding="utf-8")


@built
def test_chinese_search_index_has_chinese_words():
    import json
    text = (HTML / "zh" / "searchindex.js").read_text(encoding="utf-8")
    index = json.loads(text[text.index("(") + 1:text.rindex(")")])
    # jieba splits the text into words (not whole sentences), with the book's terms
    # (tools/zh_search_words.txt) kept whole: "智能体" (agent), "强化学习" (RL) are found.
    terms = index["terms"]
    for word in ("智能体", "强化学习", "梯度", "奖励"):
        assert word in terms and len(terms[word]) > 3, word


HEADER = re.compile(r'<header id="pst-header"[^>]*>(.*?)</header>', re.S)
ARTICLE_HEADER_END = re.compile(r'<div class="header-article-items__end">(.*?)'
                                r'<div class="article-header-buttons">', re.S)
# Sphinx may append a cache-busting ?v=<checksum> to the script's address
MATHJAX_SRC = re.compile(r'<script[^>]*src="([^"?]*mathjax/tex-chtml\.js)(?:\?[^"]*)?"')


@built
@pytest.mark.parametrize("lang, page, label", [
    ("en", "chapters/07_rl_loop/en.html", "中文"),
    ("zh", "chapters/07_rl_loop/zh.html", "English"),
])
def test_built_page_chrome(lang, page, label):
    """One search field (the sidebar's; the top bar is empty), the language link in the article
    header as text, no 🌐, MathJax from the English site's _static."""
    path = HTML / SITE_DIR[lang] / page
    text = path.read_text(encoding="utf-8")
    assert text.count("search-button-field") == 1
    assert HEADER.search(text).group(1).strip() == ""
    end = ARTICLE_HEADER_END.search(text).group(1)
    assert re.search(rf'<a class="lang-switch" [^>]*>{label}</a>', end)
    assert "🌐" not in text
    sources = MATHJAX_SRC.findall(text)
    assert len(sources) == 1
    assert (path.parent / sources[0]).resolve() == (HTML / "_static/mathjax/tex-chtml.js").resolve()


@built
def test_one_mathjax_copy_across_the_two_sites():
    copies = sorted(p.relative_to(HTML).as_posix() for p in HTML.rglob("mathjax") if p.is_dir())
    assert copies == ["_static/mathjax"], copies


@built
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_built_chapter_says_which_commit_linked(lang):
    text = (HTML / SITE_DIR[lang] / f"chapters/07_rl_loop/{lang}.html").read_text(encoding="utf-8")
    paragraph = re.search(r'<p class="provenance".*?</p>', text, re.S).group(0)
    assert "+changes" not in paragraph
    assert re.search(r'<a href="https://github\.com/[^"]+/commit/[0-9a-f]{7,40}">', paragraph) \
        or "predate" in paragraph or "早于" in paragraph


def test_api_docstrings_are_shown_as_written():
    """tools/sphinx_api.py: a docstring is plain text (|x|, **kwargs, shapes), so it is
    one literal block; a module's generated docstring is dropped."""
    import sphinx_api
    lines = ["Mean |log(pi_old / mu)| over tokens.", "", "  TinyAgent(**config) -> [B, T]", ""]
    sphinx_api.literal_docstring(None, "function", "f", None, {}, lines)
    assert lines == ["::", "", "    Mean |log(pi_old / mu)| over tokens.", "",
                     "      TinyAgent(**config) -> [B, T]", ""]
    module = ["Code saved from chapters/07_rl_loop/en.ipynb."]
    sphinx_api.literal_docstring(None, "module", "agentrl.rl_loop", None, {}, module)
    assert module == []
    empty = []
    sphinx_api.literal_docstring(None, "class", "C", None, {}, empty)
    assert empty == []
