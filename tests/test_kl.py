"""Tests for agentrl/kl.py (chapter 9): KL estimators, KLConfig and its parts of rl_update."""
import copy
import math

import pytest
import torch

import agentrl as arl
from agentrl import rl_loop
from helpers import informative_rewards


def _batch(tiny_agent, seed=0, n_tasks=4):
    tasks, tok, model = tiny_agent
    cfg = arl.RLConfig(group_size=4, max_turns=3)
    trajs = arl.sample_groups(model, lambda: arl.make_env(cfg), tasks[:n_tasks], tok, cfg,
                              torch.Generator().manual_seed(seed))
    for i, t in enumerate(trajs):
        t.reward = float(i % 3 == 0)
    batch = arl.collate(trajs, tok.pad_id)
    return batch, arl.compute_advantages(batch, cfg)


def _perturb(model, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _drifted(tiny_agent):
    """A batch, zero advantages, the model as reference and a perturbed copy of it."""
    batch, _ = _batch(tiny_agent)
    model = tiny_agent[2]
    m = copy.deepcopy(model)
    _perturb(m, 0.1)
    return batch, torch.zeros(len(batch['ids'])), copy.deepcopy(model), m


# --- estimators ---------------------------------------------------------------------

def test_estimators_match_their_closed_forms():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -4.0]])
    log_r = ref - logp
    assert torch.allclose(arl.kl_estimate(logp, ref, 'k1'), logp - ref)
    assert torch.allclose(arl.kl_estimate(logp, ref, 'k2'), 0.5 * log_r ** 2)
    assert torch.allclose(arl.kl_estimate(logp, ref), log_r.exp() - 1 - log_r)
    assert arl.kl_estimate(logp, ref).shape == logp.shape
    # k2 and k3 are >= 0 everywhere; all three are 0 where pi == pi_ref
    for est in ('k2', 'k3'):
        assert (arl.kl_estimate(logp, ref, est) >= 0).all()
    assert arl.kl_estimate(logp, logp, 'k1').abs().max() == 0


def test_k1_and_k3_are_unbiased_and_k2_is_not_on_a_categorical():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(20, generator=g), 0)
    q = torch.softmax(torch.randn(20, generator=g), 0)
    true = (p * (p / q).log()).sum()
    # exact expectations under p, no sampling
    logp, logq = p.log(), q.log()
    mean = {e: (p * arl.kl_estimate(logp, logq, e)).sum() for e in ('k1', 'k2', 'k3')}
    assert mean['k1'] == pytest.approx(true.item(), rel=1e-5)
    assert mean['k3'] == pytest.approx(true.item(), rel=1e-5)
    assert abs(mean['k2'] - true) > 1e-3 * true


def test_kl_estimate_rejects_bad_input():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match='estimator'):
        arl.kl_estimate(x, x, 'k4')
    with pytest.raises(ValueError, match='ref_logp'):
        arl.kl_estimate(x, torch.zeros(4))


def test_token_entropy():
    logits = torch.zeros(2, 5, 8)
    assert torch.allclose(arl.token_entropy(logits), torch.full((2, 5), math.log(8)))
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert arl.token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)


# --- config -------------------------------------------------------------------------

def test_klconfig_validates_its_fields_and_the_parents():
    cfg = arl.KLConfig(kl_coef=0.1, kl_estimator='k2', kl_mode='reward', entropy_coef=0.01)
    assert isinstance(cfg, arl.RLConfig) and cfg.group_size == arl.RLConfig().group_size
    for bad, name in ((dict(kl_coef=-1.0), 'kl_coef'), (dict(kl_estimator='k5'), 'kl_estimator'),
                      (dict(kl_mode='both'), 'kl_mode'), (dict(entropy_coef=-0.1), 'entropy_coef'),
                      (dict(kl_coef=float('nan')), 'kl_coef'), (dict(lr_schedule='cos'), 'lr_schedule')):
        with pytest.raises(ValueError, match=name):
            arl.KLConfig(**bad)


# --- rl_update ----------------------------------------------------------------------

def test_update_without_penalty_is_chapter_7_bit_for_bit(monkeypatch, tiny_agent):
    tasks, tok, model = tiny_agent
    informative_rewards(monkeypatch)
    cfg7 = arl.RLConfig(seed=3, tasks_per_step=4, group_size=4, max_turns=3)
    cfg9 = arl.KLConfig(seed=3, tasks_per_step=4, group_size=4, max_turns=3)
    ref = copy.deepcopy(model)
    assert arl.rl_update is rl_loop.rl_update and arl.train_rl is rl_loop.train_rl
    a = copy.deepcopy(model)
    ha = arl.train_rl(a, tasks, tok, cfg7, 3, progress=False)
    b = copy.deepcopy(model)                 # KLConfig with a reference and no penalty
    hb = arl.train_rl(b, tasks, tok, cfg9, 3, ref_model=ref, progress=False)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert [h['kept'] for h in hb] == [16, 16, 16]
    for key in ('loss', 'grad_norm', 'clip_frac', 'entropy', 'ratio_max'):
        assert [h[key] for h in ha] == [h[key] for h in hb]
    assert all('kl_ref' in h and 'kl_ref' not in g for g, h in zip(ha, hb))
    assert ha[0]['grad_norm'] > 0
    assert any(p.ne(q).any() for p, q in zip(a.parameters(), model.parameters()))


