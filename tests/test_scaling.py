"""Unit tests for agentrl.scaling (chapter 14): packing, token-budget micro-batches, recomputed log-probs,
loss normalisation across data-parallel ranks, the pass-rate curriculum."""
import copy

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings, strategies as st

import agentrl as arl

V = 23


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return arl.TinyAgent(V, d_model=16, n_layers=2, n_heads=2, max_len=48).eval()


def _trajectories(lengths, seed=0):
    """Random Trajectory objects of the given lengths (ids in 1..V-1, pad id 0 never used)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = (torch.rand(n - 1, generator=gen) < 0.5).float()
        out.append(arl.Trajectory(ids=torch.randint(1, V, (n,), generator=gen), action_mask=mask,
                                  sample_logp=-torch.rand(n - 1, generator=gen) * mask, reward=0.0))
    return out


# ---------------------------------------------------------------- pack_sequences / packed_logits

@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=12), extra=st.integers(0, 20),
       seed=st.integers(0, 1000))
def test_packing_places_every_token_once(lengths, extra, seed):
    L = max(max(lengths), 2) + extra
    trajs = _trajectories(lengths, seed)
    packed = arl.pack_sequences(trajs, L, pad_id=0)
    R = len(packed['rows'])
    assert packed['ids'].shape == packed['position_ids'].shape == packed['segment_ids'].shape == (R, L)
    assert packed['action_mask'].shape == packed['sample_logp'].shape == (R, L - 1)
    assert sorted(i for row in packed['rows'] for i in row) == list(range(len(trajs)))
    real = torch.zeros(R, L, dtype=torch.bool)
    for r, members in enumerate(packed['rows']):
        assert sum(lengths[i] for i in members) <= L                         # no row overflows
        start = 0
        for k, i in enumerate(members):
            n = lengths[i]
            span = slice(start, start + n)
            assert torch.equal(packed['ids'][r, span], trajs[i].ids)
            assert torch.equal(packed['position_ids'][r, span], torch.arange(n))    # positions restart
            assert (packed['segment_ids'][r, span] == k).all()
            assert torch.equal(packed['action_mask'][r, start:start + n - 1], trajs[i].action_mask)
            assert torch.equal(packed['sample_logp'][r, start:start + n - 1], trajs[i].sample_logp)
            if start + n - 1 < L - 1:                                         # predicts the next one's first token
                assert packed['action_mask'][r, start + n - 1] == 0
            real[r, span] = True
            start += n
    assert (packed['segment_ids'][~real] == -1).all() and (packed['ids'][~real] == 0).all()
    assert int(real.sum()) == sum(lengths)                                  # every token exactly once
    assert packed['action_mask'].sum() == sum(t.action_mask.sum() for t in trajs)
    # first fit decreasing: members longest first, and each went into the first row with room,
    # so it did not fit into any earlier row (whose fill only grew afterwards)
    fill = [sum(lengths[i] for i in members) for members in packed['rows']]
    for j, members in enumerate(packed['rows']):
        assert [lengths[i] for i in members] == sorted((lengths[i] for i in members), reverse=True)
        for i in members:
            assert all(fill[r] + lengths[i] > L for r in range(j))
    assert R >= -(-sum(lengths) // L)


def _optimal_rows(lengths, L):
    """The fewest rows of L tokens that hold all lengths (exact; dynamic programme over subsets).

    best[S] = (rows, fill of the last row), minimised lexicographically, for the subset S of items
    placed in some order: the optimum of bin packing (each order of placement is an assignment).
    """
    n = len(lengths)
    best = [(1, 0)] + [None] * ((1 << n) - 1)
    for S in range(1, 1 << n):
        options = []
        for i in range(n):
            if S >> i & 1:
                rows, last = best[S ^ (1 << i)]
                fits = last + lengths[i] <= L
                options.append((rows, last + lengths[i]) if fits else (rows + 1, lengths[i]))
        best[S] = min(options)
    return best[-1][0]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=10), extra=st.integers(0, 12))
def test_packing_rows_within_the_first_fit_decreasing_bound(lengths, extra):
    # Dosa (2007): FFD(I) <= 11/9 OPT(I) + 6/9, and the bound is tight
    L = max(max(lengths), 2) + extra
    R = len(arl.pack_sequences(_trajectories(lengths), L)['rows'])
    opt = _optimal_rows(lengths, L)
    assert opt <= R and 9 * R <= 11 * opt + 6


def test_packing_first_fit_decreasing_can_miss_the_optimum():
    # rows of 12: the optimum is 5+4+3 and 5+3+3+1; FFD fills 5+5+1 and 4+3+3, then 3 is left alone
    lengths = [5, 5, 4, 3, 3, 3, 1]
    packed = arl.pack_sequences(_trajectories(lengths), 12)
    assert _optimal_rows(lengths, 12) == 2
    assert packed['rows'] == [[0, 1, 6], [2, 3, 4], [5]]


def test_packing_first_fit_decreasing_reaches_the_bound():
    trajs = _trajectories([6, 5, 4, 3, 2, 2, 1, 1])                        # 24 tokens, rows of 8: 3 rows
    packed = arl.pack_sequences(trajs, 8)
    assert len(packed['rows']) == 3 and packed['rows'][0][0] == 0           # longest first


def test_packing_rejects_a_trajectory_longer_than_a_row():
    with pytest.raises(ValueError, match='trajectory 1 has 9 tokens.*max_tokens=8'):
        arl.pack_sequences(_trajectories([3, 9]), 8)
    with pytest.raises(ValueError, match='max_tokens'):
        arl.pack_sequences(_trajectories([1]), 1)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(2, 16), min_size=2, max_size=8), seed=st.integers(0, 1000))
def test_segments_never_attend_across(model, lengths, seed):
    trajs = _trajectories(lengths, seed)
    packed = arl.pack_sequences(trajs, 32)
    with torch.no_grad():
        logits = arl.packed_logits(model, packed['ids'], packed['position_ids'], packed['segment_ids'])
        for r, members in enumerate(packed['rows']):
            start = 0
            for i in members:
                n = lengths[i]
                alone = model(trajs[i].ids[None])[0]                         # [n, V]
                assert torch.allclose(logits[r, start:start + n], alone, atol=1e-5)
                start += n


def test_packed_logits_checks_shapes(model):
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match='same shape'):
        arl.packed_logits(model, ids, torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))


# ---------------------------------------------------------------- token_budget_batches

@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 100), max_size=40), slack=st.integers(0, 300))
def test_token_budget_never_exceeded(lengths, slack):
    budget = max(lengths + [1]) + slack
    batches = arl.token_budget_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))   # every sequence once
    assert all(b for b in batches)
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= budget                      # padded size within budget
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)


def test_token_budget_accepts_a_tensor_and_packs_greedily():
    assert arl.token_budget_batches(torch.tensor([4, 4, 4, 4, 2]), 8) == [[0, 1], [2, 3], [4]]


def test_token_budget_rejects_an_over_long_sequence():
    with pytest.raises(ValueError, match='sequence 1 has 20 tokens.*max_tokens=10'):
        arl.token_budget_batches([5, 20, 3], 10)
    with pytest.raises(ValueError, match='max_tokens'):
        arl.token_budget_batches([1], 0)


def test_token_budget_rejects_a_negative_length():
    with pytest.raises(ValueError, match=r'lengths must be >= 0, got lengths\[1\] = -1'):
        arl.token_budget_batches([5, -1], 10)


# ---------------------------------------------------------------- checkpointed_log_probs

@pytest.mark.parametrize('chunk_size', [1, 3, 4, 10, 64])
def test_checkpointed_log_probs_matches_naive_values_and_gradients(chunk_size):
    gen = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(2, 10, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    ids = torch.randint(30, (2, 10), generator=gen)
    upstream = torch.randn(2, 10, generator=gen, dtype=torch.float64)
    results = []
    for fn in (lambda h, w: arl.selected_log_probs(h @ w.T, ids),
               lambda h, w: arl.checkpointed_log_probs(h, w, ids, chunk_size=chunk_size)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = fn(h, w)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), h.grad, w.grad))
    for naive, checkpointed in zip(*results):
        assert torch.allclose(naive, checkpointed, atol=1e-12)


def test_checkpointed_log_probs_rejects_a_bad_chunk():
    with pytest.raises(ValueError, match='chunk_size'):
        arl.checkpointed_log_probs(torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.zeros(1, 2, dtype=torch.long), 0)


def test_checkpointed_log_probs_peak_memory_is_flat_in_T():
    """Chapter 3's CPU meter over forward + backward: recomputation keeps the logits-sized part of
    the peak at a few chunks whatever T is, where chunking alone keeps every chunk's logits."""
    Vbig, D, C = 4096, 8, 16
    chunk_logits = C * Vbig * 4                                    # one chunk of float32 logits
    weight = torch.randn(Vbig, D, generator=torch.Generator().manual_seed(0)).requires_grad_()
    peaks = {}
    for T in (64, 256, 1024):
        gen = torch.Generator().manual_seed(T)
        hidden = torch.randn(1, T, D, generator=gen).requires_grad_()
        ids = torch.randint(Vbig, (1, T), generator=gen)
        for name, fn in (('recompute', arl.checkpointed_log_probs), ('chunked', arl.chunked_log_probs)):
            def forward_backward():
                hidden.grad = weight.grad = None
                fn(hidden, weight, ids, chunk_size=C).sum().backward()
            peaks[name, T] = arl.measure_peak_memory(forward_backward)[0]
    for T in (256, 1024):
        # tensors of one row per token (hidden's gradient [T, D], the log-probs [T] and their
        # gradient) may grow with T; the logits must not: allow a tenth of one chunk's logits
        per_token = (T - 64) * 4 * (D + 2)
        assert peaks['recompute', T] - peaks['recompute', 64] <= per_token + chunk_logits / 10
        # the meter does see logits that pile up: chunking alone keeps all T / C chunks
        assert peaks['chunked', T] - peaks['chunked', 64] >= 0.9 * (T - 64) / C * chunk_logits
    assert peaks['recompute', 64] <= 6 * chunk_logits + weight.numel() * 4


