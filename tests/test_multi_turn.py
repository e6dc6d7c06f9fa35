"""Tests for agentrl/multi_turn.py (chapter 11)."""
import copy

import pytest
import torch

import agentrl as arl
from helpers import informative_rewards


@pytest.fixture(scope='module')
def tok():
    return arl.build_tokenizer(arl.make_tasks('all'))


def _traj(tok, segments, reward=1.0, outcome='correct', task='t', group=0):
    """A Trajectory from (writer, text) segments: 'env' tokens forced, 'agent'
    tokens sampled (the sampler's conventions)."""
    ids, chosen = [], []
    for writer, text in segments:
        for i in tok.encode(text):
            ids.append(i), chosen.append(writer == 'agent')
    mask = torch.tensor([float(c) for c in chosen[1:]])
    return arl.Trajectory(ids=torch.tensor(ids), action_mask=mask,
                          sample_logp=-mask, reward=reward,
                          info=dict(task=task, group=group, outcome=outcome))


def _sum_episode(tok, **kw):
    return _traj(tok, [('env', '<bos>ab+cd'), ('agent', '<call>get ab</call>'),
                       ('env', '<obs>12</obs>'), ('agent', '<call>get ab</call>'),
                       ('env', '<obs>12</obs>'), ('agent', '<call>get xy</call>'),
                       ('env', '<obs>error</obs>'), ('agent', '<call>gt cd</call>'),
                       ('env', '<obs>error</obs>'), ('agent', '<call>get cd</call>'),
                       ('env', '<obs>error</obs>'), ('agent', '<call>calc 12+</call>'),
                       ('env', '<obs>error</obs>'), ('agent', '<ans>none</ans>')], **kw)


def test_episode_turns_tiles_the_episode(tok):
    t = _sum_episode(tok)
    turns = arl.episode_turns(t, tok)
    assert [x['kind'] for x in turns[:3]] == ['prompt', 'action', 'observation']
    assert turns[-1]['kind'] == 'action' and turns[-1]['text'] == '<ans>none</ans>'
    assert ''.join(x['text'] for x in turns) == tok.decode(t.ids)
    assert all(a['end'] == b['start'] for a, b in zip(turns, turns[1:]))
    assert turns[0]['start'] == 0 and turns[-1]['end'] == len(t.ids)
    assert turns[1]['text'] == '<call>get ab</call>'
    n_policy = sum(x['end'] - x['start'] for x in turns if x['kind'] == 'action')
    assert n_policy == int(t.action_mask.sum())


def test_episode_turns_on_sampled_episodes(tok):
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=32, n_layers=1, n_heads=2)
    cfg = arl.SamplingConfig(group_size=3, max_tokens=40)
    trajs = arl.sample_groups(model, lambda: arl.make_env(cfg),
                              arl.make_tasks('train')[:3], tok, cfg,
                              torch.Generator().manual_seed(0))
    for t in trajs:
        turns = arl.episode_turns(t, tok)
        assert ''.join(x['text'] for x in turns) == tok.decode(t.ids)
        for x in turns:
            chosen = [bool(t.action_mask[i - 1]) if i else False
                      for i in range(x['start'], x['end'])]
            assert all(c == (x['kind'] == 'action') for c in chosen)


def test_episode_turns_rejects_bad_input(tok):
    with pytest.raises(TypeError, match='traj'):
        arl.episode_turns('text', tok)
    t = _sum_episode(tok)
    bad = arl.Trajectory(ids=t.ids, action_mask=t.action_mask[:-1],
                         sample_logp=t.sample_logp[:-1], reward=1.0)
    with pytest.raises(ValueError, match='action_mask'):
        arl.episode_turns(bad, tok)


def test_call_verdicts(tok):
    verdicts = arl.call_verdicts(_sum_episode(tok), tok)
    assert [(v['call'], v['observation'], v['verdict']) for v in verdicts] == [
        ('get ab', '12', 'useful'), ('get ab', '12', 'repeat'),
        ('get xy', 'error', 'off_prompt'), ('gt cd', 'error', 'malformed'),
        ('get cd', 'error', 'useful'), ('calc 12+', 'error', 'malformed')]
    assert set(arl.WASTED) == {'malformed', 'off_prompt', 'repeat'}


def test_call_verdicts_retry_after_error_is_useful(tok):
    t = _traj(tok, [('env', '<bos>ab?'), ('agent', '<call>get ab</call>'),
                    ('env', '<obs>error</obs>'), ('agent', '<call>get ab</call>'),
                    ('env', '<obs>40</obs>'), ('agent', '<call>calc 40*2</call>'),
                    ('env', '<obs>80</obs>'), ('agent', '<call>get ab</call>')],
              outcome='turn_limit', reward=0.0)
    verdicts = arl.call_verdicts(t, tok)
    assert [v['verdict'] for v in verdicts] == ['useful', 'useful', 'useful', 'repeat']
    assert verdicts[-1]['observation'] == ''     # the episode ended on that call


