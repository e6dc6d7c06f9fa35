"""Tests for chapter 19's modules (agentrl/trajectory_store.py, heavy_loader.py,
context_parallel.py, wal_scan.py, group_commit.py): the trajectory store, dispatch on
metadata, the shared-memory loader, context parallelism, and the vectorised
write-ahead-log reader and group-commit writer."""
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentrl as arl

D = 3
PER_TOKEN = 4 + 4 + 1 + 2 * D


def make_store(root, lengths=(700, 1500, 64), d=D):
    store = arl.TrajectoryStore(root, d=d)
    trajs = []
    for i, n in enumerate(lengths):
        t = arl.synthetic_trajectory(n, d, seed=i, prompt=f'prompt {i}')
        store.append(t)
        trajs.append(t)
    return store, trajs


# --- the store -------------------------------------------------------------------

def test_store_round_trip_and_metadata(tmp_path):
    store, trajs = make_store(tmp_path)
    meta = store.metadata()
    assert meta['id'].to_pylist() == [0, 1, 2]
    assert meta['length'].to_pylist() == [700, 1500, 64]
    assert meta['prompt'].to_pylist() == ['prompt 0', 'prompt 1', 'prompt 2']
    assert meta['reward'].to_pylist() == [t['reward'] for t in trajs]
    assert meta['status'].to_pylist() == [t['status'] for t in trajs]
    views = store.read([2, 0, 1])
    for v, t in zip(views, [trajs[2], trajs[0], trajs[1]]):
        for f in arl.HEAVY_FIELDS:
            assert v[f].dtype == arl.HEAVY_DTYPES[f]
            assert np.array_equal(v[f], np.asarray(t[f]).astype(arl.HEAVY_DTYPES[f]))
    # a second store object on the same folder sees the same and appends after it
    again = arl.TrajectoryStore(tmp_path, d=D)
    assert again.metadata().equals(meta)
    assert again.append(trajs[0]) == 3
    assert again.metadata()['id'].to_pylist() == [0, 1, 2, 3]


def test_range_reads_and_counters(tmp_path):
    store, trajs = make_store(tmp_path)
    store.counters.update(heavy_bytes=0, heavy_pages=0, heavy_opens=0)
    (a, b) = store.read([1, 1], ['logp', 'hidden'], [(100, 1100), (1499, 1500)])
    assert np.array_equal(a['logp'], trajs[1]['logp'][100:1100])
    assert np.array_equal(b['hidden'], trajs[1]['hidden'][1499:1500])
    assert a['hidden'].shape == (1000, D) and set(a) == {'logp', 'hidden'}
    assert store.counters['heavy_bytes'] == 1001 * (4 + 2 * D)
    assert store.counters['heavy_opens'] == 1                # opened once per call
    pages = store.counters['heavy_pages']
    assert store.counters['heavy_bytes'] <= pages <= (store.counters['heavy_bytes']
                                                      + 4 * 2 * arl.PAGE_SIZE)
    assert pages % arl.PAGE_SIZE == 0
    assert not a['logp'].flags.writeable                       # a view of the file


def test_metadata_and_dispatch_read_no_heavy_byte(tmp_path):
    make_store(tmp_path)
    shutil.rmtree(tmp_path / 'heavy')                          # nothing heavy to read
    store = arl.TrajectoryStore(tmp_path, d=D)
    plan = arl.dispatch(store.metadata(), 256, 1024, seed=0)
    assert store.counters['heavy_bytes'] == store.counters['heavy_opens'] == 0
    assert store.counters['metadata_bytes'] > 0
    with pytest.raises(ValueError, match='trajectory 0: its heavy file .*missing'):
        store.read([0])
    assert sum(b['tokens'] for b in plan) == 700 + 1500 + 64


def test_missing_or_truncated_heavy_file_names_file_and_trajectory(tmp_path):
    store, _ = make_store(tmp_path)
    path = tmp_path / 'heavy' / '00000001.arrow'
    with open(path, 'r+b') as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(ValueError, match=r'trajectory 1: .*00000001\.arrow.*truncated'):
        store.read([1])
    store.read([0])                                            # the others still work
    path.unlink()
    with pytest.raises(ValueError, match=r'trajectory 1: .*00000001\.arrow is missing'):
        store.read([1])
    # same size but not an Arrow file: a clear error too
    p2 = tmp_path / 'heavy' / '00000002.arrow'
    p2.write_bytes(bytes(p2.stat().st_size))
    with pytest.raises(ValueError, match='trajectory 2: .*cannot be read'):
        store.read([2])


