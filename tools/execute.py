"""Execute the English notebooks in place, then sync the Chinese ones and re-extract the package.

    python tools/execute.py                  # every chapter, in book order
    python tools/execute.py chapters/14_*    # only some (folders, notebooks or globs)

Each notebook runs in a fresh `python3` kernel whose working directory is the chapter folder,
with a 600 s limit per cell. The first failing cell stops everything (exit 1).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbtools
from nbtools import ROOT, ToolError, rel

CELL_TIMEOUT = 600
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"name": "python", "pygments_lexer": "ipython3"}
# Notebook-level metadata worth keeping; the rest (versions, widget state, editor settings)
# changes from machine to machine and would only make diffs noisy.
KEEP_METADATA = ("colab", "accelerator")
CELL_NOISE = ("execution", "ExecuteTime", "collapsed", "scrolled")
KERNEL_ARGS = [
    "--InlineBackend.figure_formats=png",  # the book shows PNG figures, never SVG
    "--HistoryManager.enabled=False",      # no sqlite history file shared between runs
    # Without ipywidgets tqdm.auto falls back to a text bar (what the book shows) but warns,
    # with this machine's paths in the message; the warning is noise in committed outputs.
    "--IPKernelApp.exec_lines=import warnings; "
    "warnings.filterwarnings('ignore', message='IProgress not found')",
]


def clean_metadata(nb) -> None:
    """Reduce metadata to what matters so that re-executing changes only outputs."""
    kept = {k: nb.metadata[k] for k in KEEP_METADATA if k in nb.metadata}
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": dict(LANGUAGE_INFO), **kept}
    for cell in nb.cells:
        for key in CELL_NOISE:
            cell.metadata.pop(key, None)


def coalesce_streams(cell) -> None:
    """Merge consecutive stdout/stderr outputs and keep what a terminal shows after each `\\r`.

    A progress bar redraws itself with carriage returns in dozens of stream messages; the
    notebook keeps only its final state.
    """
    outputs = []
    for out in cell.get("outputs", []):
        prev = outputs[-1] if outputs else None
        if (out.output_type == "stream" and prev is not None and prev.output_type == "stream"
                and prev.name == out.name):
            prev.text += out.text
        else:
            outputs.append(out)
    for out in outputs:
        if out.output_type == "stream" and "\r" in out.text:
            out.text = "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1]
                                 for line in out.text.split("\n"))
    cell.outputs = outputs


def execute_notebook(path: Path, root: Path) -> None:
    """Run one notebook top to bottom in place; raise ToolError naming the failing cell."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbtools.read_nb(path)
    current = {"index": None}
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3", record_timing=False,
        extra_arguments=KERNEL_ARGS, resources={"metadata": {"path": str(path.parent)}},
        on_cell_start=lambda cell, cell_index: current.update(index=cell_index))
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as e:
        i = current["index"]
        cid = nbtools.cell_id(nb.cells[i]) if i is not None else "?"
        raise ToolError(f"{rel(path, root)}: cell {i} (id {cid}) failed:\n{e}") from None
    for cell in nb.cells:
        if cell.cell_type == "code":
            coalesce_streams(cell)
    clean_metadata(nb)
    nbtools.write_nb(nb, path)


def main(root: Path = ROOT, chapters: list[str] | None = None) -> int:
    """Execute the chosen chapters, print a time table, then sync and extract; return exit code."""
    from tqdm.auto import tqdm

    import extract
    import sync

    root = Path(root).resolve()
    # The kernel inherits this environment: fixed hashing for determinism, and no MPLBACKEND
    # so that the kernel's default inline backend embeds figures in the notebook.
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ.pop("MPLBACKEND", None)
    try:
        folders = nbtools.select_chapters(chapters, root)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    times = []
    bar = tqdm(folders, desc="notebooks", unit="nb")
    for folder in bar:
        path = folder / "en.ipynb"
        bar.set_postfix_str(folder.name)
        start = time.perf_counter()
        try:
            execute_notebook(path, root)
        except ToolError as e:
            bar.close()
            print(f"\nerror: {e}", file=sys.stderr)
            return 1
        times.append((folder.name, time.perf_counter() - start))
    bar.close()
    width = max([len(name) for name, _ in times] + [len("total")])
    print(f"\n{'chapter':<{width}}  seconds")
    for name, seconds in times:
        print(f"{name:<{width}}  {seconds:7.1f}")
    print(f"{'total':<{width}}  {sum(s for _, s in times):7.1f}")
    code = sync.main(root, chapters=[str(f) for f in folders]) if folders else 0
    return code or extract.main(root)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter folders or globs (default: all)")
    parser.add_argument("--root", type=Path, default=ROOT, help="project root (default: this repo)")
    args = parser.parse_args()
    sys.exit(main(args.root, args.chapters))
