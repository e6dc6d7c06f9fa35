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

Every page of the book then starts with a link to its translation and declares it in its head
(`<link rel="alternate" hreflang=...>`). Sphinx's generated pages (search, genindex) have no
page body and get no link.

The extension also drops duplicate inline <script> tags: Sphinx 7 adds a script registered with
`app.add_js_file(None, body=...)` twice (once with filename None, once with ''; fixed upstream in
sphinx-doc/sphinx#13402, Sphinx 8.2), so sphinx-thebe's `const THEBE_JS_URL = ...` ran twice and
every page logged "SyntaxError: Identifier 'THEBE_JS_URL' has already been declared".
"""
from __future__ import annotations

import html
import re
from urllib.parse import urljoin

# The root document of each site, and how a link to it is labelled (in the target language).
ROOTS = {"en": "index", "zh": "index_zh"}
LABELS = {"en": "Read in English", "zh": "阅读中文版"}
HREFLANG = {"en": "en", "zh": "zh-CN"}


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


def add_switch(app, pagename, templatename, context, doctree) -> None:
    """html-page-context: prepend the link to the page body and declare it in the head."""
    _dedupe_scripts(context)
    to = app.config.lang_switch_to
    if not to or "body" not in context:
        return
    # A page without a translation by name links to the other site's landing page.
    other = other_docname(pagename, to) or ROOTS[to]
    url = switch_url(pagename, other, app.config.lang_switch_root, app.builder.out_suffix)
    lang = HREFLANG[to]
    link = (f'<p class="lang-switch" style="text-align: right; margin: 0;">'
            f'<a href="{html.escape(url)}" hreflang="{lang}" lang="{lang}">'
            f"🌐 {LABELS[to]}</a></p>\n")
    context["body"] = link + context["body"]
    # Absolute when the site has a base URL (search engines want that), else relative.
    base = app.config.html_baseurl
    href = (urljoin(base.rstrip("/") + "/", app.config.lang_switch_root + other
                    + app.builder.out_suffix) if base else url)
    context["metatags"] = (context.get("metatags") or "") + (
        f'\n<link rel="alternate" hreflang="{lang}" href="{html.escape(href)}" />')


def setup(app):
    app.add_config_value("lang_switch_to", "", "html")
    app.add_config_value("lang_switch_root", "", "html")
    # Late priority: after the theme and other extensions have added their scripts.
    app.connect("html-page-context", add_switch, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
