"""Chapter 18: the write-ahead log's record format and recovery rules, counter-based sampling, the ragged
KV cache, and real crash tests: rollout processes killed with SIGKILL / preempted with SIGTERM at random
moments, restarted, and compared token for token with an uninterrupted run."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import agentrl as arl
from conftest import REPO, assert_same_trajectories as assert_same

# A fast job: a fresh random TinyAgent, 12 requests, at most 48 tokens each; a short sleep per decoding
# step stretches a run to a few tenths of a second, so that signals land in the middle of decoding.
SPEC = dict(model='random', split='heldout', n_tasks=4, group_size=3, max_tokens=48, step_sleep_s=0.003)


def spec(**changes):
    return arl.RolloutSpec(**dict(SPEC, **changes))


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    """The in-process rollouts use a tiny model: one thread is faster and steadier on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------
# Record format and recovery rules
# ----------------------------------------------------------------------------------------------------

def write_log(path, records, policy='os'):
    """Write (rtype, payload) records; return the file offset at which each record ends."""
    w = arl.WalWriter(path, policy)
    ends = []
    for rtype, payload in records:
        w.append(rtype, payload)
        ends.append(w.offset)
    w.close()
    return ends


def token_records(n_requests, n_tokens, seed=0):
    """A START for each request, then its tokens interleaved as a lockstep engine writes them."""
    rng = random.Random(seed)
    recs = [(arl.REC_START, arl.START_PAYLOAD.pack(r, r)) for r in range(n_requests)]
    truth = {r: [] for r in range(n_requests)}
    for pos in range(n_tokens):
        for r in range(n_requests):
            token = rng.randrange(36)
            truth[r].append(token)
            recs.append((arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(r, pos, token, -rng.random())))
    return recs, truth


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 255), st.binary(max_size=300)), max_size=30))
def test_records_round_trip(tmp_path_factory, records):
    path = tmp_path_factory.mktemp('log') / 'x.wal'
    write_log(path, records)
    got, report = arl.scan_log(path.read_bytes())
    assert [(t, p) for _, t, p in got] == records
    assert report['corruptions'] == [] and report['torn_tail_bytes'] == 0
    assert report['valid_end'] == path.stat().st_size


def test_encode_record_layout_and_limits():
    rec = arl.encode_record(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(7, 3, 11, -0.5))
    crc, length, rtype = arl.RECORD_HEADER.unpack_from(rec)
    assert (length, rtype, len(rec)) == (16, arl.REC_TOKEN, 7 + 16)
    import crc32c
    assert crc == crc32c.crc32c(rec[4:])
    with pytest.raises(ValueError, match='rtype'):
        arl.encode_record(0, b'')
    with pytest.raises(ValueError, match='WAL_MAX_PAYLOAD'):
        arl.encode_record(1, bytes(arl.WAL_MAX_PAYLOAD + 1))
    with pytest.raises(ValueError, match='policy'):
        arl.WalWriter('/dev/null', 'never')


def test_records_never_cross_blocks(tmp_path):
    recs, _ = token_records(20, 200)                     # ~4,000 records of 23 bytes: several blocks
    ends = write_log(tmp_path / 'x.wal', recs)
    for end, (_, payload) in zip(ends, recs):
        start = end - arl.RECORD_HEADER.size - len(payload)
        assert start // arl.WAL_BLOCK_SIZE == (end - 1) // arl.WAL_BLOCK_SIZE
    state = arl.recover_log(tmp_path / 'x.wal')
    assert state.report['records'] == len(recs) and state.report['corruptions'] == []


def test_policies_commit_and_sync(tmp_path):
    for policy, syncs in (('token', 5), ('step', 1), ('os', 0)):
        w = arl.WalWriter(tmp_path / f'{policy}.wal', policy)
        for i in range(5):
            w.append(arl.REC_START, arl.START_PAYLOAD.pack(i, 0))
        if policy != 'token':                             # nothing reaches the file before commit()
            assert (tmp_path / f'{policy}.wal').stat().st_size == 0
        w.commit()
        assert w.syncs == syncs and w.durable == (tmp_path / f'{policy}.wal').stat().st_size
        w.close()


def test_torn_tail_at_every_offset(tmp_path):
    """Truncating the log at any byte of its last records recovers exactly the complete records, silently."""
    recs, truth = token_records(3, 12)
    ends = write_log(tmp_path / 'x.wal', recs)
    data = (tmp_path / 'x.wal').read_bytes()
    for cut in range(ends[-8] - 1, len(data) + 1):
        got, report = arl.scan_log(data[:cut])
        complete = sum(end <= cut for end in ends)
        assert len(got) == complete, cut
        assert report['corruptions'] == [] and report['valid_end'] == (ends[complete - 1] if complete else 0)
        assert report['torn_tail_bytes'] == cut - report['valid_end']
        state = arl.replay_records(got, report)
        for r, req in state.requests.items():            # every recovered request is a prefix of the truth
            assert req.tokens.tolist() == truth[r][:len(req.tokens)]


