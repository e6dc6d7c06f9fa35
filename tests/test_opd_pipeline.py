"""Chapter 20: the pipeline (rollouts through chapter 18's engine in child processes, episodes and
teacher hidden states in chapter 19's store, chapter 17's loss, chapter 7's update) against chapter
15's train_opd, under real kills, one step off, with discard-and-restart, and its checks."""
import copy
import hashlib
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import agentrl as arl

FAMILIES = ('calc', 'max')


def _agent(seed, vocab):
    """A tiny TinyAgent that fits whole episodes (max_len 64 > max_tokens)."""
    torch.manual_seed(seed)
    return arl.TinyAgent(vocab, d_model=16, n_layers=1, n_heads=2, max_len=64).eval()


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    tasks = [t for t in arl.make_tasks('train') if t.family in FAMILIES][:12]
    teachers = {f: _agent(1 + k, len(tok)) for k, f in enumerate(FAMILIES)}
    store = arl.TeacherStore(tmp_path_factory.mktemp('teachers'))
    for family, model in teachers.items():
        store.save(family, model)
    cfg = arl.OPDConfig(tasks_per_step=4, max_tokens=40, max_turns=2)
    return tok, tasks, teachers, store, cfg, _agent(0, len(tok))


class _Probe(arl.UpdateTerm):
    """Records each step's token ids and the weights after each update."""
    def __init__(self, model):
        self.model, self.batches, self.weights = model, [], []

    def start(self, batch):
        self.batches.append(batch['ids'].clone())

    def epoch_end(self, epoch, stats):
        self.weights.append([p.detach().clone() for p in self.model.parameters()])


def _pipeline(setup, folder, steps=3, **changes):
    tok, tasks, _, store, cfg, student = setup
    model, probe = copy.deepcopy(student), None
    probe = _Probe(model)
    history, timeline = arl.train_opd_pipeline(model, store, tasks, tok, cfg, steps, folder,
                                               arl.PipelineConfig(**changes), progress=False,
                                               parts=(probe,))
    return model, history, timeline, probe


def test_the_synchronous_pipeline_is_train_opd(setup, tmp_path):
    """Same episodes token for token, the same loss to float32 rounding, weights that agree far
    beyond how far the update moved them."""
    tok, tasks, teachers, store, cfg, student = setup
    plain = copy.deepcopy(student)
    probe = _Probe(plain)
    plain_h = arl.train_opd(plain, teachers, tasks, tok, cfg, 3, progress=False,
                            parts=(arl.Distillation(teachers, cfg), probe))
    piped, piped_h, timeline, piped_probe = _pipeline(setup, tmp_path / 'run')
    assert len(probe.batches) == len(piped_probe.batches) == 3
    for a, b in zip(probe.batches, piped_probe.batches):
        assert torch.equal(a, b)
    for a, b in zip(plain_h[:3], piped_h[:3]):
        assert b['loss'] == pytest.approx(a['loss'], rel=1e-5)
        assert b['lag'] == 0 and b['sigkill'] == b['sigterm'] == 0
        assert b['max_resident'] == 1 and b['trunks_read'] == 0 and b['heavy_bytes'] > 0
        assert b['loader_depth'] >= 1 and 0 < b['loader_bytes'] <= 2 ** 20
    flat = lambda ws: torch.cat([w.flatten() for w in ws])
    moved = (flat(probe.weights[-1]) - flat(student.parameters())).norm()
    assert (flat(probe.weights[-1]) - flat(piped_probe.weights[-1])).norm() < 1e-2 * moved
    assert {stage for stage, *_ in timeline} == {'rollout', 'wait', 'teachers', 'read',
                                                 'update', 'load'}
    # the synchronous float32 sampler is the trainer, to float32 against float64
    assert all(0 <= r['sampler_kl'] < 1e-8 for r in piped_h[:3])
    assert all(r['light_bytes'] > 0 and r['sync_bytes'] > 0 for r in piped_h[:3])
    # every episode and its teacher states went to the store, durably, one row each
    meta = arl.TrajectoryStore(tmp_path / 'run' / 'trajectories').metadata()
    assert meta.num_rows == 3 * cfg.tasks_per_step
    assert set(meta.column('teacher').to_pylist()) <= {0, 1}