# ---------------------------------------------------------------- filter_by_pass_rate

@settings(max_examples=100, deadline=None)
@given(rates=st.lists(st.floats(0, 1), max_size=30), low=st.floats(-0.5, 1), width=st.floats(0, 1.5))
def test_filter_keeps_exactly_the_open_interval(rates, low, width):
    high = low + width
    tasks = list(range(len(rates)))
    kept = arl.filter_by_pass_rate(tasks, rates, low, high)
    assert kept == [i for i in tasks if low < rates[i] < high]               # order kept, bounds excluded


def test_filter_default_drops_solved_and_hopeless_tasks():
    assert arl.filter_by_pass_rate(['a', 'b', 'c', 'd'], [0.0, 0.5, 1.0, 0.125]) == ['b', 'd']
    with pytest.raises(ValueError, match='3 tasks but 2 pass rates'):
        arl.filter_by_pass_rate(['a', 'b', 'c'], [0.5, 0.5])


# ---------------------------------------------------------------- train_curriculum

def test_curriculum_drops_tasks_it_never_solves():
    tasks = arl.make_tasks('train')[:6]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=64)   # random: never correct
    cfg = arl.RLConfig(group_size=2, tasks_per_step=4, max_tokens=24, max_turns=1)
    history = arl.train_curriculum(model, tasks, tok, cfg, steps=3, revisit=0)
    assert [h['pool'] for h in history] == [6, 2, 0]                         # all-wrong tasks leave the pool
    assert [h['sampled'] for h in history] == [8, 4, 0]                      # nothing left to sample: no crash
    assert all(h['zero_adv_frac'] == 1.0 for h in history[:2])
    # cfg.lr_schedule is followed, as in train_rl: linear decay to 0 over the run
    assert [h['lr'] for h in history] == pytest.approx([cfg.lr * (1 - s / 3) for s in range(3)])
    again = arl.train_curriculum(model, tasks, tok, cfg, steps=3, low=-1.0, high=2.0)
    assert [h['pool'] for h in again] == [6, 6, 6] and all(h['sampled'] == 8 for h in again)


