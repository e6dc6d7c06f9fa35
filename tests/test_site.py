"""The website: two sites (English in _build/html, Chinese in _build/html/zh) built by `make book`
from the same notebooks, each page linked to its translation, published by a GitHub workflow.

The tests read the configs, tables of contents, Makefile and workflow (no Sphinx run); the last
ones read the built pages and are skipped until `make book` has run."""
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


def test_extract_reads_the_english_book_order():
    assert nbtools.toc_chapters(REPO) == [REPO / "chapters" / c for c in chapters("en")]


def test_references_pages():
    for lang, title in [("en", "# References"), ("zh", "# 参考文献")]:
        text = (REPO / f"references_{lang}.md").read_text(encoding="utf-8")
        assert text.startswith(title + "\n") and "```{bibliography}" in text, lang


# --- the two configs ------------------------------------------------------------------------

# The only keys in which the Chinese config may differ from the English one.
ZH_ONLY = [("title",), ("html", "baseurl"), ("sphinx", "config", "language"),
           ("sphinx", "config", "lang_switch_to"), ("sphinx", "config", "lang_switch_root"),
           ("sphinx", "config", "html_theme_options"), ("sphinx", "config", "html_search_options")]


def pop(cfg, path):
    for key in path[:-1]:
        cfg = cfg[key]
    return cfg.pop(path[-1])


def test_configs_differ_only_in_the_language_settings():
    en, zh = config("en"), config("zh")
    for key in ("html_theme_options", "html_search_options"):
        en["sphinx"]["config"].setdefault(key, None)
    en_only = {path: pop(en, path) for path in ZH_ONLY}
    zh_only = {path: pop(zh, path) for path in ZH_ONLY}
    assert en == zh, "_config_zh.yml must be _config.yml except " + ", ".join(map(".".join, ZH_ONLY))
    assert en_only[("sphinx", "config", "language")] == "en"
    assert zh_only[("sphinx", "config", "language")] == "zh_CN"
    # Each site points at the other: its URL and its place in the tree.
    assert zh_only[("sphinx", "config", "html_theme_options")] == {"search_bar_text": "搜索本书..."}
    assert (REPO / zh_only[("sphinx", "config", "html_search_options")]["dict"]).is_file()
    assert en_only[("html", "baseurl")] == SITE_URL
    assert zh_only[("html", "baseurl")] == SITE_URL + "zh/"
    assert en_only[("sphinx", "config", "lang_switch_to")] == "zh"
    assert zh_only[("sphinx", "config", "lang_switch_to")] == "en"
    assert en_only[("sphinx", "config", "lang_switch_root")] == SITE_DIR["zh"]
    assert zh_only[("sphinx", "config", "lang_switch_root")] == "../"


def test_both_configs_load_the_extension_and_the_bibliography():
    for lang in ("en", "zh"):
        cfg = config(lang)
        assert cfg["sphinx"]["local_extensions"] == {"sphinx_lang_switch": "tools",
                                                     "sphinx_provenance": "tools"}
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
SWITCH = re.compile(r'<p class="lang-switch"[^>]*><a href="([^"]+)" hreflang="([^"]+)"')
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
        # (search, general index) have no page body to put the link in
        if 'http-equiv="Refresh"' in text or page.name in ("search.html", "genindex.html"):
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
def test_chinese_search_index_has_chinese_words():
    import json
    text = (HTML / "zh" / "searchindex.js").read_text(encoding="utf-8")
    index = json.loads(text[text.index("(") + 1:text.rindex(")")])
    # jieba splits the text into words (not whole sentences), with the book's terms
    # (tools/zh_search_words.txt) kept whole: "智能体" (agent), "强化学习" (RL) are found.
    terms = index["terms"]
    for word in ("智能体", "强化学习", "梯度", "奖励"):
        assert word in terms and len(terms[word]) > 3, word