def test_killed_rollout_processes_change_no_bit_of_the_weights(setup, tmp_path):
    """The crash test: rollout processes stopped by SIGKILL and SIGTERM on a seeded schedule,
    resumed from the log; the trained weights equal the run without faults bit for bit."""
    clean, clean_h, *_ = _pipeline(setup, tmp_path / 'clean')
    crashed, crash_h, *_ = _pipeline(setup, tmp_path / 'crashed', kill_rate=0.15,
                                     fault_seed=1)
    assert sum(r['sigkill'] for r in crash_h[:3]) >= 1
    assert sum(r['sigterm'] for r in crash_h[:3]) >= 1
    for a, b in zip(clean.state_dict().values(), crashed.state_dict().values()):
        assert torch.equal(a, b)
    assert [r['loss'] for r in clean_h[:3]] == [r['loss'] for r in crash_h[:3]]


def test_one_step_off_trains_on_the_episodes_of_the_previous_weights(setup, tmp_path):
    """lag 1: the same draws (tasks, seeds) as lag 0; step 0 trains on the same episodes, later
    steps on episodes sampled one version earlier, tagged with those weights."""
    _, sync_h, _, sync_probe = _pipeline(setup, tmp_path / 'sync')
    _, lag_h, _, lag_probe = _pipeline(setup, tmp_path / 'lag', lag=1)
    assert [r['lag'] for r in lag_h[:3]] == [0, 1, 1]
    assert torch.equal(sync_probe.batches[0], lag_probe.batches[0])
    assert lag_h[0]['loss'] == sync_h[0]['loss']
    assert lag_h[1]['loss'] != sync_h[1]['loss']
    # step 1 was sampled by the weights that sampled step 0, as their hashes say
    logs = [arl.recover_log(tmp_path / 'lag' / 'rollouts' / f'step-{k:05d}' / 'job' /
                            'rollout.wal').meta['weights_hash'] for k in range(3)]
    assert logs[0] == logs[1] != logs[2]


def test_discard_and_restart_trains_on_other_episodes(setup, tmp_path):
    _, sync_h, _, sync_probe = _pipeline(setup, tmp_path / 'sync', steps=2)
    _, disc_h, _, disc_probe = _pipeline(setup, tmp_path / 'discard', steps=2,
                                         kill_rate=0.1, preemption='discard')
    assert sum(r['sigkill'] + r['sigterm'] for r in disc_h[:2]) >= 1
    assert not all(torch.equal(a, b) for a, b in zip(sync_probe.batches, disc_probe.batches))


def test_store_episodes_keeps_the_teacher_states_at_the_sampled_tokens(setup, tmp_path):
    tok, tasks, teachers, store, cfg, student = setup
    trajs = arl.sample_groups(student, lambda: arl.make_env(cfg), tasks[:4], tok, cfg, seed=3)
    traj_store = arl.TrajectoryStore(tmp_path / 'trajs', d=16, hidden_dtype='float32')
    ids = arl.store_episodes(traj_store, store, trajs, tok.pad_id)
    assert len(ids) == len(set(ids)) == 4
    names = store.names()
    meta = traj_store.metadata()
    assert meta.column('teacher').to_pylist() == [names.index(t.info['family'])
                                                   for t in trajs]
    for traj, tid in zip(trajs, ids):
        views = traj_store.read([tid])[0]
        assert torch.equal(torch.from_numpy(views['tokens']).long(), traj.ids)
        sampled = torch.from_numpy(views['mask']).bool()
        assert torch.equal(sampled[1:], traj.action_mask.bool()) and not sampled[0]
        with torch.no_grad():
            hidden = teachers[traj.info['family']].hidden(traj.ids[None])[0, :-1]  # [T-1, d]
        stored = torch.from_numpy(views['hidden'])
        assert torch.allclose(stored[1:][traj.action_mask.bool()],
                              hidden[traj.action_mask.bool()], atol=1e-6)
        assert not stored[~sampled].any()
    with pytest.raises(ValueError, match='no teacher named'):
        other = [t for t in arl.make_tasks('train') if t.family == 'sum'][:1]
        arl.store_episodes(traj_store, store, arl.sample_groups(
            student, lambda: arl.make_env(cfg), other, tok, cfg, seed=0), tok.pad_id)


