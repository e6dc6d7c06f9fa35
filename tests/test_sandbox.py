"""Chapter 21's sandbox (agentrl.sandbox): every layer, every attack, the pool's plumbing.

A layer this machine lacks makes its tests skip with the reason, except when the
environment variable CI is set: CI machines have every layer, so there it fails.
"""

import json
import os
import socket
import threading
import time

import pytest

import agentrl.sandbox as sc
import agentrl.sandbox_audit as au

FAST = sc.Limits(wall_s=1.0)  # keeps the bounded attacks short (3 s when unlimited)


def need(*layers):
    """Skip (or, under CI, fail) unless every named layer works here."""
    support = sc.sandbox_support()
    missing = [f'{layer}: {support[layer][1]}' for layer in layers
               if not support[layer][0]]
    if missing:
        message = 'sandbox layer unavailable: ' + '; '.join(missing)
        if os.environ.get('CI'):
            pytest.fail('CI must have every layer. ' + message)
        pytest.skip(message)


def make_pool(layers, limits=sc.Limits(), workers=1):
    need(*layers)
    return sc.SandboxPool(workers=workers, layers=layers, limits=limits)


@pytest.fixture(scope='module')
def full_pool():
    with make_pool(sc.SANDBOX_LAYERS, workers=2) as pool:
        yield pool


@pytest.fixture(scope='module')
def jail_pool():
    """Namespaces without seccomp: shows what the jail alone does."""
    with make_pool(('limits', 'namespaces')) as pool:
        yield pool


@pytest.fixture(scope='module')
def seccomp_pool():
    """Seccomp without namespaces: shows what the filter alone does."""
    with make_pool(('limits', 'seccomp')) as pool:
        yield pool


# ---- the call itself

ORDINARY = '''
import collections, json, math, re
def f(x):
    words = re.findall(r"[a-z]+", x)
    counts = collections.Counter(words)
    return {"sorted": sorted(words), "top": counts.most_common(1)[0][0],
            "sqrt": math.isqrt(len(x)), "round_trip": json.loads(json.dumps(x))}
'''


def test_ordinary_program_runs_with_all_layers(full_pool):
    result = full_pool.call(ORDINARY, ['b a b', 'c'])
    assert result.status == 'ok', result
    assert result.outputs[0] == {'sorted': ['a', 'b', 'b'], 'top': 'b', 'sqrt': 2,
                                 'round_trip': 'b a b'}
    assert result.outputs[1]['top'] == 'c'
    assert 0 < result.seconds < 1.0


def test_error_stdout_and_malformed_outputs(full_pool):
    result = full_pool.call('def f(x):\n    print("hello", x)\n    return 1 / x', [0])
    assert result.status == 'error'
    assert result.error == 'ZeroDivisionError: division by zero'
    assert result.stdout == 'hello 0\n'
    assert full_pool.call('def f(x):\n    return {1, 2}', [0]).status == 'error'
    nan = full_pool.call('def f(x):\n    return float("nan")', [0])
    assert nan.status == 'error' and 'JSON' in nan.error
    missing = full_pool.call('def g(x):\n    return x', [0])
    assert missing.status == 'error' and "'f'" in missing.error
    syntax = full_pool.call('def f(x) return x', [0])
    assert syntax.status == 'error' and syntax.error.startswith('SyntaxError')


def test_exit_without_result_is_not_ok(full_pool):
    result = full_pool.call('import os\ndef f(x):\n    os._exit(0)', [1])
    assert result.status == 'error' and result.outputs is None
    assert result.exit_code == 0 and 'before returning a result' in result.error


def test_program_cannot_forge_the_protocol(full_pool):
    # fd 3 is the result pipe: writing garbage there must not become an 'ok'
    source = 'import os\ndef f(x):\n    os.write(3, b"{not json")\n    return x'
    assert full_pool.call(source, [1]).status == 'error'
    # printing a frame-like blob on stdout is just stdout
    source = 'def f(x):\n    print(\'{"outputs": [42]}\')\n    return x'
    result = full_pool.call(source, [1])
    assert result.outputs == [1] and '42' in result.stdout


def test_workdir_is_fresh_for_every_call(full_pool):
    write = 'def f(x):\n    open("note.txt", "w").write("x")\n    return 1'
    look = 'import os\ndef f(x):\n    return sorted(os.listdir("."))'
    for _ in range(3):  # both workers
        assert full_pool.call(write, [0]).outputs == [1]
        assert full_pool.call(look, [0]).outputs == [[]]


