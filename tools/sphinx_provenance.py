"""A small Sphinx extension: say under each chapter page which run produced its outputs.

`tools/execute.py` records in each notebook it executes (metadata key `agentrl`) the package
version, the commit the run started from (with "+changes" when the working tree differed from
it) and the hash of the package's code (`arl.source_hash` of every module). This extension
prints that record at the foot of the page, so a reader can tell which code wrote the numbers
they are reading; a notebook executed before the record existed says so.

The commit links to `<repository url>/commit/<sha>` (the theme option `repository_url`, which
jupyter-book fills from `repository.url` in the configs); "+changes" is said in words ("with
uncommitted changes").
A chapter whose code hash differs from the one that most of the site's chapters (more than half
of those with a record) were executed with says so too: its numbers may not match what the
package's code of the rest of the book would print.
"""
from __future__ import annotations

import html
import json
import re
from collections import Counter
from pathlib import Path

LABELS = {
    "en": {
        "done": "Outputs on this page were produced by agentrl {version} at commit {commit}"
                "{changes} (code {code}) on {date}.",
        "changes": " with uncommitted changes",
        "missing": "Outputs on this page predate the run record of tools/execute.py.",
        "other": "This chapter was executed on other package code than the rest of the book "
                 "(most chapters: code {majority}).",
        "sep": " ",
    },
    "zh": {
        "done": "本页输出由 agentrl {version} 于 {date} 运行生成（提交 {commit}{changes}，代码 {code}）。",
        "changes": "，含未提交的改动",
        "missing": "本页输出早于 tools/execute.py 的运行记录。",
        "other": "本章运行时的包代码与本书其余各章不同（多数章节：代码 {majority}）。",
        "sep": "",
    },
}
SHA = re.compile(r"[0-9a-f]{7,40}")


def commit_html(commit: str, repo_url: str = "") -> tuple[str, bool]:
    """(HTML of the commit, whether the run had uncommitted changes): "86016af76f65+changes"
    -> a link to <repo_url>/commit/86016af76f65 (where repo_url is given), True."""
    sha, plus, _ = str(commit).partition("+")
    text = html.escape(sha)
    if repo_url and SHA.fullmatch(sha):
        url = f"{repo_url.rstrip('/')}/commit/{sha}"
        text = f'<a href="{html.escape(url)}">{text}</a>'
    return text, bool(plus)


def majority_code(codes) -> str | None:
    """The code hash of more than half of the chapters that have one (None: no such hash)."""
    known = [c for c in codes if c and c not in ("unknown", "?")]
    if not known:
        return None
    code, count = Counter(known).most_common(1)[0]
    return code if 2 * count > len(known) else None


def provenance_html(record: dict | None, language: str, repo_url: str = "",
                    majority: str | None = None) -> str:
    """The paragraph for a notebook's run record (None: no record) in `language`; the commit
    linked into `repo_url`; flagged when its code differs from `majority` (the book's)."""
    labels = LABELS["zh" if language.startswith("zh") else "en"]
    if not record:
        text = labels["missing"]
    else:
        fields = {k: html.escape(str(record.get(k, "?"))) for k in ("version", "code", "date")}
        commit, changes = commit_html(record.get("commit", "?"), repo_url)
        text = labels["done"].format(commit=commit, changes=labels["changes"] if changes else "",
                                     **fields)
        if majority and record.get("code") not in (None, "unknown") and \
                record["code"] != majority:
            text += (labels["sep"] + '<strong class="provenance-other-code">'
                     + labels["other"].format(majority=html.escape(majority)) + "</strong>")
    return f'<p class="provenance" style="font-size: 0.8em; opacity: 0.7;">{text}</p>'


def run_record(source: Path) -> dict | None:
    """The run record (metadata `agentrl`) of a notebook; None for a notebook without one."""
    return json.loads(Path(source).read_text(encoding="utf-8")).get("metadata", {}).get("agentrl")


def _notebook(app, docname: str) -> Path | None:
    source = Path(app.env.doc2path(docname))
    return source if source.suffix == ".ipynb" else None


def find_majority(app, env) -> list[str]:
    """env-updated: the code hash most of this site's notebooks were executed with, kept in the
    environment; when it changed since the last build, every notebook page is written again
    (returned), as their flags may have changed."""
    notebooks, codes = [], []
    for docname in sorted(env.all_docs):
        source = _notebook(app, docname)
        if source is not None:
            notebooks.append(docname)
            codes.append((run_record(source) or {}).get("code"))
    majority = majority_code(codes)
    before = getattr(env, "agentrl_code_majority", majority)
    env.agentrl_code_majority = majority
    return notebooks if before != majority else []


def add_provenance(app, pagename, templatename, context, doctree) -> None:
    """html-page-context: append the run record of a notebook page to its body."""
    if "body" not in context or pagename not in app.env.all_docs:
        return
    source = _notebook(app, pagename)
    if source is None:
        return
    repo_url = (app.config.html_theme_options or {}).get("repository_url") or ""
    context["body"] += provenance_html(run_record(source), app.config.language or "en",
                                       repo_url, getattr(app.env, "agentrl_code_majority", None))


def setup(app):
    app.connect("env-updated", find_majority)
    app.connect("html-page-context", add_provenance)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
