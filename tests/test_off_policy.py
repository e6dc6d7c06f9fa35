"""Tests for agentrl/off_policy.py (chapter 8): ratios, the clipped objective, TIS weights, ppo_update."""
import copy
import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import agentrl as arl


def test_importance_ratio_is_one_off_mask():
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    old = torch.tensor([[0.0, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.allclose(arl.importance_ratio(logp, old, mask), torch.tensor([[1.0, torch.e, 1.0]]))
    with pytest.raises(ValueError, match='shape'):
        arl.importance_ratio(logp, old[:, :2], mask)


def _clipped(ratios, adv, clip_low=0.2, clip_high=0.2, norm_const=None, weights=None):
    logp = torch.tensor([ratios]).log().requires_grad_(True)
    loss, stats = arl.clipped_loss(logp, torch.zeros_like(logp), torch.tensor([adv]), torch.ones_like(logp),
                                   clip_low, clip_high, norm_const, weights)
    loss.backward()
    return loss.item(), logp.grad[0], stats


def test_clipped_loss_value_on_hand_made_input():
    # per-token objective min(r A, clip(r) A): 1.3*1 -> 1.2; 0.9*1 -> 0.9; 1.3*-1 -> -1.3; 0.7*-1 -> -0.8
    loss, grad, stats = _clipped([1.3, 0.9, 1.3, 0.7], [2.0, 1.0, -1.0, -1.0])
    assert loss == pytest.approx(-(2.4 + 0.9 - 1.3 - 0.8) / 4)
    # gradient wrt logp of -r A / N is -r A / N where unclipped, 0 where clipped
    assert torch.allclose(grad, torch.tensor([0.0, -0.9 / 4, 1.3 / 4, 0.0]))
    assert stats['clip_frac'] == 0.5
    assert stats['ratio_max'] == pytest.approx(1.3) and stats['ratio_min'] == pytest.approx(0.7)


def test_clipped_loss_asymmetric_clip_and_norm_const():
    loss, grad, stats = _clipped([1.25, 0.75], [2.0, -1.0], clip_low=0.2, clip_high=0.28, norm_const=10)
    assert loss == pytest.approx(-(1.25 * 2.0 - 0.8) / 10)
    assert torch.allclose(grad, torch.tensor([-1.25 * 2.0 / 10, 0.0]))
    assert stats['clip_frac'] == 0.5


def test_clipped_loss_without_clip_is_importance_weighted_and_weights_multiply():
    loss, grad, stats = _clipped([3.0, 0.1], [1.0, -1.0], clip_low=None, clip_high=None)
    assert loss == pytest.approx(-(3.0 - 0.1) / 2) and stats['clip_frac'] == 0
    loss_w, grad_w, _ = _clipped([1.0, 1.0], [1.0, 1.0], weights=torch.tensor([[2.0, 0.5]]))
    assert loss_w == pytest.approx(-(2.0 + 0.5) / 2)
    assert torch.allclose(grad_w, torch.tensor([-1.0, -0.25]))


def test_clipped_loss_at_ratio_one_equals_reinforce_gradient():
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen)).requires_grad_(True)
    mask = (torch.rand(3, 5, generator=gen) > 0.3).float()
    adv = torch.randn(3, generator=gen)
    loss, stats = arl.clipped_loss(logp, logp.detach(), adv, mask)
    g1, = torch.autograd.grad(loss, logp)
    g2, = torch.autograd.grad(arl.reinforce_loss(logp, adv, mask, 'token_mean'), logp)
    assert torch.allclose(g1, g2, atol=1e-7) and stats['clip_frac'] == 0 and stats['approx_kl'] == 0


@settings(max_examples=60, deadline=None)
@given(st.floats(0.05, 5.0), st.floats(0.1, 3) | st.floats(-3, -0.1), st.floats(0.05, 0.5))
def test_clipped_gradient_is_zero_exactly_on_the_profitable_side(r, a, eps):
    assume(abs(r - 1 - eps) > 1e-4 and abs(r - 1 + eps) > 1e-4)          # float32 rounding at the edges
    _, grad, stats = _clipped([r], [a], eps, eps)
    clipped = (r > 1 + eps and a > 0) or (r < 1 - eps and a < 0)
    assert (grad[0] == 0) == clipped
    assert stats['clip_frac'] == float(clipped)


def test_clipped_loss_rejects_bad_clip():
    with pytest.raises(ValueError, match='clip_low'):
        _clipped([1.0], [1.0], clip_low=1.5)


def test_truncated_is_weights_cap_mask_and_no_grad():
    trainer = torch.tensor([[0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    sampler = torch.tensor([[-3.0, 0.0, 1.0, -3.0]])                     # ratios e^3, 1, e^-1, e^3
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = arl.truncated_is_weights(trainer, sampler, mask, cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, torch.exp(torch.tensor(-1.0)), 0.0]]))
    assert not w.requires_grad
    assert (arl.truncated_is_weights(trainer, sampler, mask, cap=100.0)[0, 0] - torch.exp(torch.tensor(3.0))).abs() < 1e-3
    with pytest.raises(ValueError, match='cap'):
        arl.truncated_is_weights(trainer, sampler, mask, cap=0)


def _tiny_batch():
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    trajs = [arl.demonstration_trajectory(t, tok) for t in arl.make_tasks('train')[:6]]
    batch = arl.collate(trajs, tok.pad_id)
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=128)
    with torch.no_grad():
        batch['sample_logp'] = arl.sequence_log_probs(model, batch['ids']) * batch['action_mask']
    return model, batch


