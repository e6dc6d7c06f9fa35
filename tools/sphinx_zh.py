"""A small Sphinx extension for the Chinese site (`language` zh...): its typography and interface.

Both configs load it; it does nothing when `language` does not start with "zh".

1. Spacing. A browser shows any whitespace between two words as a space, and Chinese has no spaces
   between its characters: a line break inside a Chinese sentence, the indentation of a list
   item's continuation line or a space after a bold lead-in (`**要点**。 下一句`) appear as stray
   gaps. The transform `CjkSpacing` removes every run of whitespace that stands between two CJK
   characters (CJK punctuation and full-width forms included) in the text of paragraphs, list
   items, titles and captions, also when the two characters lie in adjacent nodes (a `strong`
   and the text after it). The space between Chinese and a Latin word, a digit or inline code
   stays, as Chinese technical writing has it; code (literal blocks, inline code), math and raw
   HTML are never touched. It runs when a page is read and again before it is written (for text
   that resolving references adds).

2. Interface strings, each where its package looks for it. The theme's and Sphinx's strings
   come from gettext catalogs chosen by `language`; ours are in `locales/zh_CN/LC_MESSAGES/`
   (`locale_dirs: [locales]` in both configs; the English site has none):
   - `sphinx.po`, the catalog `sphinx`: Sphinx finds it through `locale_dirs`, compiles it to
     sphinx.mo and reads it before its own translation (the mechanism `locale_dirs` documents).
     It holds what Sphinx's zh_CN catalog leaves untranslated ("Link to this heading") and the
     strings of pydata-sphinx-theme's templates (the theme ships a `zh` catalog, which Sphinx
     does not look for when the language is zh_CN).
   - `booktheme.po`, sphinx-book-theme's catalog `booktheme` (its header buttons): "Print to PDF"
     (the theme's zh_CN catalog has the Taiwanese 列印成 PDF), "Launch interactive content"
     (missing there). A catalog that an extension registers comes after the theme's own
     (`app.add_message_catalog` adds fallbacks), so `put_our_catalogs_first` compiles ours and
     puts it before the theme's.
   - `templates_zh/`: sphinx-book-theme's templates that write English without gettext
     ("Toggle primary sidebar", aria-label "Main") or put a space after the footer's "作者："
     (`author.html`), with the string passed through the `sphinx` catalog; `add_templates` puts
     the folder ahead of the theme's in `templates_path` (Sphinx's way to override a template).
   - config values in `_config_zh.yml`: myst-nb's "Show/Hide code cell {type}"
     (`nb_code_prompt_show`, `nb_code_prompt_hide`; `HideCellPrompts` translates the English word
     myst-nb puts for `{type}`), sphinx-togglebutton's hints, the author.
   - myst-nb writes the aria-label "Toggle hidden content" into the page body:
     `translate_body` replaces it.
"""
from __future__ import annotations

import gettext
import io
import re
from pathlib import Path

from docutils import nodes
from sphinx import locale
from sphinx.transforms import SphinxTransform
from sphinx.transforms.post_transforms import SphinxPostTransform

# Han characters (all blocks), CJK radicals, punctuation and symbols, kana, compatibility forms,
# full-width forms; and the quotes and dashes of Chinese text (“”‘’ —— ……).
CJK = ("\u2014\u2018\u2019\u201c\u201d\u2026\u2e80-\u2fdf\u3001-\u303f\u3040-\u30ff"
       "\u3100-\u312f\u3190-\u31ff\u3200-\u4dbf\u4e00-\u9fff\uf900-\ufaff\ufe10-\ufe1f"
       "\ufe30-\ufe4f\uff01-\uffef\U00020000-\U0003134f")
CJK_CHAR = re.compile(f"[{CJK}]")
# Whitespace that a browser collapses into one space (not U+3000, the ideographic space, nor
# the no-break space, which are written on purpose).
GAP = re.compile(f"(?<=[{CJK}])[ \t\n\r\f\v]+(?=[{CJK}])")
# Nodes whose text is kept as written: code, math, raw HTML, comments. Their content also stops
# a gap from being joined across them (the space next to inline code stays).
VERBATIM = (nodes.FixedTextElement, nodes.literal, nodes.math, nodes.raw, nodes.comment,
            nodes.image, nodes.Invisible)


def is_zh(config) -> bool:
    return (config.language or "").lower().startswith("zh")


def _runs(element: nodes.Element) -> list[list[nodes.Text]]:
    """The Text nodes of `element` in reading order, in runs that verbatim nodes separate."""
    runs: list[list[nodes.Text]] = [[]]

    def walk(node: nodes.Element) -> None:
        for child in node.children:
            if isinstance(child, nodes.Text):
                runs[-1].append(child)
            elif isinstance(child, VERBATIM):
                runs.append([])
            elif isinstance(child, nodes.Element):
                walk(child)

    walk(element)
    return [run for run in runs if run]