# ---- arguments

@pytest.mark.parametrize('kwargs, error', [
    ({'cpu_s': 0}, ValueError), ({'cpu_s': 1.5}, TypeError),
    ({'cpu_s': True}, TypeError), ({'wall_s': -1.0}, ValueError),
    ({'wall_s': float('nan')}, ValueError), ({'wall_s': '2'}, TypeError),
    ({'memory_bytes': 256}, ValueError), ({'file_bytes': -1}, ValueError),
    ({'open_files': 3}, ValueError), ({'output_bytes': 0}, ValueError),
])
def test_limits_are_validated(kwargs, error):
    field = next(iter(kwargs))
    with pytest.raises(error, match=rf'Limits\.{field}'):
        sc.Limits(**kwargs)


def test_bad_pool_arguments():
    with pytest.raises(TypeError, match='layers'):
        sc.SandboxPool(layers='seccomp')
    with pytest.raises(ValueError, match='unknown layers'):
        sc.SandboxPool(layers=('limits', 'firewall'))
    with pytest.raises(ValueError, match='workers'):
        sc.SandboxPool(workers=0, layers=())
    with pytest.raises(TypeError, match='limits'):
        sc.SandboxPool(layers=(), limits={'cpu_s': 1})


def test_bad_call_arguments(full_pool):
    with pytest.raises(TypeError, match='source'):
        full_pool.call(b'def f(x): return x', [1])
    with pytest.raises(TypeError, match='inputs'):
        full_pool.call('def f(x): return x', 1)
    with pytest.raises(TypeError, match='JSON'):
        full_pool.call('def f(x): return x', [object()])
    with pytest.raises(ValueError, match='entry'):
        full_pool.submit('def f(x): return x', [1], entry='f; import os')


# ---- refusing to fail open

def fake_support(monkeypatch, **missing):
    support = {layer: (True, 'fake') for layer in sc.SANDBOX_LAYERS}
    support.update({layer: (False, why) for layer, why in missing.items()})
    monkeypatch.setattr(sc, 'sandbox_support', lambda: dict(support))


def test_missing_layer_is_refused(monkeypatch):
    fake_support(monkeypatch, namespaces='no bwrap here')
    with pytest.raises(RuntimeError, match='namespaces: no bwrap here'):
        sc.SandboxPool(layers=sc.SANDBOX_LAYERS)


def test_accept_less_warns_and_reports_fewer_layers(monkeypatch):
    need('limits')
    fake_support(monkeypatch, namespaces='no bwrap here')
    with pytest.warns(RuntimeWarning, match='WITHOUT sandbox layers: namespaces'):
        pool = sc.SandboxPool(layers=('limits', 'namespaces'), accept_less=True)
    with pool:
        assert pool.active_layers == ('limits',)
        assert pool.call('def f(x):\n    return x', [5]).outputs == [5]


def test_support_reports_every_layer():
    support = sc.sandbox_support()
    assert set(support) == set(sc.SANDBOX_LAYERS)
    for available, reason in support.values():
        assert isinstance(available, bool) and reason


# ---- layer: limits

LIMITS_ONLY = ('limits',)


def test_cpu_limit_kills_busy_loop():
    need('limits')
    source = 'def f(x):\n    while True:\n        pass'
    result = sc.run_in_fresh_jail(source, [0], layers=LIMITS_ONLY,
                                  limits=sc.Limits(cpu_s=1, wall_s=10.0))
    assert result.status == 'killed' and 'SIGXCPU' in result.error, result
    assert 0.9 < result.seconds < 8.0  # CPU time: slower wall clock on a busy box


def test_wall_deadline_beats_ignored_sigterm():
    need('limits')
    source = ('import signal, time\ndef f(x):\n'
              '    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n'
              '    signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n'
              '    time.sleep(30)\n')
    result = sc.run_in_fresh_jail(source, [0], layers=LIMITS_ONLY,
                                  limits=sc.Limits(wall_s=0.5))
    assert result.status == 'timeout', result
    assert 0.5 <= result.seconds < 1.5


def test_memory_limit():
    need('limits')
    source = 'def f(x):\n    return len(bytearray(512 << 20))'
    result = sc.run_in_fresh_jail(source, [0], layers=LIMITS_ONLY,
                                  limits=sc.Limits(memory_bytes=128 << 20))
    assert result.status in ('error', 'killed') and result.outputs is None
    assert result.status == 'killed' or 'MemoryError' in result.error
    assert result.max_rss_bytes < 128 << 20
    ok = sc.run_in_fresh_jail('def f(x):\n    return len(bytearray(32 << 20))', [0],
                              layers=LIMITS_ONLY,
                              limits=sc.Limits(memory_bytes=128 << 20))
    assert ok.outputs == [32 << 20]  # the limit is not so tight that nothing runs