def test_ppo_update_first_epoch_is_on_policy_and_matches_reinforce_gradient():
    model, batch = _tiny_batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    cfg = arl.RLConfig(micro_batch_size=4, max_grad_norm=1e9)
    reference = copy.deepcopy(model)
    arl.reinforce_loss(arl.sequence_log_probs(reference, batch['ids']), adv, batch['action_mask'], 'token_mean').backward()
    hist = arl.ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, adv, cfg, epochs=1)
    assert hist[0]['clip_frac'] == 0 and abs(hist[0]['ratio_max'] - 1) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_ppo_update_tis_weights_enter_the_gradient_truncated_at_the_cap():
    """A sampler that disagrees with the trainer: log mu = log pi - delta, so the trainer's
    ratio pi / mu is exp(delta), known per token and on both sides of the cap. The first epoch
    (ratio 1 against the recomputed old log-probs) must then give the token-mean REINFORCE
    gradient with each token's term multiplied by min(exp(delta), cap)."""
    model, batch = _tiny_batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    mask = batch['action_mask']
    on = mask.bool()
    with torch.no_grad():
        own = arl.sequence_log_probs(model, batch['ids'])                 # log pi_old
    delta = torch.empty_like(own).uniform_(-1.5, 1.5, generator=torch.Generator().manual_seed(1))
    batch['sample_logp'] = (own - delta) * mask                           # the sampler's log mu
    cap = 2.0
    rho = delta.exp()
    assert (rho[on] > 1.2 * cap).sum() > 10 and (rho[on] < 0.8).sum() > 10  # both sides

    def reference_grad(weights):
        ref = copy.deepcopy(model)
        logp = arl.sequence_log_probs(ref, batch['ids'])
        (-(weights * adv[:, None] * logp * mask).sum() / mask.sum()).backward()
        return _grads(ref)

    expected = reference_grad(rho.clamp(max=cap) * mask)
    untruncated, unweighted = reference_grad(rho * mask), reference_grad(mask)
    cfg = arl.RLConfig(micro_batch_size=4, max_grad_norm=1e9)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hist = arl.ppo_update(model, opt, batch, adv, cfg, epochs=1, tis_cap=cap)
    got = _grads(model)
    assert hist[0]['clip_frac'] == 0 and abs(hist[0]['ratio_max'] - 1) < 1e-5
    assert torch.allclose(got, expected, atol=1e-6)
    # the test can tell the difference: without the cap, or without the weights, it fails
    scale = expected.norm()
    assert (got - untruncated).norm() > 0.05 * scale and (got - unweighted).norm() > 0.05 * scale
    # and the weights ppo_update used are the saved helper's, truncated at the cap
    w = arl.truncated_is_weights(own, batch['sample_logp'], mask, cap)
    assert torch.allclose(w, rho.clamp(max=cap) * mask, atol=1e-5) and w.max() <= cap


