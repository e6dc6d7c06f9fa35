"""A power-loss model for the durability tests, in the spirit of RocksDB's
FaultInjectionTestFS and LevelDB's fault-injection test.

A process crash leaves the OS page cache alone, so a writer that never fsyncs passes
every test that kills its process. A power loss does not: a file keeps only the bytes
it had when it was last fsynced, and a directory only the names it held when it was
last fsynced. This module records, at every fsync, exactly that state, and builds the
disk as it would be found after a power loss at any point between two fsyncs.

How: os.fsync and os.fdatasync are replaced (PowerLoss.install) by versions that
first take a snapshot and then call the real one. A file's snapshot is its inode and
its whole content (read through /proc/self/fd, which works for a write-only
descriptor and for a file renamed since it was opened); a directory's is its inode
and {name: (inode, is a directory)}. Every snapshot is numbered by an event counter
shared by all processes (a counter file under an flock) and written to a file of its
own, so a child process (chapter 19's flusher) records into the same history: its
script is run with patch_child() in front. Each event also records the names of every
directory under the disk as they stand (for the 'early names' images). Each inode
seen is kept alive by a hard link in a side folder, so an inode number never names
two files. Syncs made in native code would bypass the hook (they would only make the
model more pessimistic); safetensors and pyarrow make none.

The crash image after event k: every directory holds the names it held at its last
fsync at or before k (a directory never fsynced: the names it held when the
recording started, none for a new one); every file the content of its inode at its
last fsync at or before k (never fsynced: its content at the start, empty for a new
file). PowerLoss.images adds two harsher variants of it (torn tails, early names).
Linux only (/proc/self/fd).
"""
import os
import pickle
import random
import shutil
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYNC_CALLS = ('fsync', 'fdatasync')
REAL_SYNC = {name: getattr(os, name) for name in SYNC_CALLS if hasattr(os, name)}
KINDS = ('file', 'dir')


class SyncLog:
    """The history of sync events, shared across processes through the folder
    `state`: counter (the number of the last event), lock (its flock), events/ (one
    pickle per event, named by its number and the pid that recorded it) and keep/
    (hard links that pin every inode seen). Syncs of a kind in `drop` ('file', 'dir')
    are neither recorded nor done: a writer without that fsync."""

    def __init__(self, state, drop=()):
        self.state = Path(state)
        self.drop = frozenset(drop)
        if not set(self.drop) <= set(KINDS):
            raise ValueError(f'drop must be among {KINDS}, got {sorted(self.drop)}')
        self.events, self.keep = self.state / 'events', self.state / 'keep'

    def reset(self, disk):
        """Forget every event (the counter back to 0); disk: the folder whose names
        each event also records as they stand (SyncLog.tree)."""
        shutil.rmtree(self.state, ignore_errors=True)
        for folder in (self.events, self.keep):
            folder.mkdir(parents=True)
        (self.state / 'counter').write_text('0')
        (self.state / 'disk').write_text(str(disk))

    @contextmanager
    def locked(self, shared=False):
        """Hold the counter's lock: events are numbered in the order they happen."""
        import fcntl                  # POSIX only; here, so the module imports anywhere
        with open(self.state / 'lock', 'a') as f:
            fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield

    def now(self):
        """The number of the last event so far (0: none yet)."""
        with self.locked(shared=True):
            return int((self.state / 'counter').read_text())

    def pin(self, ino, path, dir_fd=None):
        """Hard-link the file at path into keep/, so its inode is never reused while
        the test runs; a file gone, or one on another file system, is skipped."""
        target = self.keep / str(ino)
        if not target.exists():
            try:
                os.link(path, target, src_dir_fd=dir_fd, follow_symlinks=dir_fd is None)
            except OSError:
                pass

    def entries(self, fd):
        """A directory's names -> {name: (inode, is a directory)}; inodes from lstat,
        as fstat gives them to file snapshots (readdir's may differ on overlayfs)."""
        out = {}
        for name in os.listdir(fd):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:         # removed meanwhile by another process
                continue
            out[name] = (st.st_ino, stat.S_ISDIR(st.st_mode))
            if stat.S_ISREG(st.st_mode):
                self.pin(st.st_ino, name, dir_fd=fd)
        return out

    def tree(self, path):
        """The names of every directory under path, as they stand now -> (path's
        inode, {directory inode: entries})."""
        dirs = {}

        def walk(path):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                ino = os.fstat(fd).st_ino
                dirs[ino] = self.entries(fd)
            finally:
                os.close(fd)
            for name, (child, is_dir) in list(dirs[ino].items()):
                if is_dir:
                    try:
                        walk(path / name)
                    except FileNotFoundError:
                        del dirs[ino][name]
            return ino
        return walk(Path(path)), dirs

    def snapshot(self, fd):
        """What an fsync of fd makes durable -> dict(kind, ino, data | entries)."""
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return dict(kind='dir', ino=st.st_ino, entries=self.entries(fd))
        proc = f'/proc/self/fd/{fd}'
        with open(proc, 'rb') as f:                # also for a write-only descriptor
            data = f.read()
        self.pin(st.st_ino, proc)
        return dict(kind='file', ino=st.st_ino, data=data)

    def record(self, fd):
        """Record an fsync of fd (an int or an object with fileno) -> whether the real
        sync should follow (False: dropped)."""
        fd = fd if isinstance(fd, int) else fd.fileno()
        kind = 'dir' if stat.S_ISDIR(os.fstat(fd).st_mode) else 'file'
        if kind in self.drop:
            return False
        with self.locked():
            counter = self.state / 'counter'
            n = int(counter.read_text()) + 1
            event = dict(self.snapshot(fd), n=n, pid=os.getpid(),
                         live=self.tree((self.state / 'disk').read_text())[1])
            name = f'{n:08d}.{os.getpid()}.pkl'
            (self.events / name).write_bytes(pickle.dumps(event))
            counter.write_text(str(n))
        return True

    def load(self):
        """Every event recorded, in order."""
        events = [pickle.loads(p.read_bytes()) for p in self.events.iterdir()]
        return sorted(events, key=lambda e: e['n'])

    def recording(self, real):
        """A sync call that records, then does the real sync (unless dropped)."""
        def sync(fd):
            if self.record(fd):
                return real(fd)
        return sync


