"""Check that the built book loads nothing from the network: no remote <script> or stylesheet,
and every local one it loads exists.

    python tools/check_offline.py [_build/html]

A page that loads MathJax (or a font, or a theme script) from a CDN shows raw LaTeX or breaks
when read offline. A local address may leave the folder checked: the Chinese site (zh/) loads
the English site's copy of MathJax (../_static/mathjax, `mathjax_path` in _config_zh.yml), so
check zh/ where it lies in the published tree, after the English site is built. Exit 1, naming
each page and address, when any page loads a remote or missing file.
"""
from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

REMOTE = re.compile(r"^(https?:)?//", re.IGNORECASE)


class _Loads(HTMLParser):
    """Collects the addresses a page loads as scripts or stylesheets."""

    def __init__(self):
        super().__init__()
        self.addresses = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.addresses.append(attrs["src"])
        if tag == "link" and "stylesheet" in (attrs.get("rel") or "") and attrs.get("href"):
            self.addresses.append(attrs["href"])


def _loads(html_dir: Path):
    """(page path, address) for every script or stylesheet the HTML pages under html_dir load."""
    for page in sorted(Path(html_dir).rglob("*.html")):
        parser = _Loads()
        parser.feed(page.read_text(encoding="utf-8", errors="replace"))
        yield from ((page, a) for a in parser.addresses)


def remote_loads(html_dir: Path) -> list[tuple[str, str]]:
    """(page, address) for every remote script or stylesheet in the HTML pages under html_dir."""
    return [(str(page.relative_to(html_dir)), a) for page, a in _loads(html_dir) if REMOTE.match(a)]


def missing_loads(html_dir: Path) -> list[tuple[str, str]]:
    """(page, address) for every local script or stylesheet whose file does not exist (relative
    to the page; ?query and #fragment ignored; data: URIs and remote addresses skipped). The
    .html files in _static folders are the themes' Jinja templates (copied, never rendered),
    not pages."""
    found = []
    for page, address in _loads(html_dir):
        parts = urlsplit(address)
        if REMOTE.match(address) or parts.scheme or not parts.path or \
                "_static" in page.relative_to(html_dir).parts:
            continue
        if not (page.parent / unquote(parts.path)).is_file():
            found.append((str(page.relative_to(html_dir)), address))
    return found


def main(argv: list[str]) -> int:
    html_dir = Path(argv[0] if argv else "_build/html")
    if not html_dir.is_dir():
        print(f"error: {html_dir} is not a directory (run `make book` first)", file=sys.stderr)
        return 2
    found, missing = remote_loads(html_dir), missing_loads(html_dir)
    for page, address in found:
        print(f"{page}: loads {address}")
    for page, address in missing:
        print(f"{page}: loads {address}, which does not exist")
    pages = len(list(html_dir.rglob("*.html")))
    print(f"{pages} pages, {len(found)} remote scripts or stylesheets, {len(missing)} missing")
    return 1 if found or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