def _mixed_rewards(monkeypatch):
    """Replace sample_step's rewards by the parity of each episode's token sum, so that a random
    model gets groups with mixed rewards, kept episodes and real updates."""
    real = arl.sample_step

    def sample_step(model, env_fn, tasks, tok, cfg, generator):
        _, sampled = real(model, env_fn, tasks, tok, cfg, generator)
        for t in sampled:
            t.reward = float(int(t.ids.sum()) % 2)
        G = cfg.group_size
        kept = [t for g in range(0, len(sampled), G)
                if len({u.reward for u in sampled[g:g + G]}) > 1 for t in sampled[g:g + G]]
        return kept, sampled
    monkeypatch.setattr(arl, 'sample_step', sample_step)


def test_curriculum_heldout_cadence_and_episode_counts(monkeypatch):
    _mixed_rewards(monkeypatch)
    tasks, eval_tasks = arl.make_tasks('train')[:6], arl.make_tasks('heldout')[:3]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    # constant lr: the first k steps of a run are then a k-step run; a large one, so
    # that every step visibly changes what the model samples
    cfg = arl.RLConfig(group_size=2, tasks_per_step=4, max_tokens=24, max_turns=1,
                       lr=0.05, lr_schedule='constant')
    torch.manual_seed(0)
    init = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=64)
    model = copy.deepcopy(init)
    history = arl.train_curriculum(model, tasks, tok, cfg, 5, eval_tasks=eval_tasks,
                                   eval_every=2, eval_n=2, progress=False)
    # every eval_every steps, before the step trains, and once after the last step
    assert [h['step'] for h in history if 'heldout' in h] == [0, 2, 4, 5]
    assert len(history) == 6 and set(history[-1]) == {'step', 'episodes', 'heldout'}
    total = 0
    for h in history[:-1]:
        assert h['episodes'] == total                      # episodes sampled before this step
        total += h['sampled']
    assert history[-1]['episodes'] == total > 0
    assert sum(h['kept'] for h in history[:-1]) > 0 and all('loss' in h for h in history[:-1]
                                                             if h['kept'])
    assert all(h['heldout']['n_episodes'] == 3 * 2 for h in history if 'heldout' in h)

    # evaluating changes nothing about training: same records, same weights
    plain = copy.deepcopy(init)
    without = arl.train_curriculum(plain, tasks, tok, cfg, 5, progress=False)
    assert [{k: v for k, v in h.items() if k != 'heldout'} for h in history[:-1]] == without
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 plain.state_dict().values()))
    # each record evaluates the model as it was after `step` steps, with the step's seed
    for step in (0, 2, 5):
        m = copy.deepcopy(init)
        if step:
            arl.train_curriculum(m, tasks, tok, cfg, step, progress=False)
        ev = arl.evaluate(m, eval_tasks, tok, 2, generator=torch.Generator().manual_seed(step),
                          cfg=cfg)
        record = next(h['heldout'] for h in history if h['step'] == step and 'heldout' in h)
        assert record['mean_length'] == ev['mean_length'] and record['correct'] == ev['correct']
    lengths = [h['heldout']['mean_length'] for h in history if 'heldout' in h]
    assert len(set(lengths)) > 1                           # the model did change in between