def test_stats_keys_and_values(tiny_agent):
    tasks, tok, model = tiny_agent
    batch, adv = _batch(tiny_agent)
    mask = batch['action_mask'].bool()
    m, ref = copy.deepcopy(model), copy.deepcopy(model)
    _perturb(ref, 0.05)                         # make the reference differ from the policy
    with torch.no_grad():
        logits = model(batch['ids'])
        logp = arl.selected_log_probs(logits[:, :-1], batch['ids'][:, 1:])
        ref_logp = arl.sequence_log_probs(ref, batch['ids'])
    want_entropy = arl.token_entropy(logits[:, :-1])[mask].mean().item()
    want_kl = arl.kl_estimate(logp, ref_logp)[mask].mean().item()
    cfg = arl.KLConfig(epochs=2, micro_batch_size=5)
    stats = arl.rl_update(m, torch.optim.Adam(m.parameters(), lr=1e-2), batch, adv, cfg,
                          ref_model=ref, generator=torch.Generator().manual_seed(0))
    assert set(stats) >= {'update_tokens', 'loss', 'grad_norm', 'clip_frac', 'entropy',
                          'kl_ref', 'ratio_min', 'ratio_max'}
    assert stats['entropy'] == pytest.approx(want_entropy, rel=1e-5)
    assert stats['kl_ref'] == pytest.approx(want_kl, rel=1e-4) and want_kl > 0
    # the second epoch sees the model after one Adam step: ratios move away from 1
    assert stats['ratio_min'] < 1 < stats['ratio_max']
    one = arl.rl_update(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0),
                        batch, adv, arl.RLConfig(epochs=1))
    assert one['ratio_min'] == one['ratio_max'] == 1.0 and 'kl_ref' not in one


def test_kl_penalty_needs_a_reference(tiny_agent):
    batch, adv = _batch(tiny_agent)
    m = copy.deepcopy(tiny_agent[2])
    with pytest.raises(ValueError, match='ref_model'):
        arl.rl_update(m, torch.optim.SGD(m.parameters(), lr=0.1), batch, adv,
                      arl.KLConfig(kl_coef=0.1))


@pytest.mark.parametrize('estimator,mode', [('k3', 'loss'), ('k2', 'loss'),
                                            ('k1', 'reward')])
def test_kl_penalty_moves_the_policy_toward_the_reference(tiny_agent, estimator, mode):
    """With zero advantages only the penalty acts: a few steps must bring the policy's
    exact per-token KL to the reference down."""
    batch, zero, ref, m = _drifted(tiny_agent)
    model = tiny_agent[2]
    mask = batch['action_mask'].bool()

    def exact_kl(policy):
        with torch.no_grad():
            lp = torch.log_softmax(policy(batch['ids'])[:, :-1].float(), -1)
            lq = torch.log_softmax(ref(batch['ids'])[:, :-1].float(), -1)
            return (lp.exp() * (lp - lq)).sum(-1)[mask].mean().item()

    before = exact_kl(m)
    cfg = arl.KLConfig(kl_coef=1.0, kl_estimator=estimator, kl_mode=mode, epochs=1,
                       scale_rewards=False)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(20):
        stats = arl.rl_update(m, opt, batch, zero, cfg, ref_model=ref)
    after = exact_kl(m)
    assert before > 0 and after < 0.5 * before, (before, after)
    # the penalty leaves the reference untouched
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_k1_as_a_loss_has_no_expected_gradient_but_in_the_reward_follows_the_kl():
    """Chapter 9, section 3, by Monte Carlo on a 6-token categorical pi = softmax(theta)
    against exact gradients: k1 differentiated as a loss has expected gradient
    E_pi[grad log pi] = 0, while k1 in the reward (detached, times grad log pi)
    follows grad KL(pi || ref). Tolerances: 5 Monte Carlo standard errors."""
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(6, generator=g, dtype=torch.float64)
    ref = (theta0 + torch.randn(6, generator=g, dtype=torch.float64)).log_softmax(-1)
    theta = theta0.clone().requires_grad_()
    logp = theta.log_softmax(-1)
    (logp.exp() * (logp - ref)).sum().backward()
    exact = theta.grad.clone()                           # grad KL(pi || ref) [6]
    batches, per = 200, 2000
    grads = {'loss': [], 'reward': []}
    for _ in range(batches):
        x = torch.multinomial(theta0.softmax(-1), per, True, generator=g)   # x ~ pi
        for mode, found in grads.items():
            theta = theta0.clone().requires_grad_()
            logp = theta.log_softmax(-1)
            k1 = arl.kl_estimate(logp[x], ref[x], 'k1')                     # [per]
            surrogate = k1 if mode == 'loss' else k1.detach() * logp[x]
            surrogate.mean().backward()
            found.append(theta.grad)
    z = {}
    for mode, found in grads.items():
        found = torch.stack(found)                               # [batches, 6]
        mean, se = found.mean(0), found.std(0) / batches ** 0.5
        z[mode, '0'] = (mean / se).abs().max().item()
        z[mode, 'grad KL'] = ((mean - exact) / se).abs().max().item()
    assert z['loss', '0'] < 5 and z['reward', 'grad KL'] < 5, z
    # each estimate is far from the other's target: the test tells them apart
    assert z['loss', 'grad KL'] > 10 and z['reward', '0'] > 10, z


