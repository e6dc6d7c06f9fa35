"""Chapter 12 (evaluation): binomial and bootstrap intervals, comparisons over runs,
seeds for a power target, task overlap and the report card."""
import math
import random

import pytest
import torch

import agentrl as arl


def make_eval(tasks, n, greedy=None):
    """An evaluation-like dict from {name: (family, correct)} with n episodes per task."""
    return dict(per_task={t: c / n for t, (_, c) in tasks.items()},
                correct={t: c for t, (_, c) in tasks.items()},
                family_of={t: f for t, (f, _) in tasks.items()}, n=n,
                greedy_per_task=greedy)


# ---------------------------------------------------------------- wilson_interval
@pytest.mark.parametrize('successes, n, low, high', [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion",
    # Table II, method 3 (Wilson score without continuity correction)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_interval_matches_published_values(successes, n, low, high):
    lo, hi = arl.wilson_interval(successes, n)
    assert lo == pytest.approx(low, abs=6e-5) and hi == pytest.approx(high, abs=6e-5)


def test_wilson_interval_is_symmetric_nested_and_inside_the_unit_interval():
    for n in (1, 2, 7, 50):
        for s in range(n + 1):
            lo, hi = arl.wilson_interval(s, n)
            lo2, hi2 = arl.wilson_interval(n - s, n)
            assert 0 <= lo <= s / n <= hi <= 1
            assert lo == pytest.approx(1 - hi2) and hi == pytest.approx(1 - lo2)
            lo90, hi90 = arl.wilson_interval(s, n, level=0.9)
            assert lo <= lo90 and hi90 <= hi           # a lower level is narrower


def test_wilson_interval_rejects_bad_input():
    with pytest.raises(TypeError, match='successes'):
        arl.wilson_interval(1.0, 4)
    with pytest.raises(TypeError, match='n must'):
        arl.wilson_interval(1, True)
    with pytest.raises(ValueError, match='successes'):
        arl.wilson_interval(5, 4)
    with pytest.raises(ValueError, match='n >= 1'):
        arl.wilson_interval(0, 0)
    with pytest.raises(ValueError, match='level'):
        arl.wilson_interval(1, 4, level=1.0)


# ---------------------------------------------------------------- seeds_needed
def test_seeds_needed_matches_cohens_tables():
    # two-sided 5%, power 80%: 64 per group for d = 0.5, 26 for d = 0.8, 17 for d = 1
    assert arl.seeds_needed(0.5, 1.0) == 64
    assert arl.seeds_needed(0.8, 1.0) == 26
    assert arl.seeds_needed(1.0, 1.0) == 17
    assert arl.seeds_needed(0.05, 0.1) == 64          # only the ratio matters


def test_seeds_needed_is_monotone():
    deltas = [0.01, 0.02, 0.05, 0.1, 0.2]
    needed = [arl.seeds_needed(d, 0.03) for d in deltas]
    assert needed == sorted(needed, reverse=True) and needed[0] > needed[-1]
    sds = [0.01, 0.03, 0.1]
    assert [arl.seeds_needed(0.05, s) for s in sds] == sorted(
        arl.seeds_needed(0.05, s) for s in sds)
    assert arl.seeds_needed(0.05, 0.05, power=0.9) > arl.seeds_needed(0.05, 0.05)
    assert arl.seeds_needed(0.05, 0.05, level=0.99) > arl.seeds_needed(0.05, 0.05)
    assert arl.seeds_needed(1.0, 1e-6) == 2           # never fewer than two


def test_seeds_needed_rejects_bad_input():
    with pytest.raises(ValueError, match='delta'):
        arl.seeds_needed(0, 1)
    with pytest.raises(ValueError, match='sd'):
        arl.seeds_needed(0.1, -1)
    with pytest.raises(ValueError, match='sd'):
        arl.seeds_needed(0.1, float('nan'))
    with pytest.raises(TypeError, match='delta'):
        arl.seeds_needed('0.1', 1)
    with pytest.raises(TypeError, match='sd'):
        arl.seeds_needed(0.1, True)
    with pytest.raises(ValueError, match='power'):
        arl.seeds_needed(0.1, 1, power=1.5)
    with pytest.raises(ValueError, match='level'):
        arl.seeds_needed(0.1, 1, level=0)


# ---------------------------------------------------------------- unpaired_interval
def random_eval(gen, n_tasks, families=('a', 'b'), n=4, shift=0.0, prefix='t'):
    tasks = {}
    for i in range(n_tasks):
        f = families[i % len(families)]
        p = min(1.0, max(0.0, gen.random() + shift))
        tasks[f'{prefix}{i}'] = (f, sum(gen.random() < p for _ in range(n)))
    return make_eval(tasks, n)


def test_unpaired_interval_gives_the_difference_of_means_and_covers_it():
    gen = random.Random(0)
    low, high = random_eval(gen, 30), random_eval(gen, 20, shift=0.3, prefix='u')
    out = arl.unpaired_interval(low, high)
    expected = (sum(high['per_task'].values()) / 20 - sum(low['per_task'].values()) / 30)
    assert out['diff'] == pytest.approx(expected)
    lo, hi = out['interval']
    assert lo < out['diff'] < hi
    assert arl.unpaired_interval(low, high) == out          # deterministic


def test_unpaired_interval_of_constant_families_is_a_point():
    # every task of a family has the same rate: resampling cannot move the means
    low = make_eval({f't{i}': ('a' if i % 2 else 'b', 1 if i % 2 else 3)
                     for i in range(10)}, 4)
    high = make_eval({f'u{i}': ('a' if i % 2 else 'b', 4) for i in range(6)}, 4)
    out = arl.unpaired_interval(low, high)
    assert out['diff'] == pytest.approx(1 - 0.5)
    assert out['interval'] == pytest.approx((0.5, 0.5))


def test_unpaired_interval_is_wider_than_the_paired_one_for_shared_difficulty():
    gen = random.Random(1)
    before = random_eval(gen, 60, n=8)
    # the same tasks, each a little better: the tasks' difficulty is shared
    after = make_eval({t: (f, min(8, c + (i % 3 == 0)))
                       for i, (t, f, c) in enumerate(
                           (t, before['family_of'][t], before['correct'][t])
                           for t in before['per_task'])}, 8)
    (ulo, uhi), (plo, phi) = (arl.unpaired_interval(before, after)['interval'],
                              arl.compare_evaluations(before, after)['interval'])
    assert phi - plo < 0.5 * (uhi - ulo)


def test_unpaired_interval_rejects_bad_input():
    ev = make_eval({'t0': ('a', 1)}, 2)
    with pytest.raises(ValueError, match='before'):
        arl.unpaired_interval({'per_task': {}}, ev)
    with pytest.raises(ValueError, match='after'):
        arl.unpaired_interval(ev, None)


# ---------------------------------------------------------------- compare_runs
def test_compare_runs_mean_gain_and_per_run():
    gen = random.Random(2)
    before = random_eval(gen, 40)
    afters = [make_eval({t: (before['family_of'][t], min(4, c + s))
                         for t, c in before['correct'].items()}, 4) for s in (0, 1, 2)]
    out = arl.compare_runs(before, afters)
    per_run = [sum(a['per_task'][t] - before['per_task'][t] for t in before['per_task'])
               / 40 for a in afters]
    assert out['per_run'] == pytest.approx(per_run)
    assert out['diff'] == pytest.approx(sum(per_run) / 3)
    lo, hi = out['interval']
    assert lo <= out['diff'] <= hi


def test_compare_runs_covers_the_spread_of_runs():
    # every task gains the same within a run, but the runs differ: the interval over
    # tasks alone is a point, the interval over runs spans the runs' gains
    before = make_eval({f't{i}': ('a', 0) for i in range(20)}, 4)
    afters = [make_eval({f't{i}': ('a', c) for i in range(20)}, 4) for c in (1, 2, 3)]
    out = arl.compare_runs(before, afters)
    lo, hi = out['interval']
    assert out['diff'] == pytest.approx(0.5)
    assert lo < 0.25 and 0.75 < hi       # Student's t reaches past the extreme runs
    same = arl.compare_runs(before, [afters[1]] * 3)['interval']
    assert same == pytest.approx((0.5, 0.5))


def test_compare_runs_rejects_bad_input():
    before = make_eval({'t0': ('a', 1), 't1': ('a', 2)}, 2)
    with pytest.raises(ValueError, match='afters'):
        arl.compare_runs(before, [])
    with pytest.raises(ValueError, match=r'afters\[1\]'):
        arl.compare_runs(before, [before, make_eval({'t0': ('a', 1)}, 2)])
    with pytest.raises(ValueError, match='level'):
        arl.compare_runs(before, [before, before], level=2)


# ---------------------------------------------------------------- seed_paired (chapter 7)
def base_plus(ev, k):
    """ev with k more correct episodes on every task (a rate may pass 1: only the
    differences matter here)."""
    return make_eval({t: (ev['family_of'][t], c + k) for t, c in ev['correct'].items()},
                     4)


def test_seed_paired_pairs_by_seed_and_is_compare_runs_against_one_evaluation():
    gen = random.Random(5)
    before = random_eval(gen, 30)
    arm = lambda shift: [make_eval({t: (before['family_of'][t], min(4, c + s + shift))
                                    for t, c in before['correct'].items()}, 4)
                         for s in (0, 1, 2)]
    a, b = arm(0), arm(1)
    out = arl.seed_paired(a, b)
    per_seed = [sum(y['per_task'][t] - x['per_task'][t] for t in before['per_task'])
                / 30 for x, y in zip(a, b)]
    assert out['per_seed'] == pytest.approx(per_seed)
    assert out['diff'] == pytest.approx(sum(per_seed) / 3)
    assert out['interval'][0] <= out['diff'] <= out['interval'][1]
    runs = arl.compare_runs(before, b)
    again = arl.seed_paired([before] * 3, b)
    assert runs == dict(diff=again['diff'], interval=again['interval'],
                        per_run=again['per_seed'])
    # paired by seed: each seed's own level cancels (seed s adds s correct episodes to
    # every task in both arms), so the seeds agree and the interval is a point
    lo, hi = arl.seed_paired(arm(0), arm(0)[1:] + arm(0)[:1])['interval']
    assert lo < hi                                   # unpaired seeds: spread
    lo, hi = arl.seed_paired([base_plus(before, s) for s in (0, 1, 2)],
                             [base_plus(before, s + 1) for s in (0, 1, 2)])['interval']
    assert lo == pytest.approx(hi)


def test_seed_paired_interval_is_t_over_seeds_when_tasks_move_alike():
    base = make_eval({f't{i}': ('a', 0) for i in range(20)}, 4)
    b = [make_eval({f't{i}': ('a', c) for i in range(20)}, 4) for c in (1, 2, 3)]
    out = arl.seed_paired([base] * 3, b)
    # every task gains the same within a seed: no task term, Student's t on 2 d.f.
    half = 4.302652729911275 * (0.25 / 3 ** 0.5)          # t_{0.975, 2} * sd / sqrt(m)
    assert out['df'] == 2
    assert out['interval'] == pytest.approx((0.5 - half, 0.5 + half))
    lo, hi = arl.seed_paired(b, b)['interval']
    assert lo == hi == 0.0


def test_seed_paired_counts_the_tasks_when_they_respond_differently():
    gen = random.Random(0)
    names = [f't{i}' for i in range(40)]
    fam = {t: 'ab'[i % 2] for i, t in enumerate(names)}
    effect = {t: gen.choice((-0.5, 0.5)) for t in names}      # the same in every seed
    ev = lambda shift: dict(per_task={t: effect[t] + shift for t in names},
                            family_of=fam)
    base = dict(per_task={t: 0.0 for t in names}, family_of=fam)
    out = arl.seed_paired([base] * 3, [ev(0.0), ev(0.01), ev(-0.01)])
    t_seeds = arl.t_interval(out['diff'], 0.01 / 3 ** 0.5, 2)
    assert out['interval'][1] - out['interval'][0] > 5 * (t_seeds[1] - t_seeds[0])
    assert out['df'] > 2


def test_seed_paired_covers_at_its_level():
    """Coverage on a small simulated problem: two arms that train equally well, 3
    seeds, 40 tasks in 4 families, 8 episodes each, a seed spread twice the noise."""
    gen = torch.Generator().manual_seed(0)
    reps, m, n_tasks, n = 600, 3, 40, 8
    p = torch.rand(n_tasks, generator=gen, dtype=torch.float64) * 0.8 + 0.1
    probs = (p + 0.03 * torch.randn(reps, 2, m, 1, generator=gen, dtype=torch.float64)
             ).clamp(0, 1)
    rates = torch.binomial(torch.full_like(probs, float(n)), probs, generator=gen) / n
    out = arl.paired_t(rates[:, 1] - rates[:, 0], [i % 4 for i in range(n_tasks)])
    covered = ((out['low'] <= 0) & (0 <= out['high'])).double().mean().item()
    mc_se = (0.95 * 0.05 / reps) ** 0.5
    assert abs(covered - 0.95) < 3.5 * mc_se, covered    # 3.5 Monte Carlo SE


def test_paired_t_agrees_with_seed_paired_and_rejects_bad_input():
    gen = torch.Generator().manual_seed(1)
    d = torch.randn(3, 10, generator=gen, dtype=torch.float64)
    fam = [i % 2 for i in range(10)]
    names = [f't{i}' for i in range(10)]
    zero = dict(per_task={t: 0.0 for t in names}, family_of=dict(zip(names, fam)))
    evs = [dict(per_task=dict(zip(names, row.tolist())), family_of=zero['family_of'])
           for row in d]
    out, batched = arl.seed_paired([zero] * 3, evs), arl.paired_t(d, fam)
    assert out['interval'] == pytest.approx((batched['low'].item(),
                                             batched['high'].item()))
    with pytest.raises(ValueError, match='>= 2 seeds'):
        arl.paired_t(d[:1], fam)
    with pytest.raises(ValueError, match='families'):
        arl.paired_t(d, fam[:3])
    with pytest.raises(ValueError, match='level'):
        arl.t_interval(0.0, 1.0, 3, level=0.0)


def test_seed_paired_rejects_bad_input():
    ev = make_eval({'t0': ('a', 1), 't1': ('a', 2)}, 2)
    with pytest.raises(ValueError, match='non-empty'):
        arl.seed_paired([], [])
    with pytest.raises(ValueError, match='pair them by seed'):
        arl.seed_paired([ev, ev], [ev])
    with pytest.raises(ValueError, match='>= 2 seeds'):
        arl.seed_paired([ev], [ev])
    with pytest.raises(ValueError, match='other tasks'):
        arl.seed_paired([ev, ev], [ev, make_eval({'t0': ('a', 1)}, 2)])
    with pytest.raises(ValueError, match='level'):
        arl.seed_paired([ev, ev], [ev, ev], level=1.0)


# ---------------------------------------------------------------- task_overlap
def test_task_overlap_counts_shared_prompts_and_tasks():
    T = arl.Task
    ref = [T('r0', 'calc', '2+3', '5'), T('r1', 'lookup', 'ab?', '7', (('ab', '7'),))]
    tasks = [T('x0', 'calc', '2+3', '5'),                       # the same task
             T('x1', 'lookup', 'ab?', '9', (('ab', '9'),)),     # same prompt, new store
             T('x2', 'calc', '4+4', '8')]                       # new
    assert arl.task_overlap(ref, tasks) == dict(prompts=2, pairs=1, n=3)
    assert arl.task_overlap(ref, []) == dict(prompts=0, pairs=0, n=0)
    held, train = arl.make_tasks('heldout'), arl.make_tasks('train')
    assert arl.task_overlap(train, held)['prompts'] == 0
    assert arl.task_overlap(held, held) == dict(prompts=len(held), pairs=len(held),
                                                n=len(held))


def test_task_overlap_rejects_non_tasks():
    with pytest.raises(TypeError, match='reference'):
        arl.task_overlap(['2+3'], [])
    with pytest.raises(TypeError, match='tasks'):
        arl.task_overlap([], 'abc')


# ---------------------------------------------------------------- report_card
def card_rows(card, block):
    """{row label: fields} of one block of a report card."""
    lines = card.split('\n')
    start = next(i for i, line in enumerate(lines) if line.startswith(f'{block}:'))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows[line.split()[0]] = line
    return rows


BASE = make_eval({'a0': ('add', 0), 'a1': ('add', 1), 'b0': ('mul', 2), 'b1': ('mul', 3)},
                 4, greedy={'a0': 0.0, 'a1': 0.0, 'b0': 1.0, 'b1': 1.0})
BETTER = make_eval({'a0': ('add', 4), 'a1': ('add', 4), 'b0': ('mul', 2), 'b1': ('mul', 3)},
                   4, greedy={'a0': 1.0, 'a1': 1.0, 'b0': 1.0, 'b1': 1.0})


def test_report_card_rows_and_values():
    card = arl.report_card({'base': BASE}, ks=(1, 2, 4))
    rows = card_rows(card, 'base')
    assert list(rows) == ['add', 'mul', 'overall']
    assert card.startswith('base: 4 tasks x 4 episodes')
    f = rows['overall'].split()
    assert f[1] == '4' and f[2] == f'{6 / 16:.3f}'
    assert f[5] == '0.500'                                   # greedy
    # pass@k: the mean over tasks of the unbiased estimator
    for k, value in zip((1, 2, 4), f[6:9]):
        expected = sum(arl.pass_at_k(4, c, k) for c in (0, 1, 2, 3)) / 4
        assert value == f'{expected:.3f}'
    assert rows['add'].split()[2] == f'{1 / 8:.3f}'
    assert 'vs' not in card and '*' not in card


def test_report_card_marks_differences_whose_interval_excludes_zero():
    card = arl.report_card({'base': BASE, 'better': BETTER}, baseline='base', ks=(1, 2))
    rows = card_rows(card, 'better')
    assert rows['add'].endswith('*') and '+0.875 [+0.750, +1.000]' in rows['add']
    assert not rows['mul'].endswith('*') and '+0.000 [+0.000, +0.000]' in rows['mul']
    assert rows['overall'].endswith('*')
    assert 'vs base' in card and card.rstrip().endswith('excludes 0')
    # the baseline's own block has no difference column
    assert all('[+' not in row for row in card_rows(card, 'base').values())


def test_report_card_shows_a_dash_without_greedy_episodes():
    card = arl.report_card({'m': dict(BASE, greedy_per_task=None)}, ks=(1,))
    assert card_rows(card, 'm')['overall'].split()[5] == '-'


def test_report_card_recomputes_evaluates_own_intervals_and_pass_at_k():
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), 16, 1, 2, 256).eval()
    tasks = arl.make_tasks('heldout')[:10]
    ev = arl.evaluate(model, tasks, tok, 2, cfg=arl.SamplingConfig(max_tokens=40))
    rows = card_rows(arl.report_card({'m': ev}, ks=(1, 2)), 'm')
    for f, summary in [*ev['by_family'].items(), ('overall', ev)]:
        lo, hi = summary['interval']
        assert f"{summary['pass_rate']:.3f} [{lo:.3f}, {hi:.3f}]" in rows[f]
        assert rows[f].split()[-1] == f"{summary['pass_at_k'][1]:.3f}"


