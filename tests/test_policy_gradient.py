"""Tests for agentrl/policy_gradient.py (chapter 6): compute_advantages and reinforce_loss."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import agentrl as arl

SCALED, UNSCALED = SimpleNamespace(scale_rewards=True), SimpleNamespace(scale_rewards=False)


def _batch(rewards_per_group):
    reward = torch.tensor([float(r) for g in rewards_per_group for r in g])
    group = torch.tensor([i for i, g in enumerate(rewards_per_group) for _ in g])
    return dict(reward=reward, group=group)


def test_advantages_subtract_group_mean():
    adv = arl.compute_advantages(_batch([[1, 0, 0, 1], [1, 1, 1, 0]]), UNSCALED)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))


def test_advantages_divide_by_unbiased_group_std():
    adv = arl.compute_advantages(_batch([[1, 0, 0, 0]]), SCALED)
    std = torch.tensor([1.0, 0, 0, 0]).std()                       # unbiased, as torch.std
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]) / std, atol=1e-5)


def test_advantages_zero_for_equal_rewards_and_default_unscaled():
    batch = _batch([[1, 1, 1], [0, 0, 0], [0.5, 0.5, 0.5]])
    assert (arl.compute_advantages(batch, SCALED) == 0).all()
    assert (arl.compute_advantages(batch, object()) == 0).all()    # no scale_rewards attribute: unscaled


def test_advantages_groups_need_not_be_contiguous_or_complete():
    batch = dict(reward=torch.tensor([1.0, 0.0, 3.0, 1.0]), group=torch.tensor([2, 0, 2, 0]))
    assert torch.allclose(arl.compute_advantages(batch, UNSCALED), torch.tensor([-1.0, -0.5, 1.0, 0.5]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=2, max_size=8), min_size=1, max_size=6), st.booleans())
def test_advantages_sum_to_zero_per_group_and_unit_variance(groups, scale):
    batch = _batch(groups)
    adv = arl.compute_advantages(batch, SimpleNamespace(scale_rewards=scale))
    for g in range(len(groups)):
        a = adv[batch['group'] == g]
        assert abs(a.sum()) < 1e-4
        if scale and len(set(groups[g])) > 1:
            assert abs((a ** 2).sum() / (len(a) - 1) - 1) < 1e-3


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match='reward'):
        arl.compute_advantages(dict(reward=torch.ones(3), group=torch.zeros(2, dtype=torch.long)), UNSCALED)
    with pytest.raises(ValueError, match='reward'):
        arl.compute_advantages(dict(reward=torch.ones(2, 2), group=torch.zeros(2, 2, dtype=torch.long)),
                               UNSCALED)


def test_advantages_of_an_empty_batch_are_empty():
    for cfg in (UNSCALED, SCALED):
        adv = arl.compute_advantages(arl.collate([], pad_id=0), cfg)
        assert adv.shape == (0,)


def _token_weights(lengths, mode, norm_const=None, adv=None):
    T = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    logp = torch.zeros_like(mask, requires_grad=True)
    adv = torch.ones(len(lengths)) if adv is None else adv
    arl.reinforce_loss(logp, adv, mask, mode, norm_const).backward()
    return -logp.grad, mask


def test_token_mean_weight_is_one_over_batch_tokens():
    w, mask = _token_weights([2, 3, 5], 'token_mean')
    assert torch.allclose(w[mask.bool()], torch.full((10,), 0.1))
    assert (w[~mask.bool()] == 0).all()


def test_seq_mean_weight_is_one_over_length_times_batch():
    w, mask = _token_weights([2, 3, 5], 'seq_mean')
    expected = torch.tensor([1 / (3 * 2)] * 2 + [1 / (3 * 3)] * 3 + [1 / (3 * 5)] * 5)
    assert torch.allclose(w[mask.bool()], expected)


def test_constant_weight_is_one_over_norm_const_or_padded_size():
    w, mask = _token_weights([2, 3, 5], 'constant', norm_const=40)
    assert torch.allclose(w[mask.bool()], torch.full((10,), 1 / 40))
    w, mask = _token_weights([2, 3, 5], 'constant')                    # default B * T = 15
    assert torch.allclose(w[mask.bool()], torch.full((10,), 1 / 15))


def test_loss_values_and_per_token_advantages():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    weighted_sum = 2 * (-3.0) + (-1) * (-0.5)                         # -5.5
    assert torch.isclose(arl.reinforce_loss(logp, adv, mask, 'token_mean'), torch.tensor(5.5 / 3))
    assert torch.isclose(arl.reinforce_loss(logp, adv, mask, 'seq_mean'), torch.tensor(-(-3.0 + 0.5) / 2))
    assert torch.isclose(arl.reinforce_loss(logp, adv, mask, 'constant', 11), torch.tensor(-weighted_sum / 11))
    per_token = adv[:, None].expand(2, 3)                              # [B, T] advantages give the same loss
    assert torch.isclose(arl.reinforce_loss(logp, per_token, mask), arl.reinforce_loss(logp, adv, mask))


def test_constant_mode_adds_up_over_micro_batches():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 7, generator=gen)
    mask = (torch.rand(6, 7, generator=gen) > 0.3).float()
    adv = torch.randn(6, generator=gen)
    n = mask.sum()
    full = arl.reinforce_loss(logp, adv, mask, 'token_mean')
    parts = sum(arl.reinforce_loss(logp[r], adv[r], mask[r], 'constant', n) for r in torch.arange(6).split(4))
    assert torch.isclose(full, parts, atol=1e-6)


def test_reinforce_loss_rejects_bad_input():
    logp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match='mode'):
        arl.reinforce_loss(logp, torch.ones(2), mask, 'sum')
    with pytest.raises(ValueError, match='mask'):
        arl.reinforce_loss(logp, torch.ones(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match='adv'):
        arl.reinforce_loss(logp, torch.ones(3), mask)
    with pytest.raises(ValueError, match='norm_const'):
        arl.reinforce_loss(logp, torch.ones(2), mask, 'constant', 0)
