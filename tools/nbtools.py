"""Helpers shared by the book tools (extract, sync, execute).

Notebooks are read and written with nbformat so that files look exactly as Jupyter saves them
(1-space indented JSON, sorted keys, sources split into lines, a final newline); that keeps diffs
small whichever tool or editor touched a notebook last.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]


class ToolError(Exception):
    """A problem the user has to fix; the tools print it and exit non-zero."""


def read_nb(path: Path) -> nbformat.NotebookNode:
    """Read a notebook; it must be nbformat 4.5+ because the tools pair cells by `id`."""
    path = Path(path)
    nb = nbformat.reads(path.read_text(encoding="utf-8"), as_version=nbformat.NO_CONVERT)
    # Converting an older notebook would invent random cell ids, and en/zh would never pair.
    if nb.nbformat != 4 or nb.nbformat_minor < 5:
        raise ToolError(f"{path}: nbformat {nb.nbformat}.{nb.nbformat_minor}; cell ids need 4.5+ "
                        "(save it with a current Jupyter or nbformat)")
    return nb


def nb_text(nb: nbformat.NotebookNode) -> str:
    """The file contents Jupyter would write for `nb`."""
    return nbformat.writes(nb) + "\n"


def write_text_if_changed(path: Path, text: str) -> bool:
    """Write `text` to `path` unless it already holds it; return whether it wrote."""
    path = Path(path)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def write_nb(nb: nbformat.NotebookNode, path: Path) -> bool:
    """Save a notebook as Jupyter would, only if it changed; return whether it wrote."""
    return write_text_if_changed(path, nb_text(nb))


def cell_id(cell) -> str:
    """The nbformat 4.5 id of a cell."""
    return cell.get("id", "?")


# The book is two sites built from the same notebooks: English (`_toc.yml`, which also gives the
# package its module order) and Chinese (`_toc_zh.yml`).
EN_TOC, ZH_TOC = "_toc.yml", "_toc_zh.yml"


def toc_files(root: Path = ROOT, toc_name: str = EN_TOC) -> list[str]:
    """Every `file:` entry of a table of contents (the English `_toc.yml` unless `toc_name`
    says otherwise), in book order (root first)."""
    toc = yaml.safe_load((Path(root) / toc_name).read_text(encoding="utf-8"))
    files = [toc["root"]] if toc.get("root") else []

    def walk(node):
        # Entries nest as parts -> chapters -> sections; a `file` may sit at any level.
        if isinstance(node, dict):
            if "file" in node:
                files.append(str(node["file"]))
            for key in ("parts", "chapters", "sections"):
                for child in node.get(key) or []:
                    walk(child)

    walk(toc)
    return files


def toc_chapters(root: Path = ROOT) -> list[Path]:
    """Chapter folders in book order, from the English `_toc.yml` (its `.../en` entries)."""
    root = Path(root).resolve()
    chapters = []
    for entry in toc_files(root):
        entry = re.sub(r"\.ipynb$", "", entry)
        if entry.endswith("/en") and (root / entry).parent not in chapters:
            chapters.append((root / entry).parent)
    return chapters


def all_chapters(root: Path = ROOT) -> list[Path]:
    """Every chapter folder that has an `en.ipynb`, in folder-name order."""
    return sorted(p.parent for p in (Path(root).resolve() / "chapters").glob("*/en.ipynb"))


def chapter_slug(chapter: Path) -> str:
    """`chapters/14_scaling` -> `scaling` (the module name)."""
    return re.sub(r"^\d+_", "", Path(chapter).name)


def rel(path: Path, root: Path = ROOT) -> str:
    """`path` relative to the project root, for messages."""
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


def select_chapters(patterns: list[str] | None, root: Path = ROOT) -> list[Path]:
    """Chapter folders named by `patterns` (folders, notebooks or globs); all of them if none.

    With no patterns the order is the book's (`_toc.yml`) followed by chapters not yet in it.
    """
    root = Path(root).resolve()
    if not patterns:
        toc = [c for c in toc_chapters(root) if (c / "en.ipynb").exists()]
        return toc + [c for c in all_chapters(root) if c not in toc]
    chosen = []
    for pattern in patterns:
        # Accept a path relative to the cwd or to the root, with or without a glob.
        matches = glob.glob(pattern) or glob.glob(str(root / pattern))
        if not matches:
            raise ToolError(f"no chapter matches {pattern!r}")
        for m in sorted(matches):
            folder = Path(m).resolve()
            folder = folder.parent if folder.suffix == ".ipynb" else folder
            if not (folder / "en.ipynb").exists():
                raise ToolError(f"{m}: not a chapter folder (no en.ipynb)")
            if folder not in chosen:
                chosen.append(folder)
    return chosen
