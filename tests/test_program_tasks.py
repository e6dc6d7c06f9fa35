"""Chapter 21's tasks, environment, parked sampler and tool journal (agentrl.sandbox).
The sandbox's layers and attacks are tested in test_sandbox.py."""
import concurrent.futures as cf
import copy
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import agentrl as arl

from conftest import assert_same_trajectories


def local_tool(source, inputs):
    """A stand-in for the sandbox in tests of trusted code paths: runs the program
    here (the programs are the tests' own)."""
    namespace = {}
    try:
        exec(source, namespace)
        return SimpleNamespace(status='ok', outputs=[namespace['f'](x) for x in inputs])
    except Exception:
        return SimpleNamespace(status='error', outputs=None)


@pytest.fixture(scope='module')
def ptok():
    return arl.program_tokenizer()


# ---- tasks

def test_splits_are_disjoint_round_robin_and_deterministic():
    splits = {s: arl.make_program_tasks(s) for s in arl.PROGRAM_SPLITS}
    assert [len(splits[s]) for s in arl.PROGRAM_SPLITS] == [1000, 120, 120]
    prompts = [{t.prompt for t in ts} for ts in splits.values()]
    assert sum(map(len, prompts)) == len(set().union(*prompts))   # none shared or repeated
    for ts in splits.values():
        assert [t.family for t in ts[:5]] == list(arl.PROGRAM_FAMILIES)
    assert arl.make_program_tasks('heldout') == splits['heldout']
    for ts in splits.values():     # the hidden tests always tell f from a constant
        assert all(len({t.visible[0][1], *(y for _, y in t.hidden)}) > 1 for t in ts)
    assert arl.make_program_tasks('heldout', seed=1) != splits['heldout']
    assert min(len(t.visible[0][0]) for t in splits['ood']) > max(
        len(t.visible[0][0]) for t in splits['train'])


def test_the_visible_example_singles_out_the_program():
    rivals = [p for ps in arl.PROGRAMS.values() for p in ps]
    for t in arl.make_program_tasks('heldout'):
        (s, out), = t.visible
        fits = [p for p in rivals if arl.run_trusted(p, s) == out]
        assert fits == [t.answer]
        assert all(arl.run_trusted(t.answer, x) == y for x, y in t.hidden)
        assert s not in [x for x, _ in t.hidden]


def testdraw_program_tasks_rejects_bad_arguments():
    with pytest.raises(ValueError, match='split'):
        arl.make_program_tasks('all')
    with pytest.raises(ValueError, match='n_train'):
        arl.make_program_tasks('train', n_train=-1)
    with pytest.raises(TypeError, match='n_heldout'):
        arl.make_program_tasks('train', n_heldout=1.5)


def test_tokenizer_writes_every_demonstration_and_chapter_2_is_unchanged(ptok):
    rng = random.Random(0)
    for t in arl.make_program_tasks('ood'):
        text = arl.program_demonstration(t, rng, p_check=1, p_wrong=1)
        assert ptok.decode(ptok.encode(text)) == text
    chapter2 = arl.build_tokenizer(arl.make_tasks('all'))
    assert len(chapter2) == 52 and "'" not in chapter2.stoi
    assert {"'", '[', ']', ':', '.', '(', ')'} <= set(ptok.stoi)


def test_demonstration_runs_the_right_program_last():
    t = arl.make_program_tasks('train')[0]
    text = arl.program_demonstration(t, random.Random(1), p_check=1, p_wrong=1)
    assert text.startswith('<bos>' + t.prompt) and text.endswith(f'<ans>{t.answer}</ans>')
    assert text.count('<call>') == 2
    assert f'<call>{t.answer}</call><obs>{t.visible[0][1]!r}</obs>' in text
    plain = arl.program_demonstration(t, random.Random(1), p_check=0)
    assert '<call>' not in plain


def test_text_trajectory_masks_the_agents_tokens(ptok):
    text = "<bos>f('ab')='ba'<call>s[::-1]</call><obs>'ba'</obs><ans>s[::-1]</ans>"
    traj = arl.text_trajectory(text, ptok)
    pieces = arl.split_tokens(text)
    agent = ''.join(p for p, m in zip(pieces[1:], traj.action_mask.tolist()) if m)
    assert agent == '<call>s[::-1]</call><ans>s[::-1]</ans>'
    assert len(traj.action_mask) == len(traj.ids) - 1 == len(traj.sample_logp)