def test_the_cached_run_trains_once(setup, tmp_path, monkeypatch):
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path / 'cache'))
    tok, tasks, _, store, cfg, student = setup
    pcfg = arl.PipelineConfig(lag=1)
    model, history = arl.train_opd_pipeline_cached(student, store, tasks, tok, cfg, 2, pcfg)
    files = sorted(p.name for p in (tmp_path / 'cache').iterdir())
    assert len(files) == 2 and files[0].startswith('pipeline-')
    again, history2 = arl.train_opd_pipeline_cached(student, store, tasks, tok, cfg, 2, pcfg)
    assert history2 == history and all(torch.equal(a, b) for a, b in zip(
        model.state_dict().values(), again.state_dict().values()))
    arl.train_opd_pipeline_cached(student, store, tasks, tok, cfg, 2, arl.PipelineConfig())
    assert len(list((tmp_path / 'cache').iterdir())) == 4      # another config, another run


@pytest.mark.parametrize('changes, error, match', [
    (dict(weight_format='fp16'), ValueError, 'weight_format must be one of'),
    (dict(rollout_dtype='float16'), ValueError, 'rollout_dtype must be one of'),
    (dict(lag=-1), ValueError, 'lag must be >= 0'),
    (dict(lag=1.0), TypeError, 'lag must be an int'),
    (dict(kill_rate=float('nan')), ValueError, 'kill_rate must be a finite number'),
    (dict(p_sigterm=1.5), ValueError, r'p_sigterm must be in \[0, 1\]'),
    (dict(preemption='retry'), ValueError, 'preemption must be one of'),
    (dict(hidden_dtype='float64'), ValueError, 'hidden_dtype must be one of'),
    (dict(split='test'), ValueError, 'split must be one of'),
    (dict(loader_memory=0), ValueError, 'loader_memory must be >= 1'),
])
def test_pipeline_config_names_the_bad_field(changes, error, match):
    with pytest.raises(error, match=match):
        arl.PipelineConfig(**changes)


def test_train_opd_pipeline_refuses_what_it_cannot_run(setup, tmp_path):
    tok, tasks, teachers, store, cfg, student = setup
    run = lambda cfg=cfg, tasks=tasks, folder=tmp_path / 'x', pcfg=None: arl.train_opd_pipeline(
        copy.deepcopy(student), store, tasks, tok, cfg, 1, folder, pcfg, progress=False)
    with pytest.raises(ValueError, match='cfg.lam must be 1'):
        run(cfg=arl.OPDConfig(lam=0.5))
    with pytest.raises(ValueError, match="cfg.loss 'jsd'"):
        run(cfg=arl.OPDConfig(loss='sft'))
    with pytest.raises(TypeError, match='pcfg must be a PipelineConfig'):
        run(pcfg=dict(lag=1))
    (tmp_path / 'exists').mkdir()
    with pytest.raises(ValueError, match='starts in a new folder'):
        run(folder=tmp_path / 'exists')
    with pytest.raises(ValueError, match="are not in split 'train'"):
        run(tasks=[t for t in arl.make_tasks('heldout') if t.family == 'calc'][:4],
            folder=tmp_path / 'heldout')


def _loader_store(tmp_path, hidden_dtype):
    """A trajectory store of 6 synthetic trajectories -> (store, ids)."""
    store = arl.TrajectoryStore(tmp_path / 'store', d=8, hidden_dtype=hidden_dtype)
    return store, [store.append(arl.synthetic_trajectory(20 + 7 * k, d=8, seed=k))
                   for k in range(6)]


def _plan(store, groups):
    """One mini-batch of hidden rows per group of (id, start, stop) segments."""
    plan = []
    for segments in groups:
        segments = np.array(segments, np.int64)
        tokens = int((segments[:, 2] - segments[:, 1]).sum())
        layout, nbytes = arl.buffer_layout(tokens, ('hidden',), store.dtypes, store.d)
        plan.append(dict(segments=segments, tokens=tokens, layout=layout, nbytes=nbytes,
                         dtypes={'hidden': store.dtypes['hidden']}))
    return plan


