"""Chapter 5 (sft): demonstrations, the action-token loss, evaluate's accounting and the RL-base cache."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import agentrl as arl
import agentrl.sft as sft

TOK = arl.build_tokenizer(arl.make_tasks('all'))
TINY = dict(d_model=16, n_layers=1, n_heads=2, max_len=128, demos_per_family=4, steps=3, batch_size=4)


def expert_parts(task):
    """(text, written by the agent?) pieces of the expert episode, built independently of the code under test."""
    store = dict(task.store)
    parts = [('<bos>' + task.prompt, 0.0)]
    for call in task.calls:
        parts += [(f'<call>{call}</call>', 1.0), (f'<obs>{arl.run_tool(call, store)}</obs>', 0.0)]
    return parts + [(f'<ans>{task.answer}</ans>', 1.0)]


@pytest.mark.parametrize('family', arl.FAMILIES)
def test_demonstration_mask_covers_exactly_the_agent_tokens(family):
    for task in [t for t in arl.make_tasks('heldout') if t.family == family][:4]:
        traj = arl.demonstration_trajectory(task, TOK)
        parts = expert_parts(task)
        agent = [a for text, a in parts for _ in arl.split_tokens(text)]            # agent[t]: ids[t]
        assert TOK.decode(traj.ids) == arl.demonstration(task) == ''.join(text for text, _ in parts)
        assert traj.action_mask.tolist() == agent[1:]
        assert traj.sample_logp.shape == traj.action_mask.shape == (len(traj.ids) - 1,)
        assert traj.info['family'] == family and traj.reward == 1.0


class FixedLogits(torch.nn.Module):
    """A stand-in model that returns the same logits whatever the ids."""
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, ids):
        return self.logits


def test_action_token_loss_ignores_masked_tokens():
    gen = torch.Generator().manual_seed(0)
    B, T, V = 3, 7, 11
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.rand(B, T - 1, generator=gen) < 0.5).float()
    mask[0, 0] = 1.0
    logits = torch.randn(B, T, V, generator=gen)
    loss = arl.action_token_loss(FixedLogits(logits), dict(ids=ids, action_mask=mask))
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(loss, -(logp * mask).sum() / mask.sum())
    garbage = logits.clone()
    garbage[:, :-1][mask == 0] = 1e4 * torch.randn(int((mask == 0).sum()), V, generator=gen)   # masked predictions
    garbage[:, -1] = 1e4                                                                        # unused last position
    assert torch.allclose(arl.action_token_loss(FixedLogits(garbage), dict(ids=ids, action_mask=mask)), loss)
    with pytest.raises(ValueError):
        arl.action_token_loss(FixedLogits(logits), dict(ids=ids, action_mask=torch.zeros(B, T - 1)))


def episodes(tasks, rewards, length=3):
    """Stand-in Trajectories, task by task as sample_groups returns them: rewards[g] are
    the rewards of tasks[g]'s episodes; the i-th episode of a task has length + i ids."""
    return [arl.Trajectory(ids=torch.zeros(length + i), action_mask=torch.zeros(length + i - 1),
                           sample_logp=torch.zeros(length + i - 1), reward=float(r),
                           info=dict(task=t.name, family=t.family, group=g))
            for g, (t, rs) in enumerate(zip(tasks, rewards)) for i, r in enumerate(rs)]