def test_store_rejects_bad_input(tmp_path):
    store, trajs = make_store(tmp_path)
    with pytest.raises(ValueError, match='fields'):
        store.read([0], ['tokens', 'nope'])
    with pytest.raises(ValueError, match='ranges'):
        store.read([0], ranges=[(5, 5)])
    with pytest.raises(ValueError, match='ranges'):
        store.read([0], ranges=[(0, 701)])
    with pytest.raises(ValueError, match='ranges'):
        store.read([0, 1], ranges=[(0, 1)])
    with pytest.raises(ValueError, match='ids: trajectory 9'):
        store.read([9])
    bad = dict(trajs[0], hidden=np.zeros((700, D + 1)))
    with pytest.raises(ValueError, match='hidden'):
        store.append(bad)
    with pytest.raises(ValueError, match='missing the fields'):
        store.append({'tokens': [1, 2]})
    with pytest.raises(ValueError, match='d must be'):
        arl.TrajectoryStore(tmp_path / 'x', d=0)


def test_synthetic_trajectory():
    t = arl.synthetic_trajectory(5000, 2, seed=7)
    assert len(t['tokens']) == len(t['mask']) == len(t['logp']) == 5000
    assert t['hidden'].shape == (5000, 2) and t['hidden'].dtype == np.float16
    assert ((t['logp'] < 0) == (t['mask'] == 1)).all()         # sampled tokens only
    assert 0 < t['mask'].mean() < 1 and t['tokens'].max() < 52
    again = arl.synthetic_trajectory(5000, 2, seed=7)
    assert all(np.array_equal(t[f], again[f]) for f in arl.HEAVY_FIELDS)
    with pytest.raises(ValueError, match='n_tokens'):
        arl.synthetic_trajectory(0)


# --- dispatch --------------------------------------------------------------------

def test_dispatch_plans_every_token_once_within_budget(tmp_path):
    store, _ = make_store(tmp_path)
    meta = store.metadata()
    plan = arl.dispatch(meta, 256, 1024, world_size=2, seed=3)
    seg = np.concatenate([b['segments'] for b in plan])
    covered = {t: np.zeros(n, int) for t, n in enumerate([700, 1500, 64])}
    for t, a, b in seg:
        covered[t][a:b] += 1
    assert all((c == 1).all() for c in covered.values())
    for b in plan:
        lens = b['segments'][:, 2] - b['segments'][:, 1]
        assert len(lens) * lens.max() <= 1024                  # the padded budget
        assert b['tokens'] == lens.sum()
        assert list(b['rank']) == [j % 2 for j in range(len(lens))]
        offsets = sorted(off for off, _ in b['layout'].values())
        assert all(o % arl.PAGE_SIZE == 0 for o in offsets)
        end = 0
        for f in arl.HEAVY_FIELDS:                             # no two fields overlap
            off, (n, w) = b['layout'][f]
            assert off >= end and n == b['tokens']
            end = off + n * w * arl.HEAVY_DTYPES[f].itemsize
        assert end <= b['nbytes']
        assert (b['layout'], b['nbytes']) == arl.buffer_layout(
            b['tokens'], arl.HEAVY_FIELDS, b['dtypes'], store.d)     # one layout rule
    same = arl.dispatch(meta, 256, 1024, world_size=2, seed=3)
    other = arl.dispatch(meta, 256, 1024, world_size=2, seed=4)
    key = lambda p: np.concatenate([b['segments'] for b in p]).tolist()
    assert key(same) == key(plan) and key(other) != key(plan)
    with pytest.raises(ValueError, match='segment_tokens'):
        arl.dispatch(meta, 0, 1024)


def test_fill_batch_copies_exactly_the_ranges(tmp_path):
    store, trajs = make_store(tmp_path)
    (batch,) = arl.dispatch(store.metadata(), 100, 400, seed=0)[:1]
    buf = bytearray(batch['nbytes'])
    views = arl.batch_views(buf, batch)
    read = arl.fill_batch(store, batch, views)
    assert read == batch['tokens'] * PER_TOKEN
    for sl, (t, a, b) in zip(arl.segment_slices(batch), batch['segments']):
        for f in arl.HEAVY_FIELDS:
            want = np.asarray(trajs[t][f]).astype(arl.HEAVY_DTYPES[f])[a:b]
            assert np.array_equal(views[f][sl], want)


# --- the loader ------------------------------------------------------------------

def _shm_names():
    """The loader's shared-memory segments that exist now (theirs start 'arl')."""
    if not os.path.isdir('/dev/shm'):
        return set()
    return {n for n in os.listdir('/dev/shm') if n.startswith('arl')}


@pytest.mark.skipif(not Path('/proc/self/smaps_rollup').exists(),
                    reason='needs Linux /proc/<pid>/smaps_rollup')