def test_file_size_and_open_files_limits():
    need('limits')
    source = '''
def f(kind):
    if kind == "big":
        with open("big.bin", "wb") as fh:
            fh.write(b"x" * (2 << 20))
    else:
        handles = [open("f%d" % i, "w") for i in range(64)]
    return "done"
'''
    limits = sc.Limits(file_bytes=1 << 20, open_files=16)
    big = sc.run_in_fresh_jail(source, ['big'], layers=LIMITS_ONLY, limits=limits)
    assert big.status == 'error' and 'File too large' in big.error, big
    many = sc.run_in_fresh_jail(source, ['many'], layers=LIMITS_ONLY, limits=limits)
    assert many.status == 'error' and 'Too many open files' in many.error, many


def test_output_cap():
    need('limits')
    source = 'def f(x):\n    print("A" * 100_000)\n    return x'
    result = sc.run_in_fresh_jail(source, [0], layers=LIMITS_ONLY,
                                  limits=sc.Limits(output_bytes=4096))
    assert result.status == 'output_limit', result
    assert 0 < len(result.stdout.encode()) <= 4096 and result.outputs is None


# ---- layer: namespaces

JAIL_PROBE = '''
import os, socket
def f(what):
    try:
        if what == "files":
            return [os.path.exists(p) for p in ($paths)]
        if what == "ids":
            return [os.getuid(), os.getgid(), os.getpid() < 100,
                    sum(n.isdigit() for n in os.listdir("/proc"))]
        if what == "env":
            return sorted(os.environ)
        if what == "interfaces":
            return sorted(name for _, name in socket.if_nameindex())
        if what == "connect":
            socket.create_connection(("127.0.0.1", $port), timeout=1).close()
            return "connected"
        if what.startswith("write:"):
            path = what[len("write:"):]
            with open(path, "w") as fh:
                fh.write("x")
            with open(path) as fh:
                return fh.read()
    except OSError as exc:
        return "%s: %s" % (type(exc).__name__, exc.strerror)
'''


def test_jail_hides_host_files(jail_pool):
    paths = ['/etc/passwd', __file__, os.path.expanduser('~/.bashrc'), sc.__file__,
             '/usr/bin', '/proc/self']
    source = JAIL_PROBE.replace('$paths', repr(tuple(paths))).replace('$port', '1')
    result = jail_pool.call(source, ['files'])
    assert result.outputs == [[False, False, False, False, True, True]], result


def test_jail_has_no_network(jail_pool):
    listener = socket.create_server(('127.0.0.1', 0))
    try:
        port = listener.getsockname()[1]
        source = JAIL_PROBE.replace('$paths', '()').replace('$port', str(port))
        result = jail_pool.call(source, ['interfaces', 'connect'])
        assert result.outputs[0] == ['lo'], result
        assert result.outputs[1].startswith(('ConnectionRefusedError', 'OSError'))
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing arrived on the host side
    finally:
        listener.close()


def test_jail_view_is_read_only_but_workdir_is_writable(jail_pool):
    source = JAIL_PROBE.replace('$paths', '()').replace('$port', '1')
    inputs = ['write:/usr/pwned', 'write:/pwned', 'write:/work/ok.txt',
              'write:/tmp/ok.txt', 'write:ok2.txt']
    outputs = jail_pool.call(source, inputs).outputs
    assert outputs[0] == outputs[1] == 'OSError: Read-only file system'
    assert outputs[2:] == ['x', 'x', 'x']


def test_jail_identity_and_environment(monkeypatch):
    monkeypatch.setenv('SANDBOX_TEST_SECRET', 'do-not-leak')
    with make_pool(('limits', 'namespaces')) as pool:  # started with the secret set
        source = JAIL_PROBE.replace('$paths', '()').replace('$port', '1')
        ids, env = pool.call(source, ['ids', 'env']).outputs
    assert ids[:3] == [65534, 65534, True]
    assert ids[3] <= 3  # bwrap's init, the worker, the call: nothing of the host
    assert 'SANDBOX_TEST_SECRET' not in env and 'HOME' not in env
    assert set(env) <= {'PATH', 'PWD', 'LC_CTYPE'}


