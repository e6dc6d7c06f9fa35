"""One RL engine (issue 22): chapter 7 owns the only RL update and the only RL loop; later
chapters add parts (chapter 9's update terms) and hooks (transform, update_fn). Checked
bit for bit against frozen copies of the code every cached run was trained with."""
import copy
import dataclasses

import pytest
import torch

import agentrl as arl
from frozen.engine_v1 import rl_update_v1, train_rl_v1
from frozen.opd_v1 import train_opd_v1
from frozen.trainers_v1 import (ppo_update_v1, train_curriculum_v1,
                                 train_rl_quantized_rollout_v1)
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
    # values and key order; the one update also reports approx_kl
    assert list(new_stats.items()) == [(k, v) for k, v in old_stats.items()] + [
        ('approx_kl', new_stats['approx_kl'])]
    assert not _same_weights(new, base)


@pytest.mark.parametrize('hooks', ['none', 'transform', 'update_fn'])
@pytest.mark.parametrize('name', ['chapter 7', 'k3 loss + entropy'])
def test_one_loop_with_hooks_is_the_old_loop_bit_for_bit(monkeypatch, tmp_path, tiny_agent,
                                                         name, hooks):
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
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
    # the new loop twice: its first evaluation is computed, then read from the cache
    for loop in (train_rl_v1, arl.train_rl, arl.train_rl):
        model = copy.deepcopy(base)
        history = loop(model, tasks, tok, cfg, 3, tasks[:3], 2, 2, ref_model=ref,
                       progress=False, **kw)
        runs.append((model, history))
    (old, old_history), (new, new_history), (warm, warm_history) = runs
    assert _same_weights(new, warm) and warm_history == new_history
    assert _same_weights(old, new)
    # the one loop also records the episodes sampled before each step, and the one
    # update its approx_kl
    new_keys = ('episodes', 'approx_kl')
    strip = lambda history: [{k: v for k, v in r.items() if k not in new_keys}
                             for r in history]
    assert strip(new_history) == strip(old_history)
    per_step = cfg.tasks_per_step * cfg.group_size        # before any transform
    assert [r['episodes'] for r in new_history] == [per_step * r['step']
                                                    for r in new_history]
    assert all(h['kept'] > 0 for h in new_history if 'kept' in h)


def _trainers(tasks, tok, base, cfg):
    """Every RL trainer of the package, each a call that trains a copy of `base`."""
    batch, adv = None, None

    def ppo(model):
        nonlocal batch, adv
        trajs = arl.sample_groups(model, lambda: arl.make_env(cfg), tasks[:4], tok, cfg,
                                  torch.Generator().manual_seed(0))
        batch = arl.collate(trajs, tok.pad_id)
        adv = arl.compute_advantages(batch, cfg)
        opt = torch.optim.Adam(model.parameters())
        arl.ppo_update(model, opt, batch, adv, cfg, epochs=2, tis_cap=2.0)
        arl.traced_update(model, opt, batch, adv, cfg, rows_fn=arl.packed_update_rows,
                          forward=arl.packed_forward('block'))

    kw = dict(progress=False)
    return {
        'train_rl': lambda m: arl.train_rl(m, tasks, tok, cfg, 2, **kw),
        'train_rl + seq_mean_update': lambda m: arl.train_rl(
            m, tasks, tok, cfg, 2, update_fn=arl.seq_mean_update, **kw),
        'train_rl + traced_update': lambda m: arl.train_rl(
            m, tasks, tok, cfg, 2, update_fn=arl.traced_update, **kw),
        'train_curriculum': lambda m: arl.train_curriculum(m, tasks, tok, cfg, 2,
                                                           0.0, 1.0, **kw),
        'train_rl_quantized_rollout': lambda m: arl.train_rl_quantized_rollout(
            m, tasks, tok, cfg, 2, 'mxfp4', 2.0, **kw),
        'ppo_update, traced_update': ppo,
        'train_opd': lambda m: arl.train_opd(
            m, {f: m for f in {t.family for t in tasks}}, tasks, tok,
            arl.OPDConfig(tasks_per_step=4, max_turns=3), 2, **kw),
    }