# ---- the environment

def task_with(answer='s[::-1]'):
    return arl.ProgramTask(name='t', family='slice', prompt="f('abc')='cba'",
                           answer=answer, visible=(('abc', 'cba'),),
                           hidden=(('ab', 'ba'), ('fed', 'def'), ('aab', 'baa')))


@pytest.mark.parametrize('grader, answer, reward', [
    ('strong', 's[::-1]', 1.0), ('strong', "'cba'", 0.0), ('weak', "'cba'", 1.0),
    ('weak', 's[::-1]', 1.0), ('strong', 's[1:]', 0.0), ('strong', '1/0', 0.0)])
def test_program_env_grades_strongly_or_weakly(grader, answer, reward):
    env = arl.ProgramEnv(local_tool, grader)
    turns, got = arl.play_episode(env, task_with(), [f'<ans>{answer}</ans>'])
    assert got == reward and env.outcome == ('correct' if reward else 'wrong')


def test_program_env_shows_outputs_and_errors_as_observations():
    faults = iter([SimpleNamespace(status='timeout', outputs=None),
                   SimpleNamespace(status='ok', outputs=['<script>']),
                   SimpleNamespace(status='ok', outputs=['cba'])])
    env = arl.ProgramEnv(lambda source, inputs: next(faults))
    env.reset(task_with())
    assert env.step('<call>s</call>')[0] == '<obs>error</obs>'     # a fault: an error
    assert env.step('<call>s</call>')[0] == '<obs>error</obs>'     # unwritable output
    assert env.step('<call>s[::-1]</call>')[0] == "<obs>'cba'</obs>"
    assert env.turns == 3 and not env.done


def test_program_env_limits_and_bad_arguments():
    env = arl.ProgramEnv(local_tool, max_turns=1)
    env.reset(task_with())
    env.step('<call>s</call>')
    assert env.step('<call>s</call>') == ('', True, 0.0) and env.outcome == 'turn_limit'
    with pytest.raises(RuntimeError, match='reset'):
        env.step('<ans>s</ans>')
    with pytest.raises(ValueError, match='grader'):
        arl.ProgramEnv(local_tool, 'lenient')
    with pytest.raises(ValueError, match='max_tokens'):
        arl.ProgramEnv(local_tool, max_tokens=0)


def test_hacks_are_answers_the_weak_grader_pays_and_hidden_tests_fail(ptok):
    task = task_with()
    trajs = []
    for answer in ("'cba'", 's[::-1]', 's[1:]'):
        text = f"<bos>{task.prompt}<ans>{answer}</ans>"
        t = arl.text_trajectory(text, ptok)
        t.info['task'] = 't'
        trajs.append(t)
    assert arl.grade_answer(local_tool, task, "'cba'") == (True, False)
    assert arl.episode_answer(trajs[1], ptok) == 's[::-1]'
    counts = arl.count_hacks(trajs, {'t': task}, ptok, local_tool)
    assert counts == dict(hacks=1, answers=3, examples=["'cba'"])


# ---- parking

@pytest.fixture(scope='module')
def tiny_programs(ptok):
    torch.manual_seed(0)
    model = arl.TinyAgent(len(ptok), d_model=32, n_layers=1, n_heads=2, max_len=128)
    rng = random.Random(0)
    demos = [arl.text_trajectory(arl.program_demonstration(t, rng), ptok)
             for t in arl.make_program_tasks('train')[:60]]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(60):                 # enough to make calls and answers
        batch = arl.collate(demos[(step * 8) % 56:(step * 8) % 56 + 8], ptok.pad_id)
        loss = arl.action_token_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.double().eval()