def test_evaluate_per_family_accounting(monkeypatch):
    heldout = arl.make_tasks('heldout')
    tasks = [heldout[0], heldout[1], heldout[5]]                   # max, calc, max
    assert [t.family for t in tasks] == ['max', 'calc', 'max']
    sampled = [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]]             # n = 4 per task
    greedy = [[1], [0], [0]]
    calls = []

    def stub(model, env_fn, tasks_, tok, cfg, generator):
        calls.append(dict(group_size=cfg.group_size, temperature=cfg.temperature,
                          max_tokens=cfg.max_tokens, env=env_fn(), tasks=list(tasks_)))
        return episodes(tasks_, sampled if cfg.group_size == 4 else greedy)

    monkeypatch.setattr(arl, 'sample_groups', stub)
    cfg = arl.SamplingConfig(max_tokens=77, temperature=0.7)
    result = arl.evaluate(None, tasks, TOK, 4, cfg=cfg)
    # two passes: n sampled episodes per task at cfg's temperature, then one greedy one
    assert [(c['group_size'], c['temperature']) for c in calls] == [(4, 0.7), (1, arl.GREEDY_TEMPERATURE)]
    assert all(c['max_tokens'] == 77 and c['env'].max_tokens == 77 and c['tasks'] == tasks for c in calls)
    assert result['per_family'] == {'calc': 0.0, 'max': pytest.approx((0.75 + 0.5) / 2)}
    assert result['pass_rate'] == pytest.approx(5 / 12)
    assert result['correct'] == {tasks[0].name: 3, tasks[1].name: 0, tasks[2].name: 2}
    assert result['greedy'] == pytest.approx(1 / 3)
    assert result['greedy_per_task'] == {tasks[0].name: 1.0, tasks[1].name: 0.0, tasks[2].name: 0.0}
    assert result['by_family']['max']['greedy'] == 0.5 and result['by_family']['calc']['greedy'] == 0.0
    assert {f: s['n_tasks'] for f, s in result['by_family'].items()} == {'calc': 1, 'max': 2}
    assert result['family_of'] == {t.name: t.family for t in tasks}
    # pass@4 with n = 4: the share of tasks solved at least once
    assert result['pass_at_k'][0] == pytest.approx(result['pass_rate'])
    assert result['pass_at_k'][3] == pytest.approx(2 / 3) and len(result['pass_at_k']) == 4
    assert result['n_episodes'] == 12 and result['n'] == 4            # sampled episodes only
    lengths = [3 + i for rs in sampled for i in range(len(rs))]
    assert result['mean_length'] == pytest.approx(sum(lengths) / len(lengths))
    calls.clear()
    no_greedy = arl.evaluate(None, tasks, TOK, 4, cfg=cfg, greedy=False)
    assert len(calls) == 1 and no_greedy['greedy'] is None and no_greedy['greedy_per_task'] is None
    assert no_greedy['by_family']['max']['greedy'] is None
    assert no_greedy['pass_rate'] == result['pass_rate']


def test_evaluate_rejects_bad_input():
    with pytest.raises(ValueError):
        arl.evaluate(None, [], TOK, 4)
    with pytest.raises(ValueError):
        arl.evaluate(None, arl.make_tasks('heldout')[:1], TOK, 0)


def test_recipe_hash_is_stable_and_order_free():
    recipe = dict(a=1, b=[1, 2], c={'x': 0.5})
    assert arl.recipe_hash(recipe) == arl.recipe_hash(dict(c={'x': 0.5}, b=[1, 2], a=1))
    # A fixed value: changing how the key is computed would silently orphan every existing cache.
    assert arl.recipe_hash(recipe) == '1c9e0952188140f3'
    assert len(arl.recipe_hash(arl.RL_BASE_RECIPE)) == 16


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(arl.RL_BASE_RECIPE)), st.integers(1, 1000))
def test_recipe_hash_sees_every_entry(name, value):
    changed = dict(arl.RL_BASE_RECIPE, **{name: value})
    assert (arl.recipe_hash(changed) == arl.recipe_hash(arl.RL_BASE_RECIPE)) == (changed == arl.RL_BASE_RECIPE)


