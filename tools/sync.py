"""Keep each chapter's Chinese notebook in step with its English one.

    python tools/sync.py [CHAPTER ...]                 # copy code cells (with outputs) en -> zh
    python tools/sync.py --check [CHAPTER ...]         # write nothing; exit 1 on any difference
    python tools/sync.py --add-missing [CHAPTER ...]   # also add to-translate stubs to zh
    python tools/sync.py --join-cjk [CHAPTER ...]      # join lines broken inside Chinese text

Cells are paired by their nbformat 4.5 `id`: `zh.ipynb` has the same cells as `en.ipynb` in the
same order; code (and raw) cells are copies, markdown cells are translations. The English
notebook owns the structure, so a Chinese markdown cell must reuse the id of the English cell it
translates. One part of a code cell is translated too: the caption of the figure it draws
(MyST-NB's cell metadata `mystnb.figure.caption`), which the Chinese copy keeps in Chinese.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbtools
from nbtools import ROOT, ToolError, cell_id, rel

# Put on a stub that `--add-missing` creates; `--check` fails while it is there.
TODO = "<!-- TODO: translate -->"
CJK_RE = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")
# What may stay identical in both languages: code, math, link targets, images, HTML, URLs.
NOT_PROSE = [
    re.compile(r"```.*?```|~~~.*?~~~", re.S),                   # fenced code and MyST directives
    re.compile(r"\$\$.*?\$\$|\\begin\{.*?\\end\{[^}]*\}", re.S),  # display math
    re.compile(r"`[^`]*`|\$[^$\n]+\$"),                         # inline code, inline math
    re.compile(r"!\[[^\]]*\]\([^)]*\)"),                        # images
    re.compile(r"\]\([^)]*\)|<[^>]+>|https?://\S+"),            # link targets, HTML, bare URLs
]
MIN_WORDS = 3  # English words (3+ letters) that make an unchanged cell count as untranslated
# A browser renders a newline inside a paragraph as a space: between two Chinese characters that
# is a stray gap ("更新函数的 更新"), so Chinese prose keeps each paragraph on one line. The same
# holds for the indented continuation line of a list item ("\n  " between two Chinese characters).
CJK_BREAK = re.compile(f"(?<={CJK_RE.pattern})\n[ \t]*(?={CJK_RE.pattern})")
# A line that ends its own block (a heading, a table row): the newline after it is no space.
BLOCK_LINE = re.compile(r" {0,3}(#{1,6}[ \t]|\|)")
# Where a newline is not prose: fenced code and directives, display math.
VERBATIM = re.compile(r"```.*?```|~~~.*?~~~|\$\$.*?\$\$", re.S)


def untranslated(text: str) -> bool:
    """Whether markdown is English prose: no CJK at all, and English words outside code/math/links.

    Used on a Chinese cell that is identical to its English cell: a cell holding only a formula,
    a figure, a code block or a heading like `## Exercises` may stay as it is.
    """
    if CJK_RE.search(text):
        return False
    for pattern in NOT_PROSE:
        text = pattern.sub(" ", text)
    return len(re.findall(r"[A-Za-z]{3,}", text)) >= MIN_WORDS


def _prose_pieces(text: str) -> list[tuple[bool, str]]:
    """Split markdown into (is_prose, piece): fenced blocks and display math are not prose."""
    pieces, pos = [], 0
    for m in VERBATIM.finditer(text):
        pieces += [(True, text[pos:m.start()]), (False, m.group())]
        pos = m.end()
    return pieces + [(True, text[pos:])]


def _soft_breaks(piece: str) -> list[re.Match]:
    """The newlines (with the next line's indentation) of a prose piece that stand between two
    CJK characters inside a paragraph or list item, where a browser shows them as a space."""
    return [m for m in CJK_BREAK.finditer(piece)
            if not BLOCK_LINE.match(piece, piece.rfind("\n", 0, m.start()) + 1)]


def cjk_breaks(text: str) -> int:
    """How many newlines of `text`'s prose stand between two CJK characters (indented or not)."""
    return sum(len(_soft_breaks(piece)) for prose, piece in _prose_pieces(text) if prose)


def _join_piece(piece: str) -> str:
    out, pos = [], 0
    for m in _soft_breaks(piece):
        out.append(piece[pos:m.start()])
        pos = m.end()
    return "".join(out) + piece[pos:]


def join_cjk_breaks(text: str) -> str:
    """`text` with every newline (and the indentation after it) between two CJK characters of its
    prose removed: the lines of a paragraph or list item become one."""
    return "".join(_join_piece(piece) if prose else piece for prose, piece in _prose_pieces(text))


def figure_caption(cell) -> str | None:
    """The caption MyST-NB puts under the figure a code cell draws (None if it has none)."""
    return cell.get("metadata", {}).get("mystnb", {}).get("figure", {}).get("caption")


def _without_caption(metadata: dict) -> dict:
    """`metadata` with the figure caption, the one part of a code cell that is translated."""
    metadata = copy.deepcopy(dict(metadata))
    figure = metadata.get("mystnb", {}).get("figure")
    if figure is not None:
        figure.pop("caption", None)
    return metadata


def copy_code_cell(en_cell, zh_cell):
    """The Chinese copy of an English code cell: everything from English, the figure caption
    from the old Chinese copy when it has one."""
    cell = copy.deepcopy(en_cell)
    zh_caption = figure_caption(zh_cell) if zh_cell is not None else None
    if zh_caption is not None and figure_caption(cell) is not None:
        cell.metadata["mystnb"]["figure"]["caption"] = zh_caption
    return cell


def copied(cell) -> bool:
    """Code and raw cells are copied from English; markdown cells are translated."""
    return cell.cell_type != "markdown"


def index_cells(nb, path: Path, root: Path) -> dict:
    """Cells by id; duplicate ids would make pairing ambiguous."""
    by_id = {}
    for cell in nb.cells:
        if cell_id(cell) in by_id:
            raise ToolError(f"{rel(path, root)}: cell id {cell_id(cell)!r} appears twice")
        by_id[cell_id(cell)] = cell
    return by_id


def compare(en_cell, zh_cell) -> str:
    """What differs between a copied English cell and its Chinese copy ('' if nothing)."""
    fields = ["cell_type", "source"]
    if en_cell.cell_type == "code":
        fields += ["outputs", "execution_count"]
    diff = [f for f in fields if en_cell.get(f) != zh_cell.get(f)]
    if _without_caption(en_cell.get("metadata", {})) != _without_caption(zh_cell.get("metadata", {})):
        diff.append("metadata")
    return ", ".join(diff)


def check_chapter(chapter: Path, root: Path) -> list[str]:
    """Every way in which `zh.ipynb` is not in step with `en.ipynb`, as messages."""
    en_path, zh_path = chapter / "en.ipynb", chapter / "zh.ipynb"
    zh_name = rel(zh_path, root)
    if not zh_path.exists():
        return [f"{zh_name}: missing (start it with `python tools/sync.py --add-missing "
                f"{rel(chapter, root)}`)"]
    en, zh = nbtools.read_nb(en_path), nbtools.read_nb(zh_path)
    en_cells, zh_cells = index_cells(en, en_path, root), index_cells(zh, zh_path, root)
    problems = []
    for cid, en_cell in en_cells.items():
        zh_cell = zh_cells.get(cid)
        if zh_cell is None:
            kind = "code" if copied(en_cell) else "Chinese markdown"
            problems.append(f"{zh_name}: cell {cid}: missing {kind} cell for the English one")
        elif copied(en_cell):
            diff = compare(en_cell, zh_cell)
            if diff:
                problems.append(f"{zh_name}: cell {cid}: {diff} differ from en.ipynb")
            elif figure_caption(en_cell) is not None and not CJK_RE.search(
                    figure_caption(zh_cell) or ""):
                problems.append(f"{zh_name}: cell {cid}: figure caption not in Chinese")
        elif zh_cell.cell_type != "markdown":
            problems.append(f"{zh_name}: cell {cid}: is {zh_cell.cell_type}, en has markdown")
        elif TODO in zh_cell.source:
            problems.append(f"{zh_name}: cell {cid}: still marked {TODO}")
        elif zh_cell.source == en_cell.source and untranslated(zh_cell.source):
            problems.append(f"{zh_name}: cell {cid}: untranslated (identical to the English cell)")
        elif cjk_breaks(zh_cell.source):
            problems.append(f"{zh_name}: cell {cid}: {cjk_breaks(zh_cell.source)} line break(s) "
                            "between Chinese characters (indented or not) render as spaces "
                            "(`--join-cjk` joins them)")
    for cid, zh_cell in zh_cells.items():
        if cid not in en_cells:
            problems.append(f"{zh_name}: cell {cid}: stale ({zh_cell.cell_type} cell not in en.ipynb)")
    common = [c for c in en_cells if c in zh_cells]
    if common != [c for c in zh_cells if c in en_cells]:
        problems.append(f"{zh_name}: cells are not in the order of en.ipynb")
    return problems


def sync_chapter(chapter: Path, root: Path, add_missing: bool = False) -> bool:
    """Rebuild `zh.ipynb` from English code cells and Chinese markdown; return whether it wrote."""
    en_path, zh_path = chapter / "en.ipynb", chapter / "zh.ipynb"
    en = nbtools.read_nb(en_path)
    if zh_path.exists():
        zh = nbtools.read_nb(zh_path)
    elif add_missing:
        zh = copy.deepcopy(en)
        zh.cells = []
    else:
        raise ToolError(f"{rel(zh_path, root)}: missing; create it with "
                        f"`python tools/sync.py --add-missing {rel(chapter, root)}` and translate it")
    en_cells, zh_cells = index_cells(en, en_path, root), index_cells(zh, zh_path, root)
    stale = [c for c, cell in zh_cells.items() if c not in en_cells and not copied(cell)]
    if stale:
        raise ToolError(f"{rel(zh_path, root)}: Chinese markdown cells not in en.ipynb (stale): "
                        f"{', '.join(stale)}; delete them or give them the id of the English cell")
    cells, missing = [], []
    for cid, en_cell in en_cells.items():
        zh_cell = zh_cells.get(cid)
        if copied(en_cell):
            cells.append(copy_code_cell(en_cell, zh_cell))
        elif zh_cell is not None and zh_cell.cell_type == "markdown":
            cells.append(zh_cell)
        elif add_missing:
            stub = copy.deepcopy(en_cell)
            stub.source = f"{TODO}\n{en_cell.source}"
            cells.append(stub)
        else:
            missing.append(cid)
    if missing:
        # Copying English prose would hide the gap in the Chinese book; a person must translate.
        raise ToolError(f"{rel(zh_path, root)}: no Chinese cell for English markdown cell(s) "
                        f"{', '.join(missing)}; add them (`--add-missing` adds stubs to translate)")
    zh.cells = cells
    # The kernel, language and run record (tools/execute.py) follow the English notebook; other
    # zh metadata (if any) stays.
    for key in ("kernelspec", "language_info", "agentrl"):
        if key in en.metadata:
            zh.metadata[key] = copy.deepcopy(en.metadata[key])
    zh.nbformat_minor = max(zh.nbformat_minor, en.nbformat_minor)
    return nbtools.write_nb(zh, zh_path)


def join_chapter(chapter: Path, root: Path) -> bool:
    """Join the CJK line breaks of `zh.ipynb`'s markdown cells; return whether it wrote."""
    zh_path = chapter / "zh.ipynb"
    zh = nbtools.read_nb(zh_path)
    for cell in zh.cells:
        if cell.cell_type == "markdown":
            cell.source = join_cjk_breaks(cell.source)
    return nbtools.write_nb(zh, zh_path)


def main(root: Path = ROOT, check: bool = False, chapters: list[str] | None = None,
         add_missing: bool = False, join_cjk: bool = False) -> int:
    """Sync (or with `check`, compare) the chapters named by `chapters` (all if None)."""
    root = Path(root).resolve()
    try:
        folders = nbtools.select_chapters(chapters, root) if chapters else nbtools.all_chapters(root)
        if join_cjk:
            for folder in folders:
                if join_chapter(folder, root):
                    print(f"joined CJK line breaks in {rel(folder / 'zh.ipynb', root)}")
        if check:
            problems = [p for folder in folders for p in check_chapter(folder, root)]
            for p in problems:
                print(p, file=sys.stderr)
            if problems:
                print("code cells are synced by `python tools/sync.py`; markdown is translated "
                      "by hand", file=sys.stderr)
            return 1 if problems else 0
        for folder in folders:
            if sync_chapter(folder, root, add_missing):
                print(f"wrote {rel(folder / 'zh.ipynb', root)}")
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter folders or globs (default: all)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on differences")
    parser.add_argument("--add-missing", action="store_true",
                        help="create a missing zh.ipynb / add stubs marked " + TODO)
    parser.add_argument("--join-cjk", action="store_true",
                        help="join line breaks between Chinese characters in zh markdown first")
    parser.add_argument("--root", type=Path, default=ROOT, help="project root (default: this repo)")
    args = parser.parse_args()
    if args.check and args.add_missing:
        parser.error("--check and --add-missing exclude each other")
    sys.exit(main(args.root, args.check, args.chapters, args.add_missing, args.join_cjk))