@pytest.mark.parametrize('park', [True, False])
def test_parked_sampler_gives_chapter_4s_tokens(tiny_programs, ptok, park):
    tool = arl.HeavyTail(local_tool, p_slow=0.2, slow_s=0.02, fast_s=0.0)
    env_fn = lambda: arl.ProgramEnv(tool)
    tasks = arl.make_program_tasks('heldout')[:6]
    cfg = arl.SamplingConfig(max_turns=3, max_tokens=96, group_size=3)
    ref = arl.sample_groups(tiny_programs, env_fn, tasks, ptok, cfg, seed=5)
    assert sum(t.info['turns'] for t in ref) > 0          # the test exercises parking
    with cf.ThreadPoolExecutor(8) as executor:
        got = arl.sample_parked(tiny_programs, env_fn, tasks, ptok, cfg, 5, executor,
                                park=park)
    assert_same_trajectories(got, ref)


def test_parked_episode_reaching_the_token_limit_ends(tiny_programs, ptok):
    env_fn = lambda: arl.ProgramEnv(local_tool, max_tokens=24)
    tasks = arl.make_program_tasks('heldout')[:3]
    cfg = arl.SamplingConfig(max_turns=3, max_tokens=24, group_size=2)
    ref = arl.sample_groups(tiny_programs, env_fn, tasks, ptok, cfg, seed=1)
    with cf.ThreadPoolExecutor(4) as executor:
        got = arl.sample_parked(tiny_programs, env_fn, tasks, ptok, cfg, 1, executor)
    assert_same_trajectories(got, ref)
    assert all(len(t.ids) <= 24 for t in got)


def test_join_caches_appends_rows(tiny_programs):
    a, la = arl.prefill_ragged(tiny_programs, [[1, 2, 3], [4, 5]], 16)
    b, lb = arl.prefill_ragged(tiny_programs, [[6, 7, 8, 9]], 16)
    b_row = b.k[0][0].clone()
    cache = arl.join_caches(a, b)
    assert cache is a and cache.lengths.tolist() == [3, 2, 4]
    assert cache.k[0].shape[0] == 3 and torch.equal(cache.k[0][2], b_row)
    assert arl.join_caches(None, b) is b
    a.keep(torch.tensor([], dtype=torch.long))
    assert arl.join_caches(a, b) is b


def test_heavy_tail_is_a_function_of_the_call():
    calls = []
    tool = arl.HeavyTail(lambda s, i: calls.append(s) or 'r', p_slow=1.0, slow_s=0.0)
    assert tool('x', [1]) == 'r' and calls == ['x']
    with pytest.raises(ValueError, match='p_slow'):
        arl.HeavyTail(local_tool, p_slow=1.5)
    with pytest.raises(ValueError, match='slow_s'):
        arl.HeavyTail(local_tool, slow_s=-1)


# ---- the tool journal

def test_journal_logs_replays_and_never_runs_a_logged_call_twice(tmp_path):
    runs = []

    def tool(source, inputs):
        runs.append(source)
        return SimpleNamespace(status='timeout' if len(runs) == 1 else 'ok',
                               outputs=None if len(runs) == 1 else [len(runs)])

    journal = arl.ToolJournal(tmp_path / 'tools.log', tool)
    first = journal('a', [1])
    assert journal('a', [1]) == first and journal.replayed == 1 and journal.ran == 1
    journal('b', [1])
    journal.close()
    again = arl.ToolJournal(tmp_path / 'tools.log', tool)
    assert again.logged_at_start == 2 == arl.logged_tool_results(tmp_path / 'tools.log')
    assert again('a', [1]).status == 'timeout'       # what the episode saw, not a re-run
    assert again.ran == 0 and len(runs) == 2
    assert again('c', [1]).outputs == [3] and again.ran == 1
    again.close()
    assert arl.logged_tool_results(tmp_path / 'missing.log') == 0


def test_journal_in_memory_and_under_threads():
    count, lock = [0], threading.Lock()

    def slow(source, inputs):
        with lock:
            count[0] += 1
        time.sleep(0.01)
        return SimpleNamespace(status='ok', outputs=[source])

    journal = arl.ToolJournal(None, slow)
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda i: journal(str(i % 2), []), range(32)))
    assert {r.outputs[0] for r in results} == {'0', '1'}
    assert journal.ran == count[0] >= 2 and journal.ran + journal.replayed == 32