def test_turn_level_advantages(tok):
    good, bad = _sum_episode(tok), _sum_episode(tok, reward=0.0)
    adv = torch.tensor([1.5, -0.5])
    out = arl.turn_level_advantages([good, bad], adv, tok)
    assert out.shape == (2, len(good.ids) - 1)
    wasted = torch.zeros(len(good.ids) - 1)
    for v in arl.call_verdicts(good, tok):
        if v['verdict'] in arl.WASTED:
            wasted[v['start'] - 1:v['end'] - 1] = 1
    m = good.action_mask
    assert torch.equal(out[0], 1.5 * m * (1 - wasted))    # wasted: min(1.5, 0) = 0
    assert torch.equal(out[1], -0.5 * m)                  # failed: unchanged
    assert (out[0][m == 0] == 0).all()
    with pytest.raises(ValueError, match='advantages'):
        arl.turn_level_advantages([good], adv, tok)


def test_turn_level_advantages_pads_to_the_batch(tok):
    short = _traj(tok, [('env', '<bos>ab?'), ('agent', '<ans>3</ans>')])
    out = arl.turn_level_advantages([short, _sum_episode(tok)], torch.ones(2), tok)
    batch = arl.collate([short, _sum_episode(tok)], tok.pad_id)
    assert out.shape == batch['action_mask'].shape
    assert torch.equal(out, batch['action_mask'] * (out != 0))


def test_surrogate_gradient_matches_reinforce_loss(tok):
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=32, n_layers=1, n_heads=2)
    trajs = [_sum_episode(tok), _traj(tok, [('env', '<bos>ab?'),
                                            ('agent', '<ans>3</ans>')])]
    batch = arl.collate(trajs, tok.pad_id)
    adv, mask = torch.tensor([0.7, -1.2]), batch['action_mask']
    g = arl.surrogate_gradient(model, batch, adv, mask)
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())
    logp = arl.sequence_log_probs(model, batch['ids'])
    arl.reinforce_loss(logp, adv, mask).backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(g, ref, atol=1e-7)
    # per-token advantages equal to the broadcast ones give the same gradient
    g2 = arl.surrogate_gradient(model, batch, adv[:, None] * mask, mask)
    assert torch.allclose(g, g2, atol=1e-7)
    with pytest.raises(ValueError, match='mask'):
        arl.surrogate_gradient(model, batch, adv, mask[:, 1:])
    with pytest.raises(ValueError, match='no token'):
        arl.surrogate_gradient(model, batch, adv, torch.zeros_like(mask))
    with pytest.raises(ValueError, match='rows'):
        arl.surrogate_gradient(model, batch, adv[:1], mask)


def test_cosine():
    a = torch.tensor([1.0, 0.0])
    assert arl.cosine(a, a) == pytest.approx(1.0)
    assert arl.cosine(a, torch.tensor([0.0, 2.0])) == pytest.approx(0.0)
    assert arl.cosine(a, -3 * a) == pytest.approx(-1.0)


def test_observation_mask_and_unmask(tok):
    t = _sum_episode(tok)
    obs = arl.observation_mask(t)
    text_ids = t.ids[1:]
    # 1 exactly on the forced tokens after the first action
    expected = torch.zeros_like(obs)
    n_prompt = len(tok.encode('<bos>ab+cd'))
    expected[n_prompt - 1:] = 1 - t.action_mask[n_prompt - 1:]
    assert torch.equal(obs, expected)
    assert (obs * t.action_mask == 0).all() and obs.sum() > 0
    end_obs = tok.stoi['</obs>']
    assert all(bool(o) for o, x in zip(obs, text_ids) if int(x) == end_obs)
    u, = arl.unmask_observations([t], step=3)
    assert torch.equal(u.action_mask, t.action_mask + obs)
    assert u.action_mask[:n_prompt - 1].sum() == 0           # the prompt stays out
    assert t.action_mask.sum() < u.action_mask.sum()         # input unchanged
    assert u.reward == t.reward and u.info == t.info


def test_observation_tokens_trained(tok):
    t = _sum_episode(tok)
    assert arl.observation_tokens_trained(t, tok) == 0
    u, = arl.unmask_observations([t])
    assert arl.observation_tokens_trained(u, tok) == int(arl.observation_mask(t).sum())
    # a policy that writes '</obs>' itself is not flagged for it
    w = _traj(tok, [('env', '<bos>ab?'), ('agent', '<call>get ab</call>'),
                    ('env', '<obs>4</obs>'), ('agent', '<ans>4</obs></ans>')])
    assert arl.observation_tokens_trained(w, tok) == 0
    # one observation trained: the check counts exactly its tokens
    one = copy.deepcopy(t)
    first = arl.episode_turns(t, tok)[2]                     # <obs>12</obs>
    assert first['kind'] == 'observation'
    one.action_mask[first['start'] - 1:first['end'] - 1] = 1.0
    assert arl.observation_tokens_trained(one, tok) == first['end'] - first['start']
    bad = arl.Trajectory(ids=t.ids, action_mask=t.action_mask[1:],
                         sample_logp=t.sample_logp[1:], reward=0.0)
    with pytest.raises(ValueError, match='action_mask'):
        arl.observation_tokens_trained(bad, tok)


