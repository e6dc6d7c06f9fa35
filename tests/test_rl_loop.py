"""Tests for agentrl/rl_loop.py (chapter 7): RLConfig, sample_step filtering, rl_update accumulation, stats."""
import copy
import json
import pathlib

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


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps."""
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def test_rl_update_clips_gradient_norm_and_steps(setup):
    tok, model = setup
    batch = _demo_batch(tok)
    adv = torch.linspace(-1, 1, 12) * 100
    # the gradient that rl_update clips: the full-batch REINFORCE gradient (first epoch)
    reference = copy.deepcopy(model)
    reference.zero_grad()
    arl.reinforce_loss(arl.sequence_log_probs(reference, batch['ids']), adv, batch['action_mask'],
                       'token_mean').backward()
    raw = _grads(reference)
    assert raw.norm() > 1.0                                                   # so clipping to 0.5 acts
    m = copy.deepcopy(model)
    before = torch.cat([p.detach().flatten() for p in m.parameters()])
    optimizer = CountingSGD(m.parameters(), lr=0.1)
    stats = arl.rl_update(m, optimizer, batch, adv, arl.RLConfig(epochs=1, max_grad_norm=0.5))
    assert stats['grad_norm'] == pytest.approx(raw.norm().item(), rel=1e-4)  # reported before clipping
    assert _grads(m).norm().item() == pytest.approx(0.5, rel=1e-4)           # applied after clipping
    assert torch.allclose(_grads(m), raw * 0.5 / raw.norm(), atol=1e-6)       # same direction
    after = torch.cat([p.detach().flatten() for p in m.parameters()])
    assert (after - before).norm().item() == pytest.approx(0.1 * 0.5, rel=1e-3)  # SGD step of it
    assert stats['update_tokens'] == int(batch['action_mask'].sum())
    for epochs in (1, 3):                                                     # one step per epoch
        m2 = copy.deepcopy(model)
        optimizer = CountingSGD(m2.parameters(), lr=1e-3)
        arl.rl_update(m2, optimizer, batch, adv / 100, arl.RLConfig(epochs=epochs))
        assert optimizer.steps == epochs
    # nothing to train on (every group had equal rewards): no optimiser step at all
    for empty in (dict(batch, action_mask=torch.zeros_like(batch['action_mask'])),
                  arl.collate([], tok.pad_id)):
        m3 = copy.deepcopy(model)
        optimizer = CountingSGD(m3.parameters(), lr=1.0)
        stats = arl.rl_update(m3, optimizer, empty, arl.compute_advantages(empty, arl.RLConfig()),
                              arl.RLConfig())
        assert optimizer.steps == 0 and stats['update_tokens'] == 0
        assert all(torch.equal(p, q) for p, q in zip(m3.parameters(), model.parameters()))


class JumpTo:
    """An optimiser stand-in whose first step replaces the model's weights by `target`'s."""
    def __init__(self, model, target):
        self.model, self.target, self.steps = model, target, 0

    def zero_grad(self):
        self.model.zero_grad()

    def step(self):
        self.steps += 1
        if self.steps == 1:
            self.model.load_state_dict(self.target.state_dict())


def test_rl_update_clip_frac_counts_the_tokens_outside_the_clip_range(setup):
    tok, model = setup
    batch = _demo_batch(tok)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.0, -1.0, 0.0, 1.0, -1.0, 1.0])
    target = copy.deepcopy(model)                        # the policy after the first step
    torch.manual_seed(3)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.3 * torch.randn_like(p))
    mask = batch['action_mask'].bool()                                        # [B, T-1]
    with torch.no_grad():
        ratio = torch.exp(arl.sequence_log_probs(target, batch['ids'])
                          - arl.sequence_log_probs(model, batch['ids']))      # [B, T-1]
    eps = 0.2
    a = adv[:, None].expand_as(ratio)
    high, low = (ratio > 1 + eps) & mask, (ratio < 1 - eps) & mask
    outside = (high & (a > 0)) | (low & (a < 0))          # where the clipped objective has no gradient
    # the case discriminates: some tokens of each kind, none within rounding of the clip bounds
    assert 0 < outside.sum() < mask.sum()
    assert (high & (a < 0)).any() and (low & (a > 0)).any() and (~high & ~low & mask).any()
    assert ((ratio[mask] - (1 + eps)).abs().min() > 1e-4
            and (ratio[mask] - (1 - eps)).abs().min() > 1e-4)
    m = copy.deepcopy(model)
    optimizer = JumpTo(m, target)
    cfg = arl.RLConfig(epochs=2, clip_eps=eps, micro_batch_size=5, max_grad_norm=float('inf'))
    stats = arl.rl_update(m, optimizer, batch, adv, cfg, generator=torch.Generator().manual_seed(0))
    assert optimizer.steps == 2
    assert stats['clip_frac'] * stats['update_tokens'] == pytest.approx(outside.sum().item())


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


# ---------------------------------------------------------------- train_rl
class ParityEnv(arl.ToolEnv):
    """ToolEnv whose reward is 1 when the episode ends on an even token count: a tiny untrained
    model then gets mixed groups, so every step of the loop (filter, update) really runs."""
    def _finish(self, outcome, reward=0.0):
        return super()._finish(outcome, float(self.length % 2 == 0))


TINY_RL = dict(tasks_per_step=3, group_size=4, max_tokens=40, max_turns=2, micro_batch_size=8)


@pytest.fixture
def tiny_rl(monkeypatch, setup):
    tok, model = setup
    monkeypatch.setattr(arl, 'make_env', lambda cfg=None: ParityEnv(cfg.max_turns, cfg.max_tokens))
    tasks = arl.make_tasks('train')[:10]

    def train(steps=4, eval_tasks=None, **changes):
        m = copy.deepcopy(model)
        cfg = arl.RLConfig(**dict(TINY_RL, **changes))
        history = arl.train_rl(m, tasks, tok, cfg, steps, eval_tasks=eval_tasks, eval_every=2,
                               eval_n=2, progress=False)
        return history, m
    return train


def test_train_rl_lr_schedule_linear_to_zero_or_constant(tiny_rl):
    steps = 5
    history, _ = tiny_rl(steps, lr=1e-3)
    assert [h['lr'] for h in history] == pytest.approx([1e-3 * (1 - s / steps) for s in range(steps)])
    assert any('loss' in h for h in history)                 # updates ran at those rates
    history, _ = tiny_rl(steps, lr=2e-3, lr_schedule='constant')
    assert [h['lr'] for h in history] == pytest.approx([2e-3] * steps)


def test_train_rl_evaluates_at_the_cadence_and_after_the_last_step(tiny_rl):
    eval_tasks = arl.make_tasks('heldout')[:3]
    history, _ = tiny_rl(5, eval_tasks=eval_tasks)
    assert [h['step'] for h in history] == [0, 1, 2, 3, 4, 5]
    assert [h['step'] for h in history if 'heldout' in h] == [0, 2, 4, 5]
    assert history[-1].keys() == {'step', 'episodes', 'heldout'}   # final evaluation only
    for h in history:
        if 'heldout' in h:
            assert h['heldout']['n_episodes'] == 3 * 2         # eval_n episodes per task
            assert set(h['heldout']['per_task']) == {t.name for t in eval_tasks}
    history, _ = tiny_rl(4, eval_tasks=eval_tasks)           # last step on the cadence: once
    assert [h['step'] for h in history if 'heldout' in h] == [0, 2, 4]
    history, _ = tiny_rl(3)                                  # no eval_tasks: no evaluation
    assert len(history) == 3 and not any('heldout' in h for h in history)


def test_train_rl_is_deterministic_given_the_seed(tiny_rl):
    eval_tasks = arl.make_tasks('heldout')[:2]
    first, m1 = tiny_rl(4, eval_tasks=eval_tasks, seed=0)
    again, m2 = tiny_rl(4, eval_tasks=eval_tasks, seed=0)
    other, m3 = tiny_rl(4, eval_tasks=eval_tasks, seed=1)
    assert sum('loss' in h for h in first) >= 2              # the runs really update the model
    assert first == again
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    assert first != other
    assert any(not torch.equal(p, q) for p, q in zip(m1.parameters(), m3.parameters()))


def test_train_rl_rejects_a_bad_step_count(tiny_rl):
    for steps in (0, -1, 2.0):
        with pytest.raises(ValueError, match='steps'):
            tiny_rl(steps)


# ---------------------------------------------------------------- cached runs
@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    return tmp_path


@pytest.fixture
def counted_train_rl(monkeypatch):
    """Counts the calls of train_rl that train_rl_cached makes (a warm call makes none)."""
    calls = []
    real = arl.rl_loop.train_rl

    def counting(*args, **kwargs):
        calls.append(args[4])                                # steps
        return real(*args, **kwargs)
    monkeypatch.setattr(arl.rl_loop, 'train_rl', counting)
    return calls


def _same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_train_rl_cached_trains_once_and_a_warm_call_returns_the_cold_result(
        cache, counted_train_rl, tiny_rl, setup):
    tok, base = setup
    tasks, eval_tasks = arl.make_tasks('train')[:10], arl.make_tasks('heldout')[:2]
    cfg = arl.RLConfig(**TINY_RL)
    before = copy.deepcopy(base)
    cold_model, cold = arl.train_rl_cached(base, tasks, tok, cfg, 3, eval_tasks=eval_tasks,
                                           eval_every=2, eval_n=2)
    assert counted_train_rl == [3]
    assert _same_weights(base, before)                        # the base is left untouched
    assert not _same_weights(cold_model, base)                # the run really trained
    warm_model, warm = arl.train_rl_cached(base, tasks, tok, cfg, 3, eval_tasks=eval_tasks,
                                           eval_every=2, eval_n=2)
    assert counted_train_rl == [3]                            # loaded, not trained again
    assert warm == cold and _same_weights(warm_model, cold_model)
    assert not warm_model.training
    # and both are what an uncached train_rl gives (its history through JSON)
    direct, direct_model = tiny_rl(3, eval_tasks=eval_tasks)
    assert _same_weights(direct_model, cold_model)
    assert json.loads(json.dumps(direct)) == cold
    # the run's weights and history, and its first held-out evaluation (evaluate_once)
    assert sorted(p.suffix for p in cache.iterdir()) == ['.json', '.pkl', '.safetensors']


def test_train_rl_cached_key_covers_cfg_steps_tasks_base_and_code(
        cache, counted_train_rl, monkeypatch, setup):
    tok, base = setup
    tasks = arl.make_tasks('train')[:10]
    cfg = arl.RLConfig(**TINY_RL)
    monkeypatch.setattr(arl, 'make_env', lambda cfg=None: ParityEnv(cfg.max_turns, cfg.max_tokens))
    other_base = copy.deepcopy(base)
    with torch.no_grad():
        next(other_base.parameters()).view(-1)[0] += 1e-3
    runs = dict(
        reference=(base, tasks, cfg, 2),
        cfg=(base, tasks, arl.RLConfig(**dict(TINY_RL, seed=1)), 2),
        steps=(base, tasks, cfg, 1),
        tasks=(base, tasks[::-1], cfg, 2),                    # same tasks, another order
        base=(other_base, tasks, cfg, 2))
    for n, (name, (b, t, c, steps)) in enumerate(runs.items(), start=1):
        arl.train_rl_cached(b, t, tok, c, steps)
        assert len(counted_train_rl) == n, name               # a new key: trained
        arl.train_rl_cached(b, t, tok, c, steps)
        assert len(counted_train_rl) == n, name               # the same key: loaded
    assert len(list(cache.glob('rl_run-*.json'))) == len(runs)
    monkeypatch.setattr(arl.rl_loop, 'code_hash', lambda modules=None: 'edited code')
    arl.train_rl_cached(base, tasks, tok, cfg, 2)
    assert len(counted_train_rl) == len(runs) + 1             # other code: trained again


def _toy_train(calls):
    def train(model):
        calls.append(1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2)
        return [dict(step=0, pair=(1, 2), value=0.5)]
    return train


def test_cached_training_never_reads_a_half_written_file(cache, monkeypatch):
    import safetensors.torch
    base = torch.nn.Linear(3, 2)
    calls = []
    real_save = safetensors.torch.save_file

    def crash_half_way(tensors, path):
        real_save(tensors, path)
        data = open(path, 'rb').read()
        open(path, 'wb').write(data[:len(data) // 2])        # a torn write ...
        raise OSError('killed while writing')                # ... and the writer dies
    monkeypatch.setattr(safetensors.torch, 'save_file', crash_half_way)
    with pytest.raises(OSError, match='killed'):
        arl.cached_training('toy', base, dict(x=1), _toy_train(calls))
    assert not list(cache.iterdir())               # not even the temporary file is left
    monkeypatch.setattr(safetensors.torch, 'save_file', real_save)
    real_write = pathlib.Path.write_text

    def torn_log(path, text, *args, **kwargs):
        real_write(path, text[:len(text) // 2], *args, **kwargs)
        raise OSError('killed while writing the log')
    monkeypatch.setattr(pathlib.Path, 'write_text', torn_log)
    with pytest.raises(OSError, match='killed'):              # the weights are complete,
        arl.cached_training('toy', base, dict(x=1), _toy_train(calls))   # the log torn
    monkeypatch.setattr(pathlib.Path, 'write_text', real_write)
    assert len(list(cache.glob('toy-*.safetensors'))) == 1
    assert not list(cache.glob('toy-*.json'))
    model, history = arl.cached_training('toy', base, dict(x=1), _toy_train(calls))
    assert len(calls) == 3                                    # trained again
    assert torch.equal(model.weight, 2 * base.weight)
    assert history == [dict(step=0, pair=[1, 2], value=0.5)]  # JSON: tuples become lists
    final = {p.suffix for p in cache.glob('toy-*') if not p.name.endswith('.tmp')}
    assert final == {'.json', '.safetensors'}
    log = next(cache.glob('toy-*.json'))
    arl.cached_training('toy', base, dict(x=1), _toy_train(calls))
    assert len(calls) == 3                                    # complete: loaded
    log.unlink()                                              # weights without their log
    arl.cached_training('toy', base, dict(x=1), _toy_train(calls))
    assert len(calls) == 4


def test_cached_training_rejects_bad_arguments(cache):
    base, train = torch.nn.Linear(2, 2), _toy_train([])
    with pytest.raises(ValueError, match='kind'):
        arl.cached_training('../x', base, {}, train)
    with pytest.raises(TypeError, match='key'):
        arl.cached_training('toy', base, [('x', 1)], train)
    with pytest.raises(TypeError, match='key must be JSON-able'):
        arl.cached_training('toy', base, dict(x=object()), train)
    with pytest.raises(ValueError, match="key must not set \\['code'\\]"):
        arl.cached_training('toy', base, dict(code='mine'), train)
    with pytest.raises(TypeError, match='train'):
        arl.cached_training('toy', base, {}, None)
    assert list(cache.iterdir()) == []


def test_hashes_see_every_weight_task_and_module():
    a = torch.nn.Linear(3, 2)
    a.register_buffer('scale', torch.tensor(1.0))             # 0-dim tensors hash too
    b = copy.deepcopy(a)
    assert arl.model_hash(a) == arl.model_hash(b)
    b.scale += 1
    assert arl.model_hash(a) != arl.model_hash(b)
    tasks = arl.make_tasks('train')[:4]
    assert arl.tasks_hash(tasks) == arl.tasks_hash(list(tasks))
    assert arl.tasks_hash(tasks) != arl.tasks_hash(tasks[:3])
    assert arl.tasks_hash(tasks) != arl.tasks_hash(tasks[::-1])
    assert arl.tasks_hash(None) is None
    assert arl.code_hash() == arl.code_hash(arl.RUN_MODULES)
    assert arl.code_hash(('tasks',)) != arl.code_hash(('tasks', 'model'))


def test_clipped_objective_matches_ppo_and_names_the_clipped_tokens():
    ratio = torch.tensor([[0.5, 0.9, 1.0, 1.1, 1.5]])
    for a in (1.0, -1.0):
        adv = torch.tensor([[a]])
        objective, clipped = arl.clipped_objective(ratio, adv, 0.2, 0.3)
        expected = torch.minimum(ratio * a, ratio.clamp(0.8, 1.3) * a)
        assert torch.equal(objective, expected)
        # positive advantage: only ratios above 1.3 lose their gradient; negative: below 0.8
        assert clipped.tolist() == ([[False, False, False, False, True]] if a > 0
                                    else [[True, False, False, False, False]])


class _Doubled(arl.UpdateTerm):
    """A surrogate part: chapter 7's objective with every advantage doubled."""

    def surrogate(self, logp, old_logp, adv, mask):
        return arl.clipped_objective(torch.exp(logp - old_logp), 2 * adv, 0.2, 0.2)