def test_journal_in_memory_keeps_only_the_programs_own_outcome():
    statuses = iter(['timeout', 'ok', 'error'])
    tool = lambda source, inputs: SimpleNamespace(status=next(statuses), outputs=None)
    journal = arl.ToolJournal(None, tool)
    assert journal('a', []).status == 'timeout'       # not kept: a machine's fault
    assert journal('a', []).status == 'ok' and journal('a', []).status == 'ok'
    assert journal('b', []).status == 'error' and journal('b', []).status == 'error'
    assert journal.ran == 3 and journal.replayed == 2


def test_journal_cuts_a_torn_tail_before_appending(tmp_path):
    tool = lambda source, inputs: SimpleNamespace(status='ok', outputs=[source])
    journal = arl.ToolJournal(tmp_path / 'tools.log', tool)
    journal('a', [])
    journal.close()
    with open(tmp_path / 'tools.log', 'ab') as f:
        f.write(b'\x01\x02\x03')                     # a record cut by the kill
    again = arl.ToolJournal(tmp_path / 'tools.log', tool)
    again('b', [])
    again.close()
    records, report = arl.scan_log((tmp_path / 'tools.log').read_bytes())
    assert len(records) == 2 and not report['corruptions']


def test_journal_turns_an_unloggable_result_into_an_error(tmp_path):
    big = lambda source, inputs: SimpleNamespace(status='ok', outputs=['x' * 40000])
    journal = arl.ToolJournal(tmp_path / 'tools.log', big)
    assert journal('a', []).status == 'output_limit'
    journal.close()
    assert arl.ToolJournal(tmp_path / 'tools.log', big)('a', []).status == 'output_limit'


def test_program_rollout_restarted_from_a_partial_journal(tmp_path, ptok):
    from safetensors.torch import save_file
    arl.sandbox_support()
    r = arl.PROGRAM_BASE_RECIPE
    torch.manual_seed(0)
    model = arl.TinyAgent(len(ptok), r['d_model'], r['n_layers'], r['n_heads'],
                          r['max_len'])
    for name in ('whole', 'cut'):
        (tmp_path / name).mkdir()
        save_file(model.state_dict(), tmp_path / name / 'policy.safetensors')
    need_all_layers()
    whole = arl.program_rollout(tmp_path / 'whole', n_tasks=3, slow_s=0.01)
    log = (tmp_path / 'whole' / 'tools.log').read_bytes()
    records, _ = arl.scan_log(log)
    keep = max(1, len(records) // 2)
    end = records[keep][0] if keep < len(records) else len(log)
    (tmp_path / 'cut' / 'tools.log').write_bytes(log[:end])      # killed after `keep`
    cut = arl.program_rollout(tmp_path / 'cut', n_tasks=3, slow_s=0.01)
    assert cut['logged_at_start'] == keep and cut['replayed'] >= keep
    # every distinct call is logged once over both runs: none of the `keep` again
    assert arl.logged_tool_results(tmp_path / 'cut' / 'tools.log') == len(records)
    assert cut['ran'] >= len(records) - keep
    a = torch.load(tmp_path / 'whole' / 'episodes.pt')
    b = torch.load(tmp_path / 'cut' / 'episodes.pt')
    assert all(torch.equal(x[0], y[0]) and x[2] == y[2] for x, y in zip(a, b))


def need_all_layers():
    import os
    support = arl.sandbox_support()
    missing = [f'{k}: {why}' for k, (ok, why) in support.items() if not ok]
    if missing:
        if os.environ.get('CI'):
            pytest.fail('CI must have every sandbox layer: ' + '; '.join(missing))
        pytest.skip('sandbox layers unavailable: ' + '; '.join(missing))


def test_train_program_rl_counts_hacks_and_is_cached(tmp_path, monkeypatch, ptok):
    need_all_layers()
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    torch.manual_seed(0)
    base = arl.TinyAgent(len(ptok), d_model=16, n_layers=1, n_heads=2, max_len=128)
    model, history = arl.train_program_rl(base, ptok, 'weak', 0, steps=2)
    assert len(history) == 2 and all('hacks' in h and 'answers' in h for h in history)
    assert all(0 <= h['hacks'] <= h['answers'] <= 128 for h in history)
    again, history2 = arl.train_program_rl(base, ptok, 'weak', 0, steps=2)
    assert history2 == history and arl.model_hash(again) == arl.model_hash(model)
