"""The package's module graph, as README.md shows it: the earlier chapters each module of
`agentrl` calls (`arl.<name>`, a name saved by that chapter's module).

    python tools/deps.py           # print the block
    python tools/deps.py --write   # refresh README.md's copy (between its two markers)

Book order is the dependency order (tests/test_book_order.py), so every arrow points up
the list; the test there also fails when README's copy is out of date.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- deps: begin (tools/deps.py) -->", "<!-- deps: end -->"


def graph(root: Path = ROOT) -> dict[str, list[str]]:
    """module -> the modules whose saved names it uses, in book order."""
    sys.path.insert(0, str(root))
    arl = importlib.import_module("agentrl")
    home = {}
    for m in arl._MODULES:
        for name in importlib.import_module(f"agentrl.{m}").__all__:
            home.setdefault(name, m)
    out = {}
    for m in arl._MODULES:
        text = (root / "agentrl" / f"{m}.py").read_text(encoding="utf-8")
        used = {home[n] for n in re.findall(r"\barl\.([A-Za-z_]\w*)", text) if n in home}
        out[m] = [u for u in arl._MODULES if u in used - {m}]
    return out


def block(root: Path = ROOT) -> str:
    """The README block: one line per module, `module <- modules it uses`."""
    g = graph(root)
    width = max(map(len, g))
    lines = [f"{m:<{width}}  <- {' '.join(uses) if uses else '(nothing)'}"
             for m, uses in g.items()]
    return "\n".join([BEGIN, "```", *lines, "```", END])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="refresh README.md's copy")
    args = p.parse_args(argv)
    text = block()
    if not args.write:
        print(text)
        return 0
    readme = ROOT / "README.md"
    old = readme.read_text(encoding="utf-8")
    if BEGIN not in old or END not in old:
        print(f"README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    start, stop = old.index(BEGIN), old.index(END) + len(END)
    readme.write_text(old[:start] + text + old[stop:], encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