@pytest.mark.parametrize('hidden_dtype', ['float32', 'bfloat16'])
def test_the_heavy_loader_hands_over_what_the_store_holds(tmp_path, hidden_dtype):
    """Every depth gives the bytes a direct read gives, counts them, and leaves no segment
    behind; a plan left unfinished is drained by the next one."""
    store, ids = _loader_store(tmp_path, hidden_dtype)
    groups = [[(ids[0], 0, 20), (ids[3], 5, 30)], [(ids[1], 3, 27)],
              [(ids[5], 10, 55), (ids[2], 0, 34)]]
    direct = [np.concatenate([store.read([i], ['hidden'], [(a, b)])[0]['hidden']
                              for i, a, b in g]) for g in groups]
    loader = arl.HeavyLoader(store.root, store.d)
    try:
        for depth in (1, 2, 5):
            loader.start(_plan(store, groups), depth)
            for want in direct:
                assert np.array_equal(loader.take()['hidden'], want)
            with pytest.raises(RuntimeError, match='all 3 mini-batches'):
                loader.take()
        assert loader.bytes_read == 3 * sum(w.nbytes for w in direct)
        assert len(loader.waits) == 9
        loader.start(_plan(store, groups), 2)
        loader.take()                                   # two left, one of them filled
        loader.start(_plan(store, groups[:1]), 1)
        assert np.array_equal(loader.take()['hidden'], direct[0])
        prefix = loader.prefix
    finally:
        loader.close()
    assert loader.worker.exitcode == 0
    assert not [p for p in Path('/dev/shm').glob(f'{prefix[:-1]}*')]      # all unlinked


def test_loaded_hidden_answers_in_the_planned_order_only(tmp_path):
    store, ids = _loader_store(tmp_path, 'float32')
    groups = [(0, [0, 1]), (1, [2])]
    spans = {0: (0, 10), 1: (2, 12), 2: (4, 9)}
    plan = _plan(store, [[(ids[i], *spans[i]) for i in rows] for _, rows in groups])
    masks = {i: torch.arange(b - a) % 2 == 0 for i, (a, b) in spans.items()}
    loader = arl.HeavyLoader(store.root, store.d)
    try:
        loader.start(plan, 2)
        hidden = arl.LoadedHidden(loader, plan, groups, ['calc', 'max'], masks,
                                  torch.float32, 'float32')
        with pytest.raises(ValueError, match=r'next planned micro-batch is \[0, 1\]'):
            hidden.get([2], teacher='max')
        with pytest.raises(ValueError, match='next planned'):
            hidden.get([0, 1], teacher='max')
        got = hidden.get([0, 1], teacher='calc')
        rows = [torch.from_numpy(store.read([ids[i]], ['hidden'], [spans[i]])[0]['hidden'])
                [masks[i]] for i in (0, 1)]
        assert torch.equal(got, torch.cat(rows))
        assert hidden.get([2], torch.float64, teacher='max').dtype == torch.float64
        with pytest.raises(RuntimeError, match='once per update'):
            hidden.get([0, 1])
    finally:
        loader.close()


def test_a_loader_budget_below_one_micro_batch_is_refused(setup, tmp_path):
    tok, tasks, _, store, cfg, student = setup
    with pytest.raises(ValueError, match='memory_budget=64 bytes holds no mini-batch'):
        arl.train_opd_pipeline(copy.deepcopy(student), store, tasks, tok, cfg, 1,
                               tmp_path / 'run', arl.PipelineConfig(loader_memory=64),
                               progress=False)


def test_a_failed_loader_worker_is_reported(tmp_path):
    store, ids = _loader_store(tmp_path, 'float32')
    plan = _plan(store, [[(ids[0], 0, 20)]])
    plan[0]['segments'][0, 2] = 25                  # more rows than its buffer holds
    loader = arl.HeavyLoader(store.root, store.d, timeout=30)
    try:
        loader.start(plan, 1)
        with pytest.raises(RuntimeError, match=r'failed: \[1\]'):
            loader.take()
    finally:
        loader.close()
    assert not list(Path('/dev/shm').glob(f'{loader.name}*'))   # close removed its segment



