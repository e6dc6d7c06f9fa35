"""Execute the English notebooks in place, then sync the Chinese ones and re-extract the package.

    python tools/execute.py                  # every chapter, in book order
    python tools/execute.py chapters/14_*    # only some (folders, notebooks or globs)
    python tools/execute.py --timing warm --no-write   # time each chapter, keep the notebooks
    python tools/execute.py --timing cold --no-write   # each from an empty artefact cache
    python tools/execute.py --timing bundle --bundle DIR_OR_URL --no-write  # empty cache + bundle
    python tools/execute.py --show-timings   # print the timing record, refresh README's table

Each notebook runs in a fresh `python3` kernel whose working directory is the chapter folder,
with a one-hour limit per cell (CELL_TIMEOUT). The first failing cell stops everything (exit 1),
unless `--keep-going`: then every cell of every chapter runs and the failures are listed at the end.

`--timing` records each chapter's wall time in `agentrl/timings.json` (committed; package data
that chapter 1's `chapter_cost` reads): *warm* runs with the
usual artefact cache, *cold* with an empty one made for that chapter alone (what a first run pays:
the RL base, the runs and the teachers it needs are built), *bundle* with an empty one into which
the book's artefact bundle (`make artifacts`; a folder or a URL such as file:///...) is loaded first,
as a Colab setup cell does: the load is timed with the chapter, and a bundle that lacks something
the chapter needs shows as artefacts built. Each entry keeps the date, the machine, the load
average before the run (a timing is only worth recording on an idle machine) and the artefacts
the run built.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbtools
from nbtools import ROOT, ToolError, rel

# A limit that catches a hung cell, not a slow one: from an empty artefact cache one cell may
# train a dozen runs (chapter 16's mismatch study takes about 20 minutes on 2 cores).
CELL_TIMEOUT = 3600
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"name": "python", "pygments_lexer": "ipython3"}
# Notebook-level metadata worth keeping; the rest (versions, widget state, editor settings)
# changes from machine to machine and would only make diffs noisy.
KEEP_METADATA = ("colab", "accelerator", "agentrl")
CELL_NOISE = ("execution", "ExecuteTime", "collapsed", "scrolled")
KERNEL_ARGS = [
    # PNG (never SVG: large, not byte-stable) at twice the pixel density, shown at its
    # size: crisp on any screen
    "--InlineBackend.figure_formats=retina",
    "--HistoryManager.enabled=False",      # no sqlite history file shared between runs
    # Without ipywidgets tqdm.auto falls back to a text bar (what the book shows) but warns,
    # with this machine's paths in the message; the warning is noise in committed outputs.
    "--IPKernelApp.exec_lines=import warnings; "
    "warnings.filterwarnings('ignore', message='IProgress not found')",
]


def run_record(root: Path) -> dict:
    """What produced a notebook's outputs: package version, the commit the run started from
    ("+changes" when the working tree differs from it), the hash of the package's code
    (agentrl.source_hash of every module) and the date. Stored as metadata["agentrl"]."""
    import subprocess

    import extract

    def git(*args):
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""
    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    code = subprocess.run(
        [sys.executable, "-c", "import agentrl as arl; "
         "print(arl.source_hash(arl._MODULES))"], cwd=root, capture_output=True, text=True)
    return dict(version=extract.project_version(root), commit=commit,
                code=code.stdout.strip() or "unknown",
                date=datetime.date.today().isoformat())


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


def execute_notebook(path: Path, root: Path, write: bool = True,
                     record: dict | None = None, keep_going: bool = False) -> None:
    """Run one notebook top to bottom (in place, unless `write` is False); raise ToolError
    naming the failing cell. `record` (run_record) is stored in its metadata. With
    `keep_going` the cells after a failing one run too (so their runs reach the cache), the
    notebook is written with the error shown, and the ToolError names every failing cell."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbtools.read_nb(path)
    current = {"index": None}
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3", record_timing=False,
        allow_errors=keep_going,
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
    if record:
        nb.metadata["agentrl"] = dict(record)
    if write:
        nbtools.write_nb(nb, path)
    failed = [f"cell {i} (id {nbtools.cell_id(c)})" for i, c in enumerate(nb.cells)
              if c.cell_type == "code" and any(o.output_type == "error" for o in c.outputs)]
    if failed:
        raise ToolError(f"{rel(path, root)}: failed in " + ", ".join(failed))


TIMINGS = "agentrl/timings.json"  # package data: chapter 1's chapter_cost reads it
README_START, README_END = "<!-- timings: start -->", "<!-- timings: end -->"


def artefact_cache() -> Path:
    """The cache the package uses (agentrl.cache_dir's rule, without importing torch)."""
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def cache_listing(cache: Path) -> set[str]:
    """Names of the files in the artefact cache (empty if there is none)."""
    return {p.name for p in cache.iterdir()} if cache.is_dir() else set()


def cpu_name() -> str:
    """The processor's model name (Linux), else what platform knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        match = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


MODES = ("cold", "warm", "bundle")


def record_timing(path: Path, chapter: str, mode: str, seconds: float, built: set[str],
                  load: float, **extra) -> dict:
    """Store one chapter's `mode` (one of MODES) timing in the JSON record at `path`;
    `extra` fields (e.g. a bundle's load time) are stored with it."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    data = json.loads(path.read_text()) if path.exists() else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    data.setdefault(chapter, {})[mode] = dict(
        seconds=round(seconds, 1), date=datetime.date.today().isoformat(),
        cpu=cpu_name(), cores=os.cpu_count(), load_before=round(load, 2),
        artefacts_built=len(built), artefact_kinds=sorted({n.split("-")[0] for n in built}),
        **extra)
    path.write_text(json.dumps(dict(sorted(data.items())), indent=1, ensure_ascii=False) + "\n")
    return data