def test_without_jail_environment_is_still_empty(monkeypatch):
    monkeypatch.setenv('SANDBOX_TEST_SECRET', 'do-not-leak')
    with make_pool(('limits',)) as pool:
        env = pool.call('import os\ndef f(x):\n    return sorted(os.environ)', [0])
    assert set(env.outputs[0]) <= {'LC_CTYPE'}


# ---- layer: seccomp

SECCOMP_PROBE = '''
import ctypes, os, socket, subprocess, threading
def f(action):
    try:
        if action == "fork":
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        elif action == "exec":
            subprocess.run(["/usr/bin/true"])
        elif action == "thread":
            threading.Thread(target=lambda: None).start()
        elif action == "socket":
            socket.socket()
        elif action == "kill":
            os.kill(os.getpid(), 0)
        elif action == "ptrace":
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.ptrace(0, 0, None, None) != 0:   # PTRACE_TRACEME, harmless
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        elif action == "ordinary":
            open("data.txt", "w").write("hi")
            return sorted(os.listdir(".")) == ["data.txt"] and os.getpid() > 0
        return "allowed"
    except (OSError, RuntimeError) as exc:
        return "denied: " + str(getattr(exc, "errno", exc))
'''
SECCOMP_ACTIONS = ['fork', 'exec', 'thread', 'socket', 'kill', 'ptrace']


def test_seccomp_denies_processes_signals_sockets_ptrace(seccomp_pool):
    result = seccomp_pool.call(SECCOMP_PROBE, SECCOMP_ACTIONS + ['ordinary'])
    assert result.status == 'ok', result
    verdicts = dict(zip(SECCOMP_ACTIONS, result.outputs))
    for action in ('fork', 'exec', 'socket', 'kill', 'ptrace'):
        assert verdicts[action] == 'denied: 1', (action, verdicts)  # EPERM
    assert verdicts['thread'].startswith('denied')  # a thread is a clone too
    assert result.outputs[-1] is True  # ordinary programs still run


def test_same_probe_without_seccomp_is_allowed():
    with make_pool(('limits', 'namespaces')) as pool:
        actions = ['fork', 'socket', 'kill', 'thread', 'ptrace']
        result = pool.call(SECCOMP_PROBE, actions)
    assert result.outputs == ['allowed'] * 5, result


# ---- the pool

def test_worker_killed_mid_call_is_reported_and_restarted():
    with make_pool(('limits',)) as pool:  # no seccomp: the child can kill its worker
        killer = ('import os, signal\n'
                  'def f(x):\n    os.kill(os.getppid(), signal.SIGKILL)')
        result = pool.call(killer, [0])
        assert result.status == 'crashed' and pool.restarts == 1, result
        assert pool.call('def f(x):\n    return x + 1', [1]).outputs == [2]


def test_worker_dead_between_calls_is_replaced(full_pool):
    before = full_pool.restarts
    for worker in list(full_pool._all):
        worker.proc.kill()
        worker.proc.wait()
    results = [full_pool.call('def f(x):\n    return -x', [3]) for _ in range(2)]
    assert [r.outputs for r in results] == [[-3], [-3]]
    assert full_pool.restarts == before + 2


def test_submit_runs_calls_concurrently(full_pool):
    source = 'import time\ndef f(x):\n    time.sleep(0.2)\n    return x'
    start = time.perf_counter()
    futures = [full_pool.submit(source, [i]) for i in range(8)]
    outputs = [future.result().outputs for future in futures]
    elapsed = time.perf_counter() - start
    assert outputs == [[i] for i in range(8)]
    assert elapsed < 8 * 0.2 * 0.75  # two workers: about half of the serial time


def test_call_is_thread_safe(full_pool):
    calls_before, results = full_pool.calls, []

    def worker(k):
        for i in range(5):
            results.append(full_pool.call('def f(x):\n    return x * x', [k * 10 + i]))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.outputs[0] for r in results) == sorted(
        (k * 10 + i) ** 2 for k in range(4) for i in range(5))
    assert full_pool.calls - calls_before == 20


def test_closed_pool_refuses_calls():
    with make_pool(()) as pool:
        pass
    with pytest.raises(RuntimeError, match='closed'):
        pool.call('def f(x):\n    return x', [1])


def test_latency_helpers(full_pool):
    stats = au.pool_latency(full_pool, 20)
    assert stats['calls'] == 20 and stats['failed'] == 0
    assert 0 < stats['p50_ms'] <= stats['p99_ms'] < 1000 and stats['calls_per_s'] > 5
    fresh = au.fresh_jail_latency(2)
    assert fresh['failed'] == 0 and fresh['p50_ms'] > 0