def test_loader_releases_and_matches_naive(tmp_path):
    store, _ = make_store(tmp_path, lengths=(3000, 2000, 2500))
    plan = arl.dispatch(store.metadata(), 500, 2000, seed=0)
    before = _shm_names()
    out = arl.run_loader(tmp_path, D, [dict(plan=plan), dict(plan=plan, loader='naive'),
                                       dict(plan=plan), dict(plan=plan, loader='per-rank'),
                                       dict(plan=plan, depth=3)], depth=2)
    assert _shm_names() - before == set()                      # every segment unlinked
    shared, naive, again, own, deep = out
    results = [s['results'] for s in shared['steps']]
    assert results == [s['results'] for s in naive['steps']]   # the same bytes
    assert results == [s['results'] for s in again['steps']]   # deterministic
    assert results == [s['results'] for s in own['steps']]
    assert results == [s['results'] for s in deep['steps']]
    # per rank: each rank reads exactly the ranges of the mini-batch, every step
    for s, b in zip(own['steps'], plan):
        assert s['rank_bytes'] == [b['tokens'] * PER_TOKEN] * 2 and s['worker_bytes'] == 0
    assert all(r['seconds'] > 0 for r in out)
    for s, b in zip(shared['steps'], plan):
        assert s['worker_bytes'] == b['tokens'] * PER_TOKEN
        assert s['rank_bytes'] == [0, 0]                       # ranks read only views
        digests = [arl.segment_digest(arl.batch_views(_fill(store, b), b), b, j)
                   for j in range(len(b['segments']))]
        assert s['results'] == [digests, digests]              # both ranks saw it all
    # the naive ranks read whole trajectories, each the first time it needs one
    assert sum(sum(s['rank_bytes']) for s in naive['steps']) == \
        2 * (3000 + 2000 + 2500) * PER_TOKEN
    with pytest.raises(ValueError, match='consume'):
        arl.run_loader(tmp_path, D, [], consume='eat')
    with pytest.raises(ValueError, match='loader'):
        arl.run_loader(tmp_path, D, [dict(plan=plan, loader='mmap')])
    with pytest.raises(ValueError, match='depth'):
        arl.run_loader(tmp_path, D, [dict(plan=plan)], depth=0)


def test_loader_depth_caps_by_memory_and_picks_the_smallest_fast_depth():
    plan = [dict(nbytes=100), dict(nbytes=250), dict(nbytes=40)]
    assert arl.loader_depth(plan, 250) == 1 and arl.loader_depth(plan, 1000) == 4
    times = {1: 1.0, 2: 0.70, 3: 0.68, 4: 0.60, 5: 0.1}
    assert arl.loader_depth(plan, 1000, times) == 4          # 5 does not fit
    assert arl.loader_depth(plan, 750, times) == 2           # 0.70 <= 1.05 * 0.68
    assert arl.loader_depth(plan, 750, times, tolerance=0.01) == 3
    with pytest.raises(ValueError, match='memory_budget'):
        arl.loader_depth(plan, 249)
    with pytest.raises(ValueError, match='fits'):
        arl.loader_depth(plan, 250, {2: 0.5})


def _fill(store, batch):
    buf = bytearray(batch['nbytes'])
    arl.fill_batch(store, batch, arl.batch_views(buf, batch))
    return buf


def test_packed_segment_loss_splits_over_ranks(tmp_path):
    store, _ = make_store(tmp_path, lengths=(400, 300))
    (batch,) = arl.dispatch(store.metadata(), 64, 512, seed=0)[:1]
    views = arl.batch_views(_fill(store, batch), batch)
    torch.manual_seed(0)
    model = arl.TinyAgent(52, d_model=16, n_layers=1, n_heads=2)
    parts = [arl.packed_segment_loss(model, views, batch, r, 128) for r in (0, 1)]
    alone = dict(batch, rank=np.zeros(len(batch['segments']), int))
    whole = arl.packed_segment_loss(model, views, alone, 0, 128)
    assert torch.isfinite(whole) and whole.ndim == 0
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-6)
    assert arl.packed_segment_loss(model, views, alone, 1, 128).item() == 0.0