def test_rl_base_path_depends_on_recipe_and_vocabulary(monkeypatch, tmp_path):
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    path = arl.rl_base_path(TOK)
    assert path.parent == tmp_path and path.name.startswith('rl_base-') and path.suffix == '.safetensors'
    assert arl.rl_base_path(TOK, dict(steps=arl.RL_BASE_RECIPE['steps'])) == path
    assert arl.rl_base_path(TOK, dict(steps=1)) != path
    assert arl.rl_base_path(arl.Tokenizer(TOK.itos + ['#'])) != path
    with pytest.raises(ValueError, match='unknown recipe keys'):
        arl.rl_base_path(TOK, dict(stepz=1))


def test_make_rl_base_cache_round_trip(monkeypatch, tmp_path):
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    assert arl.cache_dir() == tmp_path
    built = arl.make_rl_base(TOK, TINY, verbose=False)
    path = arl.rl_base_path(TOK, TINY)
    assert path.exists() and path.parent == tmp_path
    assert not list(tmp_path.glob('*.tmp'))                         # the temporary file was renamed

    def no_training(*args, **kwargs):
        raise AssertionError('a cached RL base must be loaded, not rebuilt')

    monkeypatch.setattr(sft, 'build_rl_base', no_training)
    loaded = arl.make_rl_base(TOK, TINY, verbose=False)
    assert not loaded.training
    for (name, p), q in zip(built.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name
    with pytest.raises(AssertionError, match='must be loaded'):   # another recipe is another cache entry
        arl.make_rl_base(TOK, dict(TINY, steps=4), verbose=False)


def test_make_demo_tasks_never_overlaps_train_heldout_or_ood():
    train = {(t.prompt, t.store) for t in arl.make_tasks('train')}
    unseen = {t.prompt for t in arl.make_tasks('heldout') + arl.make_tasks('ood')}
    demos = arl.make_demo_tasks(n_per_family=60, seed=1)
    assert demos and not {(t.prompt, t.store) for t in demos} & train
    assert not {t.prompt for t in demos} & unseen          # no evaluation prompt, whatever its store
    assert {t.family for t in demos} == set(arl.FAMILIES)


def test_train_sft_learns_and_validates():
    torch.manual_seed(0)
    model = arl.TinyAgent(len(TOK), d_model=16, n_layers=1, n_heads=2, max_len=128)
    tasks = [t for t in arl.make_demo_tasks(n_per_family=8) if t.family in ('max', 'lookup')]
    losses = arl.train_sft(model, tasks, TOK, steps=20, batch_size=8, lr=1e-2, progress=False)
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < 0.7 * losses[0]
    assert not model.training
    for bad in (dict(steps=0), dict(batch_size=0), dict(family_weights={'max': 0.0, 'lookup': 0.0}),
                dict(family_weights={'max': -1.0})):
        with pytest.raises(ValueError):
            arl.train_sft(model, tasks, TOK, progress=False, **bad)
    with pytest.raises(ValueError):
        arl.train_sft(model, [], TOK, progress=False)


def test_evaluate_stderr_and_per_task_by_hand(monkeypatch):
    import math
    import statistics
    tasks = arl.make_tasks('heldout')[:4]
    rewards = [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]]     # per task, n=4

    def stub(model, env_fn, tasks_, tok, cfg, generator):
        assert cfg.group_size in (4, 1)                            # sampled, then greedy
        return episodes(tasks_, rewards if cfg.group_size == 4 else [[0]] * len(tasks_))

    monkeypatch.setattr(arl, 'sample_groups', stub)
    result = arl.evaluate(None, tasks, TOK, 4)
    rates = [sum(rs) / len(rs) for rs in rewards]                  # 0.75, 0, 1, 0.25
    assert result['per_task'] == {t.name: r for t, r in zip(tasks, rates)}
    assert result['pass_rate'] == pytest.approx(sum(rates) / 4)
    # the task, not the episode, is the unit: sample std of the 4 rates / sqrt(4)
    assert result['stderr'] == pytest.approx(statistics.stdev(rates) / math.sqrt(4))
    # ... which differs from the (wrong) per-episode binomial error here
    flat = [r for rs in rewards for r in rs]
    assert result['stderr'] != pytest.approx(statistics.stdev(flat) / math.sqrt(len(flat)))
    one = arl.evaluate(None, tasks[:1], TOK, 4)                    # one task: no spread
    assert one['per_task'] == {tasks[0].name: 0.75} and math.isnan(one['stderr'])