def test_rl_update_takes_a_parts_surrogate_in_place_of_the_clipped_objective(setup):
    tok, model = setup
    batch = _demo_batch(tok)
    adv = torch.linspace(-1, 1, len(batch['ids']))
    grads = {}
    for name, terms, scale in (('own', (_Doubled(),), 1.0), ('default', (), 2.0)):
        m = copy.deepcopy(model)
        cfg = arl.RLConfig(epochs=1, max_grad_norm=float('inf'))
        optimizer = torch.optim.SGD(m.parameters(), lr=0.0)
        arl.rl_update(m, optimizer, batch, scale * adv, cfg, terms=terms)
        grads[name] = [p.grad.clone() for p in m.parameters()]
    # the part's surrogate with A is the default surrogate with 2A, to the bit
    assert all(torch.equal(a, b) for a, b in zip(grads['own'], grads['default']))


def _write_run(name, data):
    (arl.cache_dir() / name).write_bytes(data)


def test_artifacts_travel_through_a_bundle_with_their_hashes_checked(cache, tmp_path,
                                                                     monkeypatch):
    _write_run('rl_run-0123.json', b'{"history": []}')
    _write_run('rl_run-0123.safetensors', b'weights')
    _write_run('kl-4567.json', b'{}')
    _write_run('rl_run-89.json.77.tmp', b'half')              # never shipped
    bundle = tmp_path / 'bundle'
    manifest = arl.export_artifacts(bundle, kinds=('rl_run',))
    assert sorted(manifest) == ['rl_run-0123.json', 'rl_run-0123.safetensors']
    again = arl.export_artifacts(tmp_path / 'again', kinds=('rl_run',))
    assert (bundle / 'manifest.json').read_bytes() == (tmp_path / 'again' / 'manifest.json').read_bytes()
    assert again == manifest
    reader = tmp_path / 'reader'
    monkeypatch.setenv('AGENTRL_CACHE', str(reader))
    assert arl.load_artifacts(bundle.as_uri()) == 2            # a file:// URL
    assert (reader / 'rl_run-0123.safetensors').read_bytes() == b'weights'
    assert arl.load_artifacts(bundle) == 0                     # already there: kept
    (bundle / 'rl_run-0123.json').write_bytes(b'tampered')
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path / 'other'))
    with pytest.raises(ValueError, match='sha256'):
        arl.load_artifacts(bundle)
    assert not (tmp_path / 'other' / 'rl_run-0123.json').exists()
    (bundle / 'manifest.json').write_text(json.dumps({'../x-1': '0'}))
    with pytest.raises(ValueError, match='bad file name'):
        arl.load_artifacts(bundle)
    with pytest.raises(ValueError, match='no cached artefacts'):
        arl.export_artifacts(tmp_path / 'none', kinds=('teacher',))