# ---- red team

ATTACKS = [a for a in au.RED_TEAM if not a.grading]


@pytest.mark.parametrize('attack', au.RED_TEAM, ids=lambda a: a.name)
def test_attack_blocked_with_all_layers(attack):
    need(*sc.SANDBOX_LAYERS)
    outcome = au.run_attack(attack, sc.SANDBOX_LAYERS, FAST)
    assert outcome['outcome'] == 'blocked', outcome
    assert outcome['blocked_by'] == attack.defenses[0]
    if attack.grading:  # the same program fools a grader that runs inside
        assert outcome['weak_grader_fooled'], outcome


@pytest.mark.parametrize('attack', ATTACKS, ids=lambda a: a.name)
def test_attack_succeeds_without_its_defenses(attack):
    """Proves the layer is what blocks it: switch it off and the attack lands."""
    assert not set(attack.defenses) & set(attack.succeeds_with)
    need(*attack.succeeds_with)
    outcome = au.run_attack(attack, attack.succeeds_with, FAST)
    assert outcome['outcome'] == 'succeeded', outcome
    assert outcome['gained']


@pytest.mark.parametrize(
    'attack, layer_off',
    [(a, d) for a in ATTACKS if len(a.defenses) > 1 for d in a.defenses],
    ids=lambda v: v if isinstance(v, str) else v.name)
def test_two_defense_attack_needs_only_one(attack, layer_off):
    layers = tuple(layer for layer in sc.SANDBOX_LAYERS if layer != layer_off)
    need(*layers)
    outcome = au.run_attack(attack, layers, FAST)
    other = next(d for d in attack.defenses if d != layer_off)
    assert (outcome['outcome'], outcome['blocked_by']) == ('blocked', other), outcome


# Children that name themselves (prctl PR_SET_NAME) so the host can look for them.
NAMED_CHILDREN = '''
import ctypes, os, time
def f(n):
    for _ in range(n):
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, $name, 0, 0, 0)   # PR_SET_NAME
            time.sleep(5)
            os._exit(0)
    return n
'''


def host_processes_named(name):
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/stat') as fh:
                stat = fh.read()
        except OSError:
            continue
        if f'({name})' in stat and stat.rsplit(')', 1)[1].split()[0] not in 'ZX':
            found.append(int(pid))
    return found


@pytest.mark.parametrize('layers', [('limits', 'namespaces'), ('limits',)],
                         ids=['kill(-1) in the jail', 'killpg on the host'])
def test_children_are_counted_then_swept(layers):
    """With seccomp off, processes a call forks are counted and die with it."""
    name = 'sbx' + os.urandom(5).hex()  # <= 15 characters: the kernel's comm size
    with make_pool(layers) as pool:
        result = pool.call(NAMED_CHILDREN.replace('$name', repr(name.encode())), [8])
        assert result.outputs == [8] and result.stray_processes == 8, result
        assert host_processes_named(name) == []
        if 'namespaces' in layers:
            look = ('import os\n'
                    'def f(x):\n    return sum(map(str.isdigit, os.listdir("/proc")))')
            assert pool.call(look, [0]).outputs == [3]  # init, worker, this call


# ---- grading

def test_grade_outside_is_type_strict():
    ok = sc.CallResult('ok', outputs=[1, [2.5, 'a'], {'k': None}])
    assert au.grade_outside(ok, [1, [2.5, 'a'], {'k': None}])
    assert not au.grade_outside(sc.CallResult('ok', outputs=[True]), [1])
    assert not au.grade_outside(sc.CallResult('ok', outputs=[1.0]), [1])
    assert not au.grade_outside(sc.CallResult('error', outputs=None), [1])
    assert not au.grade_outside(sc.CallResult('ok', outputs=[1, 2]), [1])


def test_both_graders_agree_on_honest_and_wrong_programs(full_pool):
    tests = au.GRADING_TESTS
    honest, wrong = 'def f(x):\n    return x * x', 'def f(x):\n    return x + x'
    for source, verdict in ((honest, True), (wrong, False)):
        result = full_pool.call(source, [x for x, _ in tests])
        assert au.grade_outside(result, [y for _, y in tests]) is verdict
        assert au.grade_inside(full_pool, source, tests) is verdict


