"""Tests for agentrl/rl_loop.py (chapter 7): RLConfig, sample_step filtering, rl_update accumulation, stats."""
import copy

import pytest
import torch

import agentrl as arl


@pytest.fixture(scope='module')
def setup():
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=192)
    return tok, model


def _demo_batch(tok, n=12):
    trajs = [arl.demonstration_trajectory(t, tok) for t in arl.make_tasks('train')[:n]]
    for i, t in enumerate(trajs):
        t.info['group'] = i // 4                                           # groups of 4 consecutive episodes
        t.info['task'] = f'task{i // 4}'
    return arl.collate(trajs, tok.pad_id)


def test_config_defaults_and_validation():
    cfg = arl.RLConfig()
    assert cfg.group_size == 8 and cfg.epochs >= 1 and cfg.lr > 0 and cfg.max_tokens == 160
    with pytest.raises(ValueError, match='lr_schedule'):
        arl.RLConfig(lr_schedule='cosine')
    with pytest.raises(ValueError, match='epochs'):
        arl.RLConfig(epochs=0)


def test_sample_step_keeps_exactly_the_groups_with_unequal_rewards(monkeypatch, setup):
    tok, model = setup
    rewards = [1, 1, 1, 1,  0, 1, 0, 0,  0, 0, 0, 0,  0.5, 0.5, 0.5, 1]          # groups: flat, mixed, flat, mixed

    def fake_sample_groups(model, env_fn, tasks, tok, cfg, generator):
        return [arl.Trajectory(ids=torch.tensor([1, 2]), action_mask=torch.ones(1), sample_logp=torch.zeros(1),
                               reward=float(r), info=dict(task=tasks[i // 4].name, group=i // 4))
                for i, r in enumerate(rewards)]
    monkeypatch.setattr(arl, 'sample_groups', fake_sample_groups)
    cfg = arl.RLConfig(group_size=4, tasks_per_step=4)
    kept, sampled = arl.sample_step(model, None, arl.make_tasks('train'), tok, cfg, torch.Generator().manual_seed(0))
    assert len(sampled) == 16
    assert [t.reward for t in kept] == [0, 1, 0, 0, 0.5, 0.5, 0.5, 1]
    with pytest.raises(ValueError, match='tasks'):
        arl.sample_step(model, None, [], tok, cfg, torch.Generator())


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_rl_update_micro_batches_accumulate_to_the_full_batch_gradient(setup):
    tok, model = setup
    batch = _demo_batch(tok)
    adv = torch.linspace(-1, 1, 12)
    results = {}
    for mbs in (1, 5, 12):
        m = copy.deepcopy(model)
        cfg = arl.RLConfig(epochs=1, micro_batch_size=mbs, max_grad_norm=float('inf'))
        arl.rl_update(m, torch.optim.SGD(m.parameters(), lr=0.0), batch, adv, cfg, generator=torch.Generator().manual_seed(1))
        results[mbs] = _grads(m)
    reference = copy.deepcopy(model)
    reference.zero_grad()
    arl.reinforce_loss(arl.sequence_log_probs(reference, batch['ids']), adv, batch['action_mask'], 'token_mean').backward()
    for mbs, g in results.items():
        assert torch.allclose(g, _grads(reference), atol=1e-6, rtol=1e-4), mbs


def test_rl_update_clips_gradient_norm_and_steps(setup):
    tok, model = setup
    batch = _demo_batch(tok)
    adv = torch.linspace(-1, 1, 12) * 100
    m = copy.deepcopy(model)
    stats = arl.rl_update(m, torch.optim.SGD(m.parameters(), lr=0.0), batch, adv,
                          arl.RLConfig(epochs=1, max_grad_norm=0.5))
    assert stats['grad_norm'] > 0.5                                           # reported before clipping
    assert abs(_grads(m).norm().item() - 0.5) < 1e-4                          # applied after clipping
    assert stats['policy_tokens'] == int(batch['action_mask'].sum())
    m2 = copy.deepcopy(model)
    stats2 = arl.rl_update(m2, torch.optim.Adam(m2.parameters(), lr=1e-2), batch, adv / 100, arl.RLConfig(epochs=3))
    assert 0 <= stats2['clip_frac'] <= 1
    assert any((p - q).abs().max() > 0 for p, q in zip(m2.parameters(), model.parameters()))
    with pytest.raises(ValueError, match='policy tokens'):
        empty = dict(batch, action_mask=torch.zeros_like(batch['action_mask']))
        arl.rl_update(m2, torch.optim.SGD(m2.parameters(), lr=0.0), empty, adv, arl.RLConfig())


def test_behavior_stats():
    trajs = [arl.Trajectory(ids=torch.arange(n), action_mask=torch.ones(n - 1), sample_logp=torch.zeros(n - 1),
                            reward=r, info=dict(outcome=o, turns=k))
             for n, r, o, k in [(4, 1.0, 'correct', 1), (6, 0.0, 'wrong', 2), (10, 0.0, 'turn_limit', 7)]]
    s = arl.behavior_stats(trajs)
    assert s['reward'] == pytest.approx(1 / 3) and s['length'] == pytest.approx(20 / 3)
    assert s['policy_tokens'] == pytest.approx(17 / 3) and s['tool_calls'] == pytest.approx(10 / 3)
    assert s['share_correct'] == s['share_wrong'] == s['share_turn_limit'] == pytest.approx(1 / 3)
    assert s['share_token_limit'] == 0
    assert arl.behavior_stats([])['reward'] == 0