def test_report_card_rejects_bad_input():
    with pytest.raises(TypeError, match='evaluations'):
        arl.report_card([BASE])
    with pytest.raises(ValueError, match='evaluations is empty'):
        arl.report_card({})
    with pytest.raises(TypeError, match=r"evaluations\['x'\]"):
        arl.report_card({'x': 0.5})
    with pytest.raises(ValueError, match=r"evaluations\['x'\] lacks \['correct'\]"):
        arl.report_card({'x': {k: v for k, v in BASE.items() if k != 'correct'}})
    with pytest.raises(ValueError, match='baseline'):
        arl.report_card({'base': BASE}, baseline='nope')
    other = make_eval({'z0': ('add', 1)}, 4)
    with pytest.raises(ValueError, match='other tasks than the baseline'):
        arl.report_card({'base': BASE, 'other': other}, baseline='base')
    with pytest.raises(ValueError, match='ks'):
        arl.report_card({'base': BASE}, ks=(1, 8))            # n = 4 < 8
    for ks in ((), (0,), 2, (1.0,)):
        with pytest.raises(ValueError, match='ks'):
            arl.report_card({'base': BASE}, ks=ks)
    with pytest.raises(ValueError, match='level'):
        arl.report_card({'base': BASE}, ks=(1,), level=95)