def test_a_new_loader_removes_only_its_own_stores_segments(tmp_path):
    """A loader starting on store B removes what a dead loader of B left in /dev/shm, and
    leaves alone the segments a live loader of store A holds."""
    a_store, a_ids = _loader_store(tmp_path / 'a', 'float32')
    b_store, b_ids = _loader_store(tmp_path / 'b', 'float32')
    a = arl.HeavyLoader(a_store.root, a_store.d)
    try:
        a.start(_plan(a_store, [[(a_ids[0], 0, 20)], [(a_ids[1], 0, 20)]]), 2)
        a.take()                                  # the second segment is still held
        held = Path('/dev/shm') / f'{a.prefix}-1'
        assert held.exists()
        where = str(Path(b_store.root).resolve()).encode()
        b_name = f'arl{hashlib.sha256(where).hexdigest()[:12]}'
        orphan = Path('/dev/shm') / f'{b_name}r7-0'        # as a killed trainer leaves it
        orphan.write_bytes(b'x')
        b = arl.HeavyLoader(b_store.root, b_store.d)
        assert b.name == b_name and not orphan.exists()
        b.close()
        assert held.exists() and a.name != b.name       # a's live segment is untouched
        assert np.array_equal(a.take()['hidden'],
                              a_store.read([a_ids[1]], ['hidden'], [(0, 20)])[0]['hidden'])
    finally:
        a.close()

def _agent32(seed, vocab):
    """A tiny TinyAgent whose linear layers MXFP4 can store (32-wide blocks)."""
    torch.manual_seed(seed)
    return arl.TinyAgent(vocab, d_model=32, n_layers=1, n_heads=2, max_len=64).eval()


@pytest.fixture(scope='module')
def fp4_setup(setup, tmp_path_factory):
    """setup's task and config, with d_model 32 agents and their teachers in MXFP4."""
    tok, tasks, _, _, cfg, _ = setup
    store = arl.TeacherStore(tmp_path_factory.mktemp('fp4-teachers'))
    for k, family in enumerate(FAMILIES):
        store.save(family, _agent32(1 + k, len(tok)), fmt='mxfp4')
    return tok, tasks, store, cfg, _agent32(0, len(tok))


ALL_PILLARS = dict(weight_format='mxfp4', hidden_dtype='bfloat16', lag=1,
                   loader_memory=2 ** 13, kill_rate=0.3, fault_seed=1)


def test_all_four_pillars_with_three_trainer_kills_end_on_the_twin_weights(fp4_setup,
                                                                           tmp_path):
    """The chapter's run, tiny: MXFP4 weights sent as an MXFP4 file, MXFP4 teachers, bfloat16
    hidden states, one step off, a loader budget that binds, rollout processes preempted and
    the trainer's process group SIGKILLed three times; it ends on the weights and losses of
    its unkilled twin, bit for bit, while the same kills with the log ignored (discard) end
    elsewhere. Each kill lands in a recorded stage, after its drawn step; restarts used both
    the KV snapshot and the log; no shared-memory segment or semaphore is left behind."""
    tok, tasks, store, cfg, student = fp4_setup
    steps, kills = 5, 3

    def run(folder, **changes):
        model = copy.deepcopy(student)
        hist, _ = arl.train_opd_pipeline(model, store, tasks, tok, cfg, steps, folder,
                                         arl.PipelineConfig(**{**ALL_PILLARS, **changes}),
                                         progress=False)
        return model, hist
    twin, twin_h = run(tmp_path / 'twin', kill_rate=0.0)
    ablation, _ = run(tmp_path / 'discard', preemption='discard')
    semaphores = set(Path('/dev/shm').glob('sem.mp-*'))
    killed = copy.deepcopy(student)
    history, deaths = arl.train_with_trainer_kills(
        killed, store, tasks, tok, cfg, steps, tmp_path / 'killed',
        arl.PipelineConfig(**ALL_PILLARS), kills=kills, seed=0)
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                              b.state_dict().values()))
    assert same(twin, killed) and not same(twin, ablation)
    assert [r['loss'] for r in history[:steps]] == [r['loss'] for r in twin_h[:steps]]
    # kill k lands once the checkpoint holds its drawn step, and before the run ends
    drawn = sorted(np.random.default_rng(0).choice(np.arange(1, steps - 1), kills,
                                                   replace=False).tolist())
    assert [d['in_step'] >= at for d, at in zip(deaths, drawn)] == [True] * kills
    assert all(d['in_step'] <= steps - 1 for d in deaths)
    assert {d['stage'] for d in deaths} <= {'decode', 'teachers', 'update', 'checkpoint',
                                            'start-up'}
    modes = Counter()
    for job in (tmp_path / 'killed' / 'run' / 'rollouts').glob('step-*/job'):
        modes.update(r['mode'] for r in arl.read_runs(job) if r.get('run', 0) > 0
                     and 'mode' in r)
    assert modes['snapshot'] > 0 and modes['reprefill'] > 0
    steps_h = [r for r in twin_h if 'loss' in r]
    assert all(r['loader_bytes'] <= 2 ** 13 for r in steps_h)
    assert any(r['loader_depth'] < r['loader_plan'] for r in steps_h)     # it binds
    assert [r['lag'] for r in steps_h] == [0] + [1] * (steps - 1)
    assert all(r['sampler_kl'] > 0 for r in steps_h)       # MXFP4 and stale: never zero
    assert len(list((tmp_path / 'killed').glob('trainer-*.log'))) == kills + 1
    root = str((tmp_path / 'killed' / 'run' / 'trajectories').resolve()).encode()
    name = f'arl{hashlib.sha256(root).hexdigest()[:12]}'          # HeavyLoader's segments
    assert not list(Path('/dev/shm').glob(f'{name}*'))    # the dead trainers' ones removed
    # and their semaphores: the resource tracker, spared by the kills, unlinks them
    for _ in range(100):
        leaked = set(Path('/dev/shm').glob('sem.mp-*')) - semaphores
        if not leaked:
            break
        time.sleep(0.05)
    assert not leaked