def test_torn_tail_across_a_block_boundary(tmp_path):
    recs, _ = token_records(10, 160)
    ends = write_log(tmp_path / 'x.wal', recs)
    data = (tmp_path / 'x.wal').read_bytes()
    first_in_block_1 = next(i for i, e in enumerate(ends) if e > arl.WAL_BLOCK_SIZE)
    for cut in range(ends[first_in_block_1 - 2], ends[first_in_block_1 + 1] + 1):
        got, report = arl.scan_log(data[:cut])
        assert len(got) == sum(end <= cut for end in ends) and report['corruptions'] == [], cut


def test_flipped_bit_is_reported_never_a_wrong_token(tmp_path):
    """Every single-bit flip in a record of a full block is reported; the recovered tokens stay correct."""
    recs, truth = token_records(10, 200)                 # > 2 blocks
    ends = write_log(tmp_path / 'x.wal', recs)
    data = bytearray((tmp_path / 'x.wal').read_bytes())
    victim = next(i for i, e in enumerate(ends) if e > arl.WAL_BLOCK_SIZE // 2)
    start = ends[victim - 1]
    for bit in range(8 * (ends[victim] - start)):
        bad = bytearray(data)
        bad[start + bit // 8] ^= 1 << (bit % 8)
        got, report = arl.scan_log(bytes(bad))
        assert len(report['corruptions']) >= 1, bit
        assert report['corruptions'][0][0] == start
        state = arl.replay_records(got, report)
        for r, req in state.requests.items():
            assert req.tokens.tolist() == truth[r][:len(req.tokens)]
        # reading resumed at the next block: nothing there was lost
        in_block_1 = sum(1 for off, _, _ in got if off >= arl.WAL_BLOCK_SIZE)
        assert in_block_1 == sum(1 for e in ends if e > arl.WAL_BLOCK_SIZE)


def test_append_after_a_torn_padding(tmp_path):
    """A crash in the middle of a block's zero padding is a torn tail: cut it, append, and the log reads clean
    (were the partial padding kept, a 15-byte record appended after it would be misread)."""
    recs = [(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, i, 1, 0.0)) for i in range(1500)]
    ends = write_log(tmp_path / 'x.wal', recs)
    data = (tmp_path / 'x.wal').read_bytes()
    last_in_block_0 = max(e for e in ends if e <= arl.WAL_BLOCK_SIZE)
    assert arl.WAL_BLOCK_SIZE - last_in_block_0 == 16              # 1,424 records of 23 bytes, then padding
    cut = last_in_block_0 + 1                                      # one byte of padding made it to disk
    got, report = arl.scan_log(data[:cut])
    assert report['torn_tail_bytes'] == 1 and report['valid_end'] == last_in_block_0
    (tmp_path / 'y.wal').write_bytes(data[:report['valid_end']])   # what the engine does before appending
    write_log(tmp_path / 'y.wal', [(arl.REC_START, arl.START_PAYLOAD.pack(99, 0))])
    got2, report2 = arl.scan_log((tmp_path / 'y.wal').read_bytes())
    assert report2['corruptions'] == [] and len(got2) == len(got) + 1


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 10_000))
def test_scan_never_raises(garbage, where):
    recs, _ = token_records(2, 20)
    data = b''.join(arl.encode_record(t, p) for t, p in recs)
    where = where % (len(data) + 1)
    for blob in (garbage, data[:where] + garbage + data[where:], data[:where] + garbage):
        got, report = arl.scan_log(blob)
        arl.replay_records(got, report)


def test_replay_keeps_gap_free_prefixes():
    recs = [(arl.REC_START, arl.START_PAYLOAD.pack(0, 5)),
            (arl.REC_FORCED, arl.FORCED_PAYLOAD.pack(0, 0, 1)),
            (arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 2, 9, -1.0)),     # position 1 is missing: orphan
            (arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 1, 8, -0.5)),
            (arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 1, 8, -0.5)),     # duplicate
            (arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 1, 7, -0.5)),     # conflicting duplicate
            (arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(1, 0, 3, -0.5)),     # request 1 never started
            (arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(0, 3, 1.0, 0, 0)),  # wrong length: orphan
            (arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(0, 2, 1.0, 0, 1)),
            (arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 2, 9, -1.0)),     # after the finish: orphan
            (99, b'?'), (arl.REC_START, b'short')]                       # malformed
    state = arl.replay_records([(0, t, p) for t, p in recs], dict(corruptions=[]))
    req = state.requests[0]
    assert (req.task, req.tokens.tolist(), req.sampled.tolist(), req.finish) == (
        5, [1, 8], [0, 1], (1.0, 'correct', 1))
    assert req.logp.tolist() == [0.0, -0.5]
    assert (req.tokens.typecode, req.sampled.typecode, req.logp.typecode) == ('q', 'B', 'd')
    assert (state.report['orphans'], state.report['duplicates'], state.report['conflicts'],
            state.report['malformed']) == (4, 1, 1, 2)


# ----------------------------------------------------------------------------------------------------
# Sampling and decoding
# ----------------------------------------------------------------------------------------------------

