"""tools/execute.py: the timing record (timings.json) and README's copy of it."""
import json

import pytest

import execute

README = "# Book\n\nBefore.\n\n{start}\nold table\n{end}\n\nAfter.\n"


def test_record_timing_keeps_both_modes_and_counts_artefacts(tmp_path):
    path = tmp_path / "timings.json"
    execute.record_timing(path, "07_rl_loop", "cold", 251.04, {"rl_base-ab.safetensors",
                          "rl_run-cd.json", "rl_run-cd.safetensors"}, 0.1)
    execute.record_timing(path, "07_rl_loop", "warm", 25.26, set(), 0.3)
    execute.record_timing(path, "01_introduction", "warm", 30.0, set(), 0.0)
    data = json.loads(path.read_text())
    assert list(data) == ["01_introduction", "07_rl_loop"]          # chapters in order
    cold, warm = data["07_rl_loop"]["cold"], data["07_rl_loop"]["warm"]
    assert cold["seconds"] == 251.0 and warm["seconds"] == 25.3
    assert cold["artefacts_built"] == 3 and cold["artefact_kinds"] == ["rl_base", "rl_run"]
    assert warm["artefacts_built"] == 0 and warm["load_before"] == 0.3
    assert cold["cores"] >= 1 and cold["cpu"]
    with pytest.raises(ValueError, match="mode"):
        execute.record_timing(path, "07_rl_loop", "tepid", 1.0, set(), 0.0)


def test_readme_table_is_rewritten_from_the_record(tmp_path):
    (tmp_path / "README.md").write_text(README.format(start=execute.README_START,
                                                      end=execute.README_END))
    execute.record_timing(tmp_path / execute.TIMINGS, "05_sft", "cold", 120.0,
                          {"rl_base-x.safetensors"}, 0.0)
    assert execute.refresh_readme(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "old table" not in text and "| 05_sft | 120.0 | – | – | rl_base |" in text
    assert text.startswith("# Book\n\nBefore.") and text.endswith("\n\nAfter.\n")
    assert not execute.refresh_readme(tmp_path)                     # nothing left to change


def test_bundle_timing_loads_the_bundle_into_an_empty_cache(tmp_path, monkeypatch):
    """--timing bundle: an empty cache of the chapter's own, the bundle loaded (from a
    file:// URL) before the notebook runs, timed with it; what the notebook then builds
    is reported as built, and the usual cache is left alone."""
    import nbformat
    import agentrl as arl

    usual, source, bundle = (tmp_path / name for name in ("usual", "source", "bundle"))
    for folder in (usual, source):
        folder.mkdir()
    (source / "rl_run-abc.json").write_text("{}")
    monkeypatch.setenv("AGENTRL_CACHE", str(source))
    arl.export_artifacts(bundle)
    monkeypatch.setenv("AGENTRL_CACHE", str(usual))
    chapter = tmp_path / "chapters" / "99_demo"
    chapter.mkdir(parents=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nfrom pathlib import Path\ncache = Path(os.environ['AGENTRL_CACHE'])\n"
        "assert sorted(p.name for p in cache.iterdir()) == ['rl_run-abc.json']\n"
        "(cache / 'eval-new.pkl').write_bytes(b'x')")])
    nbformat.write(nb, chapter / "en.ipynb")
    seconds, built, extra = execute.run_timed(chapter / "en.ipynb", tmp_path, "bundle",
                                              write=False, bundle=bundle.as_uri())
    assert built == {"eval-new.pkl"} and extra["bundle_files"] == 1
    assert 0 <= extra["bundle_load_seconds"] <= seconds
    assert list(usual.iterdir()) == []
    with pytest.raises(execute.ToolError, match="needs --bundle"):
        execute.run_timed(chapter / "en.ipynb", tmp_path, "bundle", write=False)
    with pytest.raises(execute.ToolError, match="loading the bundle"):
        execute.run_timed(chapter / "en.ipynb", tmp_path, "bundle", write=False,
                          bundle=(tmp_path / "missing").as_uri())


