"""A small Sphinx extension: say under each chapter page which run produced its outputs.

`tools/execute.py` records in each notebook it executes (metadata key `agentrl`) the package
version, the commit the run started from (with "+changes" when the working tree differed from
it) and the hash of the package's code (`arl.source_hash` of every module). This extension
prints that record at the foot of the page, so a reader can tell which code wrote the numbers
they are reading; a notebook executed before the record existed says so.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

LABELS = {
    "en": ("Outputs on this page were produced by agentrl {version} at commit {commit} "
           "(code {code}) on {date}.",
           "Outputs on this page predate the run record of tools/execute.py."),
    "zh": ("本页输出由 agentrl {version} 在提交 {commit}（代码 {code}）上于 {date} 运行生成。",
           "本页输出早于 tools/execute.py 的运行记录。"),
}


def provenance_html(record: dict | None, language: str) -> str:
    """The paragraph for a notebook's run record (None: no record) in `language`."""
    done, missing = LABELS["zh" if language.startswith("zh") else "en"]
    text = done.format(**{k: html.escape(str(record.get(k, "?"))) for k in
                          ("version", "commit", "code", "date")}) if record else missing
    return f'<p class="provenance" style="font-size: 0.8em; opacity: 0.7;">{text}</p>'


def add_provenance(app, pagename, templatename, context, doctree) -> None:
    """html-page-context: append the run record of a notebook page to its body."""
    if "body" not in context or pagename not in app.env.all_docs:
        return
    source = Path(app.env.doc2path(pagename))
    if source.suffix != ".ipynb":
        return
    record = json.loads(source.read_text(encoding="utf-8")).get("metadata", {}).get("agentrl")
    context["body"] += provenance_html(record, app.config.language or "en")


def setup(app):
    app.connect("html-page-context", add_provenance)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
