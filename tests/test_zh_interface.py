"""The Chinese site's interface in Simplified Chinese, and its typography.

Where each English string of the theme and extensions gets its Chinese (tools/sphinx_zh.py says
why each one is where it is):
  - Sphinx's catalog `sphinx` (locales/zh_CN/LC_MESSAGES/sphinx.po, found through locale_dirs):
    "Link to this heading", pydata-sphinx-theme's template strings, tools/templates_zh/'s;
  - sphinx-book-theme's catalog `booktheme` (locales/zh_CN/LC_MESSAGES/booktheme.po, put before
    the theme's own by tools/sphinx_zh.py): "Print to PDF", "Launch interactive content", "By";
  - config values in _config_zh.yml: myst-nb's "Show/Hide code cell {type}", togglebutton's hints,
    the author.
The first tests read those files (and Sphinx's own lookup on them), one builds a two-page site
with the Chinese config (seconds), the last reads the built book and is skipped until `make book`.
"""
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from gettext import NullTranslations
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import sphinx_zh
from conftest import REPO

LOCALES = REPO / "locales" / "zh_CN" / "LC_MESSAGES"
HTML_ZH = REPO / "_build" / "html" / "zh"

# The English strings the Chinese site showed, and what it shows now.
SPHINX_STRINGS = {"Link to this heading": "链接到此标题",
                  "Toggle primary sidebar": "显示或隐藏主侧边栏"}
BOOKTHEME_STRINGS = {"Print to PDF": "打印为 PDF", "Launch interactive content": "启动交互式内容",
                     "By": "作者："}
PROMPTS = {"Show code cell source": "显示代码单元源代码", "Hide code cell source": "隐藏代码单元源代码"}
ENGLISH = [*SPHINX_STRINGS, *BOOKTHEME_STRINGS.keys() - {"By"}, *PROMPTS, "Click to show",
           "Click to hide", "Toggle hidden content", "The Agentic RL from Scratch authors",
           "列印"]  # "列印" (print) is Taiwanese usage: Simplified writes 打印
# Characters that only Traditional Chinese uses (their Simplified forms in the comment below).
TRADITIONAL = set("與個們來時為說國會後這對過還發現開關門問間題點體數據寫讀學習機網頁碼鏈結標籤"
                  "側邊欄顯隱啟動載檔設導覽選單尋複製貼圖條範圍歷紀錄內編輯議儲庫")
# 与个们来时为说国会后这对过还发现开关门问间题点体数据写读学习机网页码链结标签
# 侧边栏显隐启动载档设导览选单寻复制贴图条范围历纪录内编辑议储库
CJK = re.compile("[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")


def catalog(name):
    from babel.messages.pofile import read_po
    with open(LOCALES / f"{name}.po", encoding="utf-8") as f:
        return {m.id: m.string for m in read_po(f) if m.id}


def zh_config():
    return yaml.safe_load((REPO / "_config_zh.yml").read_text(encoding="utf-8"))


# --- the catalogs and the config ------------------------------------------------------------

def test_the_catalogs_translate_the_strings_the_site_showed_in_english():
    sphinx_po, booktheme_po = catalog("sphinx"), catalog("booktheme")
    for msgid, msgstr in SPHINX_STRINGS.items():
        assert sphinx_po[msgid] == msgstr, msgid
    for msgid, msgstr in BOOKTHEME_STRINGS.items():
        assert booktheme_po[msgid] == msgstr, msgid


@pytest.mark.parametrize("name", ["sphinx", "booktheme"])
def test_every_entry_is_simplified_chinese_with_its_placeholders(name):
    for msgid, msgstr in catalog(name).items():
        assert CJK.search(msgstr), f"{name}.po: {msgid!r} is not translated"
        assert not TRADITIONAL & set(msgstr) and "列印" not in msgstr, f"{name}.po: {msgstr!r}"
        assert sorted(re.findall(r"%\(\w+\)s", msgid)) == sorted(re.findall(r"%\(\w+\)s", msgstr))


def test_the_config_gives_the_prompts_hints_and_author_in_chinese():
    cfg = zh_config()
    options = cfg["sphinx"]["config"]
    assert cfg["author"] == "《从零实现智能体强化学习》作者团队"
    assert options["locale_dirs"] == ["locales"] and LOCALES.is_dir()
    assert (options["togglebutton_hint"], options["togglebutton_hint_hide"]) == ("点击显示", "点击隐藏")
    assert "sphinx_zh" in cfg["sphinx"]["local_extensions"]
    # myst-nb puts "source" for {type} (the book hides inputs only); tools/sphinx_zh.py
    # translates that word in the prompts it builds
    for english, key in zip(PROMPTS, ("nb_code_prompt_show", "nb_code_prompt_hide")):
        prompt = options[key].replace("{type}", "source")
        translated = sphinx_zh.PROMPT_TYPE.sub(lambda m: sphinx_zh.PROMPT_TYPES[m.group()], prompt)
        assert translated == PROMPTS[english]