def test_engine_samples_what_sample_groups_samples(tmp_path):
    """One sampler, one token step: chapter 18's engine and chapter 4's sample_groups give
    the same episodes for the same seed, model and tasks (request = index in the batch)."""
    job = spec(step_sleep_s=0.0, seed=5, temperature=0.8)
    arl.run_rollout(tmp_path / 'job', job)
    engine = arl.read_trajectories(tmp_path / 'job')
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    model = arl.build_rollout_model(job, tok)
    cfg = arl.SamplingConfig(group_size=job.group_size, temperature=job.temperature,
                             max_turns=job.max_turns, max_tokens=job.max_tokens)
    tasks = arl.make_tasks(job.split)[:job.n_tasks]
    lockstep = arl.sample_groups(model, lambda: arl.make_env(cfg), tasks, tok, cfg, seed=job.seed)
    assert len(engine) == len(lockstep) == job.n_tasks * job.group_size
    for a, b in zip(engine, lockstep):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.action_mask, b.action_mask)
        assert torch.allclose(a.sample_logp, b.sample_logp, atol=1e-6)
        assert (a.reward, a.info['outcome']) == (b.reward, b.info['outcome'])


def test_engine_decodes_the_tasks_a_step_picks(tmp_path):
    """tasks= lists the job's tasks by index into the split, in order (as a training step picks
    them): the engine samples what sample_groups samples on those tasks; the log keeps the list,
    so read_trajectories names the same tasks, and a discard run's re-samples keep them."""
    picked = (7, 2, 11)
    job = spec(step_sleep_s=0.0, seed=4, n_tasks=3, tasks=picked, group_size=2)
    arl.run_rollout(tmp_path / 'job', job)
    engine = arl.read_trajectories(tmp_path / 'job')
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    cfg = arl.SamplingConfig(group_size=2, max_turns=job.max_turns, max_tokens=job.max_tokens)
    tasks = [arl.make_tasks('heldout')[i] for i in picked]
    assert arl.rollout_tasks(job) == tasks
    lockstep = arl.sample_groups(arl.build_rollout_model(job, tok), lambda: arl.make_env(cfg),
                                 tasks, tok, cfg, seed=4)
    assert [t.info['task'] for t in engine] == [t.name for t in tasks for _ in range(2)]
    for a, b in zip(engine, lockstep):
        assert torch.equal(a.ids, b.ids) and a.info['group'] == b.info['group']
    logged, _ = arl.logged_job(arl.recover_log(tmp_path / 'job' / 'rollout.wal').meta)
    assert logged == job and logged.tasks == picked             # a tuple again, from JSON
    # preempted gracefully, a job of picked tasks restarts from its KV snapshot
    trajs, kills = arl.run_with_preemptions(tmp_path / 'resume', job, 0.1, seed=2,
                                            mode='resume', p_sigterm=1.0)
    assert_same(trajs, engine) and kills and 'snapshot' in modes(tmp_path / 'resume')
    trajs, kills = arl.run_with_preemptions(tmp_path / 'discard', job, 0.1, seed=2,
                                            mode='discard')
    assert kills and [t.info['task'] for t in trajs] == [t.info['task'] for t in engine]
    with pytest.raises(ValueError, match='n_tasks must be len\\(tasks\\) = 3'):
        spec(tasks=picked, n_tasks=4)
    with pytest.raises(TypeError, match='tasks must be a tuple of ints'):
        spec(tasks=(1, -2), n_tasks=2)
    with pytest.raises(ValueError, match="split 'heldout' has 160 tasks"):
        arl.run_rollout(tmp_path / 'bad', spec(tasks=(3, 160), n_tasks=2))
    assert not (tmp_path / 'bad').exists()


def test_ragged_decoding_matches_the_full_forward():
    torch.manual_seed(0)
    model = arl.TinyAgent(20, d_model=32, n_layers=2, n_heads=2, max_len=40).double().eval()
    seqs = [torch.randint(0, 20, (n,)).tolist() for n in (6, 11, 15)]
    with torch.no_grad():
        full = [model(torch.tensor([s]))[0] for s in seqs]                # [n, V] each
    cache, lengths = arl.prefill_ragged(model, [s[:k] for s, k in zip(seqs, (1, 4, 7))], 40)
    pos = [1, 4, 7]
    for _ in range(5):
        logits = arl.decode_step_ragged(model, cache, lengths, torch.tensor([s[p] for s, p in zip(seqs, pos)]))
        for i in range(3):
            assert (logits[i] - full[i][pos[i]]).abs().max() < 1e-12
        pos = [p + 1 for p in pos]
    assert lengths.tolist() == pos
    with pytest.raises(ValueError, match='capacity'):
        arl.prefill_ragged(model, [list(range(5))], 5)


