"""Tests for agentrl/rewards.py (chapter 10)."""
import copy

import pytest
import torch

import agentrl as arl
from agentrl import rl_loop


def _cfg():
    return arl.RLConfig(seed=3, tasks_per_step=4, group_size=4, max_turns=3)


def test_train_rl_without_hooks_is_chapter_7_bit_for_bit(monkeypatch, tiny_agent):
    tasks, tok, model = tiny_agent
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


def test_identity_transform_trains_like_no_transform(monkeypatch, tiny_agent):
    tasks, tok, model = tiny_agent
    real = arl.sample_groups

    def informative(*args):                   # a random model never succeeds: give the
        trajs = real(*args)                   # groups unequal rewards: both runs train
        for i, t in enumerate(trajs):
            t.reward = float(i % 3 == 0)
        return trajs

    monkeypatch.setattr(arl, 'sample_groups', informative)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ha = arl.train_rl(a, tasks, tok, _cfg(), 2, progress=False)
    seen = []
    arl.train_rl(b, tasks, tok, _cfg(), 2, progress=False,
                 transform=lambda trajs, step: seen.append(step) or trajs)
    assert seen == [0, 1]
    assert [h['kept'] for h in ha] == [16, 16]
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    # the equality is not vacuous: both runs moved the weights
    assert not all(torch.equal(p, q)
                   for p, q in zip(a.parameters(), model.parameters()))


def test_update_fn_replaces_rl_update(tiny_agent):
    tasks, tok, model = tiny_agent
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


def test_train_rl_rejects_bad_hooks(tiny_agent):
    tasks, tok, model = tiny_agent
    with pytest.raises(TypeError, match='transform'):
        arl.train_rl(model, tasks, tok, _cfg(), 1, transform=3)
    with pytest.raises(TypeError, match='update_fn'):
        arl.train_rl(model, tasks, tok, _cfg(), 1, update_fn='x')


# --- the reward functions -------------------------------------------------------------

def _scripted(task, actions, tok, max_turns=6):
    """A Trajectory of `actions` played in a real ToolEnv on `task` (the agent's tokens
    marked as sampled, the prompt and observations as forced) and the env."""
    env = arl.ToolEnv(max_turns=max_turns)
    turns, reward = arl.play_episode(env, task, actions)
    ids, sampled = [], []
    for writer, text in turns:
        piece = tok.encode(text)
        ids += piece
        sampled += [float(writer == 'agent')] * len(piece)
    info = dict(task=task.name, family=task.family, group=0, outcome=env.outcome,
                turns=env.turns)
    return arl.Trajectory(ids=torch.tensor(ids), action_mask=torch.tensor(sampled[1:]),
                          sample_logp=torch.zeros(len(ids) - 1), reward=reward,
                          info=info)


@pytest.fixture(scope='module')
def chain_task():
    return next(t for t in arl.make_tasks('train') if t.family == 'chain'
                and t.answer != arl.NONE and len(t.calls) == 2)


def test_parse_episode_reads_calls_observations_and_answer(tiny_agent, chain_task):
    tok = tiny_agent[1]
    t = chain_task
    actions = [f'<call>{t.calls[0]}</call>', '<call>calc 1+</call>',
               f'<call>{t.calls[1]}</call>', f'<ans>{t.answer}</ans>']
    traj = _scripted(t, actions, tok)
    ep = arl.parse_episode(traj, tok)
    store = dict(t.store)
    assert ep['actions'] == actions
    assert ep['calls'] == [t.calls[0], 'calc 1+', t.calls[1]]
    assert ep['observations'] == [arl.run_tool(t.calls[0], store), arl.ERROR,
                                  arl.run_tool(t.calls[1], store)]
    assert ep['answer'] == t.answer and ep['outcome'] == 'correct' and ep['turns'] == 3
    assert arl.outcome_reward(ep, t) == traj.reward == 1.0