def test_every_rl_trainer_steps_the_optimiser_only_inside_the_one_update(monkeypatch,
                                                                         tiny_agent):
    """Chapters 7, 8, 10, 13, 14, 15 and 16 train through arl.rl_update: every optimiser
    step of their trainers happens inside it."""
    tasks, tok, base = tiny_agent
    informative_rewards(monkeypatch)
    inside, steps = [0], []
    real_update, real_step = arl.rl_update, torch.optim.Adam.step

    def counting_update(*args, **kw):
        inside[0] += 1
        try:
            return real_update(*args, **kw)
        finally:
            inside[0] -= 1

    def recording_step(self, *args, **kw):
        steps.append(inside[0] > 0)
        return real_step(self, *args, **kw)

    monkeypatch.setattr(arl, 'rl_update', counting_update)
    monkeypatch.setattr(torch.optim.Adam, 'step', recording_step)
    for name, train in _trainers(tasks, tok, base, CONFIGS['chapter 7']).items():
        steps.clear()
        train(copy.deepcopy(base))
        assert steps and all(steps), name


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


@pytest.mark.parametrize('epochs, clip, tis_cap', [(3, 0.2, None), (2, None, None),
                                                   (1, 0.2, None), (3, 0.2, 2.0)])
def test_ppo_update_is_the_one_update_with_a_part_bit_for_bit(tiny_agent, epochs, clip,
                                                              tis_cap):
    """Chapter 8's ppo_update (chapter 7's rl_update with RecomputedOldLogProbs) trains
    exactly as the frozen copy of its old loop; its per-step stats agree to rounding."""
    batch, adv = _batch(tiny_agent)
    base = tiny_agent[2]
    cfg = CONFIGS['chapter 7']
    out = []
    for update in (ppo_update_v1, arl.ppo_update):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        out.append((model, update(model, opt, batch, adv, cfg, epochs, clip, tis_cap,
                                  torch.Generator().manual_seed(1))))
    (old, old_hist), (new, new_hist) = out
    assert _same_weights(old, new) and not _same_weights(new, base)
    assert len(new_hist) == len(old_hist) == epochs
    for a, b in zip(old_hist, new_hist):
        assert a.keys() == b.keys()
        for key in a:           # per-micro-batch shares added up vs one division
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    assert new_hist[-1]['clip_frac'] == 0 if clip is None else True


def test_ppo_update_refuses_bad_arguments(tiny_agent):
    batch, adv = _batch(tiny_agent)
    model = copy.deepcopy(tiny_agent[2])
    opt = torch.optim.Adam(model.parameters())
    cfg = CONFIGS['chapter 7']
    with pytest.raises(ValueError, match='epochs'):
        arl.ppo_update(model, opt, batch, adv, cfg, epochs=0)
    with pytest.raises(ValueError, match='tis_cap'):
        arl.ppo_update(model, opt, batch, adv, cfg, tis_cap=0)
    with pytest.raises(ValueError, match='clip_eps'):
        arl.ppo_update(model, opt, batch, adv, cfg, clip=-0.1)


def _without(history, *keys):
    return [{k: v for k, v in r.items() if k not in keys} for r in history]


def _old_and_new(monkeypatch, tmp_path, tiny_agent, old_loop, new_loop, *args):
    """Train copies of the tiny agent with the frozen loop and the one that replaced
    it (same arguments, informative rewards, a cache of their own) -> (old history, new
    history), after checking that both trained the same weights bit for bit."""
    tasks, tok, base = tiny_agent
    informative_rewards(monkeypatch)
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    runs = []
    for loop in (old_loop, new_loop):
        model = copy.deepcopy(base)
        runs.append((model, loop(model, tasks, tok, CONFIGS['chapter 7'], *args,
                                 tasks[:3], 2, 2, progress=False)))
    (old, old_history), (new, new_history) = runs
    assert _same_weights(old, new) and not _same_weights(new, base)
    return old_history, new_history


@pytest.mark.parametrize('low, high', [(-1.0, 2.0), (0.0, 1.0)])
def test_curriculum_is_the_one_loop_with_a_sampler_bit_for_bit(monkeypatch, tmp_path,
                                                               tiny_agent, low, high):
    """Chapter 14's train_curriculum (train_rl with curriculum_sampler) trains exactly
    as the frozen copy of its old loop and records the same steps."""
    old_history, new_history = _old_and_new(monkeypatch, tmp_path, tiny_agent,
                                            train_curriculum_v1, arl.train_curriculum,
                                            4, low, high, 1)
    for r in old_history:
        if 'n_episodes' in r:
            r['sampled'] = r.pop('n_episodes')
    assert _without(new_history, 'approx_kl') == _without(old_history, 'approx_kl')


