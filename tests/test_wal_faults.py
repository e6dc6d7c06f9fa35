"""Chapter 18: regression tests for faults the rollout engine once mishandled.

Each fault is reproduced at a deterministic point, never after a sleep: a wrapper around one
of the engine's own functions stops the process right there (SIGKILL in a child process, an
exception in this one, which leaves the files exactly as a kill would, or a SIGTERM the
process sends itself at a chosen decoding step). The wrappers touch only names that the
engine looks up at call time (WalWriter.append, decode_step_ragged, _append_line,
safetensors' save_file, run_rollout), so the same tests also run against older engines.
The tests that restart a job run it with both of the log's reader/writer pairs: chapter
18's (recover_log, WalWriter) and chapter 19's (recover_log_fast, GroupCommitWriter).
"""
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import time

import pytest
import torch

import agentrl as arl
from agentrl import wal_rollout as W
from conftest import REPO, assert_same_trajectories as assert_same

# The job of the fault-injection run that found these faults: a random-weight TinyAgent,
# 4 tasks x 3 samples, at most 48 tokens, seed 5, temperature 1.3.
SPEC = dict(model='random', split='heldout', n_tasks=4, group_size=3, max_tokens=48,
            seed=5, temperature=1.3)


def spec(**changes):
    return arl.RolloutSpec(**dict(SPEC, **changes))


# The log's parts run_rollout takes: chapter 18's reader and writer, and chapter 19's
# vectorised reader and group-commit writer (policy 'step' only).
PARTS = {'ch18': dict(recover=arl.recover_log, writer=arl.WalWriter),
         'ch19': dict(recover=arl.recover_log_fast, writer=arl.GroupCommitWriter)}


@pytest.fixture(params=sorted(PARTS))
def parts(request):
    """The keyword arguments of one reader/writer pair, for run_rollout and
    launch_rollout: a test that takes this fixture runs once with each pair."""
    return PARTS[request.param]


class Crash(BaseException):
    """Raised by a wrapper to stop a run in this process at a named point. Nothing runs
    after it that writes a file, so the folder is left as a SIGKILL there would leave it
    (a BaseException, so that no `except Exception` in the engine can swallow it)."""


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """The job run to the end without interruption, in this process."""
    folder = tmp_path_factory.mktemp('reference')
    assert arl.run_rollout(folder, spec(policy='os'))['status'] == 'finished'
    return arl.read_trajectories(folder)


def acked_lengths(folder):
    """request -> the longest length any run acknowledged as committed."""
    best = {}
    path = folder / 'acks.txt'
    for line in (path.read_text().splitlines() if path.exists() else []):
        for item in line.split()[2:]:
            rid, n = map(int, item.split(':'))
            best[rid] = max(best.get(rid, 0), n)
    return best


def start_lines(folder):
    """The start line of each run in runs.jsonl (a torn line skipped)."""
    lines = []
    for line in (folder / 'runs.jsonl').read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [r for r in lines if 'mode' in r]


def at_step(monkeypatch, k, action):
    """Call action() right after the k-th decoding step's forward pass (k = 1, 2, ...)."""
    step = W.decode_step_ragged
    calls = []

    def wrapped(*args, **kwargs):
        out = step(*args, **kwargs)
        calls.append(1)
        if len(calls) == k:
            action()
        return out
    monkeypatch.setattr(W, 'decode_step_ragged', wrapped)


def preempt_at_step(monkeypatch, k):
    """SIGTERM to this process during step k: the engine preempts at the step boundary.
    (signal.raise_signal runs the Python handler before it returns.)"""
    at_step(monkeypatch, k, lambda: signal.raise_signal(signal.SIGTERM))


def crash_at_step(monkeypatch, k):
    def crash():
        raise Crash(f'step {k}')
    at_step(monkeypatch, k, crash)


def preempted_folder(tmp_path, monkeypatch, k=6, policy='step', parts=None):
    """A folder in which the job was preempted at step k: log + KV snapshot."""
    folder = tmp_path / 'preempted'
    preempt_at_step(monkeypatch, k)
    result = arl.run_rollout(folder, spec(policy=policy), **(parts or {}))
    monkeypatch.undo()
    assert result['status'] == 'preempted' and (folder / 'kv.safetensors').exists()
    return folder


