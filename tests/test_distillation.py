"""Unit tests for agentrl.distillation (chapter 15): the generalised JSD, the per-token KL
estimators, routing, the distillation loss and loop, cached specialists and runs."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import agentrl as arl

V = 13


def naive_jsd(s_logits, t_logits, beta):
    """The textbook formula (softmax and log), fine for small logits."""
    s, t = s_logits.softmax(-1), t_logits.softmax(-1)
    kl = lambda p, q: (p * (p.log() - q.log())).sum(-1)
    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = (1 - beta) * s + beta * t
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def _logits(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def test_jsd_endpoints_are_the_two_kls():
    s, t = _logits(3, 5, V, seed=0), _logits(3, 5, V, seed=1)
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    forward = F.kl_div(ls, lt, reduction='none', log_target=True).sum(-1)   # KL(t||s)
    reverse = F.kl_div(lt, ls, reduction='none', log_target=True).sum(-1)   # KL(s||t)
    assert arl.generalized_jsd(s, t, 0.0).shape == (3, 5)
    assert torch.allclose(arl.generalized_jsd(s, t, 0.0), forward, atol=1e-12)
    assert torch.allclose(arl.generalized_jsd(s, t, 1.0), reverse, atol=1e-12)
    assert not torch.allclose(forward, reverse)          # the two directions differ


@pytest.mark.parametrize('beta', [0.0, 0.1, 0.5, 0.9, 1.0])
def test_jsd_is_zero_for_equal_logits_and_matches_the_formula(beta):
    s, t = _logits(4, V, seed=2), _logits(4, V, seed=3)
    assert arl.generalized_jsd(s, s, beta).abs().max() < 1e-12
    assert torch.allclose(arl.generalized_jsd(s, t, beta), naive_jsd(s, t, beta),
                          atol=1e-12)
    assert (arl.generalized_jsd(s, t, beta) > 0).all()


def test_jsd_half_is_symmetric_and_bounded_by_log_2():
    s, t = _logits(6, V, seed=4, scale=5), _logits(6, V, seed=5, scale=5)
    half = arl.generalized_jsd(s, t, 0.5)
    assert torch.allclose(half, arl.generalized_jsd(t, s, 0.5), atol=1e-12)
    assert (half <= math.log(2) + 1e-12).all()


@pytest.mark.parametrize('beta', [0.0, 0.3, 0.5, 1.0])
def test_jsd_gradients_match_float64_autograd_of_the_naive_formula(beta):
    s = _logits(2, 3, V, seed=6).requires_grad_()
    t = _logits(2, 3, V, seed=7)
    (g,) = torch.autograd.grad(arl.generalized_jsd(s, t, beta).sum(), s)
    (g_ref,) = torch.autograd.grad(naive_jsd(s, t, beta).sum(), s)
    assert torch.allclose(g, g_ref, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: arl.generalized_jsd(x, t, beta), (s,))


@pytest.mark.parametrize('beta', [0.0, 0.5, 1.0])
def test_jsd_is_stable_for_huge_logits_and_underflowing_teachers(beta):
    s, t = _logits(4, V, seed=8, scale=1e4).float(), _logits(4, V, seed=9, scale=1e4).float()
    assert not naive_jsd(s, t, beta).isfinite().all()     # the naive formula breaks
    x = s.clone().requires_grad_()
    value = arl.generalized_jsd(x, t, beta)
    (g,) = torch.autograd.grad(value.sum(), x)
    assert value.isfinite().all() and g.isfinite().all()
    # a teacher probability of exactly 0 (logit -inf): forward KL and JSD stay finite
    zero = _logits(4, V, seed=10)
    zero[:, :3] = -float('inf')
    x = _logits(4, V, seed=11).requires_grad_()
    value = arl.generalized_jsd(x, zero, beta)
    if beta < 1:
        (g,) = torch.autograd.grad(value.sum(), x)
        assert value.isfinite().all() and g.isfinite().all()
    else:       # the student has mass where the teacher has none: infinite reverse KL
        assert (value == float('inf')).all()


def test_jsd_half_precision_is_computed_in_float32():
    s, t = _logits(3, V, seed=12).half(), _logits(3, V, seed=13).half()
    out = arl.generalized_jsd(s, t, 0.5)
    assert out.dtype == torch.float32
    assert torch.allclose(out, arl.generalized_jsd(s.float(), t.float(), 0.5))


def test_jsd_temperature_divides_both_logits():
    s, t = _logits(3, V, seed=14), _logits(3, V, seed=15)
    for beta in (0.0, 0.5, 1.0):
        assert torch.allclose(arl.generalized_jsd(s, t, beta, temperature=2.0),
                              arl.generalized_jsd(s / 2, t / 2, beta), atol=1e-12)


def test_jsd_rejects_bad_input():
    s = _logits(3, V)
    with pytest.raises(ValueError, match='beta'):
        arl.generalized_jsd(s, s, 1.5)
    with pytest.raises(TypeError, match='beta'):
        arl.generalized_jsd(s, s, None)
    with pytest.raises(ValueError, match='temperature'):
        arl.generalized_jsd(s, s, 0.5, temperature=0.0)
    with pytest.raises(ValueError, match='shape'):
        arl.generalized_jsd(s, s[:, :-1], 0.5)
    with pytest.raises(TypeError, match='student_logits'):
        arl.generalized_jsd(torch.ones(3, V, dtype=torch.long), s, 0.5)
    with pytest.raises(TypeError, match='teacher_logits'):
        arl.generalized_jsd(s, s.tolist(), 0.5)


@pytest.mark.parametrize('beta', [0.0, 0.5, 1.0])
@pytest.mark.parametrize('bad', [float('nan'), float('inf')])
@pytest.mark.parametrize('arg', ['student_logits', 'teacher_logits'])
def test_jsd_refuses_nan_and_positive_inf_at_every_beta(beta, bad, arg):
    """Issue: a NaN in the ignored side must not vanish into a finite divergence."""
    s, t = _logits(3, V), _logits(3, V, seed=1)
    poisoned = (s if arg == 'student_logits' else t).clone()
    poisoned[1, 4] = bad
    args = (poisoned, t) if arg == 'student_logits' else (s, poisoned)
    with pytest.raises(ValueError, match=arg):
        arl.generalized_jsd(*args, beta)


def test_jsd_still_accepts_minus_inf_logits():
    s, t = _logits(3, V), _logits(3, V, seed=1)
    t[:, :2] = -float('inf')
    assert torch.isfinite(arl.generalized_jsd(s, t, 0.0)).all()


def test_token_estimators_bias_matches_the_theory():
    s, t = _logits(V, seed=16, scale=2), _logits(V, seed=17, scale=2)
    n = 200_000
    est = arl.token_kl_estimators(s, t, n, torch.Generator().manual_seed(0))
    exact, value = est['exact']['grad'], est['exact']['value']
    assert value == pytest.approx(naive_jsd(s, t, 1.0).item(), abs=1e-12)
    z = s.clone().requires_grad_()
    (forward,) = torch.autograd.grad(arl.generalized_jsd(z, t, 0.0), z)

    def mean_and_se(g):
        return g.mean(0), (g.var(0).sum() / n).sqrt()

    m, se = mean_and_se(est['reward']['grads'])     # REINFORCE with the token reward
    assert (m - exact).norm() < 5 * se
    m, se = mean_and_se(est['k1']['grads'])         # k1 as a loss: no signal
    assert m.norm() < 5 * se and exact.norm() > 20 * se
    m, se = mean_and_se(est['k3']['grads'])         # k3 as a loss: the forward KL's
    assert (m - forward).norm() < 5 * se and (m - exact).norm() > 20 * se
    for name in ('k1', 'k3'):                       # both values are unbiased
        v = est[name]['values']
        assert abs(v.mean().item() - value) < 5 * v.std().item() / n ** 0.5
    assert (est['k3']['values'] >= 0).all()
    with pytest.raises(ValueError, match='1-D'):
        arl.token_kl_estimators(s[None], t[None], 10, torch.Generator())
    with pytest.raises(ValueError, match='n_samples'):
        arl.token_kl_estimators(s, t, 0, torch.Generator())


def _traj(family, ids, mask, name='x'):
    return arl.Trajectory(ids=torch.tensor(ids), action_mask=torch.tensor(mask, dtype=torch.float),
                          sample_logp=torch.zeros(len(mask)), reward=0.0,
                          info=dict(family=family, task=name, group=0))


def test_routing_sends_every_trajectory_to_its_familys_teacher():
    families = ['sum', 'max', 'calc', 'max', 'sum', 'sum']
    trajs = [_traj(f, [1, 2, 3], [1.0, 1.0], name=str(i)) for i, f in enumerate(families)]
    teachers = {'max': 'T_max', 'calc': 'T_calc', 'lookup': 'T_lookup', 'sum': 'T_sum'}
    routes = arl.route_by_family(trajs, teachers)
    assert [f for f, _ in routes] == ['max', 'calc', 'sum']      # teacher order, used only
    assert sorted(i for _, idx in routes for i in idx) == list(range(len(trajs)))
    for family, idx in routes:
        assert all(trajs[i].info['family'] == family for i in idx)
    with pytest.raises(ValueError, match='chain'):
        arl.route_by_family([_traj('chain', [1, 2], [1.0])], teachers)
    with pytest.raises(TypeError, match='teachers'):
        arl.route_by_family(trajs, {})


class _Logits(torch.nn.Module):
    """A 'model' that returns fixed logits [B, T, V] whatever the ids (same shape)."""
    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def forward(self, ids):
        return self.logits[:ids.shape[0], :ids.shape[1]]


def test_observation_and_prompt_tokens_carry_zero_loss():
    gen = torch.Generator().manual_seed(0)
    B, T = 3, 9
    ids = torch.randint(1, V, (B, T), generator=gen)
    mask = (torch.rand(B, T - 1, generator=gen) < 0.5).float()
    mask[0, 0] = 1.0
    student_logits = torch.randn(B, T, V, generator=gen)
    # the teacher agrees with the student on policy tokens and differs elsewhere
    teacher_logits = student_logits.clone()
    off = torch.cat([1 - mask, torch.ones(B, 1)], 1).bool()          # [B, T]
    teacher_logits[off] = torch.randn(int(off.sum()), V, generator=gen) * 3
    student = _Logits(student_logits)
    teacher = _Logits(teacher_logits)
    n = mask.sum()
    for beta in (0.0, 0.5, 1.0):
        loss, stats = arl.distill_loss(student, teacher, ids, mask, beta, n)
        loss.backward()
        assert abs(loss.item()) < 1e-6 and abs(stats['reverse_kl']) < 1e-5
        assert student.logits.grad.abs().max() < 1e-6
        student.logits.grad = None
    loss, _ = arl.distill_loss(student, teacher, ids, torch.ones_like(mask), 1.0, n)
    assert loss.item() > 0.1                     # the same positions do count when masked in
    loss, _ = arl.distill_loss(student, teacher, ids, mask, 1.0, n, loss='sft')
    ref = -(student_logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
            * mask).sum() / n
    assert torch.allclose(loss, ref)


def test_distill_loss_is_normalised_by_the_whole_batch():
    gen = torch.Generator().manual_seed(1)
    B, T = 4, 7
    ids = torch.randint(1, V, (B, T), generator=gen)
    mask = (torch.rand(B, T - 1, generator=gen) < 0.6).float()
    student, teacher = _Logits(torch.randn(B, T, V, generator=gen)), \
        _Logits(torch.randn(B, T, V, generator=gen))
    n = mask.sum()
    whole, _ = arl.distill_loss(student, teacher, ids, mask, 1.0, n)
    per_token = arl.generalized_jsd(student.logits[:, :-1], teacher.logits[:, :-1], 1.0)
    assert torch.allclose(whole, (per_token * mask).sum() / n)
    halves = sum(arl.distill_loss(_Logits(student.logits[r].detach()),
                                  _Logits(teacher.logits[r].detach()),
                                  ids[r], mask[r], 1.0, n)[0] for r in (slice(0, 1), slice(1, 4)))
    assert torch.allclose(whole, halves)


def test_opd_config_rejects_bad_values():
    with pytest.raises(ValueError, match='loss'):
        arl.OPDConfig(loss='mse')
    with pytest.raises(ValueError, match='beta'):
        arl.OPDConfig(beta=2.0)
    with pytest.raises(ValueError, match='teacher_temperature'):
        arl.OPDConfig(teacher_temperature=0.0)


@pytest.fixture(scope='module')
def small():
    """A tokenizer, a few tasks of two families, a tiny student and two tiny teachers."""
    tasks = [t for t in arl.make_tasks('train') if t.family in ('calc', 'max')][:8]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    make = lambda: arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=256).eval()
    student = make()
    teachers = {'calc': make(), 'max': make()}
    return tok, tasks, student, teachers


def test_train_opd_history_and_on_policy_share(small):
    tok, tasks, student, teachers = small
    cfg = arl.OPDConfig(tasks_per_step=4, max_tokens=40, max_turns=2)
    model = copy.deepcopy(student)
    hist = arl.train_opd(model, teachers, tasks, tok, cfg, 2, eval_tasks=tasks[:2],
                         eval_every=1, eval_n=1, progress=False)
    assert [('heldout' in r) for r in hist] == [True, True, True]
    assert all(r['on_policy'] and r['sampled'] == r['kept'] == 4
               and r['teacher_episodes'] == 0 for r in hist[:2])
    assert [r['episodes'] for r in hist] == [0, 4, 8]      # student episodes before each
    assert all(r['loss'] > 0 and r['entropy'] > 0 for r in hist[:2])
    assert hist[0]['loss'] == pytest.approx(hist[0]['reverse_kl'], rel=1e-5)  # beta = 1
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), student.parameters()))
    off = arl.train_opd(copy.deepcopy(student), teachers, tasks, tok,
                        arl.OPDConfig(tasks_per_step=4, max_tokens=40, max_turns=2, lam=0.0),
                        2, progress=False)
    assert all(not r['on_policy'] and r['sampled'] == r['episodes'] == 0
               and r['teacher_episodes'] == r['kept'] == 4 for r in off)
    with pytest.raises(ValueError, match='no teacher'):
        arl.train_opd(copy.deepcopy(student), {'calc': teachers['calc']}, tasks, tok, cfg, 1,
                      progress=False)
    with pytest.raises(ValueError, match='steps'):
        arl.train_opd(copy.deepcopy(student), teachers, tasks, tok, cfg, 0, progress=False)


def test_train_opd_is_deterministic_and_micro_batching_changes_nothing(small):
    tok, tasks, student, teachers = small
    cfg = arl.OPDConfig(tasks_per_step=4, max_tokens=40, max_turns=2)
    runs = []
    for micro in (32, 32, 1):
        model = copy.deepcopy(student)
        h = arl.train_opd(model, teachers, tasks, tok,
                          arl.OPDConfig(**{**vars(cfg), 'micro_batch_size': micro}), 1,
                          progress=False)
        runs.append((model, h[0]['loss']))
    assert all(torch.equal(p, q) for p, q in zip(runs[0][0].parameters(),
                                                  runs[1][0].parameters()))
    assert runs[2][1] == pytest.approx(runs[0][1], rel=1e-5)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(runs[0][0].parameters(),
                                                               runs[2][0].parameters()))


def test_make_teachers_is_cached_and_deterministic(small, tmp_path, monkeypatch):
    tok = small[0]
    student = arl.make_rl_base(tok, verbose=False)    # from the usual cache, before the switch
    recipe = dict(steps=1, tasks_per_step=4, eval_n=0, tasks_per_family=10)
    built = {}
    for name in ('a', 'b'):
        monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path / name))
        built[name] = arl.make_teachers(tok, recipe=recipe, base=student, families=('calc',))
    a, b = built['a']['calc'], built['b']['calc']
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), student.parameters()))

    def no_training(*args, **kwargs):
        raise AssertionError('a cached specialist was trained again')

    monkeypatch.setattr(arl, 'train_rl', no_training)
    again, hist = arl.make_teachers(tok, recipe=recipe, base=student, families=('calc',),
                                    with_history=True)
    assert all(torch.equal(p, q) for p, q in zip(again['calc'].parameters(), b.parameters()))
    assert len(hist['calc']) == 1 and 'reward' in hist['calc'][0]
    with pytest.raises(AssertionError, match='trained again'):     # a new recipe trains
        arl.make_teachers(tok, recipe=dict(recipe, seed=1), base=student, families=('calc',))
    with pytest.raises(ValueError, match='recipe'):
        arl.make_teachers(tok, recipe=dict(width=128), base=student)
    with pytest.raises(ValueError, match='families'):
        arl.make_teachers(tok, base=student, families=('poetry',))


def test_train_opd_cached_loads_the_second_time(small, tmp_path, monkeypatch):
    tok, tasks, student, teachers = small
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    cfg = arl.OPDConfig(tasks_per_step=2, max_tokens=40, max_turns=2)
    model, hist = arl.train_opd_cached(student, teachers, tasks, tok, cfg, 1)
    monkeypatch.setattr(arl.distillation, 'train_opd', lambda *a, **k: pytest.fail('trained again'))
    again, hist2 = arl.train_opd_cached(student, teachers, tasks, tok, cfg, 1)
    assert hist2 == hist
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_train_opd_parts_join_the_update(small):
    """The update's parts are the loop's only hook into the gradient: a part after the
    Distillation sees every update start and changes nothing; parts[0] must distil."""
    tok, tasks, student, teachers = small
    cfg = arl.OPDConfig(tasks_per_step=4, max_tokens=40, max_turns=2, micro_batch_size=3)
    starts = []

    class Count(arl.UpdateTerm):
        def start(self, batch):
            starts.append(int(batch['action_mask'].sum()))

    plain, hooked = copy.deepcopy(student), copy.deepcopy(student)
    h_plain = arl.train_opd(plain, teachers, tasks, tok, cfg, 3, progress=False)
    h_hooked = arl.train_opd(hooked, teachers, tasks, tok, cfg, 3, progress=False,
                             parts=(arl.Distillation(teachers, cfg), Count()))
    assert len(starts) == 3 and all(n > 0 for n in starts)
    assert h_plain == h_hooked
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), hooked.parameters()))
    assert any(not torch.equal(p, q) for p, q in zip(plain.parameters(), student.parameters()))
    with pytest.raises(TypeError, match='Distillation'):
        arl.train_opd(copy.deepcopy(student), teachers, tasks, tok, cfg, 1, progress=False,
                      parts=(Count(),))


def test_opd_config_is_an_rl_config_without_group_baseline():
    cfg = arl.OPDConfig()
    assert isinstance(cfg, arl.RLConfig)
    assert (cfg.group_size, cfg.epochs, cfg.lr_schedule) == (1, 1, 'constant')
    with pytest.raises(ValueError, match='group_size'):
        arl.RLConfig(group_size=1)
    with pytest.raises(ValueError, match='teacher_temperature'):
        arl.OPDConfig(teacher_temperature=0.0)


def test_opd_draws_picks_tasks_then_flips_the_on_policy_coin():
    tasks = arl.make_tasks('train')[:20]
    cfg = arl.OPDConfig(tasks_per_step=5, lam=0.5)
    gen = torch.Generator().manual_seed(3)
    picked, on_policy = arl.opd_draws(tasks, cfg, gen)
    ref = torch.Generator().manual_seed(3)
    pick = torch.randperm(20, generator=ref)[:5].tolist()
    assert [t.name for t in picked] == [tasks[i].name for i in pick]
    assert on_policy == bool(torch.rand(1, generator=ref) < 0.5)
    assert torch.equal(gen.get_state(), ref.get_state())          # nothing else drawn
    always = arl.OPDConfig(tasks_per_step=5, lam=1.0)
    assert all(arl.opd_draws(tasks, always, gen)[1] for _ in range(20))
