"""Chapters 18 and 19: regression tests for the write-ahead-log writers and reader.

Each test is named after the issue item it covers (4, 5, 7, 8). Every call that once
hung runs under a watchdog (a thread joined with a timeout), so a regression fails
instead of hanging the suite. The tests use only names that older writers also have
(fd, _flusher, append, commit, wait, close), so they run against older code as well.
"""
import os
import select
import threading
import time

import numpy as np
import pytest

import agentrl as arl

WATCHDOG_S = 5.0


def in_thread(call):
    """Start call() in a daemon thread -> (thread, box); box['result'] or box['error']
    holds how it ended."""
    box = {}

    def run():
        try:
            box['result'] = call()
        except BaseException as e:                      # noqa: BLE001 (reported)
            box['error'] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def release(writer):
    """Unblock a writer whose call hung (older code): kill its flusher, so that its
    report pipe ends and every blocked read of it returns."""
    writer._flusher.kill()
    writer._flusher.wait()


def open_fds():
    """The descriptors open in this process (less the one that listing them used)."""
    fds = set()
    for name in os.listdir('/proc/self/fd'):
        try:
            os.fstat(int(name))
            fds.add(int(name))
        except OSError:
            pass
    return fds


def token_step(n, step=0):
    g = np.random.default_rng(step)
    return (np.arange(n), np.full(n, step), g.integers(0, 52, n),
            -g.random(n).astype(np.float32))


def unsynced_log(path):
    """A log of a few records written without any fsync (as a crashed run leaves it)."""
    w = arl.WalWriter(path, 'os')
    w.append(arl.REC_META, b'{}')
    for p in range(10):
        w.append(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, p, 3, -0.5))
    w.close()
    return os.path.getsize(path)


@pytest.fixture
def fsynced_inodes(monkeypatch):
    """The inodes of every file this process fsyncs (fsync or fdatasync) from now on."""
    synced = []
    for name in ('fsync', 'fdatasync'):
        if hasattr(os, name):
            real = getattr(os, name)

            def recording(fd, real=real):
                synced.append(os.fstat(fd).st_ino)
                return real(fd)
            monkeypatch.setattr(os, name, recording)
    return synced


# --------------------------------------------------------------------------------------
# 4. A reopened log is durable only once fsynced; token fields are validated everywhere
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize('policy', ['step', 'token'])
def test_item4_reopened_wal_writer_reports_durable_only_once_fsynced(
        tmp_path, fsynced_inodes, policy):
    path = tmp_path / 'x.wal'
    size = unsynced_log(path)
    w = arl.WalWriter(path, policy)
    assert w.offset == size                               # appends continue the log
    # the inherited tail was never fsynced: durable must wait for an fsync of this file
    assert w.durable == 0 or os.stat(path).st_ino in fsynced_inodes
    w.append(arl.REC_TOKEN, arl.TOKEN_PAYLOAD.pack(0, 10, 3, -0.5))
    assert w.commit() == os.path.getsize(path)
    assert os.stat(path).st_ino in fsynced_inodes
    w.close()


def test_item4_reopened_group_commit_writer_reports_durable_only_once_fsynced(
        tmp_path, fsynced_inodes):
    path = tmp_path / 'x.wal'
    size = unsynced_log(path)
    w = arl.GroupCommitWriter(path)
    try:
        # the flusher is another process: only an fsync here, in the writer's own
        # process, may let the writer call the inherited tail durable at once
        assert w.durable == 0 or os.stat(path).st_ino in fsynced_inodes
        assert w.wait() == size
    finally:
        w.close()


BAD_FIELDS = [('rids', -1, ValueError), ('tokens', 2**32 + 5, ValueError),
              ('positions', 2**32, ValueError), ('positions', 1.5, TypeError),
              ('tokens', 7.0, TypeError), ('logps', 1e39, ValueError),
              ('logps', '0.5', TypeError)]