def test_committed_record_has_every_chapter_within_budget_with_the_bundle():
    """Chapter 1's claim: with the bundle loaded into an empty cache, every chapter runs in
    at most 3 minutes and builds nothing (its cell checks the chapters recorded before it)."""
    root = execute.ROOT
    record = json.loads((root / execute.TIMINGS).read_text())
    chapters = sorted(p.name for p in (root / "chapters").iterdir() if (p / "en.ipynb").exists())
    assert sorted(record) == chapters
    for chapter, times in record.items():
        assert times["warm"]["seconds"] <= 120, chapter
        assert times["bundle"]["seconds"] <= 180 and times["bundle"]["artefacts_built"] == 0, \
            chapter


def test_committed_readme_shows_the_committed_record():
    root = execute.ROOT
    if not (root / execute.TIMINGS).exists():
        pytest.skip("no timing record yet")
    text = (root / "README.md").read_text()
    table = execute.timing_table(json.loads((root / execute.TIMINGS).read_text()))
    assert f"{execute.README_START}\n{table}\n{execute.README_END}" in text


def test_run_record_names_version_commit_and_code():
    record = execute.run_record(execute.ROOT)
    assert set(record) == {"version", "commit", "code", "date"}
    import extract
    assert record["version"] == extract.project_version(execute.ROOT)
    assert len(record["code"]) == 16 and int(record["code"], 16) >= 0
    assert record["commit"] != "unknown"


def test_clean_metadata_keeps_the_run_record():
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata.update(agentrl={"commit": "abc"}, widgets={"x": 1}, colab={"y": 2})
    execute.clean_metadata(nb)
    assert nb.metadata["agentrl"] == {"commit": "abc"} and "widgets" not in nb.metadata


def test_provenance_paragraph_in_both_languages():
    import sphinx_provenance as prov
    record = dict(version="0.1.0", commit="abc123", code="f" * 16, date="2026-12-02")
    en, zh = prov.provenance_html(record, "en"), prov.provenance_html(record, "zh_CN")
    assert "agentrl 0.1.0 at commit abc123 (code ffffffffffffffff) on 2026-12-02" in en
    assert "提交 abc123" in zh and "2026-12-02" in zh
    assert "predate" in prov.provenance_html(None, "en")
    assert "<script" not in prov.provenance_html(dict(record, commit="<script>"), "en")


def test_keep_going_runs_past_a_failing_cell_and_names_it(tmp_path):
    """--keep-going: the cells after a failure still run (their runs reach the cache), the
    notebook is written with the error shown, and the ToolError names the failing cell;
    without it the first failure stops the notebook and nothing is written."""
    import nbformat

    chapter = tmp_path / "chapters" / "99_demo"
    chapter.mkdir(parents=True)
    marker = tmp_path / "ran"
    cells = [nbformat.v4.new_code_cell("assert 1 == 2"),
             nbformat.v4.new_code_cell(f"open({str(marker)!r}, 'w').write('x')")]
    cells[0]["id"], cells[1]["id"] = "fails", "after"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), chapter / "en.ipynb")
    before = (chapter / "en.ipynb").read_text()
    with pytest.raises(execute.ToolError, match=r"cell 0 \(id fails\) failed"):
        execute.execute_notebook(chapter / "en.ipynb", tmp_path)
    assert not marker.exists() and (chapter / "en.ipynb").read_text() == before
    with pytest.raises(execute.ToolError, match=r"failed in cell 0 \(id fails\)$"):
        execute.execute_notebook(chapter / "en.ipynb", tmp_path, keep_going=True)
    assert marker.read_text() == "x"
    written = nbformat.read(chapter / "en.ipynb", as_version=4)
    assert written.cells[0].outputs[0].output_type == "error"