def test_rl_base_path_hashes_the_demonstrations(monkeypatch, tmp_path):
    import dataclasses
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    path = arl.rl_base_path(TOK, TINY)
    real = sft.make_demo_tasks

    def same(n_per_family, seed):
        return list(real(n_per_family, seed))

    def other_answer(n_per_family, seed):
        demos = real(n_per_family, seed)
        return [dataclasses.replace(demos[0], answer=demos[0].answer + '0')] + demos[1:]

    def one_fewer(n_per_family, seed):
        return real(n_per_family, seed)[1:]

    monkeypatch.setattr(sft, 'make_demo_tasks', same)
    assert arl.rl_base_path(TOK, TINY) == path         # same demonstrations, same key
    keys = {path}
    for changed in (other_answer, one_fewer):         # same recipe, other demonstrations
        monkeypatch.setattr(sft, 'make_demo_tasks', changed)
        keys.add(arl.rl_base_path(TOK, TINY))
    assert len(keys) == 3


# ---- pass@k, bootstrap intervals, paired comparisons ----------------------------------

def test_pass_at_k_equals_enumeration_over_all_k_subsets():
    from itertools import combinations
    for n in range(1, 9):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert arl.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
            assert arl.pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
            row = [arl.pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert all(a <= b + 1e-12 for a, b in zip(row, row[1:]))         # monotone in k


def test_pass_at_k_is_unbiased_and_the_naive_estimate_is_not():
    from math import comb
    n, p = 10, 0.3
    pmf = [comb(n, c) * p ** c * (1 - p) ** (n - c) for c in range(n + 1)]   # Binomial(n, p)
    for k in (1, 2, 5, 10):
        truth = 1 - (1 - p) ** k
        unbiased = sum(w * arl.pass_at_k(n, c, k) for c, w in enumerate(pmf))
        naive = sum(w * (1 - (1 - c / n) ** k) for c, w in enumerate(pmf))
        assert unbiased == pytest.approx(truth, abs=1e-12)
        if k > 1:
            assert naive < truth - 1e-3                                     # biased low


def test_pass_at_k_rejects_bad_input():
    for bad in [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            arl.pass_at_k(*bad)
    for bad in [(4.0, 2, 1), (4, 2.0, 1), (4, 2, True), ('4', 2, 1)]:
        with pytest.raises(TypeError):
            arl.pass_at_k(*bad)


def simulated_suites(n_suites, families, n, seed):
    """n_suites evaluation suites: per family (tasks, a, b), tasks with Beta(a, b)
    difficulty and n episodes each -> (per-task pass rates [n_suites, tasks], family
    labels, the true mean the suite estimates)."""
    import random
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rates, labels, truth = [], [], 0.0
    total = sum(tasks for tasks, _, _ in families.values())
    for name, (tasks, a, b) in families.items():
        p = torch.tensor([[rng.betavariate(a, b) for _ in range(tasks)]
                          for _ in range(n_suites)])                           # [S, tasks]
        counts = torch.binomial(torch.full((n_suites, tasks), float(n)), p, generator=gen)
        rates.append(counts / n)
        labels += [name] * tasks
        truth += tasks / total * a / (a + b)
    return torch.cat(rates, 1).double(), labels, truth


def coverage(rates, labels, truth, **kwargs):
    hits = [lo <= truth <= hi for lo, hi in (arl.bootstrap_interval(r, labels, n_boot=1000, **kwargs)
                                             for r in rates)]
    return sum(hits) / len(hits)


def test_bootstrap_interval_covers_the_truth():
    # one family of 48 tasks, 8 episodes each: the interval over tasks covers the true mean
    rates, _, truth = simulated_suites(300, {'a': (48, 2.0, 2.0)}, 8, seed=0)
    assert 0.90 <= coverage(rates, None, truth) <= 0.985
    # three families of different difficulty, stratified: covers the suite's true mean
    fams = {'easy': (16, 6.0, 1.5), 'mid': (16, 2.0, 2.0), 'hard': (16, 0.7, 3.0)}
    rates, labels, truth = simulated_suites(300, fams, 8, seed=1)
    assert 0.90 <= coverage(rates, labels, truth) <= 0.985


def test_resampling_episodes_instead_of_tasks_undercovers():
    # tasks of very different difficulty: an interval that treats every episode as
    # independent is too narrow and misses the truth far more often than 5% of the time
    rates, _, truth = simulated_suites(200, {'a': (40, 0.5, 0.5)}, 8, seed=2)
    gen = torch.Generator().manual_seed(3)
    misses = 0
    for r in rates:
        correct = torch.round(r * 8)
        # [tasks, 8] episode outcomes consistent with the task's count
        episodes_ = (torch.arange(8)[None] < correct[:, None]).double()
        lo, hi = arl.bootstrap_interval(episodes_.flatten(), n_boot=500,
                                        seed=int(torch.randint(1000, (1,), generator=gen)))
        misses += not lo <= truth <= hi
    assert misses / len(rates) > 0.25


def test_bootstrap_interval_stratified_groups_keep_their_sizes():
    values = [0.0] * 6 + [1.0] * 2
    groups = ['a'] * 6 + ['b'] * 2
    # every resample keeps 6 a's and 2 b's, so the mean is always 2/8
    assert arl.bootstrap_interval(values, groups) == pytest.approx((0.25, 0.25))
    lo, hi = arl.bootstrap_interval(values)                   # one group: the share varies
    assert lo < 0.25 < hi
    # interleaved labels are grouped by label, not by position
    mixed = [0.0, 1.0] * 4
    assert arl.bootstrap_interval(mixed, ['x', 'y'] * 4) == pytest.approx((0.5, 0.5))
    # labels given as a tensor are labels too (0-d tensors hash by identity, not value)
    assert arl.bootstrap_interval(torch.tensor(mixed), torch.tensor([0, 1] * 4)) == pytest.approx((0.5, 0.5))


def test_bootstrap_interval_is_deterministic_and_contains_the_mean():
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(30, generator=gen)
    a = arl.bootstrap_interval(values, seed=5)
    assert a == arl.bootstrap_interval(values.tolist(), seed=5)
    assert a != arl.bootstrap_interval(values, seed=6)
    assert a[0] < values.mean().item() < a[1]
    narrow, wide = arl.bootstrap_interval(values, level=0.5), arl.bootstrap_interval(values, level=0.99)
    assert wide[0] < narrow[0] < narrow[1] < wide[1]


def test_bootstrap_interval_rejects_bad_input():
    for kwargs in (dict(level=0), dict(level=1), dict(level=1.5), dict(n_boot=0),
                   dict(n_boot=2.5), dict(n_boot=True), dict(groups=['a', 'b'])):
        with pytest.raises(ValueError):
            arl.bootstrap_interval([0.0, 1.0, 1.0], **kwargs)
    with pytest.raises(ValueError):
        arl.bootstrap_interval([])


def evaluation(per_task, families, greedy=None):
    """A minimal result of `evaluate`: what compare_evaluations reads."""
    out = dict(per_task=dict(per_task), family_of=dict(families))
    if greedy is not None:
        out['greedy_per_task'] = dict(greedy)
    return out


def random_evaluation(n_tasks=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    names = [f't{i:02d}' for i in range(n_tasks)]
    fams = {k: 'ab'[i % 2] for i, k in enumerate(names)}
    rates = (torch.randint(0, 9, (n_tasks,), generator=gen) / 8).tolist()
    greedy = torch.randint(0, 2, (n_tasks,), generator=gen).double().tolist()
    return names, fams, dict(zip(names, rates)), dict(zip(names, greedy))


def test_compare_evaluations_of_identical_evaluations_is_zero():
    names, fams, rates, greedy = random_evaluation()
    e = evaluation(rates, fams, greedy)
    out = arl.compare_evaluations(e, e)
    assert out['diff'] == 0 and out['interval'] == (0.0, 0.0)
    assert out['greedy_diff'] == 0 and out['greedy_interval'] == (0.0, 0.0)
    assert out['per_family'] == {f: dict(diff=0.0, interval=(0.0, 0.0)) for f in 'ab'}


def test_compare_evaluations_finds_a_known_shift():
    names, fams, rates, greedy = random_evaluation()
    gen = torch.Generator().manual_seed(1)
    noise = (torch.randn(len(names), generator=gen) * 0.05).tolist()
    # family a gains 0.2 (plus task-level noise), family b nothing; greedy: all of a flips to 1
    after = {k: rates[k] + (0.2 + e if fams[k] == 'a' else 0.0) for k, e in zip(names, noise)}
    after_greedy = {k: 1.0 if fams[k] == 'a' else greedy[k] for k in names}
    out = arl.compare_evaluations(evaluation(rates, fams, greedy), evaluation(after, fams, after_greedy))
    gain_a = sum(after[k] - rates[k] for k in names if fams[k] == 'a') / 20
    assert out['diff'] == pytest.approx(gain_a / 2)
    assert out['per_family']['a']['diff'] == pytest.approx(gain_a)
    assert out['per_family']['b'] == dict(diff=0.0, interval=(0.0, 0.0))
    lo, hi = out['per_family']['a']['interval']
    assert lo < gain_a < hi and lo > 0.15 and hi < 0.25
    lo, hi = out['interval']
    assert lo < out['diff'] < hi and hi - lo < 0.05             # paired: only the noise is left
    unpaired = arl.bootstrap_interval(list(after.values()), list(fams.values()))
    assert hi - lo < 0.5 * (unpaired[1] - unpaired[0])
    flipped = sum(1 - greedy[k] for k in names if fams[k] == 'a') / len(names)
    assert out['greedy_diff'] == pytest.approx(flipped)
    assert out['greedy_interval'][0] <= flipped <= out['greedy_interval'][1]
    # after - before, not before - after
    back = arl.compare_evaluations(evaluation(after, fams), evaluation(rates, fams))
    assert back['diff'] == pytest.approx(-out['diff'])


def test_compare_evaluations_greedy_none_and_mismatched_tasks():
    names, fams, rates, greedy = random_evaluation()
    with_greedy, without = evaluation(rates, fams, greedy), evaluation(rates, fams)
    for a, b in [(with_greedy, without), (without, with_greedy), (without, without),
                 (dict(with_greedy, greedy_per_task=None), with_greedy)]:
        out = arl.compare_evaluations(a, b)
        assert out['greedy_diff'] is None and out['greedy_interval'] is None and out['diff'] == 0
    fewer = evaluation({k: rates[k] for k in names[1:]}, fams)
    for a, b in [(without, fewer), (fewer, without)]:
        with pytest.raises(ValueError, match='same tasks'):
            arl.compare_evaluations(a, b)


# ---- evaluate on a real (tiny) model ----------------------------------------------------

def digit_max_tasks(n, seed, family):
    """Hand-made max tasks over digits only (no tool needed): easy enough for a tiny
    model to get partly right after a few steps."""
    import random
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        digits = [rng.randint(0, 9) for _ in range(rng.randint(2, 3))]
        tasks.append(arl.Task(name=f'{family}-{seed}-{i}', family=family,
                              prompt='max ' + ' '.join(map(str, digits)),
                              answer=str(max(digits))))
    return tasks


@pytest.fixture(scope='module')
def partly_trained():
    torch.manual_seed(0)
    model = arl.TinyAgent(len(TOK), d_model=16, n_layers=1, n_heads=2, max_len=64)
    arl.train_sft(model, digit_max_tasks(200, 0, 'max'), TOK, steps=60, batch_size=16, lr=1e-2,
                  progress=False)
    return model


def test_evaluate_on_a_real_model(partly_trained):
    tasks = digit_max_tasks(8, 1, 'max') + digit_max_tasks(8, 2, 'calc')   # two 'families'
    cfg = arl.SamplingConfig(max_tokens=24)
    runs = [arl.evaluate(partly_trained, tasks, TOK, 6, generator=torch.Generator().manual_seed(s), cfg=cfg)
            for s in (1, 2)]
    r = runs[0]
    assert 0 < r['pass_rate'] < 1, 'the model should be partly right, or the checks below are vacuous'
    assert runs[0]['correct'] != runs[1]['correct']            # other generator, other samples ...
    assert runs[0]['greedy_per_task'] == runs[1]['greedy_per_task']      # ... same greedy episodes
    assert r['pass_at_k'][0] == pytest.approx(r['pass_rate'])
    assert r['interval'][0] <= r['pass_rate'] <= r['interval'][1]
    assert r['n_episodes'] == 6 * len(tasks)
    for f, s in r['by_family'].items():
        names = [t.name for t in tasks if t.family == f]
        assert s['pass_rate'] == pytest.approx(r['per_family'][f])
        assert s['pass_rate'] == pytest.approx(sum(r['per_task'][k] for k in names) / len(names))
        assert s['greedy'] == pytest.approx(sum(r['greedy_per_task'][k] for k in names) / len(names))
        assert s['n_tasks'] == len(names) and s['interval'][0] <= s['pass_rate'] <= s['interval'][1]
        assert s['pass_at_k'] == pytest.approx(
            [sum(arl.pass_at_k(6, r['correct'][k], j) for k in names) / len(names) for j in range(1, 7)])
    assert r['greedy'] == pytest.approx(sum(r['greedy_per_task'].values()) / len(tasks))


def test_greedy_temperature_picks_the_argmax(partly_trained):
    tasks = digit_max_tasks(6, 3, 'max')
    cfg = arl.SamplingConfig(max_tokens=24, group_size=2, temperature=arl.GREEDY_TEMPERATURE)
    runs = [arl.sample_groups(partly_trained, lambda: arl.make_env(cfg), tasks, TOK, cfg,
                              torch.Generator().manual_seed(s)) for s in (0, 1)]
    for a, b in zip(*runs):
        assert torch.equal(a.ids, b.ids)
        with torch.no_grad():
            best = partly_trained(a.ids[None])[0, :-1].argmax(-1)              # [T-1]
        chosen = a.action_mask.bool()
        assert chosen.any() and torch.equal(best[chosen], a.ids[1:][chosen])


def test_recipe_seed_variable_rebuilds_the_base_from_another_seed(monkeypatch, tmp_path):
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    monkeypatch.delenv(arl.RECIPE_SEED_VARIABLE, raising=False)
    ours = arl.rl_base_path(TOK)
    monkeypatch.setenv(arl.RECIPE_SEED_VARIABLE, '1')
    other = arl.rl_base_path(TOK)
    assert other != ours
    assert other == arl.rl_base_path(TOK, dict(seed=1))
    assert arl.rl_base_path(TOK, dict(seed=0)) == ours       # a caller's own seed wins
    monkeypatch.setenv(arl.RECIPE_SEED_VARIABLE, '')         # empty: unset
    assert arl.rl_base_path(TOK) == ours
    for bad in ('-1', 'one', '1.5'):
        monkeypatch.setenv(arl.RECIPE_SEED_VARIABLE, bad)
        with pytest.raises(ValueError, match=arl.RECIPE_SEED_VARIABLE):
            arl.rl_base_path(TOK)