def test_kv_snapshot_round_trip(tmp_path):
    torch.manual_seed(0)
    model = arl.TinyAgent(20, d_model=32, n_layers=2, n_heads=2, max_len=40).double().eval()
    cache, lengths = arl.prefill_ragged(model, [[1, 2, 3], [4, 5]], 40)
    arl.save_kv_snapshot(tmp_path / 'kv.safetensors', cache, lengths, [7, 9], 1234)
    loaded, lengths2, requests, claims = arl.load_kv_snapshot(tmp_path / 'kv.safetensors', model, 40)
    assert (requests, claims['log_offset'], lengths2.tolist()) == ([7, 9], 1234, [3, 2])
    a = arl.decode_step_ragged(model, cache, lengths, torch.tensor([6, 6]))
    b = arl.decode_step_ragged(model, loaded, lengths2, torch.tensor([6, 6]))
    assert torch.equal(a, b)


def test_length_bias_simulation_matches_theory():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(np.log(50), 0.8, 5000).round() + 1
    lam = 1 / lengths.mean()
    theory = arl.discard_restart_theory(lengths, lam)
    sim = arl.simulate_interruptions(lengths, lam, 20_000, rng, resume=False)
    assert abs(sim['completed'].mean() / theory['mean'] - 1) < 0.03
    assert abs(sim['decoded'] / 20_000 / theory['decoded'] - 1) < 0.03
    assert theory['mean'] < 0.8 * lengths.mean()                      # clearly biased towards short
    kept = arl.simulate_interruptions(lengths, lam, 20_000, rng, resume=True)
    assert abs(kept['completed'].mean() / lengths.mean() - 1) < 0.03 and kept['wasted'] == 0
    assert arl.discard_restart_theory(lengths, 0.0)['wasted'] == 0
    with pytest.raises(ValueError, match='lam'):
        arl.simulate_interruptions(lengths, -1, 10, rng, resume=False)


# ----------------------------------------------------------------------------------------------------
# Real crash tests
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """An uninterrupted run, in this process."""
    folder = tmp_path_factory.mktemp('reference')
    result = arl.run_rollout(folder, spec(policy='os', step_sleep_s=0.0))
    assert result['status'] == 'finished' and result['mode'] == 'fresh'
    return arl.read_trajectories(folder)


def ack_lines(folder):
    path = folder / 'acks.txt'
    return path.read_text().splitlines() if path.exists() else []


def acked_lengths(folder):
    """request -> the longest length any run acknowledged as committed."""
    best = {}
    for line in ack_lines(folder):
        for item in line.split()[2:]:
            rid, n = map(int, item.split(':'))
            best[rid] = max(best.get(rid, 0), n)
    return best


def check_durable(folder, ref):
    """Every acknowledged token is in the log, and the log holds no wrong token."""
    log = folder / 'rollout.wal'
    state = arl.recover_log(log) if log.exists() else arl.replay_records(*arl.scan_log(b''))
    assert state.report['corruptions'] == []
    for rid, n in acked_lengths(folder).items():
        assert len(state.requests[rid].tokens) >= n, (rid, n)
    for rid, req in state.requests.items():
        assert req.tokens.tolist() == ref[rid].ids[:len(req.tokens)].tolist()


def modes(folder):
    return [json.loads(line)['mode'] for line in (folder / 'runs.jsonl').read_text().splitlines()
            if '"mode"' in line]


def wait_for_acks(folder, proc, n, timeout=30.0):
    """Wait until the rollout has acknowledged n commits (or ended)."""
    start = time.time()
    while len(ack_lines(folder)) < n and proc.exitcode is None and time.time() - start < timeout:
        time.sleep(0.001)


def test_sigkill_at_random_moments(tmp_path, reference):
    """>= 20 SIGKILLs at random moments; after each, the log holds every acknowledged token and no wrong
    one; restarted each time (re-prefill from the log), the rollout ends equal to the uninterrupted one."""
    rng = random.Random(18)
    kills, trial = 0, 0
    while kills < 24:
        folder = tmp_path / f'trial{trial}'
        policy = ('step', 'os', 'step', 'os', 'token')[trial % 5]
        proc = arl.launch_rollout(folder, spec(policy=policy))
        for _ in range(3):                                # up to three kills per rollout
            if rng.random() < 0.25:                       # any moment, startup and recovery included
                time.sleep(rng.uniform(0, 0.15))
            else:                                         # somewhere in decoding, at a random step
                base = len(ack_lines(folder))
                wait_for_acks(folder, proc, base + rng.randint(1, 30))
                time.sleep(rng.uniform(0, 0.004))
            if proc.exitcode is not None:
                break
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            kills += 1
            check_durable(folder, reference)
            proc = arl.launch_rollout(folder, spec(policy=policy))   # the scheduler restarts the same job
        proc.join()
        assert proc.exitcode == 0
        assert_same(arl.read_trajectories(folder), reference)
        assert 'reprefill' in modes(folder) or modes(folder) == ['fresh']
        trial += 1
    assert kills >= 20