def _join_run(run: list[nodes.Text]) -> int:
    """Remove the gaps between CJK characters across the texts of `run`; return how many."""
    texts = [str(t) for t in run]
    gaps = list(GAP.finditer("".join(texts)))
    if not gaps:
        return 0
    start = 0
    for node, text in zip(run, texts):
        end = start + len(text)
        keep = list(text)
        for gap in gaps:
            for i in range(max(gap.start(), start), min(gap.end(), end)):
                keep[i - start] = ""
        new = "".join(keep)
        if new != text:
            if new:
                node.parent.replace(node, nodes.Text(new))
            else:
                node.parent.remove(node)
        start = end
    return len(gaps)


def join_cjk_gaps(tree: nodes.Node) -> int:
    """Remove whitespace between two CJK characters in the prose of `tree`; return how many gaps.

    Every text block (paragraph, title, caption, term, ...) is handled as one run of text across
    its inline nodes; code, math and raw nodes are left alone and end a run.
    """
    count = 0
    for block in list(tree.findall(nodes.TextElement)):
        if isinstance(block, (nodes.Inline, nodes.FixedTextElement)):
            continue  # inline nodes belong to their block; verbatim blocks stay
        if any(isinstance(a, VERBATIM) for a in _ancestors(block)):
            continue
        for run in _runs(block):
            count += _join_run(run)
    return count


def _ancestors(node: nodes.Node):
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


class CjkSpacing(SphinxTransform):
    """Drop whitespace between two CJK characters (Chinese site only)."""

    default_priority = 800  # after smart quotes (750), so their “” count as Chinese quotes

    def apply(self, **kwargs) -> None:
        if is_zh(self.config):
            join_cjk_gaps(self.document)


class CjkSpacingResolved(SphinxPostTransform):
    """The same, once references are resolved (their text is in the tree only now)."""

    default_priority = 900

    def run(self, **kwargs) -> None:
        if is_zh(self.config):
            join_cjk_gaps(self.document)


# The words myst-nb puts for `{type}` in `nb_code_prompt_show` / `nb_code_prompt_hide`.
PROMPT_TYPES = {"content": "内容", "source": "源代码", "outputs": "输出", "output": "输出"}
PROMPT_TYPE = re.compile(r"(?<![A-Za-z])(content|source|outputs|output)(?![A-Za-z])")


class HideCellPrompts(SphinxPostTransform):
    """Translate the `{type}` word in myst-nb's hidden-cell prompts (Chinese site only)."""

    default_priority = 200  # right after myst-nb's HideInputCells (199) builds the prompts
    formats = ("html",)

    def run(self, **kwargs) -> None:
        if not is_zh(self.config):
            return
        for node in self.document.findall(nodes.Element):
            for key in ("prompt_show", "prompt_hide"):
                if isinstance(node.get(key), str) and CJK_CHAR.search(node[key]):
                    node[key] = PROMPT_TYPE.sub(lambda m: PROMPT_TYPES[m.group()], node[key])


# The catalogs of other packages that our locale_dirs may override (Sphinx's own is handled by
# Sphinx).
OVERRIDDEN_CATALOGS = ("booktheme",)


def catalog_translations(po_path: Path) -> gettext.GNUTranslations:
    """A .po file compiled in memory (babel is one of Sphinx's requirements)."""
    from babel.messages.mofile import write_mo
    from babel.messages.pofile import read_po

    with open(po_path, encoding="utf-8") as f:
        catalog = read_po(f)
    buffer = io.BytesIO()
    write_mo(buffer, catalog)
    buffer.seek(0)
    return gettext.GNUTranslations(buffer)


def put_our_catalogs_first(app) -> None:
    """builder-inited: our catalog of each package in OVERRIDDEN_CATALOGS before its own."""
    if not is_zh(app.config):
        return
    for domain in OVERRIDDEN_CATALOGS:
        for folder in app.config.locale_dirs:
            po = Path(app.srcdir, folder, app.config.language, "LC_MESSAGES", f"{domain}.po")
            if po.is_file():
                ours = catalog_translations(po)
                theirs = locale.translators.get(("general", domain))
                if theirs is not None and theirs.__class__ is not gettext.NullTranslations:
                    ours.add_fallback(theirs)
                locale.translators["general", domain] = ours
                break


TEMPLATES = Path(__file__).parent / "templates_zh"


def add_templates(app, config) -> None:
    """config-inited: our templates ahead of the theme's (the themes append theirs in setup)."""
    if is_zh(config):
        config.templates_path.insert(0, str(TEMPLATES))


# myst-nb writes this aria-label into its HTML (HideCodeCellNode's visitor) without gettext.
HIDDEN_LABEL = ('aria-label="Toggle hidden content"', 'aria-label="显示或隐藏内容"')


def translate_body(app, pagename, templatename, context, doctree) -> None:
    """html-page-context: the strings that packages write into the page body in English."""
    if is_zh(app.config) and "body" in context:
        context["body"] = context["body"].replace(*HIDDEN_LABEL)


def setup(app):
    app.add_transform(CjkSpacing)
    app.add_post_transform(CjkSpacingResolved)
    app.add_post_transform(HideCellPrompts)
    app.connect("config-inited", add_templates)
    app.connect("builder-inited", put_our_catalogs_first)
    app.connect("html-page-context", translate_body)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