@pytest.fixture
def translators(monkeypatch):
    """Sphinx's registry of message catalogs, empty and restored after the test."""
    from sphinx import locale
    monkeypatch.setattr(locale, "translators", defaultdict(NullTranslations))
    return locale


def test_sphinx_reads_our_sphinx_catalog_before_its_own(translators, tmp_path):
    # What Sphinx does at start-up (Sphinx._init_i18n): compile locale_dirs' sphinx.po, then
    # load locale_dirs, the system's and its own catalogs, the first found first.
    from sphinx.util.i18n import CatalogRepository
    shutil.copytree(REPO / "locales", tmp_path / "locales",
                    ignore=shutil.ignore_patterns("*.mo"))
    repo = CatalogRepository(str(tmp_path), ["locales"], "zh_CN", "utf-8")
    for cat in repo.catalogs:
        if cat.domain == "sphinx":
            cat.write_mo("zh_CN")
    sphinx_dir = Path(translators.__file__).parent
    translators.init([*repo.locale_dirs, None, str(sphinx_dir)], "zh_CN")
    _ = translators.get_translation("sphinx")
    for msgid, msgstr in SPHINX_STRINGS.items():
        assert _(msgid) == msgstr
    assert _("previous") == "上一页"  # Sphinx's own translation is still there behind ours


def test_our_booktheme_catalog_comes_before_the_themes(translators):
    theme = pytest.importorskip("sphinx_book_theme")
    theme_locales = Path(theme.__file__).parent / "theme" / "sphinx_book_theme" / "static" / "locales"
    translators.init([str(theme_locales)], "zh_CN", "booktheme")  # the theme's setup
    _ = translators.get_translation("booktheme")
    assert _("Print to PDF") == "列印成 PDF"  # the theme's zh_CN
    app = SimpleNamespace(config=SimpleNamespace(language="zh_CN", locale_dirs=["locales"]),
                          srcdir=str(REPO))
    sphinx_zh.put_our_catalogs_first(app)
    for msgid, msgstr in BOOKTHEME_STRINGS.items():
        assert _(msgid) == msgstr
    english = SimpleNamespace(config=SimpleNamespace(language="en", locale_dirs=["locales"]),
                              srcdir=str(REPO))
    translators.translators.clear()
    sphinx_zh.put_our_catalogs_first(english)
    assert ("general", "booktheme") not in translators.translators


@pytest.mark.parametrize("name, english, ours", [
    ("toggle-primary-sidebar.html", 'title="Toggle primary sidebar"',
     "title=\"{{ _('Toggle primary sidebar') }}\""),
    ("sbt-sidebar-nav.html", 'aria-label="Main"', "aria-label=\"{{ _('Main') }}\""),
    ("author.html", "{{ translate('By') }} {{ author }}", "{{ translate('By') }}{{ author }}"),
])
def test_our_templates_are_the_themes_but_for_the_string(name, english, ours):
    # When sphinx-book-theme changes one of these templates, ours must follow.
    theme = pytest.importorskip("sphinx_book_theme")
    theirs = (Path(theme.__file__).parent / "theme" / "sphinx_book_theme" / "components" / name)
    text = (sphinx_zh.TEMPLATES / name).read_text(encoding="utf-8")
    text = re.sub(r"\A\{#-.*?-#\}\n", "", text, flags=re.S)  # our comment
    assert english in theirs.read_text(encoding="utf-8")
    assert text == theirs.read_text(encoding="utf-8").replace(english, ours)
    for msgid in re.findall(r"_\('([^']+)'\)", ours):
        assert msgid in catalog("sphinx")


# --- a two-page site built with the Chinese config ------------------------------------------

PAGE = """# 1. 测试页

这是第一行，
第二行。**要点**。 下一句，以及 `代码` 和 Adam 优化器。

- 列表项的第一行，
  缩进的续行。
"""