def test_a_bundle_of_runs_built_twice_from_empty_caches_is_the_same_bit_for_bit(
        tiny_rl, tmp_path, monkeypatch, setup):
    """make artifacts on a small recipe: the same runs, the same manifest."""
    tok, base = setup
    tasks = arl.make_tasks('train')[:10]
    manifests = []
    for name in ('first', 'second'):
        monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path / name))
        for seed in (0, 1):
            arl.train_rl_cached(base, tasks, tok, arl.RLConfig(**TINY_RL, seed=seed), 2)
        manifests.append(arl.export_artifacts(tmp_path / f'{name}-bundle'))
    assert len(manifests[0]) == 4                  # two runs: weights and history each
    assert manifests[0] == manifests[1]
    # and a reader's cache loaded from the bundle holds the runs: nothing trains
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path / 'reader'))
    assert arl.load_artifacts(tmp_path / 'first-bundle') == 4
    monkeypatch.setattr(arl.rl_loop, 'train_rl', None)        # would fail if called
    arl.train_rl_cached(base, tasks, tok, arl.RLConfig(**TINY_RL, seed=1), 2)


class Crash(Exception):
    pass


class CountingSampler:
    """A sample_fn with state (how many steps it sampled), saved in checkpoints."""

    def __init__(self, tok, cfg, crash_at=None):
        self.tok, self.cfg, self.crash_at, self.calls = tok, cfg, crash_at, 0

    def __call__(self, model, tasks, step, generator):
        if step == self.crash_at:
            raise Crash(step)
        self.calls += 1
        env_fn = lambda: arl.make_env(self.cfg)
        kept, sampled = arl.sample_step(model, env_fn, tasks, self.tok, self.cfg, generator)
        return kept, sampled, dict(calls=self.calls)

    def state_dict(self):
        return dict(calls=self.calls)

    def load_state_dict(self, state):
        self.calls = state['calls']


