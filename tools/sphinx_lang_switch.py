"""A small Sphinx extension: link every page of the book to the same page in the other language.

The book is built twice from the same sources (`make book`): the English site (`_config.yml`,
`_toc.yml`) into `_build/html`, and the Chinese site (`_config_zh.yml`, `_toc_zh.yml`) into
`_build/html/zh`. A page and its translation pair by their names:

    index                   <->  index_zh
    chapters/07_rl_loop/en  <->  chapters/07_rl_loop/zh
    references_en           <->  references_zh

Each site's config names the other site (under `sphinx: config:`):

    lang_switch_to:   zh     the other site's language, "en" or "zh"
    lang_switch_root: zh/    the other site's root, relative to this site's root ("../" from zh/)

Every page then shows, in the header above the article, a text link to its translation ("中文"
on the English site, "English" on the Chinese one): the template
`tools/_templates/lang-switch.html`, placed by the theme option `article_header_end`
(sphinx-book-theme's slot for the header's right end, listed in both configs before the theme's
own `article-header-buttons.html`); this extension adds its folder to `templates_path` and gives
the template its link (`lang_switch` in the page context). A page without a translation by name
(Sphinx's search and index pages) links to the other site's landing page. Pages with a body also
declare their translation in their head (`<link rel="alternate" hreflang=...>`).

The extension also drops duplicate inline <script> tags: Sphinx 7 adds a script registered with
`app.add_js_file(None, body=...)` twice (once with filename None, once with ''; fixed upstream in
sphinx-doc/sphinx#13402, Sphinx 8.2), so sphinx-thebe's `const THEBE_JS_URL = ...` ran twice and
every page logged "SyntaxError: Identifier 'THEBE_JS_URL' has already been declared".
"""
from __future__ import annotations

import html
import re
from pathlib import Path
from urllib.parse import urljoin

# The root document of each site, and how a link to it is labelled (in the target language):
# text, not an emoji (a 🌐 is a blank box where no emoji font is installed).
ROOTS = {"en": "index", "zh": "index_zh"}
LABELS = {"en": "English", "zh": "中文"}
TITLES = {"en": "Read this page in English", "zh": "阅读本页的中文版"}
HREFLANG = {"en": "en", "zh": "zh-CN"}
TEMPLATES = Path(__file__).resolve().parent / "_templates"  # lang-switch.html


def other_docname(docname: str, to: str) -> str | None:
    """The name of `docname`'s translation in language `to`, or None if it has none by name.

    >>> other_docname("chapters/07_rl_loop/en", "zh"), other_docname("index_zh", "en")
    ('chapters/07_rl_loop/zh', 'index')
    """
    if to not in ROOTS:
        raise ValueError(f"lang_switch_to must be one of {sorted(ROOTS)}, not {to!r}")
    source = "zh" if to == "en" else "en"
    if docname == ROOTS[source]:
        return ROOTS[to]
    # "<folder>/en" or "<name>_en" -> the same with the other language's code.
    match = re.fullmatch(rf"(.+[/_]){source}", docname)
    return match.group(1) + to if match else None


def switch_url(pagename: str, other: str, other_root: str, suffix: str = ".html") -> str:
    """Relative URL from page `pagename` of this site to page `other` of the other site."""
    return "../" * pagename.count("/") + other_root + other + suffix


def _dedupe_scripts(context) -> None:
    """Keep one of each <script> (same file, priority and attributes; None and '' alike)."""
    seen, kept = set(), []
    for js in context.get("script_files") or []:
        key = (getattr(js, "filename", js) or "", getattr(js, "priority", 0),
               tuple(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    context["script_files"] = kept


def switch_link(pagename: str, to: str, other_root: str, suffix: str = ".html") -> dict:
    """The header link of page `pagename` to its translation in language `to`: what the template
    lang-switch.html prints (url, label, title, hreflang)."""
    # A page without a translation by name links to the other site's landing page.
    other = other_docname(pagename, to) or ROOTS[to]
    return {"url": switch_url(pagename, other, other_root, suffix), "label": LABELS[to],
            "title": TITLES[to], "hreflang": HREFLANG[to], "docname": other}


def add_switch(app, pagename, templatename, context, doctree) -> None:
    """html-page-context (before the theme drops templates that render empty): the header link
    for lang-switch.html, and the translation declared in the head of a page with a body."""
    to = app.config.lang_switch_to
    if not to:
        return
    root, suffix = app.config.lang_switch_root, app.builder.out_suffix
    link = context["lang_switch"] = switch_link(pagename, to, root, suffix)
    if "body" not in context:
        return
    # Absolute when the site has a base URL (search engines want that), else relative.
    base = app.config.html_baseurl
    href = (urljoin(base.rstrip("/") + "/", root + link["docname"] + suffix) if base
            else link["url"])
    context["metatags"] = (context.get("metatags") or "") + (
        f'\n<link rel="alternate" hreflang="{link["hreflang"]}" href="{html.escape(href)}" />')


def dedupe_scripts(app, pagename, templatename, context, doctree) -> None:
    """html-page-context, late: one copy of each <script> (see the module's docstring)."""
    _dedupe_scripts(context)


def add_templates(app, config) -> None:
    """config-inited: the folder of lang-switch.html joins the config's templates_path."""
    if str(TEMPLATES) not in config.templates_path:
        config.templates_path = [*config.templates_path, str(TEMPLATES)]


def setup(app):
    app.add_config_value("lang_switch_to", "", "html")
    app.add_config_value("lang_switch_root", "", "html")
    app.connect("config-inited", add_templates)
    # Before pydata-sphinx-theme's update_and_remove_templates (priority 500), which drops a
    # template of article_header_end that renders empty.
    app.connect("html-page-context", add_switch, priority=400)
    # Late priority: after the theme and other extensions have added their scripts.
    app.connect("html-page-context", dedupe_scripts, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