def test_smaps_rollup():
    if not Path('/proc/self/smaps_rollup').exists():
        pytest.skip('needs Linux')
    m = arl.smaps_rollup()
    assert set(m) == set(arl.SMAPS_FIELDS) and 0 < m['Pss'] <= m['Rss']
    assert arl.memory_of([os.getpid()])['Rss'] > 0
    big = np.ones(64 * 2**20 // 8)                  # touch 64 MB of private memory
    assert arl.smaps_rollup()['Pss'] - m['Pss'] > 60 * 2**20
    del big


# --- the vectorised write-ahead log ------------------------------------------------

@pytest.mark.parametrize('n', [1, 2, 11, 17, 19, 20, 61])
def test_crc32c_rows(n):
    g = np.random.default_rng(n)
    rows = g.integers(0, 256, (50, n + 8), dtype=np.uint8)
    want = [crc32c(r[:n].tobytes()) for r in rows]
    assert arl.crc32c_rows(rows, n).tolist() == want
    with pytest.raises(ValueError, match='rows'):
        arl.crc32c_rows(rows[:, :n - 1] if n > 1 else rows[:, :0], n)


def test_encode_token_records_matches_encode_record():
    g = np.random.default_rng(0)
    rid, pos, tok = (g.integers(0, 2**32, 40, dtype=np.uint64) for _ in range(3))
    lp = -g.random(40).astype(np.float32)
    rows = arl.encode_token_records(rid, pos, tok, lp)
    for k in range(40):
        want = arl.encode_record(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(
            int(rid[k]), int(pos[k]), int(tok[k]), float(lp[k])))
        assert rows[k].tobytes() == want


def write_log(path, seed=0, n_requests=6, n_tokens=500, finish=True):
    """A log with every record type, over several blocks, in lockstep order."""
    g = np.random.default_rng(seed)
    w = arl.WalWriter(path, 'os')
    w.append(arl.REC_META, json.dumps(dict(seed=seed, note='x' * 50)).encode())
    for r in range(n_requests):
        w.append(arl.REC_START, arl.START_PAYLOAD.pack(r, 100 + r))
    for p in range(n_tokens):
        for r in range(n_requests):
            if g.random() < 0.3:
                w.append(arl.REC_FORCED, arl.FORCED_PAYLOAD.pack(r, p, int(g.integers(52))))
            else:
                w.append(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(
                    r, p, int(g.integers(52)), float(-g.random())))
    if finish:
        for r in range(n_requests - 1):
            w.append(arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(r, n_tokens, 1.0, 1, 3))
    w.close()
    return Path(path).read_bytes()


def assert_same(data):
    records, report = arl.scan_log(data)
    table, fast_report = arl.scan_log_fast(data)
    assert fast_report == report
    assert table.records() == records
    slow = arl.replay_records(records, report)
    fast = arl.replay_records_fast(table, fast_report)
    assert fast == slow
    assert list(fast.requests) == list(slow.requests)          # same insertion order


def test_fast_reader_equals_chapter_18_on_clean_and_torn_logs(tmp_path):
    data = write_log(tmp_path / 'a.wal')
    assert len(data) > 2 * arl.WAL_BLOCK_SIZE
    assert_same(data)
    assert_same(b'')
    for cut in list(range(0, 200, 7)) + list(range(len(data) - 300, len(data))) + [
            arl.WAL_BLOCK_SIZE, arl.WAL_BLOCK_SIZE + 3, 2 * arl.WAL_BLOCK_SIZE - 2]:
        assert_same(data[:cut])


def test_fast_reader_on_irregular_records(tmp_path):
    """Records with good checksums but odd content: duplicates, orphans, conflicts,
    wrong sizes, unknown types, a bad outcome code, a finish with the wrong length."""
    w = arl.WalWriter(tmp_path / 'b.wal', 'os')
    rec = lambda t, p: w.append(t, p)
    rec(arl.REC_META, b'not json')
    rec(arl.REC_META, json.dumps({'a': 1}).encode())
    rec(arl.REC_START, arl.START_PAYLOAD.pack(0, 5))
    rec(arl.REC_START, arl.START_PAYLOAD.pack(0, 6))              # duplicate start
    rec(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(1, 0, 3, -1.0))     # orphan: no start
    rec(arl.REC_START, arl.START_PAYLOAD.pack(1, 7))
    rec(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 0, 3, -1.0))
    rec(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 0, 4, -1.0))     # conflict
    rec(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 2, 4, -1.0))     # gap: orphan
    rec(arl.REC_TOKEN, b'\x00' * 5)                               # wrong size
    rec(9, b'abc')                                                # unknown type
    rec(arl.REC_START, arl.START_PAYLOAD.pack(2, 8))
    rec(arl.REC_FORCED, arl.FORCED_PAYLOAD.pack(2, 0, 1))
    rec(arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(2, 1, 0.5, 9, 1))   # bad outcome
    rec(arl.REC_START, arl.START_PAYLOAD.pack(3, 9))
    rec(arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(3, 4, 0.5, 0, 1))   # wrong length
    rec(arl.REC_START, arl.START_PAYLOAD.pack(4, 1))
    rec(arl.REC_FORCED, arl.FORCED_PAYLOAD.pack(4, 0, 1))
    rec(arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(4, 1, 0.5, 0, 1))   # regular
    rec(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(4, 1, 3, -1.0))     # after its finish
    for p in range(200):                                          # enough for tables
        rec(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(1, p, p % 52, -0.5))
    w.close()
    data = (tmp_path / 'b.wal').read_bytes()
    assert_same(data)
    state = arl.recover_log_fast(tmp_path / 'b.wal')
    assert state == arl.recover_log(tmp_path / 'b.wal')
    assert state.report['malformed'] >= 3 and state.report['orphans'] >= 3


