"""Helpers for the tests: small projects (`_toc.yml`, `_toc_zh.yml` and chapter notebooks) built in
a temporary folder, and rewards that make a random model's groups train."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def code(cell_id, source, text=None, count=None):
    """A code cell with a fixed id and, if `text` is given, one stdout output."""
    outputs = [new_output("stream", name="stdout", text=text)] if text is not None else []
    return new_code_cell(source, id=cell_id, outputs=outputs, execution_count=count)


def md(cell_id, source):
    """A markdown cell with a fixed id."""
    return new_markdown_cell(source, id=cell_id)


def write_nb(path, cells):
    """Save a notebook of `cells` as Jupyter would."""
    nb = new_notebook(cells=cells, metadata={"kernelspec": KERNELSPEC})
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def read_nb(path):
    """Load a notebook (current format)."""
    return nbformat.read(str(path), as_version=4)


class Project:
    """A throw-away book: chapters are added in book order and listed in `_toc.yml`."""

    def __init__(self, root: Path):
        self.root = root
        self.chapters = []
        self.write_toc()

    def chapter(self, name, en_cells, zh_cells=None, in_toc=True):
        """Write `chapters/<name>/en.ipynb` (and zh.ipynb if given); return the folder."""
        folder = self.root / "chapters" / name
        write_nb(folder / "en.ipynb", en_cells)
        if zh_cells is not None:
            write_nb(folder / "zh.ipynb", zh_cells)
        if in_toc and name not in self.chapters:
            self.chapters.append(name)
            self.write_toc()
        return folder

    def write_toc(self):
        """Tables of contents shaped like the book's: `_toc.yml` (English site) and
        `_toc_zh.yml` (Chinese site)."""
        for name, root, lang in [("_toc.yml", "index", "en"), ("_toc_zh.yml", "index_zh", "zh")]:
            # With `parts:` every page is in a part: the chapters, then the references.
            lines = ["format: jb-book", f"root: {root}", "parts:", "  - caption: Chapters",
                     "    chapters:" + ("" if self.chapters else " []")]
            lines += [f"      - file: chapters/{c}/{lang}" for c in self.chapters]
            lines += ["  - caption: References", "    chapters:", f"      - file: references_{lang}"]
            (self.root / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def informative_rewards(monkeypatch):
    """A random model never succeeds, so no group would train: rescore every sampled
    group's episodes 1, 0, 0, 1, 0, 0, ... (arl.sample_groups patched for this test)."""
    import agentrl as arl
    real = arl.sample_groups

    def informative(*args):
        trajs = real(*args)
        for i, t in enumerate(trajs):
            t.reward = float(i % 3 == 0)
        return trajs

    monkeypatch.setattr(arl, "sample_groups", informative)
