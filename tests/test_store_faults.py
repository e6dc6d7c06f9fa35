"""Chapter 19: regression tests for faults the trajectory store once mishandled.

Each test is named after the item of the issue it covers (1: writers overwrote each
other; 2: reads and appends trusted their input; 8: one damaged part broke the whole
store, nothing was fsynced, a store's index went stale). Every fault is reproduced at a
deterministic point: two writers are lined up on a barrier before either appends, and
damage is done to the files directly.
"""
import multiprocessing
import os
import struct

import numpy as np
import pytest

import agentrl as arl

D = 3


def trajectory(seed, n=200, d=D):
    return arl.synthetic_trajectory(n, d, seed=seed, prompt=f'prompt {seed}')


def assert_reads_back(store, tid, traj):
    (got,) = store.read([tid])
    for f in arl.HEAVY_FIELDS:
        assert np.array_equal(got[f], traj[f]), (tid, f)


# --- item 1: many writers on one root --------------------------------------------

def test_item1_two_store_objects_append_without_overwriting(tmp_path):
    a = arl.TrajectoryStore(tmp_path, d=D)
    b = arl.TrajectoryStore(tmp_path, d=D)          # opened before either appends
    ta, tb = trajectory(1), trajectory(2)
    ia, ib = a.append(ta), b.append(tb)
    assert ia != ib
    fresh = arl.TrajectoryStore(tmp_path, d=D)
    assert sorted(fresh.metadata()['id'].to_pylist()) == sorted([ia, ib])
    assert_reads_back(fresh, ia, ta)
    assert_reads_back(fresh, ib, tb)


def _append_five(root, first_seed, barrier, results):
    """A writer process: open the store, wait for the other writer, append 5."""
    store = arl.TrajectoryStore(root, d=D)
    barrier.wait(timeout=120)
    results.put([(store.append(trajectory(s)), s)
                 for s in range(first_seed, first_seed + 5)])


def test_item1_two_processes_append_five_each_all_readable(tmp_path):
    ctx = multiprocessing.get_context('spawn')
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_append_five, args=(str(tmp_path), s, barrier, results))
             for s in (0, 100)]
    for p in procs:
        p.start()
    try:
        acked = results.get(timeout=180) + results.get(timeout=180)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    ids = [tid for tid, _ in acked]
    assert len(set(ids)) == 10, f'acknowledged ids collide: {sorted(ids)}'
    fresh = arl.TrajectoryStore(tmp_path, d=D)
    assert sorted(fresh.metadata()['id'].to_pylist()) == sorted(ids)
    for tid, seed in acked:                     # every acknowledged append reads back
        assert_reads_back(fresh, tid, trajectory(seed))
    assert not list(tmp_path.rglob('*.tmp'))


# --- item 2: what read and append check --------------------------------------------

def test_item2_reopen_without_d_takes_the_stored_d(tmp_path):
    t = trajectory(0)
    arl.TrajectoryStore(tmp_path, d=3).append(t)
    again = arl.TrajectoryStore(tmp_path)          # d not given: the store's own
    assert again.d == 3
    assert_reads_back(again, 0, t)
    with pytest.raises(ValueError, match='d=3'):
        arl.TrajectoryStore(tmp_path, d=4)


def ipc_metadata_bytes(data):
    """The byte positions of an Arrow IPC file that are not column data: the schema
    and record-batch messages at the front, the footer at the back."""
    schema_len = struct.unpack('<i', data[12:16])[0]
    batch_at = 16 + schema_len
    batch_len = struct.unpack('<i', data[batch_at + 4:batch_at + 8])[0]
    footer_len = struct.unpack('<i', data[-10:-6])[0]
    return (list(range(batch_at + 8 + batch_len))
            + list(range(len(data) - 10 - footer_len, len(data))))


def test_item2_flipped_schema_or_batch_byte_never_reads_wrong_shape_or_type(tmp_path):
    """Flip each bit-pattern of each byte of a heavy file's schema, batch header and
    footer: a read either raises ValueError naming the file, or returns every field in
    the store's dtype and shape. (A flip that only moves a buffer within the file
    changes values, which nothing but a checksum could see; the store keeps none.)"""
    d, t = 4, trajectory(0, n=64, d=4)
    store = arl.TrajectoryStore(tmp_path, d=d)
    store.append(t)
    path = tmp_path / 'heavy' / '00000000.arrow'
    data = path.read_bytes()
    shapes = {f: np.shape(t[f]) for f in arl.HEAVY_FIELDS}
    wrong, rejected = [], 0
    for i in ipc_metadata_bytes(data):
        for bit in (0x01, 0x02, 0x80):
            flipped = bytearray(data)
            flipped[i] ^= bit
            path.write_bytes(flipped)
            try:
                (got,) = store.read([0])
            except ValueError as e:
                assert '00000000.arrow' in str(e), (i, bit, e)
                rejected += 1
                continue
            for f, view in got.items():
                if view.shape != shapes[f] or view.dtype != arl.HEAVY_DTYPES[f]:
                    wrong.append((i, bit, f, view.shape, view.dtype))
    assert not wrong, f'{len(wrong)} flips read as wrong shapes or types: {wrong[:5]}'
    assert rejected > 100
    path.write_bytes(data)
    assert_reads_back(store, 0, t)