# A child process that runs the job and stops itself at a named point.
DRIVER = r'''
import json, os, signal, struct, sys
import torch
import agentrl as arl
from agentrl import wal, wal_rollout as W
folder, spec, point = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(1)
if point['at'] == 'record':
    # SIGKILL right after this record is appended (under policy 'token': written and
    # fsynced)
    append = wal.WalWriter.append
    def append_then_die(self, rtype, payload):
        append(self, rtype, payload)
        if rtype == point['rtype'] and list(struct.unpack_from('<II', payload)) == point['key']:
            os.kill(os.getpid(), signal.SIGKILL)
    wal.WalWriter.append = append_then_die
    W.run_rollout(folder, arl.RolloutSpec(**spec))
elif point['at'] == 'before-handler':
    # stop inside the rollout process before run_rollout installs its SIGTERM handler
    print('ready', flush=True)
    sys.stdin.readline()
    W.run_rollout(folder, arl.RolloutSpec(**spec))
'''


def child(folder, job, point, **kwargs):
    cmd = [sys.executable, '-c', DRIVER, str(folder), json.dumps(job), json.dumps(point)]
    return subprocess.Popen(cmd, cwd=REPO, text=True, **kwargs)


# ----------------------------------------------------------------------------------------
# 1. A request whose log holds exactly one token
# ----------------------------------------------------------------------------------------

def test_killed_right_after_the_first_token_of_a_request_resumes(tmp_path, reference):
    """SIGKILL right after the forced record of request 1, position 0 (<bos>), is written
    and fsynced (policy 'token'): every restart used to fail in prefill_ragged."""
    proc = child(tmp_path, dict(SPEC, policy='token'),
                 dict(at='record', rtype=arl.REC_FORCED, key=[1, 0]))
    assert proc.wait(timeout=120) == -signal.SIGKILL
    state = arl.recover_log(tmp_path / 'rollout.wal')
    assert len(state.requests[1].tokens) == 1 and 2 not in state.requests
    for _ in range(2):                                   # the restart, and one more
        result = arl.run_rollout(tmp_path)
        assert result['status'] == 'finished'
    assert_same(arl.read_trajectories(tmp_path), reference)


def test_log_truncated_after_a_first_token_resumes(tmp_path, reference, parts):
    """The same state made by truncating a finished log right after the record of
    position 0 of a request: the restart logs the rest of its prompt and finishes."""
    source = tmp_path / 'source'
    arl.run_rollout(source, spec(policy='token'))
    data = (source / 'rollout.wal').read_bytes()
    records, _ = arl.scan_log(data)
    for rid in (0, 1, 11):
        offset, _, payload = next(
            r for r in records
            if r[1] == arl.REC_FORCED and arl.FORCED_PAYLOAD.unpack(r[2])[:2] == (rid, 0))
        folder = tmp_path / f'cut{rid}'
        folder.mkdir()
        (folder / 'rollout.wal').write_bytes(
            data[:offset + arl.RECORD_HEADER.size + len(payload)])
        assert len(arl.recover_log(folder / 'rollout.wal').requests[rid].tokens) == 1
        assert arl.run_rollout(folder, spec(), **parts)['status'] == 'finished'
        assert_same(arl.read_trajectories(folder), reference)


# ----------------------------------------------------------------------------------------
# 2. The KV snapshot carries a checksum
# ----------------------------------------------------------------------------------------

def safetensors_layout(data):
    """-> (header dict, offset of the data section) of a safetensors file image."""
    n = struct.unpack_from('<Q', data)[0]
    return json.loads(data[8:8 + n]), 8 + n