def _checkpointed_run(setup, tasks, path, crash_at=None, steps=4, seed=0, eval_tasks=None):
    tok, model = setup
    model = copy.deepcopy(model)
    cfg = arl.RLConfig(**dict(TINY_RL, seed=seed))
    sampler = CountingSampler(tok, cfg, crash_at)
    history = arl.train_rl(model, tasks, tok, cfg, steps, eval_tasks=eval_tasks,
                           eval_every=2, eval_n=2, progress=False, sample_fn=sampler,
                           checkpoint=path)
    return model, history


@pytest.mark.parametrize('crash_at', [1, 3])
def test_train_rl_resumes_from_its_checkpoint_bit_for_bit(tiny_rl, setup, tmp_path, crash_at):
    tasks, eval_tasks = arl.make_tasks('train')[:10], arl.make_tasks('heldout')[:2]
    straight, history = _checkpointed_run(setup, tasks, None, eval_tasks=eval_tasks)
    assert sum('loss' in h for h in history) >= 2            # the run really updates
    path = tmp_path / 'run.pt'
    with pytest.raises(Crash):
        _checkpointed_run(setup, tasks, path, crash_at=crash_at, eval_tasks=eval_tasks)
    saved = torch.load(path, weights_only=False)
    assert saved['state']['step'] == crash_at and saved['hooks'][0] == dict(calls=crash_at)
    resumed, resumed_history = _checkpointed_run(setup, tasks, path, eval_tasks=eval_tasks)
    assert resumed_history == history                        # the hook's count included
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), straight.parameters()))
    assert not list(tmp_path.glob('*.tmp'))