def test_fast_reader_on_large_ids_one_request_and_a_meta_in_between(tmp_path):
    """The sort key for request ids of 2**16 and more, a log of one request (no sort),
    and one request interrupted by a meta record (sorted again), each also torn."""
    g = np.random.default_rng(5)
    logs = []
    for name, rids, meta_at in (('big', [70000, 2**32 - 2, 65535], 300),
                                ('one', [3], None), ('meta', [3], 700)):
        w = arl.WalWriter(tmp_path / f'{name}.wal', 'os')
        for r in rids:
            w.append(arl.REC_START, arl.START_PAYLOAD.pack(r, 1))
        for p in range(1500):
            if p == meta_at:
                w.append(arl.REC_META, b'{"late": true}')
            for r in rids:
                w.append(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(
                    r, p, int(g.integers(52)), float(-g.random())))
        w.append(arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(rids[0], 1500, 1.0, 0, 2))
        w.close()
        logs.append((tmp_path / f'{name}.wal').read_bytes())
    for data in logs:
        assert len(data) > arl.WAL_BLOCK_SIZE
        assert_same(data)
        assert_same(data[:-30])
        state = arl.replay_records_fast(*arl.scan_log_fast(data))
        assert len(state.requests[int(arl.START_PAYLOAD.unpack(
            data[7:15])[0])].tokens) == 1500


damage = st.lists(st.tuples(st.sampled_from(['flip', 'zero', 'noise', 'copy']),
                            st.floats(0, 1), st.integers(1, 300), st.integers(0, 7)),
                  min_size=1, max_size=4)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=damage, cut=st.one_of(st.none(), st.floats(0, 1)), seed=st.integers(0, 3))
def test_fast_reader_equals_chapter_18_on_random_damage(tmp_path, ops, cut, seed):
    data = bytearray(write_log(tmp_path / f'h{seed}.wal', seed=seed, n_tokens=300))
    for kind, where, n, bit in ops:
        i = int(where * (len(data) - 1))
        if kind == 'flip':
            data[i] ^= 1 << bit
        elif kind == 'zero':
            data[i:i + n] = bytes(len(data[i:i + n]))
        elif kind == 'noise':
            g = np.random.default_rng(i + n)
            data[i:i + n] = g.integers(0, 256, len(data[i:i + n]), np.uint8).tobytes()
        else:                                # a stale copy of earlier bytes
            j = max(0, i - n)
            data[i:i + n] = data[j:j + n][:len(data[i:i + n])]
    if cut is not None:
        data = data[:int(cut * len(data))]
    assert_same(bytes(data))


def test_group_commit_writer_same_bytes_and_durable(tmp_path):
    g = np.random.default_rng(0)
    old = arl.WalWriter(tmp_path / 'old.wal', 'step')
    new = arl.GroupCommitWriter(tmp_path / 'new.wal')
    for w in (old, new):
        w.append(arl.REC_META, b'{}')
    for step in range(300):                          # about 4 blocks of records
        rid = np.arange(20)
        pos = np.full(20, step)
        tok = g.integers(0, 52, 20)
        lp = -g.random(20).astype(np.float32)
        for k in range(20):
            old.append(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(
                int(rid[k]), step, int(tok[k]), float(lp[k])))
        old.commit()
        new.append_tokens(rid, pos, tok, lp)
        if step % 50 == 0:
            new.append(arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(0, step, 1.0, 0, 1))
            old.append(arl.REC_FINISH, arl.FINISH_PAYLOAD.pack(0, step, 1.0, 0, 1))
            old.commit()
        offset = new.commit()
        assert offset == new.offset
    assert new.wait() == new.offset == old.offset
    assert new.syncs >= 1
    old.close()
    new.close()
    assert (tmp_path / 'new.wal').read_bytes() == (tmp_path / 'old.wal').read_bytes()
    assert arl.recover_log_fast(tmp_path / 'new.wal') == \
        arl.recover_log(tmp_path / 'old.wal')
    # appending to an existing log continues it
    again = arl.GroupCommitWriter(tmp_path / 'new.wal')
    again.append_tokens([1], [0], [2], [-0.5])
    again.close()
    records, report = arl.scan_log((tmp_path / 'new.wal').read_bytes())
    assert report['corruptions'] == [] and records[-1][1] == arl.REC_TOKEN