@pytest.mark.parametrize('field, value, error, says', [
    ('tokens', 35.7, TypeError, r'tokens must be integers in \[0, 2147483647\]'),
    ('tokens', 2**32 + 35, ValueError, r'tokens must lie in \[0, 2147483647\]'),
    ('tokens', -1, ValueError, r'tokens must lie in \[0, 2147483647\]'),
    ('mask', -1, ValueError, r'mask must lie in \[0, 1\]'),
    ('mask', 0.5, TypeError, r'mask must be integers in \[0, 1\]'),
    ('logp', 'x', TypeError, 'logp must be real numbers'),
    ('hidden', 1e6, ValueError, r'hidden must lie within \+-65504'),
])
def test_item2_append_rejects_values_the_store_type_cannot_hold(tmp_path, field, value,
                                                                 error, says):
    store = arl.TrajectoryStore(tmp_path, d=D)
    t = trajectory(0)
    values = np.asarray(t[field], dtype=np.asarray(value).dtype)   # int64, float64..
    values[(5, 1) if field == 'hidden' else 5] = value
    with pytest.raises(error, match=says):
        store.append(dict(t, **{field: values}))
    assert store.metadata().num_rows == 0                  # nothing was written


def test_item2_read_rejects_non_integer_ids_and_ranges(tmp_path):
    store = arl.TrajectoryStore(tmp_path, d=D)
    store.append(trajectory(0))
    with pytest.raises(TypeError, match='ranges'):
        store.read([0], ranges=[(2.5, 7.9)])
    with pytest.raises(TypeError, match='ids'):
        store.read([0.9])
    with pytest.raises(TypeError, match='ids'):
        store.read(np.array([0.0]))
    (got,) = store.read(np.array([0]), ranges=[(np.int64(2), 7)])  # numpy ints: fine
    assert got['tokens'].shape == (5,)


# --- item 8: damaged parts, durability, a stale index -------------------------------