def test_drop_truncated(tok):
    trajs = [_sum_episode(tok, outcome=o, group=g) for g, o in
             enumerate(['correct', 'turn_limit', 'wrong', 'token_limit'])]
    kept = arl.drop_truncated(trajs, step=0)
    assert [t.info['outcome'] for t in kept] == ['correct', 'wrong']
    assert set(arl.TRUNCATED) == {'turn_limit', 'token_limit'}
    assert set(arl.TRUNCATED) <= set(arl.OUTCOMES)


def _eval(rates, families):
    names = [f't{i}' for i in range(len(rates))]
    return dict(per_task=dict(zip(names, rates)), family_of=dict(zip(names, families)))


def test_compare_arms():
    """Chapter 7's seed_paired on the tasks of some families: runs paired by seed."""
    fam = ['x', 'x', 'y', 'y']
    a = [_eval([0.0, 0.5, 0.5, 1.0], fam), _eval([0.5, 0.5, 0.5, 0.5], fam)]
    b = [_eval([1.0, 1.0, 0.5, 1.0], fam), _eval([0.5, 1.0, 0.5, 1.0], fam)]
    r = arl.compare_arms(a, b)
    assert r['diff'] == pytest.approx((0.875 + 0.75) / 2 - 0.5)
    assert r['per_run_a'] == [0.5, 0.5] and r['per_run_b'] == [0.875, 0.75]
    low, high = r['interval']
    assert low <= r['diff'] <= high
    assert r['interval'] == arl.seed_paired(a, b)['interval']
    same = arl.compare_arms(a, a)
    assert same['diff'] == 0 and same['interval'] == (0.0, 0.0)
    only_y = arl.compare_arms(a, b, families=('y',))
    assert only_y['diff'] == pytest.approx((0.75 + 0.75) / 2 - 0.625)
    assert only_y['per_run_b'] == [0.75, 0.75]
    # a constant difference in every task of every seed: no width
    c = [_eval([0.25, 0.5, 0.5, 0.75], fam)] * 2
    d = [_eval([0.5, 0.75, 0.75, 1.0], fam)] * 2
    assert arl.compare_arms(c, d)['interval'] == pytest.approx((0.25, 0.25))
    with pytest.raises(ValueError, match='non-empty'):
        arl.compare_arms([], b)
    with pytest.raises(ValueError, match='other tasks'):
        arl.compare_arms(a, [_eval([1.0], ['x'])] * 2)
    with pytest.raises(ValueError, match='pair them by seed'):
        arl.compare_arms(a, b[:1])
    with pytest.raises(ValueError, match='families'):
        arl.compare_arms(a, b, families=('z',))
    with pytest.raises(ValueError, match='level'):
        arl.compare_arms(a, b, level=1.5)


def test_train_multi_turn_caches_and_applies_the_transform(tok, tmp_path, monkeypatch):
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=32, n_layers=1, n_heads=2)
    tasks = arl.make_tasks('train')[:6]
    cfg = arl.RLConfig(seed=1, tasks_per_step=3, group_size=2, max_turns=2,
                       max_tokens=40)
    seen = []
    real = arl.TRANSFORMS['drop_truncated']
    monkeypatch.setitem(arl.TRANSFORMS, 'drop_truncated',
                        lambda trajs, step: seen.append(step) or real(trajs, step))
    m1, h1 = arl.train_multi_turn(model, tasks, tok, cfg, 2, 'drop_truncated',
                                  tasks[:5], 2, 1, final_limits=[(3, 50)])
    assert seen == [0, 1]
    assert len(h1) == 3 and len(h1[-1]['final']) == 1
    assert h1[-1]['final'][0]['n'] == 1
    m2, h2 = arl.train_multi_turn(model, tasks, tok, cfg, 2, 'drop_truncated',
                                  tasks[:5], 2, 1, final_limits=[(3, 50)])
    assert seen == [0, 1] and h2 == h1                      # read from the cache
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    # 'none' is chapter 10's train_rl without hooks (and so chapter 7's loop); a
    # random model never succeeds, so give the groups unequal rewards: both train
    informative_rewards(monkeypatch)
    m3, h3 = arl.train_multi_turn(model, tasks, tok, cfg, 2, 'none')
    ref = copy.deepcopy(model)
    arl.train_rl(ref, tasks, tok, cfg, 2, progress=False)
    assert all(h['kept'] > 0 for h in h3)
    for p, q in zip(m3.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, q) for p, q in zip(m3.parameters(),
                                                      model.parameters()))
    with pytest.raises(ValueError, match='transform'):
        arl.train_multi_turn(model, tasks, tok, cfg, 2, 'mask_everything')
    with pytest.raises(ValueError, match='eval_tasks'):
        arl.train_multi_turn(model, tasks, tok, cfg, 2, final_limits=[(3, 50)])
