"""Tests for the chapter 1 helpers (agentrl/introduction.py)."""
import sys

import matplotlib
matplotlib.use('Agg')
import pytest
import torch
import agentrl as arl
from conftest import REPO


def test_pick_device_respects_preference():
    assert arl.pick_device(prefer_gpu=False) == 'cpu'
    assert arl.pick_device() == ('cuda' if torch.cuda.is_available() else 'cpu')


def test_seed_everything_repeats_draws_and_rejects_bad_seeds():
    a = torch.rand(4, generator=arl.seed_everything(3)), torch.rand(4)
    b = torch.rand(4, generator=arl.seed_everything(3)), torch.rand(4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])   # the returned generator and the global one
    assert not torch.equal(a[0], torch.rand(4, generator=arl.seed_everything(4)))
    for bad in (-1, 1.5, '0'):
        with pytest.raises(ValueError, match='seed'):
            arl.seed_everything(bad)


def test_timer_measures_elapsed_time():
    with arl.Timer() as t:
        assert t.seconds is None
        sum(range(10_000))
    assert t.seconds > 0


def test_plot_curves_smooths_with_a_moving_average():
    ax = arl.plot_curves({'a': [0, 2, 4, 6], 'b': ([10, 20, 30], [1, 1, 1])}, smooth=2)
    (xa, ya), (xb, yb) = [(list(l.get_xdata()), list(l.get_ydata())) for l in ax.get_lines()]
    assert ya == [1.0, 3.0, 5.0] and xa == [1, 2, 3]
    assert xb == [20, 30] and yb == [1.0, 1.0]
    with pytest.raises(ValueError, match='smooth'):
        arl.plot_curves({'a': [1]}, smooth=0)


@pytest.mark.parametrize("missing", ["matplotlib", "matplotlib.pyplot"])
def test_plot_curves_without_matplotlib_names_the_extra(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)      # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r'agentrl-from-scratch\[plots\]') as info:
        arl.plot_curves({'a': [1, 2]})
    assert not isinstance(info.value, ModuleNotFoundError)   # ours, not the bare import error
    assert isinstance(info.value.__cause__, ImportError)


def test_set_torch_threads_returns_previous_and_sets():
    start = torch.get_num_threads()
    try:
        assert arl.set_torch_threads(2) == start
        assert torch.get_num_threads() == 2
        assert arl.set_torch_threads() == 2                  # default: TINY_MODEL_THREADS
        assert torch.get_num_threads() == arl.TINY_MODEL_THREADS == 1
    finally:
        torch.set_num_threads(start)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, '2', None])
def test_set_torch_threads_rejects_bad_counts(bad):
    start = torch.get_num_threads()
    with pytest.raises(ValueError, match=r'\bn\b'):
        arl.set_torch_threads(bad)
    assert torch.get_num_threads() == start                  # unchanged


def test_timing_record_ships_with_the_package_and_names_every_chapter():
    record = arl.timing_record()
    chapters = sorted(p.name for p in (REPO / "chapters").iterdir() if p.is_dir())
    assert sorted(record) == chapters
    for times in record.values():
        for kind, entry in times.items():
            assert kind in ("cold", "warm", "bundle") and entry["seconds"] > 0 and entry["cores"] >= 1


def test_chapter_cost_says_cold_and_warm_and_fits_the_page(monkeypatch):
    fake = {"07_rl_loop": {"cold": dict(seconds=428.8, date="2026-12-05", cores=2),
                           "warm": dict(seconds=31.0, date="2026-12-04", cores=2)},
            "02_tasks": {"warm": dict(seconds=4.6, date="2026-12-01", cores=2)}}
    monkeypatch.setattr(arl.introduction, "timing_record", lambda: fake)
    assert arl.chapter_cost("07_rl_loop") == (
        "This chapter on 2 CPU cores: 7.1 min from an empty cache, 31 s warm (2026-12-05)")
    assert "not measured from an empty cache, 5 s warm" in arl.chapter_cost("02_tasks")
    with pytest.raises(ValueError, match="chapter must be one of"):
        arl.chapter_cost("99_missing")


def test_every_chapters_cost_line_fits_the_page():
    for chapter in arl.timing_record():
        assert len(arl.chapter_cost(chapter)) <= 88, chapter


def test_load_release_artifacts_loads_this_version_or_says_why_not(tmp_path, monkeypatch,
                                                                   capsys):
    """Every setup cell's helper: the bundle under <repo>/releases/download/v<version>,
    and with no such release a message and 0 (the chapter then trains cold)."""
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path / 'made'))
    (arl.cache_dir() / 'rl_run-0123.json').write_bytes(b'{"history": []}')
    repo = tmp_path / 'repo'
    arl.export_artifacts(repo / 'releases' / 'download' / f'v{arl.__version__}')
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path / 'reader'))
    assert arl.load_release_artifacts(repo.as_uri()) == 1
    assert (tmp_path / 'reader' / 'rl_run-0123.json').read_bytes() == b'{"history": []}'
    assert arl.load_release_artifacts((tmp_path / 'no-such-repo').as_uri()) == 0
    assert 'no published artefacts' in capsys.readouterr().out