@pytest.mark.parametrize('n', [3, 300], ids=['struct path', 'numpy path'])
@pytest.mark.parametrize('field,value,error', BAD_FIELDS)
def test_item4_append_tokens_validates_every_field_on_every_path(
        tmp_path, n, field, value, error):
    w = arl.GroupCommitWriter(tmp_path / 'x.wal')
    try:
        columns = dict(zip(('rids', 'positions', 'tokens', 'logps'),
                           (c.tolist() for c in token_step(n))))
        columns[field][n // 2] = value
        with pytest.raises(error, match=field):
            w.append_tokens(**columns)
        assert w.offset == 0 and not w.pending            # nothing was appended
        if n >= 256:
            with pytest.raises(error, match=field):
                arl.encode_token_records(**columns)
    finally:
        w.close()


def test_item4_out_of_range_message_names_the_range(tmp_path):
    w = arl.GroupCommitWriter(tmp_path / 'x.wal')
    try:
        for n in (3, 300):
            rids, positions, tokens, logps = token_step(n)
            rids[0] = -1
            with pytest.raises(ValueError, match=r'rids.*4294967295'):
                w.append_tokens(rids, positions, tokens, logps)
        # in range, as unsigned 64-bit ints or Python lists: accepted on both paths
        for n in (3, 300):
            rids, positions, tokens, logps = token_step(n)
            w.append_tokens(rids.astype(np.uint64), positions.tolist(), tokens, logps)
        w.commit()
        assert w.wait() == w.offset
    finally:
        w.close()


# --------------------------------------------------------------------------------------
# 5. close() is idempotent and never closes descriptors it no longer owns
# --------------------------------------------------------------------------------------

def assert_second_close_leaves_other_files_alone(tmp_path, make):
    before = open_fds()
    w = make()
    owned = sorted(open_fds() - before)
    assert owned                                          # the writer opened some
    w.close()
    # other files now hold the writer's old descriptor numbers
    victim = os.open(tmp_path / 'victim.txt', os.O_RDWR | os.O_CREAT)
    ino = os.fstat(victim).st_ino
    for fd in owned:
        os.dup2(victim, fd)
    try:
        w.close()                                         # the second close
        for fd in owned:
            assert os.fstat(fd).st_ino == ino, f'close() closed descriptor {fd} again'
    finally:
        for fd in owned + [victim]:
            try:
                os.close(fd)
            except OSError:
                pass


def test_item5_wal_writer_second_close_leaves_other_files_alone(tmp_path):
    assert_second_close_leaves_other_files_alone(
        tmp_path, lambda: arl.WalWriter(tmp_path / 'x.wal', 'step'))


def test_item5_group_commit_writer_second_close_leaves_other_files_alone(tmp_path):
    def make():
        w = arl.GroupCommitWriter(tmp_path / 'x.wal')
        w.append_tokens(*token_step(5))
        w.commit()
        return w
    assert_second_close_leaves_other_files_alone(tmp_path, make)


def test_item5_closed_writers_refuse_new_records(tmp_path):
    for w in (arl.WalWriter(tmp_path / 'a.wal', 'step'),
              arl.GroupCommitWriter(tmp_path / 'b.wal')):
        w.close()
        w.append(arl.REC_META, b'{}')                     # kept in memory only
        with pytest.raises(ValueError, match='closed'):
            w.commit()


# --------------------------------------------------------------------------------------
# 7. Every blocking call ends
# --------------------------------------------------------------------------------------

def test_item7_close_does_not_wait_for_a_child_forked_after_the_writer(tmp_path):
    w = arl.GroupCommitWriter(tmp_path / 'x.wal')
    w.append_tokens(*token_step(5))
    w.commit()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:                        # the child lives until the test lets it go
        try:
            os.close(hold_w)
            os.read(hold_r, 1)
        finally:
            os._exit(0)
    os.close(hold_r)
    try:
        thread, box = in_thread(w.close)
        thread.join(WATCHDOG_S)
        hung = thread.is_alive()
    finally:
        os.close(hold_w)                                  # the child exits
        os.waitpid(pid, 0)
    thread.join(WATCHDOG_S)
    assert not hung, 'close() waited for a forked child to exit'
    assert 'error' not in box, box.get('error')
    assert arl.recover_log(tmp_path / 'x.wal').report['records'] == 5


def test_item7_a_forked_child_cannot_stop_the_parents_flusher(tmp_path):
    w = arl.GroupCommitWriter(tmp_path / 'x.wal')
    try:
        pid = os.fork()
        if pid == 0:
            try:
                w.close()                                 # the child's copy only
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.1)                     # ten of the flusher's longest naps
        assert w._flusher.poll() is None, 'the child stopped the flusher'
        w.append_tokens(*token_step(5))
        w.commit()
        thread, box = in_thread(w.wait)
        thread.join(WATCHDOG_S)
        if thread.is_alive():
            release(w)
        assert box.get('result') == w.offset, box
    finally:
        w.close()