class Visible(HTMLParser):
    """The visible text of a page's paragraphs and list items (code shown as "X"), and the text
    of its title, aria-label and alt attributes."""

    SKIP = {"script", "style", "pre"}

    def __init__(self):
        super().__init__()
        self.stack, self.blocks, self.attrs = [], [], []

    def handle_starttag(self, tag, attrs):
        self.attrs += [v for k, v in attrs if k in ("title", "aria-label", "alt", "placeholder",
                                                     "data-bs-title") and v]
        if tag in ("br", "img", "meta", "link", "input", "hr", "source"):
            return
        self.stack.append(tag)
        if tag in ("p", "li"):
            self.blocks.append("")
        if tag in ("code", "kbd") and self.blocks and not self.SKIP & set(self.stack):
            self.blocks[-1] += "X"

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop() != tag:
            pass

    def handle_data(self, data):
        if self.blocks and {"p", "li"} & set(self.stack) and not (
                self.SKIP | {"code", "kbd"}) & set(self.stack):
            self.blocks[-1] += data


def visible(html):
    parser = Visible()
    parser.feed(html)
    return parser


def cjk_gaps(blocks):
    cjk = CJK.pattern
    return [m.group() for b in blocks for m in re.finditer(f"{cjk}[ \t\n\r]+{cjk}", b)]


def test_a_two_page_site_built_with_the_chinese_config(tmp_path):
    pytest.importorskip("jupyter_book")
    nbformat = pytest.importorskip("nbformat")
    for name in ("_config_zh.yml", "references.bib"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "tools").symlink_to(REPO / "tools")
    shutil.copytree(REPO / "locales", tmp_path / "locales", ignore=shutil.ignore_patterns("*.mo"))
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: index_zh\nchapters:\n"
                                       "  - file: chapters/01_x/zh\n", encoding="utf-8")
    (tmp_path / "index_zh.md").write_text("# 首页\n\n首页的\n内容。\n", encoding="utf-8")
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [nbformat.v4.new_markdown_cell(PAGE, id="md"),
                nbformat.v4.new_code_cell("x = '中 文'", id="code", execution_count=1,
                                          metadata={"tags": ["hide-input"]})]
    (tmp_path / "chapters" / "01_x").mkdir(parents=True)
    nbformat.write(nb, tmp_path / "chapters" / "01_x" / "zh.ipynb")
    # As `jupyter-book build` calls Sphinx, in a process of its own (Sphinx's catalogs are global)
    script = ("import sys; from pathlib import Path; from jupyter_book.sphinx import build_sphinx\n"
              "src = Path.cwd()\n"
              "sys.exit(build_sphinx(src, src / '_build' / 'html', noconfig=True, quiet=True,\n"
              "    path_config=str(src / '_config_zh.yml'), freshenv=True, confoverrides={\n"
              "    'latex_individualpages': False, 'external_toc_path': str(src / '_toc.yml')}))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    html = (tmp_path / "_build" / "html" / "chapters" / "01_x" / "zh.html").read_text(encoding="utf-8")
    page = visible(html)
    assert "这是第一行，第二行。要点。下一句，以及 X 和 Adam 优化器。" in page.blocks
    assert "列表项的第一行，缩进的续行。" in page.blocks
    assert not cjk_gaps(page.blocks)
    assert "x = &#39;中 文&#39;" in html or "中 文" in html  # the code cell as written
    for text in ("链接到此标题", "显示或隐藏主侧边栏", "打印为 PDF", "启动交互式内容",
                 "显示代码单元源代码", "隐藏代码单元源代码", "作者：《从零实现智能体强化学习》作者团队",
                 "toggleHintShow = '点击显示'"):
        assert text in html, text
    for text in ENGLISH:
        assert text not in html, text


# --- the built book (after `make book`) -----------------------------------------------------

@pytest.mark.skipif(not (HTML_ZH / "chapters" / "07_rl_loop" / "zh.html").exists(),
                    reason="the book is not built (make book)")
@pytest.mark.parametrize("chapter", ["01_introduction", "07_rl_loop", "18_wal_rollout"])
def test_built_chinese_chapter_has_no_gaps_and_no_english_interface(chapter):
    html = (HTML_ZH / "chapters" / chapter / "zh.html").read_text(encoding="utf-8")
    page = visible(html)
    assert len(page.blocks) > 20
    assert not cjk_gaps(page.blocks), cjk_gaps(page.blocks)[:10]
    for text in ENGLISH:
        assert text not in html, text
    for text in ("链接到此标题", "显示或隐藏主侧边栏", "打印为 PDF", "作者：《从零实现智能体强化学习》作者团队"):
        assert text in html, text