def test_the_rollouts_are_sent_an_mxfp4_file_and_sample_what_float32_weights_would(
        fp4_setup, tmp_path):
    """weight_format 'mxfp4': the weight file is chapter 16's MXFP4 file (far smaller than
    float32), and the episodes are those of float32 weights rounded in the rollout process,
    token for token (the same decoded weights)."""
    tok, tasks, store, cfg, student = fp4_setup
    pcfg = arl.PipelineConfig(weight_format='mxfp4')
    rollouts = arl.Rollouts(tmp_path / 'r', cfg, pcfg)
    rollouts.submit(0, student, tasks[:2], 5)
    sent, _ = rollouts.collect(0)
    _, nbytes, seconds = rollouts.syncs[0]
    plain = tmp_path / 'plain.safetensors'
    assert nbytes < 0.6 * arl.save_rollout_weights(plain, student) and seconds > 0
    assert arl.weights_file_format(tmp_path / 'r' / 'step-00000' / 'policy.safetensors') \
        == 'mxfp4'
    spec = rollouts.spec(plain, tasks[:2], 5)
    arl.run_rollout(tmp_path / 'local', spec)
    rounded = arl.read_trajectories(tmp_path / 'local')
    assert [t.ids.tolist() for t in sent] == [t.ids.tolist() for t in rounded]
    assert {t.info['weights_hash'] for t in sent} == {t.info['weights_hash'] for t in rounded}
    with pytest.raises(ValueError, match='has no rollout job in flight'):
        rollouts.collect(0)


def test_load_episodes_gives_back_what_the_store_holds(setup, tmp_path):
    """The trainer's episodes, read back through the loader: tokens, mask and the sampler's
    log-probs of each episode as stored, its reward from the metadata, its light info."""
    tok, tasks, _, store, cfg, student = setup
    trajs = arl.sample_groups(student, lambda: arl.make_env(cfg), tasks[:3], tok, cfg, seed=2)
    traj_store = arl.TrajectoryStore(tmp_path / 'trajs', d=16, hidden_dtype='bfloat16')
    ids = arl.store_episodes(traj_store, store, trajs, tok.pad_id)
    meta = {r['id']: r for r in traj_store.metadata().to_pylist()}
    loader = arl.HeavyLoader(traj_store.root, traj_store.d)
    try:
        back = arl.load_episodes(loader, [meta[i] for i in ids], [t.info for t in trajs])
    finally:
        loader.close()
    for a, b, i in zip(trajs, back, ids):
        assert torch.equal(a.ids, b.ids) and b.ids.dtype == torch.int64
        assert torch.equal(a.action_mask, b.action_mask)
        assert torch.equal(a.sample_logp.float(), b.sample_logp)
        assert b.reward == pytest.approx(a.reward) and b.info == dict(a.info, store_id=i)
    assert loader.bytes_read == sum(len(t.ids) * (4 + 4 + 1) for t in trajs)