def test_damaged_kv_snapshot_falls_back_to_reprefill(tmp_path, monkeypatch, reference,
                                                     parts):
    """One flipped bit in the K or V data (or anywhere else in the snapshot) is caught by
    its checksum: the restart re-prefills, says so in runs.jsonl, and ends equal to the
    uninterrupted run. An intact snapshot is still used."""
    folder = preempted_folder(tmp_path, monkeypatch, parts=parts)
    snap = (folder / 'kv.safetensors').read_bytes()
    header, base = safetensors_layout(snap)
    n_layers = sum(name.startswith('k') for name in header if name != '__metadata__')

    def data_byte(name, i):
        return base + header[name]['data_offsets'][0] + i
    # byte 7 of a float64 holds its sign and top exponent bits: slot 0 of row 0 (<bos>),
    # attended by every later position, moves a lot
    cases = {'k0 data': data_byte('k0', 7), f'v{n_layers - 1} data': data_byte(f'v{n_layers - 1}', 7),
             'k0 low bit': data_byte('k0', 0), 'lengths': data_byte('lengths', 0),
             'requests': data_byte('requests', 0),
             'metadata': snap.index(b'log_offset') + len('log_offset') + 3}
    for name, where in list(cases.items()) + [('intact', None), ('truncated', -1)]:
        copy = tmp_path / name.replace(' ', '-')
        copy.mkdir()
        (copy / 'rollout.wal').write_bytes((folder / 'rollout.wal').read_bytes())
        bad = bytearray(snap)
        if where == -1:
            bad = bad[:len(bad) // 2]
        elif where is not None:
            bad[where] ^= 0x40
        (copy / 'kv.safetensors').write_bytes(bytes(bad))
        result = arl.run_rollout(copy, spec(), **parts)
        line = start_lines(copy)[-1]
        if name == 'intact':
            assert (result['mode'], result['snapshot'], line['snapshot']) == (
                'snapshot', 'loaded', 'loaded')
        else:
            assert result['mode'] == 'reprefill', name
            assert result['snapshot'].startswith(('checksum mismatch', 'unreadable')), name
            assert line['snapshot'] == result['snapshot'] and line['mode'] == 'reprefill'
        assert not (copy / 'kv.safetensors').exists()
        assert_same(arl.read_trajectories(copy), reference)


def test_snapshot_of_another_log_position_or_job_is_not_used(tmp_path, monkeypatch,
                                                             reference, parts):
    """What the snapshot claims to match is checked too: the log's end and the job."""
    folder = preempted_folder(tmp_path, monkeypatch, parts=parts)
    path = folder / 'kv.safetensors'
    cache, lengths, requests, claims = arl.load_kv_snapshot(
        path, W.build_rollout_model(spec(), arl.build_tokenizer(arl.make_tasks('all'))),
        SPEC['max_tokens'])
    for name, offset, job in (('offset', claims['log_offset'] - 23, claims['job']),
                              ('job', claims['log_offset'], dict(claims['job'], seed=6))):
        copy = tmp_path / name
        copy.mkdir()
        (copy / 'rollout.wal').write_bytes((folder / 'rollout.wal').read_bytes())
        arl.save_kv_snapshot(copy / 'kv.safetensors', cache, lengths, requests, offset, job)
        result = arl.run_rollout(copy, spec(), **parts)
        assert result['mode'] == 'reprefill' and result['snapshot'] != 'loaded'
        assert_same(arl.read_trajectories(copy), reference)


# ----------------------------------------------------------------------------------------
# 3. A damaged length in the last block
# ----------------------------------------------------------------------------------------

def test_flipped_length_bit_in_the_last_block_truncates_nothing(tmp_path, monkeypatch,
                                                                reference, parts):
    """A flipped bit makes a record's length run past the end of the file. LevelDB's rule
    takes it for a torn write, and the restart used to cut every intact, checksummed,
    acknowledged record after it. Now the reader finds the records after it: the damage is
    reported, nothing after it is cut, and only the damaged request loses tokens."""
    folder = tmp_path / 'job'
    crash_at_step(monkeypatch, 30)                       # a run killed in mid-decoding
    with pytest.raises(Crash):
        arl.run_rollout(folder, spec(policy='step'), **parts)
    monkeypatch.undo()
    data = bytearray((folder / 'rollout.wal').read_bytes())
    size = len(data)
    records, report = arl.scan_log(bytes(data))
    assert report['torn_tail_bytes'] == 0 and size < arl.WAL_BLOCK_SIZE   # one block
    # a token record about 4,000 bytes before the end, and a bit of its length field
    # that makes it run past the end of the file but not past its block
    pos, rtype, payload = next(r for r in records if r[0] >= size - 4000
                               and r[1] == arl.REC_TOKEN)
    victim_end = pos + arl.RECORD_HEADER.size + len(payload)
    bit = next(b for b in range(16) if size < pos + arl.RECORD_HEADER.size
               + (len(payload) ^ 1 << b) <= arl.WAL_BLOCK_SIZE)
    data[pos + 4 + bit // 8] ^= 1 << (bit % 8)
    (folder / 'rollout.wal').write_bytes(bytes(data))
    victim_rid, victim_position = struct.unpack_from('<II', payload)

    state = arl.recover_log(folder / 'rollout.wal')
    assert [(c[0], c[1]) for c in state.report['corruptions']] == [
        (pos, 'length runs past the end of the file')]
    assert state.report['torn_tail_bytes'] == 0 and state.report['valid_end'] == size
    for rid, n in acked_lengths(folder).items():         # acknowledged: still there
        have = len(state.requests[rid].tokens)
        assert have >= n if rid != victim_rid else have == victim_position
    result = arl.run_rollout(folder, spec(policy='step'), **parts)
    after = (folder / 'rollout.wal').read_bytes()
    assert after[victim_end:size] == bytes(data[victim_end:size])   # nothing was cut
    assert result['status'] == 'finished' and len(result['report']['corruptions']) == 1
    assert_same(arl.read_trajectories(folder), reference)


def test_every_bit_flip_of_a_last_block_record_is_reported_and_cuts_nothing(tmp_path):
    """All 8 x 23 single-bit flips of a token record in the last block, with intact
    records after it: each is reported, no record after it is lost, nothing may be cut."""
    w = arl.WalWriter(tmp_path / 'x.wal', 'os')
    for i in range(1600):                                # 1.1 blocks of 23-byte records
        w.append(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(i % 4, i // 4, i % 36, -0.5))
    w.close()
    data = (tmp_path / 'x.wal').read_bytes()
    records, _ = arl.scan_log(data)
    victim = next(i for i, r in enumerate(records) if r[0] > len(data) - 1500)
    start = records[victim][0]
    after = [r for r in records if r[0] > start]
    for bit in range(8 * 23):
        bad = bytearray(data)
        bad[start + bit // 8] ^= 1 << (bit % 8)
        got, report = arl.scan_log(bytes(bad))
        assert [c[0] for c in report['corruptions']] == [start], bit
        assert report['valid_end'] == len(data) and report['torn_tail_bytes'] == 0, bit
        assert [r for r in got if r[0] > start] == after, bit


def test_resynchronising_finds_no_records_in_random_bytes():
    """Scanning for the next valid record after damage must not invent records: in 256 KiB
    of random bytes (8 blocks, every offset a candidate) none passes the checksum."""
    import numpy as np
    garbage = np.random.default_rng(0).integers(0, 256, 8 * arl.WAL_BLOCK_SIZE,
                                                 dtype=np.uint8).tobytes()
    records, report = arl.scan_log(garbage)
    assert records == [] and report['valid_end'] == 0
    assert len(report['corruptions']) >= 8               # at least one per block


def test_a_real_torn_tail_is_still_cut_silently(tmp_path, reference, parts):
    """The stricter rule changes nothing for a true torn write: a record cut off by the
    end of the file, with nothing valid after it."""
    source = tmp_path / 'source'
    arl.run_rollout(source, spec(policy='os'))
    data = (source / 'rollout.wal').read_bytes()
    folder = tmp_path / 'torn'
    folder.mkdir()
    (folder / 'rollout.wal').write_bytes(data[:-30])
    result = arl.run_rollout(folder, spec(), **parts)
    assert result['report']['corruptions'] == [] and result['report']['torn_tail_bytes'] > 0
    assert_same(arl.read_trajectories(folder), reference)


# ----------------------------------------------------------------------------------------
# 4. The whole spec is checked before anything touches the folder
# ----------------------------------------------------------------------------------------

BAD_SPECS = [('temperature', 0.0), ('temperature', -1.0), ('temperature', float('nan')),
             ('temperature', float('inf')), ('group_size', 0), ('group_size', -2),
             ('n_tasks', 0), ('n_tasks', 10 ** 6), ('max_tokens', 0), ('seed', -1),
             ('step_sleep_s', -0.1), ('step_sleep_s', float('nan')), ('policy', 'never'),
             ('model', 'gpt'), ('dtype', 'int8'), ('split', 'test'), ('group_size', 2.5),
             ('temperature', '1.0')]


@pytest.mark.parametrize('name,value', BAD_SPECS, ids=lambda v: repr(v))
def test_bad_spec_is_refused_before_the_folder_is_touched(tmp_path, name, value):
    folder = tmp_path / 'job'
    with pytest.raises((ValueError, TypeError), match=name):
        arl.run_rollout(folder, spec(**{'policy': 'token', name: value}))
    assert not folder.exists()


def test_corrected_restart_after_a_refused_spec(tmp_path, reference):
    folder = tmp_path / 'job'
    folder.mkdir()
    with pytest.raises(ValueError, match='temperature'):
        arl.run_rollout(folder, spec(policy='token', temperature=0.0))
    assert list(folder.iterdir()) == []
    assert arl.run_rollout(folder, spec(policy='token'))['status'] == 'finished'
    assert_same(arl.read_trajectories(folder), reference)
    with pytest.raises(ValueError, match='temperature'):      # at once, in the parent
        arl.launch_rollout(folder, arl.RolloutSpec(**dict(SPEC, temperature=float('nan'))))


# ----------------------------------------------------------------------------------------
# 5. Run bookkeeping
# ----------------------------------------------------------------------------------------

def test_torn_last_line_of_runs_jsonl(tmp_path, monkeypatch, reference, parts):
    """The process dies inside the write of its last runs.jsonl line: half a line, no
    newline. Restarts used to fail with JSONDecodeError."""
    folder = tmp_path / 'job'
    crash_at_step(monkeypatch, 12)
    with pytest.raises(Crash):
        arl.run_rollout(folder, spec(), **parts)
    monkeypatch.undo()
    append = W._append_line

    def torn_write(path, text):
        if path.name != 'runs.jsonl' or '"status"' not in text:
            return append(path, text)
        with open(path, 'a') as f:                        # half the line made it
            f.write(text[:len(text) // 2])
        raise Crash('died inside the write')
    preempt_at_step(monkeypatch, 6)
    monkeypatch.setattr(W, '_append_line', torn_write)
    with pytest.raises(Crash):
        arl.run_rollout(folder, spec(), **parts)
    monkeypatch.undo()
    assert not (folder / 'runs.jsonl').read_text().endswith('\n')
    result = arl.run_rollout(folder, spec(), **parts)
    assert result['status'] == 'finished' and result['run'] == 2
    lines = (folder / 'runs.jsonl').read_text().splitlines()
    assert all(json.loads(line) for line in lines)      # every line parses again
    assert [r['mode'] for r in start_lines(folder)] == ['fresh', 'reprefill', 'snapshot']
    assert start_lines(folder)[-1]['runs_torn_bytes'] > 0
    assert_same(arl.read_trajectories(folder), reference)


def test_policy_none_does_not_claim_an_unfinished_logged_job(tmp_path, monkeypatch,
                                                             reference):
    """Restarting a logged, unfinished job with policy 'none' used to report 'finished'
    while read_trajectories said it was not: now both say it has not finished."""
    folder = tmp_path / 'job'
    crash_at_step(monkeypatch, 10)
    with pytest.raises(Crash):
        arl.run_rollout(folder, spec())
    monkeypatch.undo()
    before = (folder / 'rollout.wal').read_bytes()
    with pytest.raises(ValueError, match="policy 'none'"):
        arl.run_rollout(folder, spec(policy='none'))
    with pytest.raises(ValueError, match='has not finished'):
        arl.read_trajectories(folder)
    assert (folder / 'rollout.wal').read_bytes() == before
    assert arl.run_rollout(folder, spec())['status'] == 'finished'
    done = arl.run_rollout(folder, spec(policy='none'))       # finished: both agree
    assert done['status'] == 'finished' and done['decoded_tokens'] == 0
    assert_same(arl.read_trajectories(folder), reference)
    unlogged = tmp_path / 'unlogged'
    assert arl.run_rollout(unlogged, spec(policy='none'))['status'] == 'finished'
    with pytest.raises(ValueError, match='no log'):
        arl.read_trajectories(unlogged)


def test_leftover_snapshot_tmp_is_removed(tmp_path, monkeypatch, reference, parts):
    """Killed while writing the snapshot (after save_file, before the rename): the restart
    removes the temporary kv.safetensors.<pid>.tmp, says so, and re-prefills."""
    import safetensors.torch
    save_file = safetensors.torch.save_file

    def save_then_die(*args, **kwargs):
        save_file(*args, **kwargs)
        raise Crash('killed before the rename')
    folder = tmp_path / 'job'
    preempt_at_step(monkeypatch, 8)
    monkeypatch.setattr(safetensors.torch, 'save_file', save_then_die)
    with pytest.raises(Crash):
        arl.run_rollout(folder, spec(), **parts)
    monkeypatch.undo()
    # durable_write removes its temporary file when an exception unwinds it; a kill
    # (SIGKILL, power loss) at that point leaves it behind, as here
    assert not list(folder.glob('kv.safetensors.*.tmp'))
    (folder / f'kv.safetensors.{os.getpid()}.tmp').write_bytes(b'half a snapshot')
    assert not (folder / 'kv.safetensors').exists()
    result = arl.run_rollout(folder, spec(), **parts)
    assert not list(folder.glob('kv.safetensors.*.tmp'))
    assert result['mode'] == 'reprefill' and start_lines(folder)[-1]['snapshot_tmp_removed']
    assert_same(arl.read_trajectories(folder), reference)


class Child:
    """A subprocess seen through the attributes preempt_rollout uses: pid, join, exitcode
    (negative: the signal that ended it, as multiprocessing reports it)."""
    def __init__(self, popen):
        self.popen, self.pid = popen, popen.pid

    def join(self, timeout=None):
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self):
        return self.popen.poll()


def test_sigterm_before_the_handler_is_not_called_graceful(tmp_path):
    """The rollout process stops on entering run_rollout, before its SIGTERM handler is
    installed; SIGTERM then ends it (exit -15) with nothing saved. preempt_rollout used to
    report 'graceful'."""
    proc = child(tmp_path, SPEC, dict(at='before-handler'), stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == 'ready'
    outcome = arl.preempt_rollout(Child(proc), grace_s=60)
    assert proc.returncode == -signal.SIGTERM
    assert outcome == 'terminated'
    assert not (tmp_path / 'kv.safetensors').exists()


def test_preempt_outcomes_follow_the_exit_code(tmp_path, reference, parts):
    proc = arl.launch_rollout(tmp_path / 'done', spec(), **parts)
    proc.join()
    assert arl.preempt_rollout(proc) == 'finished'       # it ended before the signal
    proc = arl.launch_rollout(tmp_path / 'slow', spec(step_sleep_s=0.05), **parts)
    while not (tmp_path / 'slow' / 'acks.txt').exists() and proc.exitcode is None:
        time.sleep(0.002)                        # polls: the signal's moment does not matter
    assert arl.preempt_rollout(proc, grace_s=60) == 'graceful'
    assert proc.exitcode == arl.EXIT_PREEMPTED


# ----------------------------------------------------------------------------------------
# Durability: directory fsyncs and exact fsync counts
# ----------------------------------------------------------------------------------------

def test_directory_is_fsynced_when_the_log_is_created_and_the_snapshot_replaced(
        tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync

    def recording_fsync(fd):
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            synced.append(st.st_ino)
        return fsync(fd)
    monkeypatch.setattr(os, 'fsync', recording_fsync)
    folder = tmp_path / 'job'
    preempt_at_step(monkeypatch, 5)
    result = arl.run_rollout(folder, spec(policy='step'))
    ino = {p.stat().st_ino: name for name, p in (('parent', tmp_path), ('folder', folder))}
    # the new folder's name, the new log's name, then the snapshot's rename
    assert [ino.get(i) for i in synced] == ['parent', 'folder', 'folder']
    assert result['dir_syncs'] == 3
    synced.clear()
    arl.run_rollout(tmp_path / 'os', spec(policy='os'))   # 'os' never fsyncs
    assert synced == []


def test_fsync_counts_are_exact(tmp_path):
    """'token': one fsync per record; 'step': one per decoding step, plus the startup
    commit (prompts); 'os': none. These counts, not timings, are what the chapter asserts."""
    counts = {}
    for policy in ('token', 'step', 'os'):
        r = arl.run_rollout(tmp_path / policy, spec(policy=policy))
        records = arl.recover_log(tmp_path / policy / 'rollout.wal').report['records']
        counts[policy] = (r['syncs'], r['steps'], records)
    assert counts['token'][0] == counts['token'][2]
    assert counts['step'][0] == counts['step'][1] + 1
    assert counts['os'][0] == 0