def test_train_rl_refuses_another_runs_checkpoint(tiny_rl, setup, tmp_path):
    tasks = arl.make_tasks('train')[:10]
    path = tmp_path / 'run.pt'
    with pytest.raises(Crash):
        _checkpointed_run(setup, tasks, path, crash_at=2)
    for changes in (dict(seed=1), dict(steps=5)):
        with pytest.raises(ValueError, match='checkpoint of another run'):
            _checkpointed_run(setup, tasks, path, **changes)


def test_write_atomically_leaves_the_old_file_whole_when_the_writer_dies(tmp_path):
    path = tmp_path / 'data.bin'
    arl.write_atomically(path, lambda tmp: tmp.write_bytes(b'old'))

    def torn(tmp):
        tmp.write_bytes(b'ne')
        raise OSError('killed while writing')
    with pytest.raises(OSError, match='killed'):
        arl.write_atomically(path, torn)
    assert path.read_bytes() == b'old' and [p.name for p in tmp_path.iterdir()] == ['data.bin']
    arl.write_atomically(path, lambda tmp: tmp.write_bytes(b'new'))
    assert path.read_bytes() == b'new'


# ---------------------------------------------------------------- parallel_map
def _cache_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_parallel_map_trains_the_plain_loops_runs_bit_for_bit(monkeypatch, tmp_path, tiny_rl,
                                                              setup):
    tok, base = setup
    tasks, eval_tasks = arl.make_tasks('train')[:10], arl.make_tasks('heldout')[:2]
    seeds = [0, 1, 2]

    def run(seed):
        return arl.train_rl_cached(base, tasks, tok, arl.RLConfig(**dict(TINY_RL, seed=seed)),
                                   3, eval_tasks=eval_tasks, eval_every=2, eval_n=2)
    out = {}
    for way, workers in (('loop', 1), ('parallel', 2)):
        monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path / way))
        out[way] = arl.parallel_map(run, seeds, workers=workers)
    for (m1, h1), (m2, h2) in zip(out['loop'], out['parallel']):
        assert h1 == h2 and _same_weights(m1, m2)
    assert not _same_weights(out['loop'][0][0], out['loop'][1][0])   # three different runs
    assert _cache_bytes(tmp_path / 'loop') == _cache_bytes(tmp_path / 'parallel')
    assert len(_cache_bytes(tmp_path / 'loop')) == 2 * len(seeds) + 1  # runs + first eval