def test_sampler_drift_is_zero_for_the_sampler_and_grows_with_the_distance(setup):
    tok, tasks, _, _, cfg, student = setup
    trajs = arl.sample_groups(student, lambda: arl.make_env(cfg), tasks[:3], tok, cfg, seed=1)
    batch = arl.collate(trajs, tok.pad_id)
    drift = arl.SamplerDrift(student, cfg.temperature)
    drift.start(batch)
    assert 0 <= drift.stats(1)['sampler_kl'] < 1e-9
    kl = []
    for scale in (0.01, 0.1):
        moved = copy.deepcopy(student)
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        drift = arl.SamplerDrift(moved, cfg.temperature)
        drift.start(batch)
        kl.append(drift.stats(1)['sampler_kl'])
    assert 0 < kl[0] < kl[1]


def test_the_stored_distillation_and_the_pipeline_refuse_odd_states(setup, tmp_path):
    tok, tasks, _, store, cfg, student = setup
    part = arl.StoredDistillation(store, arl.TrajectoryStore(tmp_path / 's', d=16), cfg,
                                  tok.pad_id)
    with pytest.raises(RuntimeError, match='teacher_hidden'):
        part.stats(10)
    empty = arl.TeacherStore(tmp_path / 'no-teachers')
    with pytest.raises(ValueError, match='holds no teacher'):
        arl.train_opd_pipeline(copy.deepcopy(student), empty, tasks, tok, cfg, 1,
                               tmp_path / 'x', progress=False)


def test_a_resumable_pipeline_needs_the_log_and_refuses_bad_kill_counts(setup, tmp_path):
    tok, tasks, _, store, cfg, student = setup
    with pytest.raises(ValueError, match="needs pcfg.preemption 'resume'"):
        arl.train_opd_pipeline(copy.deepcopy(student), store, tasks, tok, cfg, 2,
                               tmp_path / 'x', arl.PipelineConfig(preemption='discard'),
                               progress=False, resumable=True)
    with pytest.raises(ValueError, match='kills must be <= steps - 2'):
        arl.train_with_trainer_kills(copy.deepcopy(student), store, tasks, tok, cfg, 2,
                                     tmp_path / 'y', arl.PipelineConfig(), kills=1)


def test_a_rollout_process_that_dies_unexplained_is_finished_from_its_log(setup, tmp_path,
                                                                         monkeypatch):
    """A job whose rollout process fails (as with a lost fork-server report, exit code 255) is
    decoded to the end from its log: the weights are those of the run where nothing failed."""
    clean, *_ = _pipeline(setup, tmp_path / 'clean', steps=2)
    real, failed = arl.run_with_preemptions, []

    def fail_first(workdir, spec, *args, **kwargs):
        if not failed:
            failed.append(workdir)
            raise arl.RolloutFailed(workdir, 255)
        return real(workdir, spec, *args, **kwargs)
    monkeypatch.setattr(arl, 'run_with_preemptions', fail_first)
    survived, *_ = _pipeline(setup, tmp_path / 'failed', steps=2)
    assert len(failed) == 1
    for a, b in zip(clean.state_dict().values(), survived.state_dict().values()):
        assert torch.equal(a, b)


class _DeadProcess:
    """What launch_rollout returns when the fork server loses the child's report."""
    exitcode = 255

    def join(self):
        pass


def test_finishing_from_the_log_tries_again_after_an_unexplained_death(setup, tmp_path,
                                                                       monkeypatch):
    """A job finished from its log whose process also dies unexplained (exit code 255, as
    after a trainer kill) is launched again from the log: the weights are the clean run's;
    a job that never gets a live process fails, saying so."""
    clean, *_ = _pipeline(setup, tmp_path / 'clean', steps=2)
    real_run, real_launch = arl.run_with_preemptions, arl.launch_rollout
    failed, launches = [], []

    def fail_first(workdir, spec, *args, **kwargs):
        if not failed:
            failed.append(workdir)
            raise arl.RolloutFailed(workdir, 255)
        return real_run(workdir, spec, *args, **kwargs)

    def dead_first(folder, spec):
        if not failed or folder != failed[0]:      # run_with_preemptions' own launches
            return real_launch(folder, spec)
        launches.append(folder)
        return _DeadProcess() if len(launches) == 1 else real_launch(folder, spec)
    monkeypatch.setattr(arl, 'run_with_preemptions', fail_first)
    monkeypatch.setattr(arl, 'launch_rollout', dead_first)
    survived, *_ = _pipeline(setup, tmp_path / 'failed', steps=2)
    assert len(failed) == 1 and len(launches) == 2
    for a, b in zip(clean.state_dict().values(), survived.state_dict().values()):
        assert torch.equal(a, b)
    monkeypatch.setattr(arl, 'launch_rollout', lambda folder, spec: _DeadProcess())
    with pytest.raises(RuntimeError, match='failed 3 times'):
        arl.Rollouts._finish(tmp_path / 'failed' / 'nowhere', None)