def timing_table(data: dict) -> str:
    """The timing record as a markdown table (README), chapters in file order."""
    rows = ["| chapter | cold (s) | warm (s) | bundle (s) | artefacts a cold run builds |",
            "|---|---:|---:|---:|---|"]
    for chapter, entry in data.items():
        cold, warm, bundle = (entry.get(mode, {}) for mode in MODES)
        kinds = ", ".join(cold.get("artefact_kinds", [])) or "none"
        rows.append(f"| {chapter} | {cold.get('seconds', '–')} | {warm.get('seconds', '–')} "
                    f"| {bundle.get('seconds', '–')} | {kinds if cold else '–'} |")
    return "\n".join(rows)


def refresh_readme(root: Path) -> bool:
    """Rewrite README's timing table from the record; return whether it changed."""
    path, record = root / "README.md", root / TIMINGS
    text = path.read_text()
    if README_START not in text or not record.exists():
        return False
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    table = timing_table(json.loads(record.read_text()))
    new = f"{head}{README_START}\n{table}\n{README_END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


def load_bundle(bundle: str) -> int:
    """Load an artefact bundle into the current AGENTRL_CACHE with arl.load_artifacts, in a
    fresh interpreter of this Python (as a reader's kernel would) -> the files it added."""
    code = "import sys, agentrl; print(agentrl.load_artifacts(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, bundle], capture_output=True, text=True)
    if out.returncode:
        raise ToolError(f"loading the bundle {bundle} failed:\n{out.stderr.strip()}")
    return int(out.stdout.split()[-1])


def run_timed(path: Path, root: Path, mode: str | None, write: bool,
              record: dict | None = None, bundle: str | None = None,
              keep_going: bool = False) -> tuple[float, set[str], dict]:
    """Execute one notebook; with `mode` 'cold' against an empty cache of its own, with
    'bundle' against an empty cache into which `bundle` is loaded first (timed with it).
    Returns (seconds, names of the artefacts the run added to the cache, extra fields for
    the record: the bundle's load time and files)."""
    if mode == "bundle" and not bundle:
        raise ToolError("--timing bundle needs --bundle (a folder or a URL)")
    saved = os.environ.get("AGENTRL_CACHE")
    tmp = tempfile.mkdtemp(prefix=f"agentrl-{mode}-") if mode in ("cold", "bundle") else None
    if tmp:
        os.environ["AGENTRL_CACHE"] = tmp
    cache = artefact_cache()
    start = time.perf_counter()
    try:
        extra = {}
        if mode == "bundle":
            files = load_bundle(bundle)
            extra = dict(bundle_load_seconds=round(time.perf_counter() - start, 1),
                         bundle_files=files)
        before = cache_listing(cache)
        execute_notebook(path, root, write=write, record=record, keep_going=keep_going)
        return time.perf_counter() - start, cache_listing(cache) - before, extra
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
            if saved is None:
                os.environ.pop("AGENTRL_CACHE", None)
            else:
                os.environ["AGENTRL_CACHE"] = saved


def main(root: Path = ROOT, chapters: list[str] | None = None, timing: str | None = None,
         write: bool = True, bundle: str | None = None, keep_going: bool = False) -> int:
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
    times, failures = [], []
    record = run_record(root) if write else None      # before any notebook is rewritten
    bar = tqdm(folders, desc="notebooks", unit="nb")
    for folder in bar:
        path = folder / "en.ipynb"
        bar.set_postfix_str(folder.name)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        try:
            seconds, built, extra = run_timed(path, root, timing, write, record, bundle,
                                              keep_going)
        except ToolError as e:
            if not keep_going:
                bar.close()
                print(f"\nerror: {e}", file=sys.stderr)
                return 1
            failures.append(str(e))
            continue
        times.append((folder.name, seconds))
        if timing:
            record_timing(root / TIMINGS, folder.name, timing, seconds, built, load, **extra)
    bar.close()
    width = max([len(name) for name, _ in times] + [len("total")])
    print(f"\n{'chapter':<{width}}  seconds")
    for name, seconds in times:
        print(f"{name:<{width}}  {seconds:7.1f}")
    print(f"{'total':<{width}}  {sum(s for _, s in times):7.1f}")
    if timing:
        refresh_readme(root)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    if failures:
        return 1
    if not write:
        return 0
    code = sync.main(root, chapters=[str(f) for f in folders]) if folders else 0
    return code or extract.main(root)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter folders or globs (default: all)")
    parser.add_argument("--timing", choices=MODES,
                        help=f"record each chapter's wall time in {TIMINGS} (cold: empty cache; "
                        "bundle: empty cache, --bundle loaded first)")
    parser.add_argument("--bundle", help="the artefact bundle for --timing bundle: a folder or "
                        "a URL (make artifacts writes _build/artifacts/bundle)")
    parser.add_argument("--no-write", action="store_true",
                        help="leave the notebooks as they are (for timing runs)")
    parser.add_argument("--show-timings", action="store_true",
                        help=f"print {TIMINGS} as a table and refresh README's copy of it")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every cell and chapter past a failure (the runs still reach "
                        "the cache), write the notebooks with their errors, exit 1 at the end")
    parser.add_argument("--root", type=Path, default=ROOT, help="project root (default: this repo)")
    args = parser.parse_args()
    if args.show_timings:
        record = args.root / TIMINGS
        print(timing_table(json.loads(record.read_text())) if record.exists() else "no record")
        refresh_readme(args.root.resolve())
        sys.exit(0)
    sys.exit(main(args.root, args.chapters, args.timing, not args.no_write, args.bundle,
                  args.keep_going))