def test_ppo_update_several_epochs_move_the_ratio():
    model, batch = _tiny_batch()
    start = copy.deepcopy(model)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    cfg = arl.RLConfig(micro_batch_size=4, max_grad_norm=1.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hist = arl.ppo_update(model, opt, batch, adv, cfg, epochs=3)
    assert len(hist) == 3 and [h['epoch'] for h in hist] == [0, 1, 2]
    assert hist[0]['approx_kl'] < 1e-9 and abs(hist[0]['ratio_max'] - 1) < 1e-5
    assert hist[-1]['approx_kl'] > 1e-4 and hist[-1]['ratio_max'] > 1 > hist[-1]['ratio_min']
    # epoch 2's stats are the ratios of the model after two steps against the start
    mid = copy.deepcopy(start)
    mid_opt = torch.optim.Adam(mid.parameters(), lr=1e-2)
    arl.ppo_update(mid, mid_opt, batch, adv, cfg, epochs=2)
    mask = batch['action_mask']
    log_r = (arl.batch_log_probs(mid, batch) - arl.batch_log_probs(start, batch))[mask.bool()]
    assert hist[2]['approx_kl'] == pytest.approx((log_r.exp() - 1 - log_r).mean().item(), rel=1e-3)
    assert hist[2]['ratio_max'] == pytest.approx(log_r.exp().max().item(), rel=1e-3)
    with pytest.raises(ValueError, match='epochs'):
        arl.ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, adv, cfg, epochs=0)


def _leaf(rows):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def test_sequence_ratio_is_one_ratio_per_episode_clipped_whole():
    logp = _leaf([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -9.0, -9.0]])
    old = torch.tensor([[-1.1, -2.0, -0.5, -3.0], [-0.2, -0.1, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    part = arl.SequenceRatio(clip_low=0.01, clip_high=0.02)
    objective, clipped = part.surrogate(logp, old, adv, mask)
    s = torch.exp(torch.tensor([0.1 / 3, -0.3 / 2], dtype=torch.float64))  # geometric means
    assert torch.allclose(objective.detach()[:, 0], torch.minimum(s * adv[:, 0],
                          s.clamp(0.99, 1.02) * adv[:, 0]))
    # episode 0 rose by 3.4% with A > 0: clipped whole; episode 1 fell by 14% with A < 0: too
    assert clipped.tolist() == [[True] * 4, [True] * 4]
    (objective * mask).sum().backward()
    assert logp.grad.abs().sum() == 0                 # clipped everywhere: no gradient


def test_sequence_ratio_and_clipped_is_weights_are_reinforce_on_policy():
    logp = _leaf([[-1.0, -2.0, -0.5], [-0.3, -0.4, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[0.5], [-2.0]], dtype=torch.float64)
    for part in (arl.SequenceRatio(), arl.ClippedISWeights()):
        logp.grad = None
        objective, clipped = part.surrogate(logp, logp.detach(), adv, mask)
        assert not clipped.any() and torch.allclose(objective.detach(), adv.expand(2, 3))
        (objective * mask).sum().backward()
        assert torch.allclose(logp.grad, adv * mask)           # REINFORCE: A per token


def test_clipped_is_weights_keep_every_gradient_with_the_weight_capped():
    logp = _leaf([[-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0 - math.log(2.0), -1.0 + math.log(10.0), -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0]], dtype=torch.float64)
    objective, capped = arl.ClippedISWeights(clip_high=0.2).surrogate(logp, old, adv, mask)
    # ratios 2, 0.1, 1: the weight of the first is capped at 1.2, the second has no floor
    assert capped.tolist() == [[True, False, False]]
    assert torch.allclose(objective.detach(), torch.tensor([[1.2, 0.1, 1.0]], dtype=torch.float64))
    objective.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[1.2, 0.1, 1.0]], dtype=torch.float64))


def test_surrogate_parts_reject_bad_bounds():
    with pytest.raises(ValueError, match='clip_low'):
        arl.SequenceRatio(clip_low=1.0)
    with pytest.raises(ValueError, match='clip_high'):
        arl.SequenceRatio(clip_high=-0.1)
    with pytest.raises(ValueError, match='clip_high'):
        arl.ClippedISWeights(clip_high=-0.1)
