"""One RL engine (issue 22): chapter 7 owns the only RL update and the only RL loop; later
chapters add parts (chapter 9's update terms) and hooks (transform, update_fn). Checked
bit for bit against frozen copies of the code every cached run was trained with."""
import copy

import pytest
import torch

import agentrl as arl
from frozen.engine_v1 import rl_update_v1, train_rl_v1
from helpers import informative_rewards

SMALL = dict(seed=3, tasks_per_step=4, group_size=4, max_turns=3)
CONFIGS = {
    'chapter 7': arl.RLConfig(**SMALL, micro_batch_size=5),
    'KLConfig, no penalty': arl.KLConfig(**SMALL),
    'k3 loss + entropy': arl.KLConfig(**SMALL, kl_coef=0.1, entropy_coef=0.01,
                                      micro_batch_size=3),
    'k1 reward': arl.KLConfig(**SMALL, kl_coef=0.2, kl_estimator='k1', kl_mode='reward'),
    'k2 loss, 3 epochs': arl.KLConfig(**SMALL, kl_coef=0.3, kl_estimator='k2', epochs=3),
    'entropy, 1 epoch': arl.KLConfig(**SMALL, entropy_coef=0.05, epochs=1),
}


def _batch(tiny_agent):
    tasks, tok, model = tiny_agent
    cfg = CONFIGS['chapter 7']
    trajs = arl.sample_groups(model, lambda: arl.make_env(cfg), tasks[:4], tok, cfg,
                              torch.Generator().manual_seed(0))
    for i, t in enumerate(trajs):
        t.reward = float(i % 3 == 0)
    batch = arl.collate(trajs, tok.pad_id)
    return batch, arl.compute_advantages(batch, cfg)


def _same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize('name', list(CONFIGS))
def test_one_update_with_parts_is_the_old_update_bit_for_bit(tiny_agent, name):
    cfg = CONFIGS[name]
    batch, adv = _batch(tiny_agent)
    base = tiny_agent[2]
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)                                  # a reference unlike the policy
    ref_model = None if name == 'chapter 7' else ref
    out = {}
    for update in (rl_update_v1, arl.rl_update):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        stats = update(model, opt, batch, adv, cfg, ref_model,
                       torch.Generator().manual_seed(1))
        out[update] = model, stats
    (old, old_stats), (new, new_stats) = out.values()
    assert _same_weights(old, new)
    assert list(new_stats.items()) == list(old_stats.items())    # values and key order
    assert not _same_weights(new, base)


@pytest.mark.parametrize('hooks', ['none', 'transform', 'update_fn'])
@pytest.mark.parametrize('name', ['chapter 7', 'k3 loss + entropy'])
def test_one_loop_with_hooks_is_the_old_loop_bit_for_bit(monkeypatch, tiny_agent, name,
                                                         hooks):
    tasks, tok, base = tiny_agent
    informative_rewards(monkeypatch)
    cfg = CONFIGS[name]
    ref = None if name == 'chapter 7' else copy.deepcopy(base)

    def drop_last_of_each_group(sampled, step):          # groups shrink to 3 episodes
        return [t for i, t in enumerate(sampled) if i % cfg.group_size != 0]

    kw = dict(transform=drop_last_of_each_group) if hooks == 'transform' else {}
    if hooks == 'update_fn':
        kw['update_fn'] = arl.seq_mean_update
    runs = []
    for loop in (train_rl_v1, arl.train_rl):
        model = copy.deepcopy(base)
        history = loop(model, tasks, tok, cfg, 3, tasks[:3], 2, 2, ref_model=ref,
                       progress=False, **kw)
        runs.append((model, history))
    (old, old_history), (new, new_history) = runs
    assert _same_weights(old, new)
    assert new_history == old_history
    assert all(h['kept'] > 0 for h in new_history if 'kept' in h)


def test_train_rl_and_its_update_hook_step_through_the_one_update(monkeypatch, tiny_agent):
    """train_rl, with no update_fn or with chapter 10's, trains only through arl.rl_update
    (chapters 8, 13, 15 and 16 still have trainers of their own: README, "One engine")."""
    tasks, tok, base = tiny_agent
    informative_rewards(monkeypatch)
    calls = []
    real = arl.rl_update

    def counting(*args, **kw):
        calls.append(args[4])
        return real(*args, **kw)

    monkeypatch.setattr(arl, 'rl_update', counting)
    cfg = CONFIGS['k1 reward']
    for update_fn in (None, arl.seq_mean_update):
        arl.train_rl(copy.deepcopy(base), tasks, tok, cfg, 2, ref_model=base,
                     progress=False, update_fn=update_fn)
    assert calls == [cfg] * 4


def test_update_terms_belong_to_the_config():
    assert arl.RLConfig().update_terms(None) == ()
    assert arl.KLConfig().update_terms(None) == []
    kinds = [type(t).__name__ for t in arl.KLConfig(kl_coef=0.1, entropy_coef=0.1)
             .update_terms(object())]
    assert kinds == ['KLPenalty', 'EntropyBonus']
    with pytest.raises(ValueError, match='ref_model'):
        arl.KLConfig(kl_coef=0.1).update_terms(None)
    term = arl.UpdateTerm()
    adv = torch.ones(2, 1)
    assert term.advantages(adv, None, None) is adv and term.stats(3) == {}
    assert term.loss(None, None, None, None, 3) is None
