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


def test_evaluate_per_family_accounting(monkeypatch):
    rewards = {'a': [1, 0, 1, 1], 'b': [0, 0, 0, 0], 'c': [1, 1]}
    seen = {}

    def stub(model, env_fn, tasks, tok, cfg, generator):
        seen.update(group_size=cfg.group_size, max_tokens=cfg.max_tokens, env=env_fn())
        return [arl.Trajectory(ids=torch.zeros(3 + i), action_mask=torch.zeros(2 + i), sample_logp=torch.zeros(2 + i),
                               reward=float(r), info=dict(family=f))
                for f, rs in rewards.items() for i, r in enumerate(rs)]

    monkeypatch.setattr(arl, 'sample_groups', stub)
    cfg = arl.SamplingConfig(max_tokens=77)
    result = arl.evaluate(None, arl.make_tasks('heldout')[:2], TOK, 5, cfg=cfg)
    assert seen['group_size'] == 5 and seen['max_tokens'] == 77 and seen['env'].max_tokens == 77
    assert result['per_family'] == {'a': 0.75, 'b': 0.0, 'c': 1.0}
    assert result['pass_rate'] == pytest.approx(5 / 10)
    assert result['n_episodes'] == 10
    lengths = [3 + i for rs in rewards.values() for i in range(len(rs))]
    assert result['mean_length'] == pytest.approx(sum(lengths) / len(lengths))


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


def test_make_demo_tasks_never_overlaps_train_or_heldout():
    taken = {(t.prompt, t.store) for t in arl.make_tasks('all')}
    demos = arl.make_demo_tasks(n_per_family=60, seed=1)
    assert demos and not {(t.prompt, t.store) for t in demos} & taken
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
        assert cfg.group_size == 4
        return [arl.Trajectory(ids=torch.zeros(3), action_mask=torch.zeros(2),
                               sample_logp=torch.zeros(2), reward=float(r),
                               info=dict(task=t.name, family=t.family, group=g))
                for g, (t, rs) in enumerate(zip(tasks_, rewards)) for r in rs]

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