def test_parse_episode_turn_limit_and_missing_answer(tiny_agent, chain_task):
    tok = tiny_agent[1]
    traj = _scripted(chain_task, ['<call>get zz</call>'] * 3, tok, max_turns=2)
    ep = arl.parse_episode(traj, tok)
    assert ep['outcome'] == 'turn_limit' and ep['answer'] is None
    assert ep['calls'] == ['get zz'] * 3 and len(ep['observations']) == 2
    traj = _scripted(chain_task, ['12</ans>'], tok)         # no '<ans>': no answer
    assert arl.parse_episode(traj, tok)['answer'] is None
    bad = arl.Trajectory(ids=torch.zeros(3, dtype=torch.long), action_mask=torch.ones(3),
                         sample_logp=torch.zeros(3), reward=0.0)
    with pytest.raises(ValueError, match='action_mask'):
        arl.parse_episode(bad, tok)


def test_digit_credit():
    assert arl.digit_credit('123', '123') == 1.0
    assert arl.digit_credit('129', '123') == pytest.approx(2 / 3)
    assert arl.digit_credit('1234', '123') == pytest.approx(3 / 4)   # extra digit
    assert arl.digit_credit('1', '123') == pytest.approx(1 / 3)
    assert arl.digit_credit(None, '123') == 0.0
    assert arl.digit_credit('', '123') == 0.0
    with pytest.raises(TypeError, match='answer'):
        arl.digit_credit(123, '123')


def test_call_credit(chain_task):
    t = chain_task
    assert arl.call_credit(list(t.calls), t) == 1.0
    assert arl.call_credit([t.calls[0]] * 3 + ['get zz'], t) == 0.5   # distinct calls
    assert arl.call_credit([], t) == 0.0
    no_tools = arl.Task(name='x', family='calc', prompt='2+3', answer='5')
    assert arl.call_credit(['calc 2+3'], no_tools) == 0.0


def _ep(outcome='wrong', answer=None, calls=(), observations=()):
    return dict(actions=[], calls=list(calls), observations=list(observations),
                answer=answer, outcome=outcome, turns=len(calls))


def test_partial_reward(chain_task):
    t = chain_task
    assert arl.partial_reward(_ep('correct', t.answer, t.calls), t) == 1.0
    wrong = _ep('wrong', t.answer + '0', t.calls)
    expected = arl.PARTIAL_WEIGHT * (arl.digit_credit(t.answer + '0', t.answer) + 1.0)
    assert arl.partial_reward(wrong, t) == pytest.approx(expected)
    assert 0 < arl.partial_reward(wrong, t) <= 2 * arl.PARTIAL_WEIGHT < 1
    assert arl.partial_reward(_ep('turn_limit'), t) == 0.0


def test_well_formed_call_and_answer():
    assert arl.well_formed_call('get ab') and arl.well_formed_call('calc 2*(3+4)')
    for call in ('get a', 'get abc', 'ge ab', 'calc 2+', 'calc', '', 'get AB'):
        assert not arl.well_formed_call(call), call
    for answer in ('12', '-7', arl.NONE):
        assert arl.well_formed_answer(answer)
    for answer in (None, '', '1 2', '12<call>', 'nine'):
        assert not arl.well_formed_answer(answer)


def test_penalized_reward(chain_task):
    t = chain_task
    assert arl.penalized_reward(_ep('correct', t.answer, t.calls), t) == 1.0
    ep = _ep('wrong', 'x1', ['get ab', 'ge', 'calc 1+'])       # 2 bad calls + bad answer
    assert arl.penalized_reward(ep, t) == pytest.approx(-3 * arl.FORMAT_PENALTY)
    ep = _ep('turn_limit', None, ['get ab'] * 7)
    assert arl.penalized_reward(ep, t) == pytest.approx(-arl.LIMIT_PENALTY)
    ep = _ep('token_limit', None, ['gxt ab'])
    assert arl.penalized_reward(ep, t) == pytest.approx(
        -arl.LIMIT_PENALTY - arl.FORMAT_PENALTY)


