"""Tests for agentrl/rewards.py (chapter 10)."""
import copy

import pytest
import torch

import agentrl as arl
from agentrl import rl_loop


@pytest.fixture(scope='module')
def setup():
    tasks = arl.make_tasks('train')[:12]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=32, n_layers=1, n_heads=2)
    return tasks, tok, model


def _cfg():
    return arl.RLConfig(seed=3, tasks_per_step=4, group_size=4, max_turns=3)


def test_train_rl_without_hooks_is_chapter_7_bit_for_bit(monkeypatch, setup):
    tasks, tok, model = setup
    real = arl.sample_groups

    def informative(*args):                   # a random model never succeeds: give the
        trajs = real(*args)                   # groups unequal rewards so both loops train
        for i, t in enumerate(trajs):
            t.reward = float(i % 3 == 0)
        return trajs

    monkeypatch.setattr(arl, 'sample_groups', informative)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ha = rl_loop.train_rl(a, tasks, tok, _cfg(), 3, progress=False)
    hb = arl.train_rl(b, tasks, tok, _cfg(), 3, progress=False)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert [h['kept'] for h in ha] == [h['kept'] for h in hb] == [16, 16, 16]
    assert ha[0]['grad_norm'] > 0
    assert [h['reward'] for h in ha] == [h['reward'] for h in hb]


def test_identity_transform_trains_like_no_transform(setup):
    tasks, tok, model = setup
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    arl.train_rl(a, tasks, tok, _cfg(), 2, progress=False)
    seen = []
    arl.train_rl(b, tasks, tok, _cfg(), 2, progress=False,
                 transform=lambda trajs, step: seen.append(step) or trajs)
    assert seen == [0, 1]
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_update_fn_replaces_rl_update(setup):
    tasks, tok, model = setup
    calls = []

    def no_update(model, optimizer, batch, advantages, cfg, ref_model, gen):
        calls.append(len(advantages))
        return dict(update_tokens=0)

    def alternate(trajs, step):             # rescored rewards: every group informative
        for i, t in enumerate(trajs):
            t.reward = float(i % 2)
        return trajs

    m = copy.deepcopy(model)
    history = arl.train_rl(m, tasks, tok, _cfg(), 2, progress=False,
                           transform=alternate, update_fn=no_update)
    assert calls == [16, 16] and [h['kept'] for h in history] == [16, 16]
    assert all(h['reward'] == 0.5 for h in history)    # behaviour of the rescored batch
    for p, q in zip(m.parameters(), model.parameters()):
        assert torch.equal(p, q)              # nothing trained


def _traj(task, group, reward):
    return arl.Trajectory(ids=torch.zeros(3, dtype=torch.long),
                          action_mask=torch.ones(2), sample_logp=torch.zeros(2),
                          reward=reward, info=dict(task=task, group=group))


def test_informative_groups_keeps_groups_with_distinct_rewards():
    trajs = [_traj('a', 0, 1.0), _traj('a', 0, 0.0),     # kept
             _traj('b', 0, 1.0), _traj('b', 0, 1.0),     # all equal: dropped
             _traj('c', 0, 0.0),                         # shrunk to one: dropped
             _traj('a', 1, 0.0), _traj('a', 1, 0.5), _traj('a', 1, 0.5)]
    kept = arl.informative_groups(trajs)
    assert [(t.info['task'], t.info['group'], t.reward) for t in kept] == [
        ('a', 0, 1.0), ('a', 0, 0.0), ('a', 1, 0.0), ('a', 1, 0.5), ('a', 1, 0.5)]
    assert arl.informative_groups([]) == []


def test_train_rl_rejects_bad_hooks(setup):
    tasks, tok, model = setup
    with pytest.raises(TypeError, match='transform'):
        arl.train_rl(model, tasks, tok, _cfg(), 1, transform=3)
    with pytest.raises(TypeError, match='update_fn'):
        arl.train_rl(model, tasks, tok, _cfg(), 1, update_fn='x')