def test_sigterm_resumes_from_the_kv_snapshot(tmp_path, reference):
    rng = random.Random(3)
    for trial in range(4):
        folder = tmp_path / f'trial{trial}'
        proc = arl.launch_rollout(folder, spec(policy=('step', 'os')[trial % 2]))
        for _ in range(2):                                # preempted twice
            wait_for_acks(folder, proc, len(ack_lines(folder)) + rng.randint(1, 25))
            if proc.exitcode is not None:
                break
            assert arl.preempt_rollout(proc, grace_s=10.0) == 'graceful'
            assert proc.exitcode == arl.EXIT_PREEMPTED
            assert (folder / 'kv.safetensors').exists()
            check_durable(folder, reference)
            proc = arl.launch_rollout(folder)
        proc.join()
        assert proc.exitcode == 0
        assert modes(folder)[1:] == ['snapshot'] * (len(modes(folder)) - 1) and len(modes(folder)) >= 2
        assert not (folder / 'kv.safetensors').exists()
        assert_same(arl.read_trajectories(folder), reference)


def test_grace_period_too_short(tmp_path, reference):
    """SIGTERM then SIGKILL a moment later: the snapshot may or may not be complete; either way the restart
    (from the snapshot or by re-prefill) ends equal to the reference."""
    for trial, delay in enumerate((0.0, 0.0005, 0.002, 0.005)):
        folder = tmp_path / f'trial{trial}'
        proc = arl.launch_rollout(folder, spec())
        wait_for_acks(folder, proc, 10)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(delay)
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        check_durable(folder, reference)
        proc = arl.launch_rollout(folder, spec())
        proc.join()
        assert proc.exitcode == 0
        assert_same(arl.read_trajectories(folder), reference)


def test_restart_checks_the_job(tmp_path):
    arl.run_rollout(tmp_path, spec(step_sleep_s=0.0))
    with pytest.raises(ValueError, match='differs'):
        arl.run_rollout(tmp_path, spec(seed=1))
    with pytest.raises(ValueError, match='no spec'):
        arl.run_rollout(tmp_path / 'empty')
    result = arl.run_rollout(tmp_path, spec(policy='token', step_sleep_s=0.0))   # runtime fields may change
    assert result['status'] == 'finished' and result['decoded_tokens'] == 0