def test_curriculum_rejects_bad_arguments():
    tasks = arl.make_tasks('train')[:2]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    model = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=64)
    cfg = arl.RLConfig(group_size=2, tasks_per_step=2, max_tokens=24, max_turns=1)
    for kwargs, name in ((dict(steps=0), 'steps'), (dict(steps=2, eval_every=-1), 'eval_every'),
                         (dict(steps=2, revisit=-1), 'revisit')):
        with pytest.raises(ValueError, match=name):
            arl.train_curriculum(model, tasks, tok, cfg, progress=False, **kwargs)


# ---------------------------------------------------------------- data_parallel_worker

def _flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_data_parallel_worker_two_ranks_global_normalisation_is_the_full_batch(tmp_path):
    """Two gloo processes with unequal shards: dividing by the all-reduced token count reproduces
    the single-process full-batch token mean; dividing by each rank's own count does not (it gives
    the mean over ranks of per-rank token means)."""
    torch.manual_seed(0)
    model = arl.TinyAgent(V, d_model=16, n_layers=1, n_heads=2, max_len=32)
    trajs = _trajectories([4, 5, 12, 14, 10, 16])
    batch = arl.collate(trajs, 0)
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75, 0.5, -1.0])
    shards = [[[0], [1]], [[2, 3], [4, 5]]]                 # rank 0: two short rows, rank 1: four long
    mask = batch['action_mask']
    rank_tokens = [float(sum(mask[rows].sum() for rows in shard)) for shard in shards]
    assert rank_tokens[1] > 3 * rank_tokens[0]                  # unequal: the normalisations differ
    job = str(tmp_path / 'job.pt')
    torch.save(dict(model=model, ids=batch['ids'], action_mask=mask, advantages=adv, shards=shards),
               job)
    mp.spawn(arl.data_parallel_worker, args=(2, job, str(tmp_path / 'rendezvous')), nprocs=2)
    grads = {normalize: torch.load(f'{job}.{normalize}') for normalize in ('local', 'global')}

    model.zero_grad()
    logp = arl.sequence_log_probs(model, batch['ids'])
    arl.reinforce_loss(logp, adv, mask, mode='token_mean').backward()
    full = _flat_grad(model)
    # what local normalisation computes: DDP's mean over ranks of each rank's own token mean
    model.zero_grad()
    for shard in shards:
        rows = torch.tensor([i for micro in shard for i in micro])
        logp = arl.sequence_log_probs(model, batch['ids'][rows])
        (arl.reinforce_loss(logp, adv[rows], mask[rows], mode='token_mean') / len(shards)).backward()
    per_rank_mean = _flat_grad(model)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    assert rel(grads['global'], full) < 1e-5
    assert rel(grads['local'], per_rank_mean) < 1e-5
    assert rel(grads['local'], full) > 0.05


def test_curriculum_sampler_state_survives_a_checkpoint():
    tasks = arl.make_tasks('train')[:6]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=64)   # never correct
    cfg = arl.RLConfig(group_size=2, tasks_per_step=4, max_tokens=24, max_turns=1)
    first = arl.curriculum_sampler(tok, cfg, revisit=0)
    gen = torch.Generator().manual_seed(0)
    assert first(model, tasks, 0, gen)[2]['pool'] == 6
    fresh, restored = (arl.curriculum_sampler(tok, cfg, revisit=0) for _ in range(2))
    restored.load_state_dict(first.state_dict())
    pools = [s(model, tasks, 1, torch.Generator().manual_seed(1))[2]['pool']
             for s in (first, fresh, restored)]
    assert pools == [2, 6, 2]               # without its state a resumed run would differ