def patch_child(state, drop=()):
    """In a child process (chapter 19's flusher): make its os.fsync and os.fdatasync
    record into the parent's history. Its script runs after this, so whatever sync
    call it binds is the recording one."""
    log = SyncLog(state, drop)
    for name, real in REAL_SYNC.items():
        setattr(os, name, log.recording(real))


def flusher_prefix(state, drop=()):
    """The line put in front of chapter 19's flusher script: patch_child."""
    return (f'import sys as _s; _s.path.insert(0, {str(HERE)!r}); '
            f'import power_loss as _p; '
            f'_p.patch_child({str(state)!r}, {tuple(sorted(drop))!r}); '
            f'_s.path.pop(0); del _s, _p\n')


@dataclass
class Outcome:
    """What a run over crash points found: crash points tried, images checked (a
    crash point gives up to three: exact, torn, early names), acknowledged items
    checked (summed over the images), and the violations (each naming its image)."""
    points: int = 0
    images: int = 0
    checked: int = 0
    violations: list = field(default_factory=list)

    def summary(self, name):
        return (f'{name}: {self.points} crash points ({self.images} images), '
                f'{self.checked} acknowledged items checked, {len(self.violations)} '
                f'violations')


class PowerLoss:
    """Power loss over the folder `disk`, the history kept in `state` (outside
    disk, on the same file system). install() patches the sync calls, start() takes
    the initial state (taken as durable), ack(value) notes what a writer has just
    acknowledged, images() walks the crash points, check() runs a check on each."""

    def __init__(self, disk, state, drop=()):
        self.disk, self.log = Path(disk), SyncLog(state, drop)
        self.acks, self.base = [], None
        self.log.reset(self.disk)

    def install(self, monkeypatch):
        """Patch os.fsync and os.fdatasync here, every module-level alias of them in
        the package, and chapter 19's flusher script (another interpreter, started by
        subprocess, which patch_child instruments)."""
        for name, real in REAL_SYNC.items():
            monkeypatch.setattr(os, name, self.log.recording(real))
        import agentrl.group_commit as gc
        if hasattr(gc, 'sync'):
            monkeypatch.setattr(gc, 'sync', os.fdatasync if hasattr(os, 'fdatasync')
                                else os.fsync)
        monkeypatch.setattr(gc, '_FLUSHER',
                            flusher_prefix(self.log.state, self.log.drop) + gc._FLUSHER)

    def start(self):
        """Forget earlier events and take the disk as it is now as durable."""
        self.log.reset(self.disk)
        self.acks = []
        root, dirs = self.log.tree(self.disk)
        self.base = root, dirs, self.contents(root, dirs, self.disk)

    def contents(self, ino, dirs, path):
        """{file inode: its bytes now} of every file under directory ino at path."""
        files = {}
        for name, (child, is_dir) in dirs[ino].items():
            if is_dir:
                files.update(self.contents(child, dirs, path / name))
            else:
                files[child] = (path / name).read_bytes()
        return files

    def now(self):
        return self.log.now()

    def ack(self, value):
        """The writer has just acknowledged value: a crash after the last event so far
        must keep it."""
        self.acks.append((self.now(), value))

    def acked(self, k):
        """What was acknowledged before a crash right after event k."""
        return [value for n, value in self.acks if n <= k]

    def images(self, dest):
        """Every crash point k (0: before the first event; k: right after event k,
        before event k + 1) -> (label, image, acked(k)), the image being the disk as a
        power loss there leaves it, built at dest (removed when the next is built):

        'k': each directory holds its names as of its last fsync, each file its
        bytes as of its last fsync (the model; LevelDB's and RocksDB's).
        'k torn', where some file has bytes written since its last fsync (its next
        fsync only appends): each such file keeps a random part of them, as a file
        system that wrote some pages before the power went (RocksDB's "drop random
        unsynced data").
        'k early names', where a directory's names have changed since its last
        fsync: every directory holds its names as they stood just before event
        k + 1 (the journal committed them), the files only their fsynced bytes: how
        a rename made before its file's fsync leaves an empty or partial file.
        """
        root, dirs, files = self.base
        dirs, files = dict(dirs), dict(files)
        events = self.log.load()
        final = self.log.tree(self.disk)[1]
        rng = random.Random(0)
        for k in range(len(events) + 1):
            if k:
                e = events[k - 1]
                assert e['n'] == k, f'event {k} is numbered {e["n"]}'
                if e['kind'] == 'dir':
                    dirs[e['ino']] = e['entries']
                else:
                    files[e['ino']] = e['data']
            variants = [(str(k), dirs, files)]
            tails = unsynced_tails(files, events[k:])
            if tails:
                cut = {ino: data[:rng.randint(len(files.get(ino, b'')) + 1, len(data))]
                       for ino, data in tails.items()}
                variants.append((f'{k} torn', dirs, {**files, **cut}))
            live = events[k]['live'] if k < len(events) else final
            if any(dirs.get(ino, {}) != names for ino, names in live.items()):
                variants.append((f'{k} early names', {**dirs, **live}, files))
            for label, names, contents in variants:
                shutil.rmtree(dest, ignore_errors=True)
                materialise(root, Path(dest), names, contents)
                yield label, Path(dest), self.acked(k)
        shutil.rmtree(dest, ignore_errors=True)

    def live_image(self, dest):
        """The disk as a process crash leaves it (the page cache survives): a copy."""
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(self.disk, dest)
        return Path(dest)

    def check(self, dest, check):
        """Run check(image, acked) -> (items checked, violations) on every image of
        every crash point -> Outcome."""
        out, points = Outcome(), set()
        for label, image, acked in self.images(dest):
            checked, bad = check(image, acked)
            points.add(label.split()[0])
            out.images += 1
            out.checked += checked
            out.violations += [f'crash after event {label}: {v}' for v in bad]
        out.points = len(points)
        return out


def unsynced_tails(files, later):
    """{inode: its content at its next fsync} for each file whose next fsync (among the
    events `later`) only appends to what files holds: the bytes a crash may have
    partly kept."""
    tails = {}
    for e in later:
        if e['kind'] == 'file' and e['ino'] not in tails:
            tails[e['ino']] = e['data']
    return {ino: data for ino, data in tails.items()
            if len(data) > len(files.get(ino, b'')) + 1
            and data.startswith(files.get(ino, b''))}


def materialise(ino, path, dirs, files):
    """Write directory ino (its names as dirs holds them, each file's content as files
    holds it, empty if unknown) at path."""
    path.mkdir()
    for name, (child, is_dir) in dirs.get(ino, {}).items():
        if is_dir:
            materialise(child, path / name, dirs, files)
        else:
            (path / name).write_bytes(files.get(child, b''))