def test_tool_bonus_rewards_every_call_and_the_fix_does_not(chain_task):
    t = chain_task
    spam = _ep('turn_limit', None, ['get zz'] * 7, [arl.ERROR] * 6)
    clean = _ep('correct', t.answer, t.calls, ['1', '2'])
    # the loophole: looping to the turn limit outscores a clean correct answer
    assert arl.tool_bonus_reward(spam, t) == pytest.approx(7 * arl.TOOL_BONUS)
    assert arl.tool_bonus_reward(spam, t) > arl.tool_bonus_reward(clean, t)
    assert arl.tool_bonus_fixed(spam, t) == 0.0
    assert arl.tool_bonus_fixed(clean, t) == pytest.approx(1 + 2 * arl.TOOL_BONUS)
    # errors, repeats and calls beyond MAX_BONUS_CALLS earn nothing more
    many = _ep('correct', t.answer, ['get a', 'get b', 'get b', 'get c', 'get d'],
               [arl.ERROR, '5', '5', '6', '7'])
    assert arl.tool_bonus_fixed(many, t) == pytest.approx(
        1 + arl.MAX_BONUS_CALLS * arl.TOOL_BONUS)
    one = _ep('correct', t.answer, ['get a', 'get a'], ['5', '5'])
    assert arl.tool_bonus_fixed(one, t) == pytest.approx(1 + arl.TOOL_BONUS)


def test_reward_transform_rescores_and_keeps_the_truth(tiny_agent, chain_task):
    tok = tiny_agent[1]
    t = chain_task
    trajs = [_scripted(t, [f'<ans>{t.answer}</ans>'], tok),
             _scripted(t, ['<call>get zz</call>', '<ans>1</ans>'], tok)]
    transform = arl.reward_transform(arl.tool_bonus_reward, [t], tok)
    out = transform(trajs, 0)
    assert out is trajs
    assert [u.reward for u in out] == [1.0, arl.TOOL_BONUS]
    assert [u.info['true_reward'] for u in out] == [1.0, 0.0]
    assert [u.info['outcome'] for u in out] == ['correct', 'wrong']
    transform(trajs, 1)                        # a second pass keeps the true reward
    assert [u.info['true_reward'] for u in out] == [1.0, 0.0]
    other = arl.make_tasks('heldout')[0]
    with pytest.raises(ValueError, match='not in tasks'):
        arl.reward_transform(arl.outcome_reward, [other], tok)(trajs, 0)
    with pytest.raises(TypeError, match='reward_fn'):
        arl.reward_transform('outcome', [t], tok)


# --- normalisation ---------------------------------------------------------------------

def test_seq_mean_update_follows_the_seq_mean_gradient(tiny_agent):
    tasks, tok, model = tiny_agent
    gen = torch.Generator().manual_seed(0)
    cfg = arl.RLConfig(tasks_per_step=4, group_size=4, max_turns=3, epochs=1,
                       max_grad_norm=float('inf'), micro_batch_size=5)
    trajs = arl.sample_groups(model, arl.make_env, tasks[:4], tok, cfg, gen)
    batch = arl.collate(trajs, tok.pad_id)
    adv = torch.randn(len(trajs), generator=gen)
    lengths = batch['action_mask'].sum(-1)
    assert len(set(lengths.tolist())) > 1               # lengths differ: the test bites

    def grad_of(loss_fn):
        m = copy.deepcopy(model)
        m.zero_grad()
        loss_fn(m)
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    def update(fn):
        def go(m):
            fn(m, torch.optim.SGD(m.parameters(), lr=0.0), batch, adv, cfg)
        return go

    def reference(mode):
        def go(m):
            logp = arl.sequence_log_probs(m, batch['ids'])
            arl.reinforce_loss(logp, adv, batch['action_mask'], mode).backward()
        return go

    seq = grad_of(update(arl.seq_mean_update))
    want = grad_of(reference('seq_mean'))
    assert torch.allclose(seq, want, atol=1e-6, rtol=1e-4)
    token = grad_of(update(arl.rl_update))
    assert torch.allclose(token, grad_of(reference('token_mean')), atol=1e-6, rtol=1e-4)
    assert not torch.allclose(seq, token, atol=1e-6, rtol=1e-2)
    with pytest.raises(ValueError, match='advantages'):
        arl.seq_mean_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch,
                            adv[:-1], cfg)
