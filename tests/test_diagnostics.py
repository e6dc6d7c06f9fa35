"""Tests for agentrl/diagnostics.py (chapter 13)."""
import copy
import dataclasses
import random

import matplotlib
import pytest
import torch

import agentrl as arl
from agentrl import rl_loop

matplotlib.use('Agg')


@pytest.fixture(scope='module')
def setup():
    """A tiny model and a batch of hand-made episodes: a prompt (mask 0), policy
    tokens, an observation (mask 0) and more policy tokens; sample_logp from the
    model itself, as a synced sampler would give."""
    torch.manual_seed(0)
    model = arl.TinyAgent(20, d_model=16, n_layers=1, n_heads=2, max_len=64).eval()
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(10):
        n = int(torch.randint(8, 30, (1,), generator=gen))
        ids = torch.randint(1, 20, (n,), generator=gen)
        mask = torch.zeros(n - 1)
        mask[2:n // 2] = 1                       # first turn
        mask[n // 2 + 3:] = 1                    # after a 3-token observation
        with torch.no_grad():
            logp = arl.sequence_log_probs(model, ids[None])[0] * mask
        trajs.append(arl.Trajectory(ids, mask, logp, float(i % 3 == 0),
                                    dict(task=f't{i // 5}', group=i // 5)))
    batch = arl.collate(trajs, 0)
    cfg = arl.RLConfig(micro_batch_size=4, epochs=2, group_size=5, max_tokens=64)
    adv = arl.compute_advantages(batch, cfg)
    return model, trajs, batch, adv, cfg


def _update(setup, fn=None, ref=False, optimizer=torch.optim.Adam, **kw):
    model, _, batch, adv, cfg = setup
    m = copy.deepcopy(model)
    opt = optimizer(m.parameters(), lr=1e-2)
    fn = fn or arl.traced_update
    stats = fn(m, opt, batch, adv, cfg, model if ref else None,
               torch.Generator().manual_seed(3), **kw)
    return m, stats


def test_defaults_train_exactly_as_chapter_7(setup):
    a, _ = _update(setup, rl_loop.rl_update)
    b, stats = _update(setup)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert stats['loss'] == pytest.approx(stats['loss_expected'], abs=1e-6)
    assert stats['mismatch'] < 1e-5 and stats['first_ratio_dev'] == 0.0


def test_shared_stats_agree_with_chapter_9(setup):
    model, _, batch, adv, cfg = setup
    kl_cfg = arl.KLConfig(**dataclasses.asdict(cfg))    # chapter 9's parts, no penalty
    _, s9 = _update((model, None, batch, adv, kl_cfg), arl.rl_update, ref=True)
    _, st = _update(setup, ref=True)
    for key in ('loss', 'grad_norm', 'clip_frac', 'entropy', 'kl_ref', 'ratio_min',
                'ratio_max'):
        assert st[key] == pytest.approx(s9[key], rel=1e-5, abs=1e-7), key
    assert st['kl_ref'] == pytest.approx(0.0, abs=1e-6)   # ref is the start policy
    assert st['approx_kl'] > 0 and st['ratio_max'] > 1 > st['ratio_min']


def packed(mask):
    """traced_update's parts for packed rows (chapter 14) under `mask`."""
    return dict(rows_fn=arl.packed_update_rows, forward=arl.packed_forward(mask))


def test_block_packing_matches_padded_and_causal_packing_leaks(setup):
    _, padded = _update(setup)
    _, block = _update(setup, **packed('block'))
    _, leaky = _update(setup, **packed('causal'))
    m, also_leaky = _update(setup, arl.leaky_packing_update)
    assert also_leaky == leaky
    assert block['loss'] == pytest.approx(padded['loss'], abs=1e-5)
    assert block['entropy'] == pytest.approx(padded['entropy'], rel=1e-4)
    assert block['mismatch'] < 1e-5
    assert leaky['mismatch'] > 100 * max(block['mismatch'], 1e-7)
    assert leaky['update_tokens'] == block['update_tokens'] == padded['update_tokens']


def test_micro_normalisation_breaks_the_loss_identity(setup):
    _, good = _update(setup)
    _, bad = _update(setup, normalize='micro')
    assert abs(good['loss'] - good['loss_expected']) < 1e-6
    assert abs(bad['loss'] - bad['loss_expected']) > 1e-3
    assert bad['loss_expected'] == good['loss_expected']


def test_old_policy_sets_the_first_ratio(setup):
    model = setup[0]
    _, same = _update(setup, old_policy=model)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.head.weight.mul_(1.5)
    _, stale = _update(setup, old_policy=other)
    assert same['first_ratio_dev'] < 1e-5 and same['mismatch'] < 1e-5
    assert stale['first_ratio_dev'] > 0.01 and stale['mismatch'] > 0.01


def test_traced_update_rejects_bad_options_and_empty_batches(setup):
    with pytest.raises(ValueError, match="mask must be 'block' or 'causal'"):
        arl.packed_forward('packed')
    with pytest.raises(ValueError, match='normalize'):
        _update(setup, normalize='local')
    model, _, _, _, cfg = setup
    empty = arl.collate([], 0)
    opt = torch.optim.Adam(model.parameters())
    stats = arl.traced_update(model, opt, empty, torch.zeros(0), cfg)
    assert stats['update_tokens'] == 0


def test_observation_loss_bug_marks_observations_not_the_prompt(setup):
    trajs = setup[1]
    before = [t.action_mask.clone() for t in trajs]
    out = arl.observation_loss_bug(trajs, 0)
    for t, m, o in zip(trajs, before, out):
        assert torch.equal(t.action_mask, m)              # input left alone
        first = int(m.nonzero()[0])
        assert o.action_mask[:first].sum() == 0           # prompt still 0
        assert o.action_mask[first:].eq(1).all()          # observations now 1
        assert o.action_mask.sum() > m.sum()
        assert o.info == t.info and o.reward == t.reward


def test_stale_update_refreshes_every_lag_calls(setup):
    model, _, batch, adv, cfg = setup
    update = arl.stale_old_policy_update(lag=2)
    m = copy.deepcopy(model)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    devs = [update(m, opt, batch, adv, cfg, None, torch.Generator().manual_seed(k))
            ['first_ratio_dev'] for k in range(4)]
    assert devs[0] == 0.0 and devs[2] == 0.0              # refreshed: current policy
    assert devs[1] > 1e-3 and devs[3] > 1e-3              # one update behind
    with pytest.raises(ValueError, match='lag'):
        arl.stale_old_policy_update(0)


def test_inject_bug_hooks():
    cfg = arl.RLConfig(lr=1e-3)
    clean = arl.inject_bug(None, cfg)
    assert clean['cfg'] is cfg and clean['transform'] is None
    assert clean['update_fn'] is arl.traced_update
    for name in arl.BUGS:
        hooks = arl.inject_bug(name, cfg)
        assert set(hooks) == {'cfg', 'transform', 'update_fn'}
        assert callable(hooks['update_fn'])
    assert arl.inject_bug('lr_x30', cfg)['cfg'].lr == pytest.approx(3e-2)
    assert arl.inject_bug('observations_in_loss', cfg)['transform'] is not None
    with pytest.raises(ValueError, match='name'):
        arl.inject_bug('typo', cfg)


def _evaluation(rates):
    """An evaluate-like result of 40 tasks in two families from per-task rates."""
    names = [f't{i}' for i in range(len(rates))]
    mean = sum(rates) / len(rates)
    return dict(pass_rate=mean, interval=[mean - 0.05, mean + 0.05],
                per_task=dict(zip(names, rates)),
                family_of={n: 'ab'[i % 2] for i, n in enumerate(names)})


def _history(seed, steps=30, spike=None, gain=0.1):
    """A synthetic clean history: every logged statistic noisy around a healthy
    level, evaluations at the first step, step 10 and the end; spike=(name, step,
    value) overrides one statistic from `step` on; gain: the final evaluation's
    change in every task's pass rate since the first (plus noise; step 10 gains
    0.05)."""
    rng = random.Random(seed)
    h = []
    for s in range(steps):
        r = dict(step=s, lr=1e-3, reward=0.5 + 0.01 * s, length=50.0,
                 policy_tokens=28.0, sampled=128, kept=rng.choice([64, 72, 80, 88]),
                 update_tokens=2500, loss_expected=0.05, grad_norm=rng.uniform(.3, .6),
                 clip_frac=rng.uniform(0, .04), ratio_min=rng.uniform(.1, .9),
                 ratio_max=rng.uniform(1.1, 3), approx_kl=rng.uniform(.001, .01),
                 entropy=rng.uniform(.15, .2), kl_ref=0.002 * s,
                 mismatch=rng.uniform(0, 1e-7), mismatch_max=1e-6,
                 first_ratio_dev=0.0)
        r['loss'] = r['loss_expected'] + rng.uniform(-1e-9, 1e-9)
        for o in arl.OUTCOMES:
            r[f'share_{o}'] = 0.25
        if spike and s >= spike[1]:
            key, value = spike[0], spike[2]
            if key == 'loss':
                r['loss'] = r['loss_expected'] + value
            else:
                r[key] = value
        h.append(r)
    base = [0.3 + 0.4 * i / 39 for i in range(40)]
    noisy = lambda g: [min(1.0, max(0.0, p + g + rng.uniform(-0.1, 0.1)))
                       for p in base]
    h[0]['heldout'] = _evaluation(base)
    h[10]['heldout'] = _evaluation(noisy(0.05))
    h.append(dict(step=steps, heldout=_evaluation(noisy(gain))))
    return h


def test_check_values_reads_every_check():
    values = arl.check_values(_history(0))
    assert set(values) == set(arl.CHECKS)
    assert all(len(v) == 30 for n, v in values.items() if n != 'heldout_drop')
    h = _history(0)
    changes = arl.heldout_changes(h)
    assert [step for step, _ in changes] == [10, 30]
    first, last = h[0]['heldout'], h[-1]['heldout']
    assert changes[1][1] == arl.compare_evaluations(first, last)    # paired by task
    assert values['heldout_drop'] == [(s, -c['interval'][1]) for s, c in changes]
    assert values['heldout_drop'][1][1] < -0.05        # a gain of 0.1: no drop
    assert values['loss_identity'][0][1] < 1e-8
    with pytest.raises(TypeError, match='history'):
        arl.check_values({'step': 0})


def test_calibrate_is_max_plus_k_std():
    h = [dict(step=s, update_tokens=1, grad_norm=float(v), entropy=float(v),
              loss=0.0, loss_expected=0.0) for s, v in enumerate([1, 2, 3, 4])]
    thr = arl.calibrate_checks([h], k=2.0)
    std = (sum((v - 2.5) ** 2 for v in [1, 2, 3, 4]) / 3) ** 0.5
    assert thr['grad_norm'] == pytest.approx(4 + 2 * std)
    assert thr['loss_identity'] == 0.0                    # exact in every step
    assert 'heldout_drop' not in thr                      # h has no evaluations
    clean = [_history(1), _history(2)]
    lows = [c['interval'][0] for h in clean for _, c in arl.heldout_changes(h)]
    assert arl.calibrate_checks(clean)['heldout_drop'] == -min(lows)
    with pytest.raises(ValueError, match='histories'):
        arl.calibrate_checks([])
    with pytest.raises(ValueError, match='k'):
        arl.calibrate_checks([h], k=-1)


def test_drift_from_the_base_fires_no_check():
    """kl_ref is not a check, since it drifts in healthy runs: however far a run
    drifts from the base, every check stays silent."""
    thresholds = arl.calibrate_checks([_history(1), _history(2)])
    report = arl.run_checks(_history(3, spike=('kl_ref', 12, 1e3)), thresholds)
    assert set(report) == set(arl.CHECKS)
    assert not any(r['fired'] for r in report.values())


@pytest.mark.parametrize('name, key, value', [
    ('sampler_mismatch', 'mismatch', 0.5), ('loss_identity', 'loss', 0.01),
    ('first_ratio', 'first_ratio_dev', 0.3), ('update_kl', 'approx_kl', 0.5),
    ('clip_frac', 'clip_frac', 0.3), ('grad_norm', 'grad_norm', 5.0)])
def test_each_check_fires_on_its_signature_and_only_from_its_step(name, key, value):
    thresholds = arl.calibrate_checks([_history(1), _history(2)])
    assert not any(r['fired'] for r in arl.run_checks(_history(3), thresholds)
                   .values())                             # a fresh clean run: silent
    report = arl.run_checks(_history(3, spike=(key, 12, value)), thresholds)
    assert report[name]['fired'] and report[name]['first_step'] == 12
    assert report[name]['threshold'] == thresholds[name]
    others = [n for n, r in report.items() if r['fired'] and n != name]
    assert others == [], others


def test_heldout_drop_fires_below_the_clean_band():
    thresholds = arl.calibrate_checks([_history(1), _history(2)])
    assert not arl.run_checks(_history(3), thresholds)['heldout_drop']['fired']
    # the clean runs gained at least 0.05 by step 10 (beyond their noise), so a run
    # that ends where it started lags behind every one of them: it fires too
    flat = arl.run_checks(_history(3, gain=0.0), thresholds)['heldout_drop']
    assert flat['fired'] and flat['first_step'] == 30
    report = arl.run_checks(_history(3, gain=-0.2), thresholds)
    drop = report['heldout_drop']
    assert drop['fired'] and drop['first_step'] == 30
    assert drop['value'] > thresholds['heldout_drop']


def test_run_checks_rejects_bad_thresholds():
    with pytest.raises(TypeError, match='thresholds'):
        arl.run_checks(_history(0), [1.0])


def test_dashboard_draws_every_panel():
    h, ref = _history(0, spike=('mismatch', 5, 0.3)), _history(1)
    thr = arl.calibrate_checks([ref])
    fig = arl.dashboard(h, reference=ref, thresholds=thr, title='test')
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == list(arl.PANELS)
    ax = fig.axes[list(arl.PANELS).index('sampler mismatch')]
    assert ax.get_yscale() == 'log'
    assert len(ax.lines) == 3                             # reference, run, threshold
    assert max(ax.lines[1].get_ydata()) == pytest.approx(0.3)
    matplotlib.pyplot.close(fig)
    with pytest.raises(TypeError, match='reference'):
        arl.dashboard(h, reference='clean')
    with pytest.raises(ValueError, match='ncols'):
        arl.dashboard(h, ncols=0)


@pytest.mark.parametrize('kw', [dict(), dict(pack='block'), dict(pack='causal'),
                                dict(normalize='micro'), dict(old_policy='perturbed'),
                                dict(ref=True)])
def test_traced_update_is_the_frozen_one_bit_for_bit(setup, kw):
    """traced_update, now chapter 7's rl_update with the part Trace, trains and measures
    exactly as the 110-line original (the micro-normalisation bug: to rounding)."""
    from frozen.traced_v1 import traced_update_v1
    kw = dict(kw)
    ref = kw.pop('ref', False)
    if kw.get('old_policy') == 'perturbed':
        old = copy.deepcopy(setup[0])
        with torch.no_grad():
            for p in old.parameters():
                p.mul_(0.98)
        kw['old_policy'] = old
    new = dict(kw)
    if 'pack' in new:                    # packing is now chapter 14's two parts
        new.update(packed(new.pop('pack')))
    a, sa = _update(setup, traced_update_v1, ref=ref, **kw)
    b, sb = _update(setup, ref=ref, **new)
    if kw.get('normalize') == 'micro':
        # the bug is now a per-token weight N / (n_micro * micro-batches) on chapter 7's
        # N-normalised loss: the same loss, rounded differently
        sgd = lambda fn: _update(setup, fn, ref=ref, optimizer=torch.optim.SGD, **kw)
        (a, _), (b, _) = sgd(traced_update_v1), sgd(arl.traced_update)
        for p, q, p0 in zip(a.parameters(), b.parameters(), setup[0].parameters()):
            torch.testing.assert_close(q - p0, p - p0, rtol=1e-4, atol=1e-7)
        assert sb.keys() >= sa.keys()
        for key in sa:
            assert sb[key] == pytest.approx(sa[key], rel=1e-4, abs=1e-6), key
        return
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert {k: sb[k] for k in sa} == sa       # every old stat, same value
    assert set(sb) - set(sa) <= {'approx_kl', 'ratio_min', 'ratio_max', 'entropy'}