@pytest.mark.parametrize('damage', ['empty', 'half'])
def test_item8_damaged_part_costs_that_trajectory_only(tmp_path, damage):
    writer = arl.TrajectoryStore(tmp_path, d=D)
    trajs = [trajectory(s) for s in range(3)]
    for t in trajs:
        writer.append(t)
    part = tmp_path / 'metadata' / 'part-00000001.parquet'
    data = part.read_bytes()
    part.write_bytes(b'' if damage == 'empty' else data[:len(data) // 2])
    store = arl.TrajectoryStore(tmp_path, d=D)             # opening still works
    assert store.metadata()['id'].to_pylist() == [0, 2]
    assert list(store.damaged) == [part]                   # and says what it skipped
    with pytest.raises(ValueError, match=r'trajectory 1: .*part-00000001\.parquet'):
        store.read([1])
    assert_reads_back(store, 0, trajs[0])
    assert_reads_back(store, 2, trajs[2])
    assert store.append(trajs[1]) == 3                      # id 1 is not reused


def test_item8_append_fsyncs_file_before_rename_and_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(('fsync', os.readlink(f'/proc/self/fd/{fd}')))
        real_fsync(fd)

    def replace(src, dst):
        events.append(('replace', os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, 'fsync', fsync)
    monkeypatch.setattr(os, 'fdatasync', fsync)      # files: chapter 18's sync_file
    monkeypatch.setattr(os, 'replace', replace)
    store = arl.TrajectoryStore(tmp_path / 'store', d=D)
    for seed in range(2):                       # the first append and a later one
        events.clear()
        tid = store.append(trajectory(seed))
        renames = [(k, e) for k, e in enumerate(events) if e[0] == 'replace']
        names = {os.path.basename(dst) for _, (_, _, dst) in renames}
        assert {f'{tid:08d}.arrow', f'part-{tid:08d}.parquet'} <= names
        for k, (_, src, dst) in renames:
            assert ('fsync', src) in events[:k], f'{src} renamed before its fsync'
            assert ('fsync', os.path.dirname(dst)) in events[k:], \
                f'the folder of {dst} is not fsynced after the rename'


def test_item8_index_sees_what_another_store_object_appended(tmp_path):
    a = arl.TrajectoryStore(tmp_path, d=D)
    t0, t1 = trajectory(0), trajectory(1)
    a.append(t0)
    assert_reads_back(a, 0, t0)                             # a has built its index
    b = arl.TrajectoryStore(tmp_path, d=D)
    tid = b.append(t1)
    assert tid in a.metadata()['id'].to_pylist()
    assert_reads_back(a, tid, t1)


# --- metadata at scale: compaction ----------------------------------------------------

def metadata_files(root):
    return sorted(p.name for p in (root / 'metadata').iterdir())


def test_compact_merges_parts_into_one_file_and_ids_go_on(tmp_path):
    store = arl.TrajectoryStore(tmp_path, d=D)
    trajs = [trajectory(s) for s in range(5)]
    for t in trajs:
        store.append(t)
    before = store.metadata()
    path = store.compact()
    assert metadata_files(tmp_path) == ['compact-00000000-00000004.parquet']
    assert path.name == 'compact-00000000-00000004.parquet'
    fresh = arl.TrajectoryStore(tmp_path)
    assert fresh.metadata().equals(before)
    assert_reads_back(fresh, 3, trajs[3])
    assert store.compact() is None                      # nothing left to merge
    assert fresh.append(trajectory(5)) == 5             # a part beside the file
    assert fresh.metadata()['id'].to_pylist() == list(range(6))
    fresh.compact()
    assert metadata_files(tmp_path) == ['compact-00000000-00000005.parquet']


def test_compact_crash_between_rename_and_removal_leaves_no_duplicate(tmp_path,
                                                                      monkeypatch):
    store = arl.TrajectoryStore(tmp_path, d=D)
    for s in range(4):
        store.append(trajectory(s))
    real_unlink = type(tmp_path).unlink
    removed = []

    def crash_after_one(self, missing_ok=False):
        if 'metadata' in self.parts and len(removed) == 1:
            raise RuntimeError('power loss')            # the new file is in place
        removed.append(self)
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(type(tmp_path), 'unlink', crash_after_one)
    with pytest.raises(RuntimeError, match='power loss'):
        store.compact()
    monkeypatch.undo()
    names = metadata_files(tmp_path)
    assert 'compact-00000000-00000003.parquet' in names and len(names) == 4
    fresh = arl.TrajectoryStore(tmp_path)
    assert fresh.metadata()['id'].to_pylist() == [0, 1, 2, 3]     # each row once
    assert not fresh.damaged
    assert fresh.append(trajectory(9)) == 4
    fresh.compact()                                     # cleans up what was left
    assert metadata_files(tmp_path) == ['compact-00000000-00000004.parquet']
    assert fresh.metadata()['id'].to_pylist() == [0, 1, 2, 3, 4]


def test_compact_with_a_concurrent_append_loses_nothing(tmp_path, monkeypatch):
    import threading
    import time
    store = arl.TrajectoryStore(tmp_path, d=D)
    for s in range(3):
        store.append(trajectory(s))
    module = arl.trajectory_store
    real_write, appended, threads = module._write_durably, [], []

    def write_slowly(path, write):
        if path.name.startswith('compact-') and not threads:
            other = arl.TrajectoryStore(tmp_path)      # another writer, mid-compaction
            threads.append(threading.Thread(
                target=lambda: appended.append(other.append(trajectory(7)))))
            threads[0].start()
            time.sleep(0.3)                  # it waits for the lock meanwhile
            assert not appended
        real_write(path, write)

    monkeypatch.setattr(module, '_write_durably', write_slowly)
    store.compact()
    threads[0].join(timeout=60)
    assert appended == [3]
    fresh = arl.TrajectoryStore(tmp_path)
    assert fresh.metadata()['id'].to_pylist() == [0, 1, 2, 3]
    assert_reads_back(fresh, 3, trajectory(7))
    assert 'part-00000003.parquet' in metadata_files(tmp_path)


@pytest.mark.parametrize('damage', ['empty', 'half', 'other rows'])
def test_damaged_compacted_file_is_named_and_costs_its_rows_only(tmp_path, damage):
    store = arl.TrajectoryStore(tmp_path, d=D)
    trajs = [trajectory(s) for s in range(4)]
    for t in trajs[:3]:
        store.append(t)
    path = store.compact()
    store.append(trajs[3])                              # a part after the compaction
    data = path.read_bytes()
    if damage == 'other rows':                          # valid Parquet, wrong ids
        import pyarrow.parquet as pq
        table = pq.read_table(path)
        pq.write_table(table.slice(1), path)
    else:
        path.write_bytes(b'' if damage == 'empty' else data[:len(data) // 2])
    fresh = arl.TrajectoryStore(tmp_path)
    assert fresh.metadata()['id'].to_pylist() == [3]
    assert list(fresh.damaged) == [path]
    with pytest.raises(ValueError,
                       match=r'trajectory 1: .*compact-00000000-00000002\.parquet'):
        fresh.read([1])
    assert_reads_back(fresh, 3, trajs[3])
    fresh.compact()                        # the damaged file is kept, not merged
    assert path.exists() and list(fresh.damaged) == [path]
    assert fresh.append(trajs[0]) == 4                  # no id is reused


def test_reader_never_sees_a_compaction_half_done(tmp_path):
    """metadata() takes the lock shared: while a compaction holds it, a read waits."""
    store = arl.TrajectoryStore(tmp_path, d=D)
    for s in range(3):
        store.append(trajectory(s))
    with arl.trajectory_store._exclusive(tmp_path):
        ctx = multiprocessing.get_context('spawn')
        results = ctx.Queue()
        p = ctx.Process(target=_read_ids, args=(str(tmp_path), results))
        p.start()
        import queue
        with pytest.raises(queue.Empty):
            results.get(timeout=3)                      # blocked on the lock
    assert results.get(timeout=120) == [0, 1, 2]
    p.join(timeout=60)


def _read_ids(root, results):
    results.put(arl.TrajectoryStore(root).metadata()['id'].to_pylist())


# --- the hidden dtype is a parameter of the store ------------------------------------

@pytest.mark.parametrize('dtype', ['float16', 'bfloat16', 'float32'])
def test_hidden_dtype_recorded_and_read_back(tmp_path, dtype):
    import torch
    t = trajectory(0)
    hidden32 = np.random.default_rng(0).standard_normal((200, D)).astype(np.float32)
    store = arl.TrajectoryStore(tmp_path, d=D, hidden_dtype=dtype)
    store.append(dict(t, hidden=hidden32))
    again = arl.TrajectoryStore(tmp_path)                # taken from store.json
    assert again.hidden_dtype == dtype
    assert again.metadata()['hidden_dtype'].to_pylist() == [dtype]
    (h,) = again.read_hidden([0])
    want = torch.from_numpy(hidden32).to(getattr(torch, dtype))
    assert h.dtype == want.dtype and h.shape == (200, D)
    assert torch.equal(h.view(torch.int16) if dtype != 'float32' else h,
                       want.view(torch.int16) if dtype != 'float32' else want)
    other = 'float32' if dtype != 'float32' else 'bfloat16'
    with pytest.raises(ValueError, match='hidden_dtype'):
        arl.TrajectoryStore(tmp_path, hidden_dtype=other)


def test_bfloat16_store_fills_hidden_buffer_with_the_same_bits(tmp_path):
    import torch
    store = arl.TrajectoryStore(tmp_path, d=D, hidden_dtype=torch.bfloat16)
    hidden = torch.randn(200, D, generator=torch.Generator().manual_seed(0))
    tid = store.append(dict(trajectory(0), hidden=hidden))
    (raw,) = store.read([tid], ['hidden'])
    assert raw['hidden'].dtype == np.uint16                 # the stored bit patterns
    from_store, from_teacher = arl.HiddenBuffer(torch.bfloat16), \
        arl.HiddenBuffer(torch.bfloat16)
    from_store.put(0, store.read_hidden([tid])[0])
    from_teacher.put(0, hidden)                     # what chapter 17 buffers directly
    bits = from_store.get([0]).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bits, raw['hidden'])
    assert torch.equal(from_store.get([0]).view(torch.int16),
                       from_teacher.get([0]).view(torch.int16))
    # the loader path copies the bits: a planned mini-batch holds them too
    (batch,) = arl.dispatch(store.metadata(), 200, 200)
    buf = bytearray(batch['nbytes'])
    views = arl.batch_views(buf, batch)
    arl.fill_batch(store, batch, views)
    assert views['hidden'].dtype == np.uint16
    assert np.array_equal(views['hidden'], raw['hidden'])


def test_bfloat16_store_rejects_values_it_cannot_hold(tmp_path):
    store = arl.TrajectoryStore(tmp_path, d=D, hidden_dtype='bfloat16')
    t = trajectory(0)
    big = np.asarray(t['hidden'], np.float64)
    big[5, 1] = 1e39
    with pytest.raises(ValueError, match=r'hidden must lie within \+-3\.38953e\+38'):
        store.append(dict(t, hidden=big))
    with pytest.raises(ValueError, match='hidden_dtype must be one of'):
        arl.TrajectoryStore(tmp_path / 'x', d=D, hidden_dtype='int8')