def test_parallel_map_keeps_the_order_and_reports_what_went_wrong():
    import os
    assert arl.parallel_map(lambda x: x * x, range(7), workers=3) == [x * x for x in range(7)]
    assert arl.parallel_map(lambda x: x, [], workers=2) == []
    with pytest.raises(RuntimeError, match='ZeroDivisionError'):
        arl.parallel_map(lambda x: 1 / x, [1, 0, 2], workers=2)
    with pytest.raises(RuntimeError, match='died computing item 1'):
        arl.parallel_map(lambda x: os._exit(3) if x == 1 else x, [0, 1, 2], workers=2)
    with pytest.raises(RuntimeError, match='pickle'):                # a result that cannot travel
        arl.parallel_map(lambda x: (lambda: x), [0, 1], workers=2)
    for workers in (0, -1):
        with pytest.raises(ValueError, match='workers must be >= 1'):
            arl.parallel_map(abs, [1, 2], workers=workers)
    for workers in (1.5, True, '2'):
        with pytest.raises(TypeError, match='workers must be an int'):
            arl.parallel_map(abs, [1, 2], workers=workers)


def test_parallel_map_runs_here_with_one_worker_and_in_copies_otherwise():
    seen = []
    arl.parallel_map(seen.append, [1, 2], workers=1)
    assert seen == [1, 2]                                  # the plain loop, in this process
    arl.parallel_map(seen.append, [3, 4], workers=2)
    assert seen == [1, 2]                                  # the workers' changes stay there
    assert arl.usable_cores() >= 1


