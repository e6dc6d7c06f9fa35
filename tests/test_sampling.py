"""Chapter 4 (sampling): lockstep episode sampling, Trajectory alignment, padding and collation."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import agentrl as arl

TASKS = arl.make_tasks('train')[:6]
TOK = arl.build_tokenizer(arl.make_tasks('all'))


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return arl.TinyAgent(len(TOK), d_model=32, n_layers=1, n_heads=2, max_len=128).eval()


def sample(model, cfg, seed=0, tasks=TASKS):
    return arl.sample_groups(model, lambda: arl.make_env(cfg), tasks, TOK, cfg, torch.Generator().manual_seed(seed))


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x.ids, y.ids) and torch.equal(x.sample_logp, y.sample_logp)
                                    and x.reward == y.reward and x.info == y.info for x, y in zip(a, b))


CFG = arl.SamplingConfig(group_size=3, max_tokens=40, max_turns=3)


def test_reproducible_from_generator():
    model = tiny_model()
    a, b, c = sample(model, CFG, seed=0), sample(model, CFG, seed=0), sample(model, CFG, seed=1)
    assert same(a, b)
    assert not same(a, c)


def test_groups_and_info():
    trajs = sample(tiny_model(), CFG)
    assert len(trajs) == len(TASKS) * CFG.group_size
    for i, t in enumerate(trajs):
        task = TASKS[i // CFG.group_size]
        assert t.info['task'] == task.name and t.info['family'] == task.family
        assert t.info['group'] == i // CFG.group_size
        assert t.info['outcome'] in ('correct', 'wrong', 'turn_limit', 'token_limit')
        assert t.ids[0] == TOK.bos_id


def test_mask_and_sample_logp_align_with_recomputed_log_probs():
    model = tiny_model()
    trajs = sample(model, dataclasses.replace(CFG, temperature=1.0))
    n_policy = 0
    for t in trajs:
        assert t.action_mask.shape == t.sample_logp.shape == (len(t.ids) - 1,)
        with torch.no_grad():
            recomputed = arl.sequence_log_probs(model, t.ids[None])[0]          # [T-1]
        policy = t.action_mask.bool()
        assert torch.allclose(t.sample_logp[policy], recomputed[policy], atol=1e-5)
        assert (t.sample_logp[~policy] == 0).all()
        n_policy += int(policy.sum())
        # Forced tokens are exactly the prompt and the observations the environment wrote.
        prompt = TOK.encode('<bos>' + next(x for x in TASKS if x.name == t.info['task']).prompt)
        assert t.ids[:len(prompt)].tolist() == prompt and not policy[:len(prompt) - 1].any()
        assert policy[len(prompt) - 1]                   # the first token after the prompt is the policy's
    assert n_policy > 0


def test_forced_tokens_are_exactly_prompt_and_observations():
    """Replay each episode through a fresh environment: every forced token must be the prompt or an observation
    the environment returns, every other token must be marked as sampled, and the outcome must match."""
    by_name = {t.name: t for t in TASKS}
    for t in sample(tiny_model(), CFG):
        env = arl.make_env(CFG)
        pending = TOK.encode(env.reset(by_name[t.info['task']]))
        sampled = [False] + t.action_mask.bool().tolist()                          # sampled[i]: ids[i]
        action = ''
        for i, token in enumerate(t.ids.tolist()):
            if pending:
                assert not sampled[i] and token == pending.pop(0)
                continue
            assert sampled[i]
            action += TOK.itos[token]
            if TOK.itos[token] in arl.STOP_TOKENS or i + 1 >= CFG.max_tokens:
                observation, done, reward = env.step(action)
                pending, action = TOK.encode(observation), ''
        if not env.done:                               # the token limit was reached on a forced token
            env.step(action)
        assert env.done and env.outcome == t.info['outcome'] and not pending


@pytest.mark.parametrize('max_tokens,max_turns', [(20, 1), (40, 2), (64, 0)])
def test_episodes_respect_limits(max_tokens, max_turns):
    cfg = arl.SamplingConfig(group_size=4, max_tokens=max_tokens, max_turns=max_turns)
    for t in sample(tiny_model(1), cfg):
        assert len(t.ids) <= max_tokens
        assert t.info['turns'] <= max_turns + 1        # the call that exceeds the limit ends the episode
        if t.info['outcome'] != 'turn_limit':
            assert t.info['turns'] <= max_turns


def test_low_temperature_is_near_greedy():
    model = tiny_model(2)
    cfg = arl.SamplingConfig(group_size=4, max_tokens=30, temperature=1e-4)
    trajs = sample(model, cfg)
    for g in range(len(TASKS)):
        group = trajs[g * 4:(g + 1) * 4]
        assert all(torch.equal(group[0].ids, t.ids) for t in group[1:])
    t = trajs[0]                                       # every sampled token is the argmax of the logits
    with torch.no_grad():
        logits = model(t.ids[None])[0, :-1]                                          # [T-1, V]
    policy = t.action_mask.bool()
    assert torch.equal(logits.argmax(-1)[policy], t.ids[1:][policy])


def test_sampling_rejects_bad_config():
    model = tiny_model()
    for bad in (dict(temperature=0.0), dict(temperature=-1.0), dict(group_size=0)):
        with pytest.raises(ValueError):
            sample(model, dataclasses.replace(CFG, **bad))
    assert sample(model, CFG, tasks=[]) == []


def test_render_trajectory_brackets_policy_tokens():
    parts = [('<bos>k1?', 0.0), ('<call>get k1</call>', 1.0), ('<obs>12</obs>', 0.0), ('<ans>12</ans>', 1.0)]
    sampled = [s for text, s in parts for _ in arl.split_tokens(text)]          # sampled[t]: ids[t]
    t = arl.Trajectory(ids=torch.tensor(TOK.encode(''.join(text for text, _ in parts))),
                       action_mask=torch.tensor(sampled[1:]), sample_logp=torch.zeros(len(sampled) - 1), reward=1.0)
    assert arl.render_trajectory(t, TOK) == '<bos>k1?[<call>get k1</call>]<obs>12</obs>[<ans>12</ans>]'
    assert arl.render_trajectory(t, TOK, '{', '}').count('{') == 2


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(-5, 5), max_size=8), max_size=6), st.integers(0, 3), st.integers(-9, 9))
def test_pad_rows_property(lists, extra, fill):
    rows = [torch.tensor(r, dtype=torch.long) for r in lists]
    width = max((len(r) for r in rows), default=0) + extra
    out = arl.pad_rows(rows, width, fill)
    assert out.shape == (len(rows), width)
    for row, padded in zip(rows, out):
        assert padded[:len(row)].tolist() == row.tolist()
        assert (padded[len(row):] == fill).all()


def test_pad_rows_rejects_wider_rows():
    with pytest.raises(ValueError, match='width=2'):
        arl.pad_rows([torch.arange(3)], 2, 0)
    with pytest.raises(ValueError):
        arl.pad_rows([torch.zeros(2, 2)], 4, 0)
    with pytest.raises(ValueError):
        arl.pad_rows([torch.arange(3)], -1, 0)
    with pytest.raises(TypeError):
        arl.pad_rows([torch.arange(3)], 3.5, 0)
    assert arl.pad_rows([torch.arange(3)], torch.tensor(4), 0).shape == (1, 4)     # an integer tensor is fine


def test_collate_shapes_and_groups():
    trajs = sample(tiny_model(), CFG)
    batch = arl.collate(trajs, TOK.pad_id)
    B, T = len(trajs), max(len(t.ids) for t in trajs)
    assert batch['ids'].shape == (B, T)
    assert batch['action_mask'].shape == batch['sample_logp'].shape == (B, T - 1)
    assert batch['reward'].shape == batch['length'].shape == batch['group'].shape == (B,)
    assert batch['group'].tolist() == [i // CFG.group_size for i in range(B)]
    assert batch['length'].tolist() == [len(t.ids) for t in trajs]
    beyond = torch.arange(T) >= batch['length'][:, None]
    assert (batch['ids'][beyond] == TOK.pad_id).all()
    assert (batch['action_mask'][beyond[:, 1:]] == 0).all()


def test_collate_group_index_follows_task_and_group():
    def traj(task, group):
        return arl.Trajectory(ids=torch.tensor([1, 2]), action_mask=torch.ones(1), sample_logp=torch.zeros(1),
                              reward=0.0, info=dict(task=task, group=group))
    batch = arl.collate([traj('a', 0), traj('a', 0), traj('b', 1), traj('a', 2), traj('a', 2)], pad_id=0)
    assert batch['group'].tolist() == [0, 0, 1, 2, 2]


def test_collate_of_nothing_is_an_empty_batch():
    """A step whose groups all had equal rewards keeps no trajectory: B = 0, not an error."""
    batch = arl.collate([], pad_id=3)
    assert batch['ids'].shape == (0, 1) and batch['action_mask'].shape == (0, 0)
    assert batch['sample_logp'].shape == (0, 0)
    assert all(batch[k].shape == (0,) for k in ('reward', 'length', 'group'))
    assert batch['ids'].dtype == batch['length'].dtype == batch['group'].dtype == torch.long


# ----------------------------------------------------------------------------------------------------
# The counter-based draw
# ----------------------------------------------------------------------------------------------------

def test_counter_uniforms_are_a_pure_function_of_their_counters():
    u = arl.counter_uniforms(7, [0, 1, 2, 1], [5, 5, 5, 6], 40)
    assert u.shape == (4, 40) and u.dtype == torch.float64
    assert ((u > 0) & (u < 1)).all()
    again = arl.counter_uniforms(7, [1], [5], 40)                        # row 1 alone
    assert torch.equal(again[0], u[1])
    # every one of (seed, request, position) changes the noise
    assert not torch.equal(u[1], u[3]) and not torch.equal(u[0], u[1])
    assert not torch.equal(arl.counter_uniforms(8, [1], [5], 40)[0], u[1])


def test_counter_uniforms_look_uniform():
    u = arl.counter_uniforms(0, list(range(2000)), [3] * 2000, 50).flatten()      # 100k
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = len(u) / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 43.8                                  # chi-square, 19 df, p = 0.001
    # neighbouring counters are not correlated
    a = arl.counter_uniforms(0, list(range(5000)), [0] * 5000, 2)
    corr = torch.corrcoef(torch.stack([a[:-1, 0], a[1:, 0]]))[0, 1]
    assert abs(float(corr)) < 4 / 5000 ** 0.5


def test_counter_draw_follows_softmax_and_ignores_the_batch():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    n = 4000
    req, pos = list(range(n)), [3] * n
    tokens, logp, margins = arl.counter_draw(logits.expand(n, 5), 0, req, pos, temperature=0.7)
    again, _, _ = arl.counter_draw(logits.expand(n, 5).flip(0), 0, req[::-1], pos, temperature=0.7)
    assert torch.equal(tokens, again.flip(0))                         # order and batch do not matter
    probs = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert (freq - probs).abs().max() < 0.03                          # ~4 standard errors
    assert torch.allclose(logp.double(), probs.log()[tokens], atol=1e-6)
    assert (margins > 0).all()


def test_counter_draw_rejects_bad_input():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match='temperature'):
        arl.counter_draw(logits, 0, [0, 1], [0, 0], 0.0)
    with pytest.raises(ValueError, match='requests'):
        arl.counter_draw(logits, 0, [0], [0, 0])
    with pytest.raises(ValueError, match='seed'):
        arl.counter_draw(logits, -1, [0, 1], [0, 0])
    with pytest.raises(ValueError, match='>= 0'):
        arl.counter_draw(logits, 0, [0, -1], [0, 0])
    with pytest.raises(ValueError, match=r'\[R, V\]'):
        arl.counter_draw(torch.zeros(5), 0, [0], [0])
    empty = arl.counter_draw(torch.zeros(0, 5), 0, [], [])
    assert [len(x) for x in empty] == [0, 0, 0]


def test_sample_groups_takes_a_seed_or_a_generator():
    model, g = tiny_model(), torch.Generator().manual_seed(0)
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=torch.Generator().manual_seed(0)))
    by_seed = arl.sample_groups(model, lambda: arl.make_env(CFG), TASKS, TOK, CFG, seed=seed)
    assert same(by_seed, arl.sample_groups(model, lambda: arl.make_env(CFG), TASKS, TOK, CFG, g))
    with pytest.raises(TypeError, match='exactly one'):
        arl.sample_groups(model, lambda: arl.make_env(CFG), TASKS, TOK, CFG)
    with pytest.raises(TypeError, match='exactly one'):
        arl.sample_groups(model, lambda: arl.make_env(CFG), TASKS, TOK, CFG, g, seed=1)


def test_episodes_do_not_depend_on_the_rest_of_the_batch():
    """Each token is a function of (seed, request, position): the first tasks' episodes
    are the same whether or not later tasks share the batch (float64: rounding far below
    every margin)."""
    model = tiny_model().double()
    cfg = dataclasses.replace(CFG, group_size=2)
    env_fn = lambda: arl.make_env(cfg)
    full = arl.sample_groups(model, env_fn, TASKS, TOK, cfg, seed=11)
    part = arl.sample_groups(model, env_fn, TASKS[:2], TOK, cfg, seed=11)
    assert all(torch.equal(a.ids, b.ids) and torch.equal(a.action_mask, b.action_mask)
               for a, b in zip(part, full))


def test_episode_advance_refuses_a_wrong_forced_token():
    cfg = CFG
    e = arl.Episode(0, 0, TASKS[0], arl.make_env(cfg), TOK)
    first = e.pending[0]
    with pytest.raises(ValueError, match='forced token'):
        e.advance(first + 1, False, 0.0, TOK, cfg.max_tokens, set())
    e2 = arl.Episode(0, 0, TASKS[0], arl.make_env(cfg), TOK)
    e2.advance(first, False, 0.0, TOK, cfg.max_tokens, set())
    assert e2.ids == [first] and e2.sampled == [] and e2.logp == []