def test_group_commit_writer_big_steps_and_durable_offsets(tmp_path):
    """Steps of 300 records (the numpy encoder) across blocks give chapter 18's bytes;
    durable never runs ahead of what is written, and wait() makes all of it durable."""
    g = np.random.default_rng(1)
    old = arl.WalWriter(tmp_path / 'old.wal', 'os')
    new = arl.GroupCommitWriter(tmp_path / 'new.wal')
    with pytest.raises(ValueError, match='one length'):
        new.append_tokens([0, 1], [0], [1, 2], [-0.5, -0.5])
    for step, n in enumerate((300, 7, 300, 1, 300, 256, 255)):
        rid, tok = np.arange(n), g.integers(0, 52, n)
        lp = -g.random(n).astype(np.float32)
        for k in range(n):
            old.append(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(
                int(rid[k]), step, int(tok[k]), float(lp[k])))
        new.append_tokens(rid, [step] * n, tok, lp)
        assert new.commit() == new.offset == old.offset
        assert new.durable <= new.written == os.path.getsize(tmp_path / 'new.wal')
    assert new.wait() == new.offset
    old.close()
    new.close()
    assert (tmp_path / 'new.wal').read_bytes() == (tmp_path / 'old.wal').read_bytes()


@given(st.lists(st.integers(1, 300), max_size=60), st.integers(300, 1000))
@settings(max_examples=60, deadline=None)
def test_budget_batches_equal_token_budget_batches(lengths, budget):
    order, bounds = arl.budget_batches(lengths, budget)
    got = [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    assert got == arl.token_budget_batches(lengths, budget)


def synthetic_meta(n, seed=0, n_teachers=4):
    """n metadata rows (no heavy files) with long-tailed lengths."""
    import pyarrow as pa
    g = np.random.default_rng(seed)
    lengths = np.clip(g.lognormal(10.5, 1.2, n), 16, 2**20).astype(np.int64)
    return pa.table({'id': np.arange(n), 'prompt': [''] * n,
                     'reward': g.random(n).astype(np.float32), 'length': lengths,
                     'teacher': g.integers(0, n_teachers, n).astype(np.int32),
                     'status': ['finished'] * n, 'd': np.full(n, 4, np.int32),
                     'hidden_dtype': ['float16'] * n, 'heavy_file': [''] * n,
                     'heavy_bytes': lengths * 17}, schema=arl.META_SCHEMA)


def test_dispatch_order_teacher_groups_each_minibatch_by_teacher():
    meta = synthetic_meta(2000)
    plain = arl.dispatch(meta, 4096, 2**16, seed=3)
    by_teacher = arl.dispatch(meta, 4096, 2**16, seed=3, order='teacher')
    assert len(plain) == len(by_teacher)
    teacher_of = dict(zip(meta['id'].to_pylist(), meta['teacher'].to_pylist()))
    switches = []
    for a, b in zip(plain, by_teacher):
        # the same segments, only reordered; teacher is the metadata's
        assert sorted(map(tuple, a['segments'].tolist())) == \
            sorted(map(tuple, b['segments'].tolist()))
        assert b['teacher'].tolist() == [teacher_of[t] for t in b['segments'][:, 0]]
        # sorted by teacher, stable: what chapter 17's teacher_order gives
        order = arl.teacher_order(a['teacher']).numpy()
        assert np.array_equal(b['segments'], a['segments'][order])
        # one head per teacher and mini-batch for chapter 17's scheduler, per rank too
        for rank in range(2):
            mine = b['teacher'][b['rank'] == rank].tolist()
            names = [name for k, name in enumerate(mine)
                     if k == 0 or mine[k - 1] != name]
            assert names == sorted(set(mine))
        switches.append(int((np.diff(a['teacher']) != 0).sum()))
    assert max(switches) > 4                     # without the option, heads reload
    with pytest.raises(ValueError, match='order'):
        arl.dispatch(meta, 4096, 2**16, order='length')


def test_dispatch_of_many_rows_covers_every_token_within_budget():
    # its speed is measured in chapter 19 (dispatch-scale), not asserted here
    meta = synthetic_meta(100_000)
    plan = arl.dispatch(meta, 2**18, 2**22, seed=0, order='teacher')
    seg = np.concatenate([b['segments'] for b in plan])
    assert (seg[:, 2] - seg[:, 1]).sum() == meta['length'].to_numpy().sum()
    assert all(b['tokens'] <= 2**22 for b in plan)


# -------- context parallelism: segments that see their context

def dense_window_attention(q, keys, values, window):
    """The textbook computation: the full score matrix, masked to each query's window."""
    H, T, dh = q.shape
    P = keys.shape[1] - T
    scores = q @ keys.transpose(1, 2) / dh ** 0.5                 # [H, T, P + T]
    t, j = torch.arange(T)[:, None] + P, torch.arange(P + T)[None, :]
    scores = scores.masked_fill(~((j <= t) & (j > t - window)), float('-inf'))
    return torch.softmax(scores, -1) @ values


@pytest.mark.parametrize('P,T,window', [(0, 1, 4), (0, 13, 4), (3, 13, 4), (7, 64, 8),
                                        (2, 5, 16)])
def test_window_attention_is_the_dense_masked_softmax(P, T, window):
    g = torch.Generator().manual_seed(P * 100 + T)
    q = torch.randn(2, T, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(2, 2, P + T, 8, generator=g, dtype=torch.float64)
    got = arl.window_attention(q, kv[0], kv[1], window)
    assert torch.allclose(got, dense_window_attention(q, kv[0], kv[1], window),
                          rtol=0, atol=1e-12)


def test_rotary_scores_depend_on_distance_only():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 16, generator=g, dtype=torch.float64)
    score = lambda p, s: float(arl.rotate(q, torch.tensor([p + s]))
                               @ arl.rotate(k, torch.tensor([p])).transpose(1, 2))
    assert score(0, 5) == pytest.approx(score(999_990, 5), abs=1e-9)
    assert score(0, 5) != pytest.approx(score(0, 6), abs=1e-3)
    x = torch.randn(1, 7, 16, generator=g, dtype=torch.float64)   # rotations keep norms
    assert torch.allclose(arl.rotate(x, torch.arange(7) * 1000).norm(dim=-1),
                          x.norm(dim=-1))


def windowed_case(dtype=torch.float64, T=300):
    torch.manual_seed(0)
    model = arl.WindowedAgent(11, d_model=8, n_layers=2, n_heads=2, window=6).to(dtype)
    ids = torch.randint(11, (T,))
    weights = torch.randn(T - 1, dtype=dtype)
    return model, ids, weights


def logp_and_grads(model, ids, weights, segment_tokens, start=0):
    model.zero_grad()
    logp = arl.context_parallel_log_probs(model, ids, segment_tokens, start)
    (logp * weights).sum().backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize('segment_tokens', [1, 5, 64, 100, 299, [1, 37, 100, 162]])
def test_context_parallel_equals_the_whole_sequence(segment_tokens):
    model, ids, weights = windowed_case()
    whole, g_whole = logp_and_grads(model, ids, weights, len(ids))
    got, g_got = logp_and_grads(model, ids, weights, segment_tokens)
    assert whole.shape == (len(ids) - 1,)
    assert torch.allclose(got, whole, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_whole):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_whole_sequence_log_probs_are_the_model_forward():
    model, ids, _ = windowed_case(T=40)
    logits, _ = model(ids)
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    assert torch.equal(arl.context_parallel_log_probs(model, ids, 40), expected)


def test_a_range_scored_from_its_context_alone_is_exact_and_less_is_not():
    model, ids, _ = windowed_case()
    C, a = model.context, 200
    with torch.no_grad():
        whole = arl.context_parallel_log_probs(model, ids, 64)
        deep = arl.context_parallel_log_probs(model, ids[a - C:], 64, start=a - C)
        short = arl.context_parallel_log_probs(model, ids[a - C + 1:], 64,
                                               start=a - C + 1)
    assert torch.allclose(deep[C:], whole[a:], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(short[C - 1], whole[a], rtol=1e-6, atol=1e-6)


def test_segments_scored_alone_are_wrong_after_each_cut():
    model, ids, _ = windowed_case()
    with torch.no_grad():
        whole = arl.context_parallel_log_probs(model, ids, len(ids))
        alone = arl.context_parallel_log_probs(model, ids[100:], 200)
    assert not torch.allclose(alone[:model.context], whole[100:100 + model.context])
    assert torch.allclose(alone[model.context:], whole[100 + model.context:],
                          rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('world_size,segment_tokens', [(2, 64), (3, 50)])
def test_context_parallel_on_gloo_ranks_equals_one_process(world_size, segment_tokens):
    model, ids, weights = windowed_case(T=260)
    whole, g_whole = logp_and_grads(model, ids, weights, len(ids))
    got, g_got = arl.run_context_parallel(model, ids, segment_tokens, weights,
                                          world_size=world_size)
    assert torch.allclose(got, whole, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_whole):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_windowed_agent_and_context_parallel_reject_bad_sizes():
    with pytest.raises(ValueError, match='n_heads'):
        arl.WindowedAgent(11, d_model=6, n_heads=2)
    with pytest.raises(ValueError, match='window'):
        arl.WindowedAgent(11, window=1)
    model, ids, _ = windowed_case(T=20)
    with pytest.raises(ValueError, match='segment_tokens'):
        arl.context_parallel_log_probs(model, ids, 0)
    with pytest.raises(ValueError, match='summing to len'):
        arl.context_parallel_log_probs(model, ids, [10, 5])
    with pytest.raises(ValueError, match='positive'):
        arl.context_parallel_log_probs(model, ids, [25, 0, -5])


def test_dispatch_in_context_order_keeps_trajectories_whole_and_in_order(tmp_path):
    store, _ = make_store(tmp_path, lengths=(700, 1500, 64, 333))
    meta = store.metadata()
    plan = arl.dispatch(meta, 100, 350, world_size=3, seed=2, order='context',
                        context_tokens=20)
    lengths = dict(zip(meta['id'].to_pylist(), meta['length'].to_pylist()))
    seen, order = {t: 0 for t in lengths}, []
    for b in plan:
        seg, scored = b['segments'], b['scored']
        n = seg[:, 2] - seg[:, 1]
        assert n[scored].sum() <= 350 and b['tokens'] == n.sum()
        assert b['baseline'] == pytest.approx(np.mean(meta['reward'].to_pylist()))
        if not scored[0]:                    # a context segment: the tokens just before
            assert scored[1:].all() and seg[0, 0] == seg[1, 0]
            assert seg[0, 2] == seg[1, 1] > 0 and n[0] == min(20, seg[1, 1])
        else:
            assert seg[0, 1] == 0           # or the batch starts a trajectory
        first = np.flatnonzero(np.r_[True, seg[1:, 0] != seg[:-1, 0]])
        in_run = np.arange(len(seg)) - np.repeat(first, np.diff(np.r_[first, len(seg)]))
        assert (b['rank'] == in_run % 3).all()
        for t, a, z in seg[scored]:
            assert a == seen[t]              # in order, each token once
            seen[t] = z
            if not order or order[-1] != t:
                order.append(t)
    assert seen == lengths and len(order) == len(lengths)   # whole trajectories
    with pytest.raises(ValueError, match='order'):
        arl.dispatch(meta, 100, 350, order='random')
    with pytest.raises(ValueError, match='context_tokens'):
        arl.dispatch(meta, 100, 350, order='context', context_tokens=-1)


def test_context_segment_loss_over_steps_is_the_whole_trajectory_loss(tmp_path):
    torch.manual_seed(0)
    model = arl.WindowedAgent(52, d_model=8, n_layers=2, n_heads=2, window=6).double()
    store, trajs = make_store(tmp_path, lengths=(900, 260))
    meta = store.metadata()
    plan = arl.dispatch(meta, 64, 300, seed=0, order='context',
                        context_tokens=model.context)
    assert sum(not b['scored'][0] for b in plan) >= 2     # steps start mid-trajectory
    total = 0.0
    for b in plan:
        views = {f: np.concatenate([store.read([t], [f], [(a, z)])[0][f]
                                    for t, a, z in b['segments']])
                 for f in arl.HEAVY_FIELDS}
        n = (b['segments'][:, 2] - b['segments'][:, 1])[b['scored']].sum()
        with torch.no_grad():
            total += float(arl.context_segment_loss(model, views, b, 0, 1)) * n
    expected = 0.0
    for t in trajs:                       # each trajectory in one piece
        ids = torch.from_numpy(np.asarray(t['tokens'], np.int64))
        with torch.no_grad():
            logp = arl.context_parallel_log_probs(model, ids, len(ids))
        adv = t['reward'] - plan[0]['baseline']
        mask = torch.from_numpy(np.asarray(t['mask'][1:], np.float64))
        expected -= adv * float((mask * logp).sum())
    assert total == pytest.approx(expected, rel=1e-10, abs=1e-10)


@pytest.mark.skipif(not Path('/proc/self/smaps_rollup').exists(),
                    reason='needs Linux /proc/<pid>/smaps_rollup')
def test_loader_context_consumer_equals_one_process(tmp_path):
    torch.manual_seed(0)
    model = arl.WindowedAgent(52, d_model=8, n_layers=2, n_heads=2, window=6)
    store, _ = make_store(tmp_path, lengths=(900, 260))
    plan = arl.dispatch(store.metadata(), 64, 300, seed=0, order='context',
                        context_tokens=model.context)
    torch.save(model, tmp_path / 'model.pt')
    (run,) = arl.run_loader(tmp_path, D, [dict(plan=plan)],
                            consume=arl.context_segment_loss,
                            model_path=tmp_path / 'model.pt')
    for step, b in zip(run['steps'], plan):
        views = arl.batch_views(_fill(store, b), b)
        model.zero_grad()
        loss = arl.context_segment_loss(model, views, b, 0, 1)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        (l0, total, g0), (l1, total1, g1) = step['results']
        assert total == total1 == pytest.approx(l0 + l1, rel=1e-6)
        assert total == pytest.approx(loss.item(), rel=1e-5) and g1 is None
        assert torch.allclose(torch.from_numpy(g0), grad, rtol=1e-5, atol=1e-6)


def test_buffer_layout_puts_each_field_on_its_own_pages():
    dtypes = dict(arl.HEAVY_DTYPES, hidden=np.dtype(np.float32))
    layout, nbytes = arl.buffer_layout(1000, ('mask', 'hidden'), dtypes, 8)
    assert layout == {'mask': (0, (1000, 1)), 'hidden': (arl.PAGE_SIZE, (1000, 8))}
    assert nbytes == arl.PAGE_SIZE + -(-32000 // arl.PAGE_SIZE) * arl.PAGE_SIZE
    assert arl.buffer_layout(0, ('hidden',), dtypes, 8) == ({'hidden': (0, (0, 8))}, 0)