def test_kill_process_group_spares_the_resource_tracker_which_unlinks_the_semaphores():
    """A process group holding forkserver semaphores (a Queue, as the loader's) killed by
    kill_process_group: every process dies but the resource tracker, which unlinks them."""
    import subprocess
    import sys
    code = ("import multiprocessing as mp, time\n"
            "ctx = mp.get_context('forkserver')\n"
            "q = ctx.Queue(); p = ctx.Process(target=time.sleep, args=(60,)); p.start()\n"
            "print('ready', flush=True); time.sleep(60)\n")
    before = set(Path('/dev/shm').glob('sem.mp-*'))
    proc = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == b'ready'
    assert set(Path('/dev/shm').glob('sem.mp-*')) - before          # the queue's semaphores
    assert len(arl.opd_pipeline._group_members(proc.pid)) >= 3      # parent, server, child
    arl.kill_process_group(proc.pid)
    assert proc.wait(timeout=10) == -9
    for _ in range(200):
        leaked = set(Path('/dev/shm').glob('sem.mp-*')) - before
        if not leaked and not arl.opd_pipeline._group_members(proc.pid):
            break
        time.sleep(0.05)
    assert not leaked                                   # unlinked by the tracker
    assert not arl.opd_pipeline._group_members(proc.pid)   # which then ended too


def test_distill_step_bytes_is_the_arithmetic_it_states():
    rows = arl.distill_step_bytes(vocab=1000, d_teacher=64, n_teachers=5, tokens=300,
                                  micro_tokens=2000, chunk_tokens=512, head_bytes=2,
                                  hidden_bytes=2, stored_tokens=500, top_k=8)
    assert rows['teacher heads held'] == (5 * 1000 * 64 * 2, 2 * 1000 * 64 * 2)
    assert rows['logits of a micro-batch'] == (2 * 2000 * 1000 * 4, 2 * 512 * 1000 * 4)
    assert rows['teacher data a step'] == (300 * 1000 * 4, 500 * 64 * 2)
    assert rows['top-8 logits instead'] == (300 * 8 * 6, 500 * 64 * 2)
    one = arl.distill_step_bytes(1000, 64, 1, 300, 100)
    assert one['teacher heads held'][1] == one['teacher heads held'][0]     # one teacher
    assert one['logits of a micro-batch'][0] == one['logits of a micro-batch'][1]
    with pytest.raises(ValueError, match='stored_tokens must be >= 300'):
        arl.distill_step_bytes(1000, 64, 5, 300, 100, stored_tokens=200)
    with pytest.raises(TypeError, match='tokens must be an int'):
        arl.distill_step_bytes(1000, 64, 5, 30.5, 100)


def test_linear_weights_counts_the_matrices_a_transformers_model_holds():
    """Qwen3 and DeepseekV3 at small shapes, built by transformers with random weights: the
    arithmetic equals the count of their matrices (2-D weights, and the 3-D tensors that pack
    the routed experts), the MoE router's included, the embeddings not; per_token counts the
    routed experts one token reaches."""
    transformers = pytest.importorskip('transformers')
    qwen = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8,
                                    tie_word_embeddings=False)
    deepseek = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1)
    for config in (qwen, deepseek):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        count = sum(p.numel() for n, p in model.named_parameters()
                    if p.ndim >= 2 and 'embed_tokens' not in n)
        got = arl.linear_weights(config)
        assert got['total'] == count, config.model_type
    expert = 3 * 32 * 16
    full = arl.linear_weights(deepseek)
    assert full['total'] - full['per_token'] == 2 * (6 - 2) * expert     # 2 MoE layers
    assert arl.linear_weights(qwen)['per_token'] == arl.linear_weights(qwen)['total']
    with pytest.raises(ValueError, match='Qwen3 or DeepseekV3'):
        arl.linear_weights(transformers.LlamaConfig())