@pytest.mark.parametrize('how', ['appended, not committed', 'beyond the end'])
def test_item7_wait_on_an_offset_never_committed_raises(tmp_path, how):
    w = arl.GroupCommitWriter(tmp_path / 'x.wal')
    w.append_tokens(*token_step(5))
    committed = w.commit()
    w.wait()
    if how == 'beyond the end':
        target = committed + 1000
    else:
        w.append_tokens(*token_step(5, step=1))
        target = w.offset
    thread, box = in_thread(lambda: w.wait(target))
    thread.join(WATCHDOG_S)
    if thread.is_alive():
        release(w)
        thread.join(WATCHDOG_S)
        pytest.fail(f'wait({target}) blocked with {committed} committed')
    assert isinstance(box.get('error'), ValueError), box
    assert str(target) in str(box['error']) and str(committed) in str(box['error'])
    if how != 'beyond the end':
        w.commit()
        assert w.wait(target) >= target                   # once committed, it ends
    w.close()


def test_item7_close_in_another_thread_wakes_a_waiter(tmp_path, monkeypatch):
    """A waiter about to block on the flusher's reports while close() runs in another
    thread: the waiter must end with the log durable, not block on (or read from) a
    descriptor that close() has closed."""
    w = arl.GroupCommitWriter(tmp_path / 'x.wal')
    w.append_tokens(*token_step(5))
    target = w.commit()
    entered, closed = threading.Event(), threading.Event()
    real_select = select.select

    def select_after_close(*args):
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            closed.wait(1.0)                  # let close() run first, if it can
        return real_select(*args)
    monkeypatch.setattr(select, 'select', select_after_close)
    thread, box = in_thread(lambda: w.wait(target))
    entered.wait(2.0)                         # the waiter is about to block
    w.close()
    closed.set()
    thread.join(WATCHDOG_S)
    if thread.is_alive():
        monkeypatch.undo()
        pytest.fail('a waiter kept waiting after close()')
    assert box.get('result', -1) >= target, box


def test_item7_close_with_waiters_in_several_threads(tmp_path):
    """The flusher stalls (SIGSTOP) while three threads wait and a fourth closes; once
    it runs again, every call ends and every waiter sees its offset durable."""
    import signal
    w = arl.GroupCommitWriter(tmp_path / 'x.wal')
    w.append_tokens(*token_step(5))
    w.commit()
    w.wait()
    os.kill(w._flusher.pid, signal.SIGSTOP)
    try:
        w.append_tokens(*token_step(300, step=1))
        target = w.commit()
        waiters = [in_thread(lambda: w.wait(target)) for _ in range(3)]
        time.sleep(0.1)
        closer = in_thread(w.close)
        time.sleep(0.1)
    finally:
        os.kill(w._flusher.pid, signal.SIGCONT)
    for thread, _ in waiters + [closer]:
        thread.join(WATCHDOG_S)
    assert not any(t.is_alive() for t, _ in waiters + [closer])
    assert all(box.get('result', -1) >= target for _, box in waiters), waiters
    assert 'error' not in closer[1], closer[1]
    assert arl.recover_log(tmp_path / 'x.wal').report['records'] == 305


# --------------------------------------------------------------------------------------
# 8. scan_log_fast reads any buffer by its bytes, as scan_log does
# --------------------------------------------------------------------------------------

def test_item8_scan_log_fast_reads_arrays_by_their_bytes(tmp_path):
    path = tmp_path / 'x.wal'
    size = unsynced_log(path)
    data = path.read_bytes()
    records, report = arl.scan_log(data)
    assert len(records) == 11
    views = [np.frombuffer(data, np.uint8), bytearray(data), memoryview(data)]
    if size % 2 == 0:
        views.append(np.frombuffer(data, np.uint16))
    else:
        views.append(np.frombuffer(data + b'\0', np.uint16))
    views.append(np.repeat(np.frombuffer(data, np.uint8), 2)[::2])  # strided view
    for view in views:
        table, fast_report = arl.scan_log_fast(view)
        want = arl.scan_log(bytes(view))               # scan_log reads the bytes too
        assert table.records() == want[0], type(view)
        assert fast_report == want[1]
        assert len(table) >= 11
    with pytest.raises(TypeError, match='data'):
        arl.scan_log_fast(np.array([object()]))
    with pytest.raises(TypeError, match='data'):
        arl.scan_log_fast([1, 2, 3])
