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