def test_the_parallel_runs_benchmark_records_identical_runs(tmp_path):
    """tools/parallel_runs.py (chapter 7 prints its record): a tiny smoke run of it."""
    import subprocess
    import sys
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / 'parallel.json'
    subprocess.run([sys.executable, str(repo / 'tools' / 'parallel_runs.py'), '--steps', '1',
                    '--seeds', '2', '--out', str(out)], check=True, capture_output=True)
    record = json.loads(out.read_text())
    assert record['identical'] and record['runs'] == 2 and record['steps'] == 1
    assert len(set(record['weights'])) == 2                # two seeds, two different runs
    assert {'date', 'cpu', 'cores', 'load_before', 'sequential_s', 'parallel_s'} <= set(record)


def test_the_batching_bound_benchmark_records_both_halves(tmp_path):
    """tools/batching_bound.py (chapter 7 prints its record): a tiny smoke run of it; the
    ratios are the times they are computed from."""
    import subprocess
    import sys
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / 'batching.json'
    subprocess.run([sys.executable, str(repo / 'tools' / 'batching_bound.py'), '--ks', '2',
                    '--repeats', '1', '--out', str(out)], check=True, capture_output=True)
    record = json.loads(out.read_text())
    assert {'date', 'cpu', 'load_before', 'threads', 'repeats'} <= set(record)
    (b,) = record['bounds']
    assert b['k'] == 2 and min(v for k, v in b.items() if k.endswith('_s')) > 0
    assert abs(b['sample_bound'] - 2 * b['sample_one_s'] / b['sample_batched_s']) < 0.02
    assert abs(b['update_bound'] - b['update_separate_s'] / b['update_batched_s']) < 0.02


def test_two_parts_answering_one_hook_raise():
    class Mine(arl.UpdateTerm):
        def micro_batches(self, order, size):
            return [order]

    class Yours(Mine):
        pass

    from agentrl.rl_loop import _part
    order = torch.arange(4)
    assert torch.equal(_part([Mine(), arl.UpdateTerm()], 'micro_batches', order, 2)[0],
                       order)
    assert _part([arl.UpdateTerm()], 'micro_batches', order, 2) is None
    with pytest.raises(ValueError, match="Mine, Yours all answer 'micro_batches'"):
        _part([Mine(), Yours()], 'micro_batches', order, 2)