def test_red_team_table_is_data():
    need(*sc.SANDBOX_LAYERS)
    names = ('read_passwd', 'fake_grade_exit_early')
    attacks = [a for a in au.RED_TEAM if a.name in names]
    variants = {'all layers': sc.SANDBOX_LAYERS, 'no namespaces': ('limits', 'seccomp')}
    rows = au.red_team_table(variants, FAST, attacks)
    assert rows[0]['all layers'] == 'blocked (namespaces)'
    assert rows[0]['no namespaces'].startswith('SUCCEEDED: root:')
    assert rows[1]['no namespaces'] == 'blocked (trusted grader)'
    assert rows[1]['weak grader'] == 'fooled'
    json.dumps(rows)  # plain data, ready for a notebook table


# ---- after review: state between calls, forged replies, malformed replies

def test_dev_and_shared_memory_keep_no_state_between_calls(full_pool):
    write_dev = 'def f(_):\n    open("/dev/shm/x", "w").write("1")\n'
    assert 'Read-only' in full_pool.call(write_dev, [0]).error
    devnull = 'def f(_):\n    return open("/dev/null", "w").write("x")\n'
    assert full_pool.call(devnull, [0]).outputs == [1]
    shm = ('import ctypes\ndef f(_):\n    libc = ctypes.CDLL(None, use_errno=True)\n'
           '    return [libc.shmget(0, 1 << 20, 0o1600), ctypes.get_errno()]\n')
    assert full_pool.call(shm, [0]).outputs == [[-1, 1]]          # EPERM


def test_a_chmod_0_directory_does_not_survive_the_call(full_pool):
    hide = ('import os\ndef f(_):\n    os.makedirs("d/e")\n    open("d/e/x", "w")\n'
            '    os.chmod("d/e", 0)\n    os.chmod("d", 0)\n    return 1\n')
    look = 'import os\ndef f(_):\n    return sorted(os.listdir("."))\n'
    assert full_pool.call(hide, [0]).outputs == [1]
    assert all(full_pool.call(look, [0]).outputs == [[]] for _ in range(2))


def test_fcntl_signal_routes_are_denied_by_seccomp(seccomp_pool):
    probe = ('import fcntl, os\ndef f(_):\n    r, w = os.pipe()\n'
             '    fcntl.fcntl(r, fcntl.F_SETOWN, os.getpid())\n')
    assert 'Operation not permitted' in seccomp_pool.call(probe, [0]).error
    fine = ('import fcntl, os\ndef f(_):\n    r, w = os.pipe()\n'
            '    return fcntl.fcntl(r, fcntl.F_GETFL) >= 0\n')
    assert seccomp_pool.call(fine, [0]).outputs == [True]


def test_malformed_replies_are_crashes_not_exceptions():
    limits = sc.Limits()
    for reply in ({'status': 'killed', 'exit_code': None},
                  {'status': 'done', 'exit_code': 0, 'strays': 'many'},
                  {'status': 7}):
        result = sc._result_from_reply(reply, 1, 0.1, limits)
        assert result.status == 'crashed' and 'malformed' in result.error


def test_a_stale_reply_is_refused():
    need(*sc.SANDBOX_LAYERS)
    worker = sc._Worker(sc.SANDBOX_LAYERS, sc.Limits())
    try:
        msg = sc._call_message('def f(x):\n    return x\n', [1], 'f')
        data = json.dumps(dict(msg, nonce='stale')).encode()
        # one frame more than the trusted side asked for: its reply arrives first,
        # as a forged reply's real one would
        worker.proc.stdin.write(sc._FRAME_HEADER.pack(len(data)) + data)
        with pytest.raises(sc._WorkerFailed, match='out of step'):
            worker.request(msg, 5.0)
    finally:
        worker.kill()


def test_close_waits_for_direct_calls_and_refuses_new_ones():
    need('limits', 'namespaces', 'seccomp')
    pool = sc.SandboxPool(workers=1, limits=sc.Limits(wall_s=1.0))
    slow = 'import time\ndef f(_):\n    time.sleep(0.3)\n    return 1\n'
    results = []
    thread = threading.Thread(target=lambda: results.append(pool.call(slow, [0])))
    thread.start()
    time.sleep(0.1)
    pool.close()
    thread.join()
    assert results[0].outputs == [1]
    with pytest.raises(RuntimeError, match='closed'):
        pool.call(slow, [0])


def test_frame_cap_follows_the_output_cap():
    assert sc._frame_cap(sc.Limits(output_bytes=1 << 10)) < sc._frame_cap(sc.Limits())
    assert sc._frame_cap(sc.Limits()) < sc._MAX_FRAME_BYTES