def test_torn_tail_and_flipped_bit_then_resume(tmp_path, reference):
    """Damage a finished log (cut it mid-record, or flip a bit in the middle), restart: the damage is
    handled (silently for the tail, reported for the bit), lost tokens are decoded again, result unchanged."""
    source = tmp_path / 'source'
    arl.run_rollout(source, spec(step_sleep_s=0.0))
    data = (source / 'rollout.wal').read_bytes()
    starts = [offset for offset, _, _ in arl.scan_log(data)[0]]
    rng = random.Random(0)
    cases = [(len(data) - 5, None), (starts[-3] + 9, None), (starts[len(starts) // 2] + 3, None),
             (len(data), len(data) // 2), (len(data), rng.randrange(len(data)))]
    for case, (cut, flip) in enumerate(cases):
        folder = tmp_path / f'case{case}'
        folder.mkdir()
        bad = bytearray(data[:cut])
        if flip is not None:
            bad[flip] ^= 0x10
        (folder / 'rollout.wal').write_bytes(bytes(bad))
        result = arl.run_rollout(folder, spec(step_sleep_s=0.0))   # needed only if the flip hit the meta record
        assert result['status'] == 'finished'
        if flip is not None:
            assert len(result['report']['corruptions']) >= 1
        else:
            assert result['report']['corruptions'] == [] and result['report']['torn_tail_bytes'] > 0
        if case > 0:                                  # case 0 only lost a finish record, which is rewritten
            assert result['decoded_tokens'] > 0
        assert_same(arl.read_trajectories(folder), reference)


def test_command_line_preempt_and_resume(tmp_path, reference):
    """The real command line: a fresh interpreter, SIGTERM, restart with no arguments but the folder."""
    cmd = [sys.executable, '-c', 'import agentrl as arl; arl.rollout_main()', str(tmp_path)]
    proc = subprocess.Popen(cmd + ['--spec', json.dumps(SPEC)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    start = time.time()
    while len(ack_lines(tmp_path)) < 8 and proc.poll() is None and time.time() - start < 60:
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == arl.EXIT_PREEMPTED and json.loads(out)['status'] == 'preempted'
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)['mode'] == 'snapshot'
    assert_same(arl.read_trajectories(tmp_path), reference)


# ----------------------------------------------------------------------------------------------------
# The policy version: a weights file, its numeric format, and the hash the job records
# ----------------------------------------------------------------------------------------------------

def preempt_at_step(monkeypatch, k):
    """SIGTERM to this process right after the k-th decoding step's forward pass: the engine
    preempts at the step boundary (signal.raise_signal runs the handler before it returns)."""
    from agentrl import wal_rollout as W
    step, calls = W.decode_step_ragged, []

    def wrapped(*args, **kwargs):
        out = step(*args, **kwargs)
        calls.append(1)
        if len(calls) == k:
            signal.raise_signal(signal.SIGTERM)
        return out
    monkeypatch.setattr(W, 'decode_step_ragged', wrapped)


def small_agent(seed=0):
    torch.manual_seed(seed)
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    return arl.TinyAgent(len(tok), d_model=32, n_layers=2, n_heads=2, max_len=48)


def weights_spec(path, **changes):
    return spec(**dict(dict(model=str(path), step_sleep_s=0.0, temperature=1.3), **changes))


def test_weights_file_changed_between_runs_is_refused(tmp_path, monkeypatch):
    """A job preempted, then restarted after its weights file changed: refused, naming both
    hashes, with the folder untouched; restarted with the same weights: it resumes from its
    snapshot. Another weight_format is refused the same way."""
    path = tmp_path / 'agent.safetensors'
    arl.save_rollout_weights(path, small_agent())
    reference = tmp_path / 'reference'
    ref = arl.run_rollout(reference, weights_spec(path))
    folder = tmp_path / 'job'
    preempt_at_step(monkeypatch, 5)
    assert arl.run_rollout(folder, weights_spec(path))['status'] == 'preempted'
    monkeypatch.undo()
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    changed = small_agent()
    with torch.no_grad():
        changed.head.weight[0, 0] += 1e-3                 # one weight, a little
    arl.save_rollout_weights(path, changed)
    other = arl.model_hash(arl.build_rollout_model(weights_spec(path), arl.build_tokenizer(
        arl.make_tasks('all'))))
    for changes in ({}, dict(weight_format='mxfp8')):
        with pytest.raises(ValueError, match='weights_hash') as refused:
            arl.run_rollout(folder, weights_spec(path, **changes))
        assert ref['weights_hash'] in str(refused.value)
        if not changes:
            assert other in str(refused.value) and other != ref['weights_hash']
    with pytest.raises(ValueError, match=ref['weights_hash']):
        arl.run_rollout(folder)                                    # the log's spec
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    arl.save_rollout_weights(path, small_agent())                   # the same weights again
    result = arl.run_rollout(folder)
    assert result['mode'] == 'snapshot' and result['weights_hash'] == ref['weights_hash']
    assert_same(arl.read_trajectories(folder), arl.read_trajectories(reference))


def test_snapshot_taken_with_other_weights_is_not_loaded(tmp_path, monkeypatch):
    """A snapshot whose claims carry another weights hash (all else equal) is not loaded: the
    restart re-prefills, says why, and ends as the uninterrupted run does."""
    reference = tmp_path / 'reference'
    arl.run_rollout(reference, spec(step_sleep_s=0.0))
    folder = tmp_path / 'job'
    preempt_at_step(monkeypatch, 5)
    arl.run_rollout(folder, spec(step_sleep_s=0.0))
    monkeypatch.undo()
    path = folder / 'kv.safetensors'
    model = arl.build_rollout_model(spec(), arl.build_tokenizer(arl.make_tasks('all')))
    cache, lengths, requests, claims = arl.load_kv_snapshot(path, model, SPEC['max_tokens'])
    assert claims['job']['weights_hash'] == arl.model_hash(model)
    assert claims['job']['weight_format'] == 'float32'
    job = dict(claims['job'], weights_hash='0123456789abcdef')
    arl.save_kv_snapshot(path, cache, lengths, requests, claims['log_offset'], job)
    result = arl.run_rollout(folder, spec(step_sleep_s=0.0))
    assert result['mode'] == 'reprefill' and result['snapshot'].startswith('other weights')
    assert '0123456789abcdef' in result['snapshot'] and not path.exists()
    assert_same(arl.read_trajectories(folder), arl.read_trajectories(reference))


def test_mxfp4_weights_file_decodes_the_quantized_model(tmp_path, monkeypatch):
    """A weights file decoded in MXFP4: the log's job names the format and the hash of the
    weights as decoded; a preempted and resumed run gives the uninterrupted run's episodes, and
    those equal the episodes of chapter 16's quantize_model(model, 'mxfp4'), its dequantised
    weights saved and decoded unrounded."""
    model = small_agent(1)
    path = tmp_path / 'agent.safetensors'
    arl.save_rollout_weights(path, model)
    quantized = arl.quantize_model(model, 'mxfp4')
    plain = small_agent(1)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, arl.QuantizedLinear):
                plain.get_submodule(name).weight.copy_(module.weight)
    float_path = tmp_path / 'dequantized.safetensors'
    arl.save_rollout_weights(float_path, plain)

    job = weights_spec(path, weight_format='mxfp4', dtype='float32')
    whole = arl.run_rollout(tmp_path / 'whole', job)
    meta = arl.recover_log(tmp_path / 'whole' / 'rollout.wal').meta
    assert meta['weight_format'] == 'mxfp4' and meta['weights_hash'] == whole['weights_hash']
    assert whole['weights_hash'] == arl.model_hash(plain)            # the model as decoded
    unrounded = arl.run_rollout(tmp_path / 'float32', weights_spec(path, dtype='float32'))
    assert unrounded['weights_hash'] != whole['weights_hash']
    preempt_at_step(monkeypatch, 7)
    assert arl.run_rollout(tmp_path / 'resumed', job)['status'] == 'preempted'
    monkeypatch.undo()
    assert arl.run_rollout(tmp_path / 'resumed')['mode'] == 'snapshot'
    trajs = arl.read_trajectories(tmp_path / 'whole')
    assert_same(arl.read_trajectories(tmp_path / 'resumed'), trajs)
    arl.run_rollout(tmp_path / 'float-path', weights_spec(float_path, dtype='float32'))
    assert_same(arl.read_trajectories(tmp_path / 'float-path'), trajs)
    assert trajs[0].info['weights_hash'] == whole['weights_hash']


def test_weights_file_and_format_are_checked(tmp_path):
    with pytest.raises(ValueError, match='weight_format'):
        spec(weight_format='int3')
    with pytest.raises(ValueError, match='model'):
        spec(model='agent.pt')
    assert spec(model=tmp_path / 'a.safetensors').model == str(tmp_path / 'a.safetensors')
    missing = tmp_path / 'missing.safetensors'
    with pytest.raises(ValueError, match='model'):
        arl.run_rollout(tmp_path / 'job', weights_spec(missing))
    assert not (tmp_path / 'job').exists()
    with pytest.raises(TypeError, match='model'):
        arl.save_rollout_weights(tmp_path / 'q.safetensors',
                                 arl.quantize_model(small_agent(), 'mxfp4'))
    with pytest.raises(ValueError, match='policy'):             # group commit is 'step' only
        arl.run_rollout(tmp_path / 'job', spec(policy='token'), writer=arl.GroupCommitWriter)
    assert not (tmp_path / 'job').exists()


# ----------------------------------------------------------------------------------------------------
# The length bias on the engine: run_with_preemptions
# ----------------------------------------------------------------------------------------------------

def decoded(traj):
    """Decoding steps an episode took: its tokens after the prompt."""
    return len(traj.ids) - 1 - int(traj.action_mask.argmax())


def test_run_with_preemptions_resume_equals_the_uninterrupted_run(tmp_path, reference):
    """Killed at exponential step counts (SIGTERM and SIGKILL), relaunched in the same folder: the
    finished job is the uninterrupted one, token for token; one run per kill, plus the last."""
    folder = tmp_path / 'resume'
    trajs, kills = arl.run_with_preemptions(folder, spec(step_sleep_s=0.0), 0.08, seed=3,
                                            mode='resume')
    assert_same(trajs, reference)
    assert kills and {k['signal'] for k in kills} == {'SIGTERM', 'SIGKILL'}
    # ('terminated': a SIGTERM that landed as the job was ending, after its handler was gone)
    assert {k['outcome'] for k in kills} <= {'graceful', 'killed', 'terminated'}
    assert all(k['discarded'] == k['discarded_tokens'] == 0 for k in kills)
    started = modes(folder)
    assert len(started) == len(kills) + 1 and started[0] == 'fresh'
    assert 'reprefill' in started and set(started[1:]) <= {'snapshot', 'reprefill'}


def test_run_with_preemptions_discard_throws_away_and_samples_again(tmp_path, reference):
    """discard: each request is the first sample of its task that fit between two kills. What run 0
    finished is the uninterrupted run's; the rest are new samples of the same task (new seeds), each no
    longer than the steps its run was allowed; every kill lost exactly the requests finished later."""
    folder = tmp_path / 'discard'
    trajs, kills = arl.run_with_preemptions(folder, spec(step_sleep_s=0.0), 0.04, seed=1,
                                            mode='discard')
    G = SPEC['group_size']
    assert len(trajs) == len(reference) and kills
    attempts = [t.info['attempt'] for t in trajs]
    assert 0 in attempts and max(attempts) == len(kills)       # the last run is the one not killed
    for rid, t in enumerate(trajs):
        assert t.info['request'] == rid and t.info['group'] == rid // G
        if t.info['attempt'] == 0:
            assert torch.equal(t.ids, reference[rid].ids)
        if t.info['attempt'] < len(kills):
            assert decoded(t) <= kills[t.info['attempt']]['steps']
    assert any(not torch.equal(t.ids, r.ids) for t, r in zip(trajs, reference))
    for k in kills:
        assert k['discarded'] == sum(a > k['run'] for a in attempts)
        assert k['discarded_tokens'] == k['discarded'] * k['steps']
    # each run decodes in a fresh folder, with seed spec.seed + run
    assert sorted(p.name for p in folder.iterdir()) == [f'attempt-{k:03d}' for k in range(len(kills) + 1)]
    assert arl.recover_log(folder / 'attempt-001' / 'rollout.wal').meta['seed'] == 1


def test_run_with_preemptions_without_kills_and_its_checks(tmp_path, reference):
    """rate 0: no kill, both modes give the uninterrupted run. Bad arguments are refused before
    anything runs; a rate at which the job cannot finish ends in RuntimeError after max_runs."""
    for mode in arl.PREEMPTION_MODES:
        trajs, kills = arl.run_with_preemptions(tmp_path / mode, spec(step_sleep_s=0.0), 0, seed=0,
                                                mode=mode)
        assert kills == [] and all(torch.equal(t.ids, r.ids) for t, r in zip(trajs, reference))
    with pytest.raises(ValueError, match='mode'):
        arl.run_with_preemptions(tmp_path / 'a', spec(), 0.1, 0, 'restart')
    for rate in (-0.1, float('nan'), float('inf')):
        with pytest.raises(ValueError, match='rate'):
            arl.run_with_preemptions(tmp_path / 'a', spec(), rate, 0, 'resume')
    with pytest.raises(ValueError, match="'none'"):
        arl.run_with_preemptions(tmp_path / 'a', spec(policy='none'), 0.1, 0, 'resume')
    with pytest.raises(ValueError, match='p_sigterm'):
        arl.run_with_preemptions(tmp_path / 'a', spec(), 0.1, 0, 'resume', p_sigterm=2)
    with pytest.raises(ValueError, match='exists'):
        arl.run_with_preemptions(tmp_path / 'resume', spec(), 0.1, 0, 'resume')
    with pytest.raises(TypeError):
        arl.run_with_preemptions(tmp_path / 'a', SPEC, 0.1, 0, 'resume')
    assert not (tmp_path / 'a').exists()
    with pytest.raises(RuntimeError, match='max_runs=2'):
        arl.run_with_preemptions(tmp_path / 'b', spec(step_sleep_s=0.0), 50.0, 0, 'discard', max_runs=2)


def test_read_trajectories_finished_only(tmp_path, reference):
    """finished_only: a preempted run's finished requests, in request order, equal to the reference's;
    without it, the unfinished job is refused."""
    proc = arl.launch_rollout(tmp_path, spec(step_sleep_s=0.01))
    wait_for_acks(tmp_path, proc, 15)
    assert arl.preempt_rollout(proc, 10.0) == 'graceful'
    part = arl.read_trajectories(tmp_path, finished_only=True)
    assert 0 < len(part) < len(reference)
    assert_same(part, [reference[t.info['request']] for t in part])
    with pytest.raises(ValueError, match='has not finished'):
        arl.read_trajectories(tmp_path)


def test_decoded_steps_counts_tokens_after_the_prompt():
    # prompt of 3 tokens (ids 0..2), then 3 decoded ones: the observation in the middle
    # (mask 0) was forced but came after the first sampled token, so it counts as a step
    ids = torch.tensor([1, 5, 6, 7, 8, 9])
    mask = torch.tensor([0, 0, 1, 0, 1])       # ids[t + 1] sampled
    traj = arl.Trajectory(ids, mask, torch.zeros(5), 0.0)
    assert arl.decoded_steps(traj) == 3


def test_a_rollout_process_that_fails_on_its_own_raises_rollout_failed(tmp_path, monkeypatch):
    """A rollout process that exits with a code of its own (neither finished nor killed by us)
    raises RolloutFailed, a RuntimeError that carries the exit code."""
    import multiprocessing

    def failing(folder, spec):
        Path(folder).mkdir(parents=True, exist_ok=True)
        proc = multiprocessing.get_context('fork').Process(target=os._exit, args=(7,))
        proc.start()
        return proc
    # run_with_preemptions (agentrl/preemption.py) calls it as arl.launch_rollout
    monkeypatch.setattr(arl, 'launch_rollout', failing)
    with pytest.raises(arl.RolloutFailed, match='exit code 7') as failure:
        arl.run_with_preemptions(tmp_path / 'job', spec(step_sleep_s=0.0), 0, seed=0,
                                 mode='resume')
    assert failure.value.exitcode == 7 and isinstance(failure.value, RuntimeError)


def test_a_quantised_weights_file_is_read_as_the_float32_file_rounded(tmp_path):
    """save_rollout_weights(fmt='mxfp4') writes chapter 16's file (its codes and scales); the
    engine reads it as the decoded weights that rounding the float32 file gives, bit for bit,
    and refuses it for another weight format."""
    model, tok = small_agent(), arl.build_tokenizer(arl.make_tasks('all'))
    fp4, fp32 = tmp_path / 'fp4.safetensors', tmp_path / 'fp32.safetensors'
    small, large = (arl.save_rollout_weights(fp4, model, 'mxfp4'),
                    arl.save_rollout_weights(fp32, model))
    assert small == fp4.stat().st_size < large / 2
    assert (arl.weights_file_format(fp4), arl.weights_file_format(fp32)) == ('mxfp4',
                                                                           'float32')
    loaded = arl.load_rollout_weights(fp4)
    assert type(loaded) is arl.TinyAgent
    assert arl.model_hash(loaded) == arl.model_hash(arl.round_weights(model, 'mxfp4'))
    spec = lambda path, fmt: arl.RolloutSpec(seed=0, model=str(path), weight_format=fmt,
                                             n_tasks=1, max_tokens=40)
    a, b = (arl.build_rollout_model(spec(fp4, 'mxfp4'), tok),
            arl.build_rollout_model(spec(fp32, 'mxfp4'), tok))
    assert arl.model_hash(a) == arl.model_hash(b)
    with pytest.raises(ValueError, match='holds mxfp4 weights'):
        arl.build_rollout_model(spec(fp4, 'float32'), tok)
    with pytest.raises(ValueError, match='fmt must be one of'):
        arl.save_rollout_weights(fp4, model, 'fp4')
    (tmp_path / 'junk.safetensors').write_bytes(b'not a file')
    with pytest.raises(ValueError, match='not a safetensors weights file'):
        arl.weights_file_format(tmp_path / 'junk.safetensors')
