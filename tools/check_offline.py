"""Check that the built book loads nothing from the network: no remote <script> or stylesheet.

    python tools/check_offline.py [_build/html]

A page that loads MathJax (or a font, or a theme script) from a CDN shows raw LaTeX or breaks
when read offline. Exit 1, naming each page and address, when any page does.
"""
from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

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


def remote_loads(html_dir: Path) -> list[tuple[str, str]]:
    """(page, address) for every remote script or stylesheet in the HTML pages under html_dir."""
    found = []
    for page in sorted(Path(html_dir).rglob("*.html")):
        parser = _Loads()
        parser.feed(page.read_text(encoding="utf-8", errors="replace"))
        found += [(str(page.relative_to(html_dir)), a) for a in parser.addresses if REMOTE.match(a)]
    return found


def main(argv: list[str]) -> int:
    html_dir = Path(argv[0] if argv else "_build/html")
    if not html_dir.is_dir():
        print(f"error: {html_dir} is not a directory (run `make book` first)", file=sys.stderr)
        return 2
    found = remote_loads(html_dir)
    for page, address in found:
        print(f"{page}: loads {address}")
    pages = len(list(html_dir.rglob("*.html")))
    print(f"{pages} pages, {len(found)} remote scripts or stylesheets")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