@pytest.mark.parametrize('fmt, cap', [('mxfp4', None), ('nvfp4', 2.0)])
def test_quantized_rollout_is_the_one_loop_with_parts_bit_for_bit(monkeypatch, tmp_path,
                                                                  tiny_agent, fmt, cap):
    """Chapter 16's train_rl_quantized_rollout (train_rl with quantized_sampler and
    RecomputedOldLogProbs) trains exactly as the frozen copy of its old loop."""
    old_history, new_history = _old_and_new(
        monkeypatch, tmp_path, tiny_agent, train_rl_quantized_rollout_v1,
        arl.train_rl_quantized_rollout, 3, fmt, cap)
    keys = ('mismatch_abs_log', 'mismatch_share', 'loss', 'grad_norm', 'kept',
            'sampled', 'reward', 'lr', 'heldout')
    for a, b in zip(old_history, new_history, strict=True):
        assert {k: a[k] for k in keys if k in a} == {k: b[k] for k in keys if k in a}


def test_evaluate_once_is_evaluate_computed_once(monkeypatch, tmp_path, tiny_agent):
    """train_rl's first held-out evaluation comes from evaluate_once: the same dict as
    arl.evaluate, computed once per model and settings, cold or warm."""
    tasks, tok, base = tiny_agent
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    cfg = CONFIGS['chapter 7']
    fresh = arl.evaluate(base, tasks[:3], tok, 2,
                         generator=torch.Generator().manual_seed(0), cfg=cfg)
    calls = []
    real = arl.evaluate
    monkeypatch.setattr(arl, 'evaluate', lambda *a, **k: calls.append(1) or real(*a, **k))
    cold = arl.evaluate_once(base, tasks[:3], tok, 2, 0, cfg)
    other_seed = dataclasses.replace(cfg, seed=cfg.seed + 1, lr=0.5)   # not read
    warm = arl.evaluate_once(base, tasks[:3], tok, 2, 0, other_seed)
    assert cold == fresh and warm == fresh and len(calls) == 1
    assert isinstance(warm['interval'], tuple)
    for changed in (dict(n=3), dict(seed=1), dict(cfg=dataclasses.replace(cfg,
                                                                          max_turns=2))):
        args = {**dict(n=2, seed=0, cfg=cfg), **changed}
        arl.evaluate_once(base, tasks[:3], tok, args['n'], args['seed'], args['cfg'])
    assert len(calls) == 4                       # each setting is its own entry
    trained = copy.deepcopy(base)
    with torch.no_grad():
        next(trained.parameters()).add_(0.01)
    arl.evaluate_once(trained, tasks[:3], tok, 2, 0, cfg)
    assert len(calls) == 5                       # another model: another entry


@pytest.mark.parametrize('lam, loss, beta, micro', [(1.0, 'jsd', 1.0, 3), (0.5, 'jsd', 0.5, 32),
                                                    (0.0, 'sft', 1.0, 2)])
def test_train_opd_is_train_rl_with_a_part_bit_for_bit(lam, loss, beta, micro):
    """Chapter 15's train_opd (chapter 7's train_rl with a sampler and the Distillation
    part) trains exactly as the frozen copy of its own old loop: the same weights after
    three steps, on- and off-policy, with micro-batches that split a family's rows."""
    tasks = [t for t in arl.make_tasks('train') if t.family in ('calc', 'max', 'sum')][:9]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    make = lambda: arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2,
                                 max_len=128).eval()
    student, teachers = make(), {'calc': make(), 'max': make(), 'sum': make()}
    cfg = arl.OPDConfig(tasks_per_step=6, max_tokens=48, max_turns=2, lam=lam, loss=loss,
                        beta=beta, micro_batch_size=micro, seed=2, lr=1e-2)
    old, new = copy.deepcopy(student), copy.deepcopy(student)
    h_old = train_opd_v1(old, teachers, tasks, tok, cfg, 3, eval_tasks=tasks[:2],
                         eval_every=2, eval_n=1, progress=False)
    h_new = arl.train_opd(new, teachers, tasks, tok, cfg, 3, eval_tasks=tasks[:2],
                          eval_every=2, eval_n=1, progress=False)
    assert _same_weights(old, new) and not _same_weights(new, student)
    assert [r.get('heldout') for r in h_old] == [r.get('heldout') for r in h_new]
    for a, b in zip(h_old[:3], h_new[:3]):
        for key in ('loss', 'grad_norm', 'reverse_kl', 'forward_kl', 'entropy',
                    'on_policy', 'teacher_episodes', 'reward', 'length'):
            assert b[key] == a[key], key
        assert b['sampled'] == a['episodes']          # the step's own student episodes