def test_entropy_bonus_raises_entropy(tiny_agent):
    tasks, tok, model = tiny_agent
    batch, _ = _batch(tiny_agent)
    zero = torch.zeros(len(batch['ids']))
    m = copy.deepcopy(model)
    cfg = arl.KLConfig(entropy_coef=1.0, epochs=1)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    first = arl.rl_update(m, opt, batch, zero, cfg)['entropy']
    for _ in range(5):
        last = arl.rl_update(m, opt, batch, zero, cfg)['entropy']
    assert last > first


def test_empty_batch_trains_nothing(tiny_agent):
    tok, model = tiny_agent[1], tiny_agent[2]
    empty = arl.collate([], tok.pad_id)
    m = copy.deepcopy(model)
    stats = arl.rl_update(m, torch.optim.SGD(m.parameters(), lr=1.0), empty,
                          torch.zeros(0), arl.KLConfig(kl_coef=0.1), ref_model=model)
    assert stats['update_tokens'] == 0
    for p, q in zip(m.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_clip_higher_is_a_part_with_its_own_upper_bound():
    assert not any(isinstance(t, arl.ClipHigher) for t in arl.KLConfig().update_terms(None))
    terms = arl.KLConfig(clip_eps_high=0.28).update_terms(None)
    (part,) = [t for t in terms if isinstance(t, arl.ClipHigher)]
    assert (part.low, part.high) == (0.2, 0.28)
    ratio = torch.tensor([[0.75, 1.25, 1.3]])
    logp, old = torch.log(ratio), torch.zeros(1, 3)
    objective, clipped = part.surrogate(logp, old, torch.tensor([[1.0]]), torch.ones(1, 3))
    # 1.25 is inside [0.8, 1.28] now (the symmetric clip would stop it at 1.2)
    assert clipped.tolist() == [[False, False, True]]
    assert torch.allclose(objective, torch.tensor([[0.75, 1.25, 1.28]]))
    with pytest.raises(ValueError, match='clip_eps_high'):
        arl.KLConfig(clip_eps_high=-0.1)
    with pytest.raises(ValueError, match='clip_eps_high needs a clip_eps below 1'):
        arl.KLConfig(clip_eps=math.inf, clip_eps_high=0.28)


def test_adaptive_kl_controller_moves_the_coefficient_toward_the_target(monkeypatch):
    seen = []

    def fake_update(model, optimizer, batch, advantages, cfg, ref_model, generator):
        seen.append(cfg.kl_coef)
        return dict(kl_ref=measured.pop(0))
    monkeypatch.setattr(arl, 'rl_update', fake_update)
    measured = [0.06, 0.03, 0.0, 0.033]
    controller = arl.AdaptiveKLController(0.5, target=0.03, rate=1.0)
    cfg = arl.KLConfig(kl_coef=0.5)
    coefs = [controller(None, None, None, None, cfg)['kl_coef'] for _ in range(4)]
    # twice the target: +20% (the error is clipped at 0.2); on target: unchanged;
    # no drift: -20%; 10% over: +10%
    assert coefs == pytest.approx([0.5, 0.6, 0.6, 0.48]) and seen == coefs
    assert controller.coef == pytest.approx(0.48 * 1.1)
    for bad in (dict(coef=0.0), dict(target=0.0), dict(rate=0.0), dict(rate=5.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            arl.AdaptiveKLController(**dict(dict(coef=0.5, target=0.03), **bad))


def test_adaptive_kl_controller_state_survives_a_checkpoint(monkeypatch):
    monkeypatch.setattr(arl, 'rl_update', lambda *args: dict(kl_ref=0.06))
    controller = arl.AdaptiveKLController(0.5, target=0.03)
    cfg = arl.KLConfig(kl_coef=0.5)
    for _ in range(3):
        controller(None, None, None, None, cfg)
    restored = arl.AdaptiveKLController(0.5, target=0.03)
    restored.load_state_dict(controller.state_dict())
    assert restored.coef == controller.coef == pytest.approx(0.5 * 1.02 ** 3)
    assert (restored(None, None, None, None, cfg)['kl_coef']
            == controller(None, None, None, None, cfg)['kl_coef'])
