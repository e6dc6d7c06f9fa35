"""Unit tests for chapter 17 (agentrl/teacher_store.py, fused_kl.py, teacher_scheduling.py): the
teacher store, the sharded head load, the hidden-state buffer, the fused linear + divergence
kernel, teacher ordering, the one-resident head scheduler and the scheduled distillation step
(against chapter 15's plain one)."""
import copy
import shutil
import threading
import time
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import agentrl as arl

V, D = 11, 16                      # vocabulary and width of the small models


def _agent(seed, d_model=D, dtype=torch.float32, vocab=V):
    torch.manual_seed(seed)
    return arl.TinyAgent(vocab, d_model=d_model, n_layers=1, n_heads=2, max_len=32).to(dtype).eval()


def _ids(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- TeacherStore

def test_store_round_trip_head_rows_and_bytes_read(tmp_path):
    model = _agent(0)
    store = arl.TeacherStore(tmp_path)
    store.save('t', model)
    assert store.bytes_read == 0                                 # saving reads nothing
    assert store.head_shape('t') == (V, D)
    assert store.head_nbytes('t') == V * D * 4
    head = store.load_head('t')
    assert head.dtype == torch.float32 and torch.equal(head, model.head.weight)
    assert store.bytes_read == V * D * 4
    for rows in ((2, 5), (0, V), (V - 1, V), (4, 4)):
        before = store.bytes_read
        part = store.load_head('t', rows=rows)
        assert part.shape == (rows[1] - rows[0], D)
        assert torch.equal(part, model.head.weight[rows[0]:rows[1]])
        assert store.bytes_read - before == (rows[1] - rows[0]) * D * 4
    before = store.bytes_read
    as64 = store.load_head('t', dtype=torch.float64)
    assert as64.dtype == torch.float64 and torch.equal(as64, model.head.weight.double())
    assert store.bytes_read - before == V * D * 4                 # the stored bytes count


def test_store_bfloat16_head_halves_the_bytes_and_converts_on_load(tmp_path):
    model = _agent(1)
    store = arl.TeacherStore(tmp_path)
    store.save('full', model)
    store.save('half', model, head_dtype=torch.bfloat16)
    assert store.head_nbytes('half') * 2 == store.head_nbytes('full')
    assert store.head_shape('half') == store.head_shape('full') == (V, D)
    rounded = model.head.weight.detach().to(torch.bfloat16)
    half = store.load_head('half')
    assert half.dtype == torch.bfloat16 and torch.equal(half, rounded)
    before = store.bytes_read
    widened = store.load_head('half', rows=(3, 8), dtype=torch.float32)
    assert widened.dtype == torch.float32 and torch.equal(widened, rounded[3:8].float())
    assert store.bytes_read - before == 5 * D * 2
    # the trunk is stored in the model's own dtype whatever the head's
    ids = _ids(2, 6)
    assert torch.equal(store.load_trunk('half')(ids), model.hidden(ids))


def test_load_trunk_is_the_model_without_its_head(tmp_path):
    model = _agent(2)
    store = arl.TeacherStore(tmp_path)
    store.save('t', model)
    before = store.bytes_read
    trunk = store.load_trunk('t')
    trunk_bytes = sum(v.nbytes for k, v in model.state_dict().items() if k != 'head.weight')
    assert store.bytes_read - before == trunk_bytes
    assert isinstance(trunk.head, torch.nn.Identity) and not trunk.training
    ids = _ids(3, 9, seed=1)
    hidden = trunk(ids)
    assert hidden.shape == (3, 9, D)
    with torch.no_grad():
        assert torch.equal(hidden, model.hidden(ids))
        assert torch.equal(model.hidden(ids), model(ids, return_hidden=True)[1])
        assert torch.equal(hidden @ store.load_head('t').T, model(ids))


def test_load_trunk_keeps_float64(tmp_path):
    model = _agent(3, dtype=torch.float64)
    store = arl.TeacherStore(tmp_path)
    store.save('t', model)
    trunk = store.load_trunk('t')
    assert all(p.dtype == torch.float64 for p in trunk.parameters())
    assert store.load_head('t').dtype == torch.float64
    ids = _ids(2, 7, seed=2)
    with torch.no_grad():
        assert torch.equal(trunk(ids), model.hidden(ids))
        assert torch.equal(trunk(ids) @ store.load_head('t').T, model(ids))


def test_store_names_are_sorted_and_only_teachers_with_a_head(tmp_path):
    store = arl.TeacherStore(tmp_path)
    assert store.names() == []
    for name in ('sum', 'calc', 'max'):
        store.save(name, _agent(0))
    (tmp_path / 'not_a_teacher').mkdir()
    assert store.names() == ['calc', 'max', 'sum']
    assert arl.TeacherStore(tmp_path).names() == ['calc', 'max', 'sum']   # read from disk


def test_store_rejects_bad_input(tmp_path):
    store = arl.TeacherStore(tmp_path)
    store.save('t', _agent(0))
    with pytest.raises(FileNotFoundError, match='head.safetensors'):
        store.load_head('missing')
    with pytest.raises(FileNotFoundError, match='trunk.safetensors'):
        store.load_trunk('missing')
    with pytest.raises(FileNotFoundError, match='missing'):
        store.head_shape('missing')
    for bad in ('a/b', '', '.x', None):
        with pytest.raises(ValueError, match='name'):
            store.load_head(bad)
        with pytest.raises(ValueError, match='name'):
            store.save(bad, _agent(0))
    for rows in ((-1, 2), (0, V + 1), (5, 3)):
        with pytest.raises(ValueError, match='rows'):
            store.load_head('t', rows=rows)
    with pytest.raises(TypeError, match='TinyAgent'):
        store.save('lin', torch.nn.Linear(D, V))
    with pytest.raises(ValueError, match='weight'):
        store.save_head('w', torch.zeros(V))
    assert store.names() == ['t']                          # the failed saves left nothing behind


def test_store_mxfp4_decodes_to_chapter_16s_rounded_weights(tmp_path):
    """fmt='mxfp4': every linear weight kept as codes and scales (4.25 bits), read back as
    chapter 18's round_weights (chapter 16's quantize_model) rounds them, bit for bit; the
    head's rows read only their codes and scales."""
    model, d = _agent(0, d_model=32), 32
    store = arl.TeacherStore(tmp_path)
    store.save('fp32', model)
    store.save('mx', model, fmt='mxfp4')
    rounded = arl.round_weights(model, 'mxfp4').state_dict()
    trunk = store.load_trunk('mx').state_dict()
    assert set(trunk) == set(rounded) - {'head.weight'}
    assert all(torch.equal(trunk[k], rounded[k]) for k in trunk)
    assert torch.equal(store.load_head('mx'), rounded['head.weight'])
    assert store.head_shape('mx') == store.head_shape('fp32') == (V, d)
    assert 8 * store.head_nbytes('mx') == 4.25 * V * d
    store.bytes_read = 0
    rows = store.load_head('mx', rows=(2, 7), dtype=torch.bfloat16)
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, rounded['head.weight'][2:7].bfloat16())
    assert store.bytes_read == 5 * (d // 2 + d // 32)      # codes and scales of 5 rows
    with torch.no_grad():
        ids = _ids(2, 9)
        assert torch.equal(store.load_trunk('mx')(ids),
                           arl.round_weights(model, 'mxfp4').hidden(ids))
    sizes = {n: (tmp_path / n / store.TRUNK).stat().st_size for n in ('fp32', 'mx')}
    assert sizes['mx'] < sizes['fp32'] / 2
    with safe_open(tmp_path / 'mx' / store.TRUNK, 'pt') as f:
        codes = [k for k in f.keys() if k.endswith(store.CODES)]
    assert len(codes) == 4                    # qkv, proj and the two MLP matrices


def test_store_rejects_unknown_formats_and_a_dtype_with_a_format(tmp_path):
    store = arl.TeacherStore(tmp_path)
    with pytest.raises(ValueError, match='fmt must be one of'):
        store.save('t', _agent(0, d_model=32), fmt='nvfp4')
    with pytest.raises(ValueError, match='has no dtype'):
        store.save('t', _agent(0, d_model=32), head_dtype=torch.bfloat16, fmt='mxfp4')
    with pytest.raises(ValueError, match='fmt must be one of'):
        store.save_head('t', torch.zeros(3, 32), fmt='mxfp8')


@pytest.mark.parametrize('part', ['head', 'trunk'])
def test_sharded_loads_of_an_mxfp4_teacher_equal_the_full_load(tmp_path, part):
    store = arl.TeacherStore(tmp_path / 'store')
    store.save('t', _agent(0, d_model=32), fmt='mxfp4')
    out = tmp_path / 'result'
    mp.spawn(arl.sharded_load_worker,
             args=(2, str(tmp_path / 'rendezvous'), str(tmp_path / 'store'), 't', str(out),
                   part),
             nprocs=2)
    results = [torch.load(f'{out}.{rank}') for rank in range(2)]
    assert all(r['equal'] is True for r in results)
    if part == 'head':                    # 11 rows: 6 and 5, codes and scales only
        assert [r['bytes_read'] for r in results] == [6 * 17, 5 * 17]


# ---------------------------------------------------------------- load_head_sharded (2 gloo ranks)

@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_sharded_load_equals_the_full_load_on_both_ranks(tmp_path, dtype):
    torch.manual_seed(0)
    rows = 13                                         # odd: rank 0 reads 7 rows, rank 1 six
    store = arl.TeacherStore(tmp_path / 'store')
    store.save_head('t', torch.randn(rows, D), dtype)
    out = tmp_path / 'result'
    mp.spawn(arl.sharded_load_worker,
             args=(2, str(tmp_path / 'rendezvous'), str(tmp_path / 'store'), 't', str(out)),
             nprocs=2)
    results = [torch.load(f'{out}.{rank}') for rank in range(2)]
    assert all(r['equal'] is True for r in results)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    assert [r['bytes_read'] for r in results] == [7 * D * itemsize, 6 * D * itemsize]
    assert sum(r['bytes_read'] for r in results) == store.head_nbytes('t')


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float64])
def test_sharded_trunk_load_equals_the_full_load_on_both_ranks(tmp_path, dtype):
    store = arl.TeacherStore(tmp_path / 'store')
    store.save('t', _agent(0).to(dtype))
    out = tmp_path / 'result'
    mp.spawn(arl.sharded_load_worker,
             args=(2, str(tmp_path / 'rendezvous'), str(tmp_path / 'store'), 't', str(out),
                   'trunk'),
             nprocs=2)
    results = [torch.load(f'{out}.{rank}') for rank in range(2)]
    assert all(r['equal'] is True for r in results)          # values, dtypes, names
    with safe_open(store.root / 't' / store.TRUNK, 'pt') as f:
        total = sum(f.get_tensor(k).nbytes for k in f.keys())
        largest = max(f.get_tensor(k).nbytes for k in f.keys())
    read = [r['bytes_read'] for r in results]
    assert sum(read) == total                                  # each tensor read once
    assert abs(read[0] - read[1]) <= largest                   # dealt evenly by size


def test_deal_by_size_balances_and_is_deterministic():
    sizes = {'a': 10, 'b': 6, 'c': 5, 'd': 1, 'e': 0}
    owner = arl.deal_by_size(sizes, 2)
    assert owner == arl.deal_by_size(dict(reversed(sizes.items())), 2)
    load = [sum(sizes[k] for k in sizes if owner[k] == r) for r in range(2)]
    assert sorted(load) == [11, 11]
    assert set(arl.deal_by_size(sizes, 1).values()) == {0}


def test_load_trunk_sharded_needs_a_process_group(tmp_path):
    store = arl.TeacherStore(tmp_path)
    store.save('t', _agent(0))
    with pytest.raises(RuntimeError, match='process group'):
        arl.load_trunk_sharded(store, 't')


# ---------------------------------------------------------------- teacher_order / inverse

@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 5), min_size=1, max_size=30))
def test_teacher_order_is_a_stable_sorting_permutation(ids):
    order = arl.teacher_order(ids)
    n = len(ids)
    assert order.dtype == torch.long and sorted(order.tolist()) == list(range(n))
    sorted_ids = torch.tensor(ids)[order].tolist()
    assert sorted_ids == sorted(ids)
    for a, b in zip(range(n - 1), range(1, n)):        # ties keep their order
        if sorted_ids[a] == sorted_ids[b]:
            assert order[a] < order[b]
    assert torch.equal(arl.teacher_order(torch.tensor(ids)), order)
    inverse = arl.inverse_permutation(order)
    assert torch.equal(inverse[order], torch.arange(n))
    x = torch.randn(n, 3)
    assert torch.equal(x[order][inverse], x)


def test_teacher_order_and_inverse_reject_bad_input():
    with pytest.raises(ValueError, match='>= 0'):
        arl.teacher_order([0, -1, 2])
    with pytest.raises(ValueError, match='teacher_ids'):
        arl.teacher_order(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match='teacher_ids'):
        arl.teacher_order(torch.tensor([True, False]))
    with pytest.raises(ValueError, match='teacher_ids'):
        arl.teacher_order([[0, 1], [1, 0]])
    for bad in ([0, 0, 1], [1, 2, 3], [0, 2], [[0, 1], [1, 0]]):
        with pytest.raises(ValueError, match='permutation'):
            arl.inverse_permutation(bad)


def test_inverse_permutation_rejects_non_integer_orders():
    for bad in (torch.tensor([1.0, 0.0]), torch.tensor([True, False])):
        with pytest.raises((ValueError, TypeError), match='order'):
            arl.inverse_permutation(bad)


def test_teacher_order_of_an_empty_list_is_empty():
    order = arl.teacher_order([])
    assert order.dtype == torch.long and order.shape == (0,)
    assert arl.inverse_permutation([]).shape == (0,)


# ---------------------------------------------------------------- HeadScheduler

@pytest.fixture(scope='module')
def heads(tmp_path_factory):
    """A store with three distinct heads a, b, c [V, D] (float32)."""
    root = tmp_path_factory.mktemp('heads')
    store = arl.TeacherStore(root)
    gen = torch.Generator().manual_seed(0)
    for name in ('a', 'b', 'c'):
        store.save_head(name, torch.randn(V, D, generator=gen))
    return root


@pytest.mark.parametrize('prefetch', [False, True])
@pytest.mark.parametrize('names', [['a', 'b', 'c'], ['a', 'b', 'a'], ['c']])
def test_scheduler_one_resident_head_in_order(heads, prefetch, names):
    store = arl.TeacherStore(heads)
    sched = arl.HeadScheduler(store, names, prefetch=prefetch)
    seen = []
    for lease in sched:                   # uses lease.weight only: each head is freed in turn
        seen.append((lease.name, lease.weight.clone()))
    assert [n for n, _ in seen] == names
    for name, weight in seen:
        assert torch.equal(weight, store.load_head(name))
    assert sched.loads == len(names) and sched.max_resident == 1
    nbytes = sum(store.head_nbytes(n) for n in names)
    assert sched.bytes_read == nbytes and store.bytes_read == 2 * nbytes   # + our check reads
    assert [t[0] for t in sched.timeline] == names
    assert all(start <= stop for _, start, stop in sched.timeline)
    # the counters add up the timeline: one read after another, each counted once
    reads = [stop - start for _, start, stop in sched.timeline]
    assert sched.load_seconds == pytest.approx(sum(reads), rel=1e-9, abs=1e-12)
    assert all(a[2] <= b[1] for a, b in zip(sched.timeline, sched.timeline[1:]))
    assert len(sched.waits) == len(names)
    assert sched.wait_seconds == pytest.approx(sum(sched.waits), rel=1e-9, abs=1e-12)
    if not prefetch:                      # the caller waits for every read itself
        assert all(w >= r for w, r in zip(sched.waits, reads))
    if prefetch:
        sched._thread.join(timeout=10)
        assert not sched._thread.is_alive()


@pytest.mark.parametrize('prefetch', [False, True])
def test_scheduler_counts_heads_the_caller_keeps(heads, prefetch):
    store = arl.TeacherStore(heads)
    names = ['a', 'b', 'c', 'a']
    sched = arl.HeadScheduler(store, names, prefetch=prefetch)
    kept = [lease.weight for lease in sched]                 # every head stays alive
    assert sched.max_resident == len(names) == len(kept)
    # keeping only the first head: it and each newly arrived one are alive together
    sched = arl.HeadScheduler(store, names, prefetch=prefetch)
    first = None
    for lease in sched:
        if first is None:
            first = lease.weight
        else:
            lease.weight.sum()
    assert sched.max_resident == 2 and sched.loads == len(names)


@pytest.mark.parametrize('prefetch', [False, True])
def test_lease_is_invalid_after_the_scheduler_moves_on(heads, prefetch):
    sched = arl.HeadScheduler(arl.TeacherStore(heads), ['a', 'b'], prefetch=prefetch)
    leases = []
    for lease in sched:
        lease.weight                                        # valid while current
        if leases:
            with pytest.raises(RuntimeError, match="'a'"):
                leases[-1].weight
        leases.append(lease)
    with pytest.raises(RuntimeError, match='released'):    # the last one after the loop
        leases[-1].weight


def test_scheduler_dtype_converts_the_heads(heads):
    store = arl.TeacherStore(heads)
    for prefetch in (False, True):
        sched = arl.HeadScheduler(store, ['b'], prefetch=prefetch, dtype=torch.float64)
        (weight,) = [lease.weight.clone() for lease in sched]
        assert weight.dtype == torch.float64
        assert torch.equal(weight, store.load_head('b').double())
        assert sched.bytes_read == store.head_nbytes('b')


@pytest.mark.parametrize('prefetch', [False, True])
def test_scheduler_reraises_a_loader_error_in_the_callers_thread(heads, tmp_path, prefetch):
    root = tmp_path / 'store'
    shutil.copytree(heads, root)
    store = arl.TeacherStore(root)
    sched = arl.HeadScheduler(store, ['a', 'b', 'c'], prefetch=prefetch).start()
    (root / 'b' / 'head.safetensors').unlink()          # after construction (and start)
    seen = []
    with pytest.raises(FileNotFoundError, match="'b'"):
        for lease in sched:
            seen.append(lease.name)
    assert seen == ['a'] and sched.loads == 1
    if prefetch:
        sched._thread.join(timeout=10)
        assert not sched._thread.is_alive()


def test_scheduler_breaking_out_early_stops_the_loader(heads):
    sched = arl.HeadScheduler(arl.TeacherStore(heads), ['a', 'b', 'c', 'a', 'b'], prefetch=True)
    for lease in sched:
        break
    sched._thread.join(timeout=10)
    assert not sched._thread.is_alive()                 # the loader thread did not hang
    with pytest.raises(RuntimeError, match='released'):
        lease.weight
    assert sched.loads == 1 and len(sched.timeline) <= 2    # at most one head was staged


def test_scheduler_rejects_unknown_teachers(heads):
    with pytest.raises(ValueError, match='zz'):
        arl.HeadScheduler(arl.TeacherStore(heads), ['a', 'zz'])


# ---------------------------------------------------------------- fused_linear_kl

def _randn(*shape, seed, dtype=torch.float64, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


def _reference(h, w, hs, wt, beta, temperature=1.0):
    return arl.generalized_jsd(h @ w.T, (hs @ wt.T) / temperature, beta)


def _values_and_grads(fn, h, w, r):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, w)
    grad_h, grad_w = torch.autograd.grad((out * r).sum(), (h, w))
    return out.detach(), grad_h, grad_w


betas = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1, exclude_min=True, exclude_max=True)


@settings(max_examples=80, deadline=None)
@given(N=st.integers(1, 20), vocab=st.integers(1, 40), d=st.integers(1, 8), d_t=st.integers(1, 8),
       chunk=st.integers(1, 25), vocab_chunk=st.none() | st.integers(1, 45), beta=betas,
       temperature=st.sampled_from([1.0, 0.7]), seed=st.integers(0, 10_000))
def test_fused_linear_kl_matches_generalized_jsd_of_the_logits(N, vocab, d, d_t, chunk,
                                                               vocab_chunk, beta, temperature,
                                                               seed):
    h, w = _randn(N, d, seed=seed), _randn(vocab, d, seed=seed + 1)
    hs, wt = _randn(N, d_t, seed=seed + 2), _randn(vocab, d_t, seed=seed + 3)
    r = _randn(N, seed=seed + 4)
    got = _values_and_grads(
        lambda h, w: arl.fused_linear_kl(h, w, hs, wt, chunk_size=chunk, beta=beta,
                                         vocab_chunk_size=vocab_chunk,
                                         teacher_temperature=temperature), h, w, r)
    ref = _values_and_grads(lambda h, w: _reference(h, w, hs, wt, beta, temperature), h, w, r)
    assert got[0].shape == (N,) and got[0].dtype == torch.float64
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-10, rtol=0), (a - b).abs().max()


def test_fused_linear_kl_keeps_leading_dimensions():
    h, w, hs, wt = _randn(2, 3, 5, seed=0), _randn(9, 5, seed=1), _randn(2, 3, 4, seed=2), \
        _randn(9, 4, seed=3)
    r = _randn(2, 3, seed=4)
    got = _values_and_grads(lambda h, w: arl.fused_linear_kl(h, w, hs, wt, chunk_size=4,
                                                             beta=0.5, vocab_chunk_size=4),
                            h, w, r)
    ref = _values_and_grads(lambda h, w: _reference(h, w, hs, wt, 0.5), h, w, r)
    assert got[0].shape == (2, 3) and got[1].shape == (2, 3, 5) and got[2].shape == (9, 5)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize('beta', [0.0, 0.3, 1.0])
def test_fused_linear_kl_gradcheck(beta):
    h, w = _randn(3, 4, seed=0).requires_grad_(), _randn(5, 4, seed=1).requires_grad_()
    hs, wt = _randn(3, 2, seed=2), _randn(5, 2, seed=3)
    assert torch.autograd.gradcheck(
        lambda h, w: arl.fused_linear_kl(h, w, hs, wt, chunk_size=2, beta=beta,
                                         vocab_chunk_size=2, teacher_temperature=0.7),
        (h, w))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('beta', [0.0, 0.5, 1.0])
def test_fused_linear_kl_low_precision_inputs_reduce_in_float32(dtype, beta):
    N, vocab, d, d_t = 12, 30, 8, 6
    h, w = _randn(N, d, seed=0, dtype=dtype), _randn(vocab, d, seed=1, dtype=dtype)
    hs, wt = _randn(N, d_t, seed=2, dtype=dtype), _randn(vocab, d_t, seed=3, dtype=dtype)
    r = _randn(N, seed=4)
    got = _values_and_grads(lambda h, w: arl.fused_linear_kl(h, w, hs, wt, chunk_size=5,
                                                             beta=beta, vocab_chunk_size=7),
                            h, w, r.to(dtype))
    # the float64 reference on the same (rounded) inputs
    h64, w64, hs64, wt64 = (x.double() for x in (h, w, hs, wt))
    ref = _values_and_grads(lambda h, w: _reference(h, w, hs64, wt64, beta), h64, w64, r)
    assert got[0].dtype == torch.float32
    assert got[1].dtype == got[2].dtype == dtype
    # reduced in float32: equal, to float32 rounding, to generalized_jsd of the logits computed
    # in the inputs' precision (generalized_jsd reduces half precision in float32); a bfloat16
    # reduction would be off by ~eps_bf16 * value, hundreds of times more
    same = arl.generalized_jsd(h @ w.T, hs @ wt.T, beta)
    f32 = 4 * torch.finfo(torch.float32).eps * vocab * same.abs().max().item()
    assert (got[0] - same).abs().max() < f32
    # and close to the float64 reference: each logit is off by at most ~eps |logit|, and the
    # divergence and its gradients move by a few times that, plus float32 rounding of the sums
    # (over the vocabulary and the tokens) that make the gradients
    eps = torch.finfo(dtype).eps
    logit = max((h64 @ w64.T).abs().max().item(), (hs64 @ wt64.T).abs().max().item())
    tol = 4 * eps * logit
    assert (got[0].double() - ref[0]).abs().max() < tol + f32
    sums = 4 * torch.finfo(torch.float32).eps * (vocab + N)
    for a, b in zip(got[1:], ref[1:]):
        assert (a.double() - b).abs().max() < (tol + sums) * b.abs().max()


@pytest.mark.parametrize('beta', [0.0, 0.5, 1.0])
def test_fused_linear_kl_is_stable_for_extreme_logits(beta):
    N, vocab, d = 6, 17, 4
    h, w = _randn(N, d, seed=0, scale=1e3 / 2), _randn(vocab, d, seed=1)  # logits ~ 1e3
    hs, wt = _randn(N, d, seed=2, scale=1e3 / 2), _randn(vocab, d, seed=3)
    assert (h @ w.T).abs().max() > 1e3
    r = _randn(N, seed=4)
    fused = lambda h, w: arl.fused_linear_kl(h, w, hs, wt, chunk_size=4, beta=beta,
                                             vocab_chunk_size=5)
    got = _values_and_grads(fused, h, w, r)
    ref = _values_and_grads(lambda h, w: _reference(h, w, hs, wt, beta), h, w, r)
    for a, b in zip(got, ref):
        assert a.isfinite().all()
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)
    # float32: finite too, and equal to generalized_jsd of the float32 logits up to rounding
    got32 = _values_and_grads(lambda h, w: arl.fused_linear_kl(
        h, w, hs.float(), wt.float(), chunk_size=4, beta=beta, vocab_chunk_size=5),
        h.float(), w.float(), r.float())
    assert all(x.isfinite().all() for x in got32)
    ref32 = _reference(h.float(), w.float(), hs.float(), wt.float(), beta)
    assert torch.allclose(got32[0], ref32, rtol=1e-4, atol=1e-2)


def test_fused_linear_kl_rejects_bad_input():
    h, w, hs, wt = _randn(4, 3, seed=0), _randn(7, 3, seed=1), _randn(4, 2, seed=2), \
        _randn(7, 2, seed=3)
    f = arl.fused_linear_kl
    with pytest.raises(ValueError, match='teacher'):
        f(h, w, hs.clone().requires_grad_(), wt)
    with pytest.raises(ValueError, match='teacher'):
        f(h, w, hs, wt.clone().requires_grad_())
    with pytest.raises(ValueError, match='vocabulary'):
        f(h, w, hs, wt[:-1])
    with pytest.raises(ValueError, match='student_hidden'):
        f(h[:, :2], w, hs, wt)
    with pytest.raises(ValueError, match='teacher_hidden'):
        f(h, w, hs[:, :1], wt)
    with pytest.raises(ValueError, match='token dimensions'):
        f(h, w, hs[:3], wt)
    with pytest.raises(ValueError, match='student_weight'):
        f(h, w[None], hs, wt)
    for bad in (0, -1, None, True, 2.0):
        with pytest.raises(ValueError, match='chunk_size'):
            f(h, w, hs, wt, chunk_size=bad)
    for bad in (0, True):
        with pytest.raises(ValueError, match='vocab_chunk_size'):
            f(h, w, hs, wt, vocab_chunk_size=bad)
    for bad in (-0.1, 1.5, None, True):
        with pytest.raises(ValueError, match='beta'):
            f(h, w, hs, wt, beta=bad)
    for bad in (0.0, -1.0, float('inf')):
        with pytest.raises(ValueError, match='teacher_temperature'):
            f(h, w, hs, wt, teacher_temperature=bad)
    with pytest.raises(TypeError, match='student_hidden'):
        f(h.long(), w, hs, wt)
    with pytest.raises(TypeError, match='teacher_weight'):
        f(h, w, hs, wt.tolist())


# ---------------------------------------------------------------- HiddenBuffer / fill_hidden_buffer

def test_hidden_buffer_round_trip_and_errors():
    buf = arl.HiddenBuffer()                                        # bfloat16 by default
    a, b = _randn(3, 5, seed=0, dtype=torch.float32), _randn(2, 5, seed=1, dtype=torch.float32)
    buf.put('a', a)
    buf.put(7, b)
    assert len(buf) == 2 and buf.nbytes == (3 + 2) * 5 * 2
    got = buf.get(['a', 7])
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.cat([a, b]).to(torch.bfloat16))
    assert torch.equal(buf.get([7, 'a'], dtype=torch.float32),
                       torch.cat([b, a]).to(torch.bfloat16).float())
    a[0, 0] = 100.0                                                 # put copies
    assert buf.get(['a'])[0, 0] != 100.0
    full = arl.HiddenBuffer(torch.float32)
    full.put(0, a)
    assert torch.equal(full.get([0]), a) and full.nbytes == a.nbytes
    with pytest.raises(KeyError, match='missing'):
        buf.get(['a', 'missing'])
    with pytest.raises(ValueError, match='hidden'):
        buf.put('c', torch.zeros(5))
    for bad in (torch.long, 'float32', None):
        with pytest.raises(TypeError, match='dtype'):
            arl.HiddenBuffer(bad)


FAMILIES = ['max', 'calc', 'sum', 'calc', 'max', 'max', 'sum']


def _trajectories(families=FAMILIES, seed=0):
    """Trajectories of various lengths with random policy masks (at least one token each), ids in
    1..V-1 (pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, family in enumerate(families):
        n = int(torch.randint(5, 15, (1,), generator=gen))
        mask = (torch.rand(n - 1, generator=gen) < 0.6).float()
        mask[-1] = 1.0
        out.append(arl.Trajectory(ids=torch.randint(1, V, (n,), generator=gen), action_mask=mask,
                                  sample_logp=torch.zeros(n - 1), reward=0.0,
                                  info=dict(family=family, task=f'task{i}', group=0)))
    return out


@pytest.fixture(scope='module')
def teachers_store(tmp_path_factory):
    """Three float64 teachers of different widths named after their families, in a store."""
    root = tmp_path_factory.mktemp('teachers')
    teachers = {'calc': _agent(10, 16, torch.float64), 'max': _agent(11, 24, torch.float64),
                'sum': _agent(12, 8, torch.float64)}
    store = arl.TeacherStore(root)
    for family, model in teachers.items():
        store.save(family, model)
    return teachers, root


@pytest.mark.parametrize('micro_batch_size', [1, 32])
def test_fill_hidden_buffer_stores_each_trunks_hidden_states_at_policy_positions(
        teachers_store, micro_batch_size):
    teachers, root = teachers_store
    store = arl.TeacherStore(root)
    reads = []
    load_trunk = store.load_trunk
    store.load_trunk = lambda name: reads.append(name) or load_trunk(name)
    trajs = _trajectories()
    ids = [store.names().index(t.info['family']) for t in trajs]
    buf = arl.HiddenBuffer(torch.float64)
    assert arl.fill_hidden_buffer(store, trajs, ids, 0, buf, micro_batch_size) == 3
    assert sorted(reads) == ['calc', 'max', 'sum']                 # each trunk read once
    assert len(buf) == len(trajs)
    with torch.no_grad():
        for i, t in enumerate(trajs):
            teacher = teachers[t.info['family']]
            ref = teacher.hidden(t.ids[None])[0, :-1][t.action_mask.bool()]
            got = buf.get([i])
            assert got.shape == (int(t.action_mask.sum()), teacher.tok_emb.embedding_dim)
            assert torch.allclose(got, ref, atol=1e-12, rtol=0)
    # only two of the teachers used: two trunks read
    two = arl.HiddenBuffer(torch.float64)
    reads.clear()
    assert arl.fill_hidden_buffer(store, trajs[:3], [2, 0, 2], 0, two, micro_batch_size) == 2
    assert sorted(reads) == ['calc', 'sum'] and len(two) == 3
    with pytest.raises(ValueError, match='teacher_ids'):
        arl.fill_hidden_buffer(store, trajs, ids[:-1], 0, buf)


# ---------------------------------------------------------------- scheduled_distill_step

def _plain_step(student, teachers, trajs, beta, micro_batch_size, teacher_temperature=1.0,
                pad_id=0):
    """Chapter 15's step: route by family, distill_loss per micro-batch, global normalisation."""
    n_tokens = sum(float(t.action_mask.sum()) for t in trajs)
    total = 0.0
    for family, idx in arl.route_by_family(trajs, teachers):
        for part in torch.tensor(idx).split(micro_batch_size):
            batch = arl.collate([trajs[i] for i in part], pad_id)
            loss, _ = arl.distill_loss(student, teachers[family], batch['ids'],
                                       batch['action_mask'], beta, n_tokens,
                                       teacher_temperature=teacher_temperature)
            loss.backward()
            total += loss.item()
    return total


@pytest.fixture(scope='module')
def distill_setup(teachers_store):
    teachers, root = teachers_store
    store = arl.TeacherStore(root)
    trajs = _trajectories(seed=1)
    teacher_ids = [store.names().index(t.info['family']) for t in trajs]
    buf = arl.HiddenBuffer(torch.float64)
    arl.fill_hidden_buffer(store, trajs, teacher_ids, 0, buf)
    student = _agent(20, 16, torch.float64)
    return teachers, root, trajs, teacher_ids, buf, student


@pytest.mark.parametrize('micro_batch_size', [1, 32])
@pytest.mark.parametrize('prefetch', [False, True])
@pytest.mark.parametrize('beta', [0.0, 0.5, 1.0])
def test_scheduled_step_equals_the_plain_distillation_step(distill_setup, beta, prefetch,
                                                           micro_batch_size):
    teachers, root, trajs, teacher_ids, buf, student = distill_setup
    plain, scheduled = copy.deepcopy(student), copy.deepcopy(student)
    ref = _plain_step(plain, teachers, trajs, beta, micro_batch_size)
    store = arl.TeacherStore(root)
    loss, sched = arl.scheduled_distill_step(scheduled, store, trajs, teacher_ids, 0, buf, beta,
                                             micro_batch_size=micro_batch_size,
                                             chunk_size=4, vocab_chunk_size=3, prefetch=prefetch)
    assert ref > 0 and loss == pytest.approx(ref, abs=1e-10, rel=0)
    for (name, p), q in zip(scheduled.named_parameters(), plain.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-10, rtol=0), name
    assert sched.loads == len(set(teacher_ids)) == 3 and sched.max_resident == 1
    assert sched.bytes_read == sum(store.head_nbytes(n) for n in store.names())


def test_scheduled_step_on_sampled_multi_turn_episodes(tiny_agent, tmp_path):
    """Real episodes (prompt and observation tokens masked out, several families): the scheduled
    step and fill_hidden_buffer agree with the plain step there too."""
    tasks, tok, model = tiny_agent
    cfg = arl.RLConfig(group_size=2, max_turns=2, max_tokens=40)
    trajs = arl.sample_groups(model, lambda: arl.make_env(cfg), tasks[:6], tok, cfg,
                              torch.Generator().manual_seed(0))
    families = sorted({t.info['family'] for t in trajs})
    assert len(families) >= 2 and any((t.action_mask == 0).any() for t in trajs)
    store = arl.TeacherStore(tmp_path)
    teachers = {}
    for seed, family in enumerate(families):
        torch.manual_seed(100 + seed)
        teachers[family] = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2).double()
        store.save(family, teachers[family])
    teacher_ids = [store.names().index(t.info['family']) for t in trajs]
    buf = arl.HiddenBuffer(torch.float64)
    assert arl.fill_hidden_buffer(store, trajs, teacher_ids, tok.pad_id, buf) == len(families)
    student = copy.deepcopy(model).double()
    plain, scheduled = copy.deepcopy(student), copy.deepcopy(student)
    ref = _plain_step(plain, teachers, trajs, 0.5, 3, pad_id=tok.pad_id)
    loss, sched = arl.scheduled_distill_step(scheduled, store, trajs, teacher_ids, tok.pad_id,
                                             buf, 0.5, micro_batch_size=3, chunk_size=16,
                                             vocab_chunk_size=20)
    assert loss == pytest.approx(ref, abs=1e-10, rel=0)
    for p, q in zip(scheduled.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-10, rtol=0)
    assert sched.loads == len(families) and sched.max_resident == 1


def test_scheduled_step_teacher_temperature_and_n_tokens(distill_setup):
    teachers, root, trajs, teacher_ids, buf, student = distill_setup
    plain, scheduled = copy.deepcopy(student), copy.deepcopy(student)
    ref = _plain_step(plain, teachers, trajs, 0.5, 2, teacher_temperature=0.7)
    store = arl.TeacherStore(root)
    loss, _ = arl.scheduled_distill_step(scheduled, store, trajs, teacher_ids, 0, buf, 0.5,
                                         micro_batch_size=2, teacher_temperature=0.7)
    assert loss == pytest.approx(ref, abs=1e-10, rel=0)
    for p, q in zip(scheduled.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-10, rtol=0)
    # an explicit n_tokens scales loss and gradient; a different one is a different step
    n = sum(float(t.action_mask.sum()) for t in trajs)
    doubled = copy.deepcopy(student)
    loss2, _ = arl.scheduled_distill_step(doubled, store, trajs, teacher_ids, 0, buf, 0.5,
                                          n_tokens=2 * n, teacher_temperature=0.7)
    assert loss2 == pytest.approx(ref / 2, abs=1e-10, rel=0)
    for p, q in zip(doubled.parameters(), plain.parameters()):
        assert torch.allclose(2 * p.grad, q.grad, atol=1e-10, rtol=0)


def test_scheduled_step_rejects_bad_input(distill_setup):
    teachers, root, trajs, teacher_ids, buf, student = distill_setup
    store = arl.TeacherStore(root)
    model = copy.deepcopy(student)
    with pytest.raises(ValueError, match='teacher id'):
        arl.scheduled_distill_step(model, store, trajs, teacher_ids[:-1], 0, buf, 0.5)
    with pytest.raises(ValueError, match='teacher id'):
        arl.scheduled_distill_step(model, store, [], [], 0, buf, 0.5)
    with pytest.raises(ValueError, match='n_tokens'):
        arl.scheduled_distill_step(model, store, trajs, teacher_ids, 0, buf, 0.5, n_tokens=0)
    with pytest.raises(KeyError):                        # hidden states never buffered
        arl.scheduled_distill_step(model, store, trajs, teacher_ids, 0, arl.HiddenBuffer(), 0.5)


def test_scheduled_step_rejecting_n_tokens_leaves_no_loader_thread(distill_setup):
    teachers, root, trajs, teacher_ids, buf, student = distill_setup
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match='n_tokens'):
        arl.scheduled_distill_step(copy.deepcopy(student), arl.TeacherStore(root), trajs,
                                   teacher_ids, 0, buf, 0.5, n_tokens=0, prefetch=True)
    new = set(threading.enumerate()) - before
    for thread in new:
        thread.join(timeout=2)
    assert not [t for t in new if t.is_alive()]


# ---------------------------------------------------------------- found in review

def test_scheduled_step_with_bfloat16_heads_and_buffer(teachers_store, tmp_path):
    """Heads stored in bfloat16 are loaded in the student's dtype; the loss moves
    only by the rounding of the heads and hidden states."""
    teachers, _ = teachers_store
    as32 = {f: copy.deepcopy(m).float() for f, m in teachers.items()}
    full, half = arl.TeacherStore(tmp_path / 'full'), arl.TeacherStore(tmp_path / 'half')
    for family, model in as32.items():
        full.save(family, model)
        half.save(family, model, head_dtype=torch.bfloat16)
    trajs = _trajectories(seed=3)
    ids = [full.names().index(t.info['family']) for t in trajs]
    losses = []
    for store, dtype in ((full, torch.float32), (half, torch.bfloat16)):
        buf = arl.HiddenBuffer(dtype)
        arl.fill_hidden_buffer(store, trajs, ids, 0, buf)
        student = _agent(20, 16)
        loss, sched = arl.scheduled_distill_step(student, store, trajs, ids, 0, buf, 1.0)
        assert sched.max_resident == 1 and student.head.weight.grad.dtype == torch.float32
        losses.append(loss)
    assert losses[1] == pytest.approx(losses[0], rel=0.05)
    assert losses[1] != losses[0]                       # the rounding is really there


def test_scheduler_frees_the_old_head_before_reading_the_next(heads):
    store = arl.TeacherStore(heads)
    handed, alive_at_read = [], []
    load_head = store.load_head

    def spy(name, rows=None, dtype=None):
        alive_at_read.append(sum(ref() is not None for ref in handed))
        head = load_head(name, rows, dtype)
        handed.append(weakref.ref(head))
        return head

    store.load_head = spy
    for lease in arl.HeadScheduler(store, ['a', 'b', 'c', 'a'], prefetch=False):
        lease.weight.sum()
    assert alive_at_read == [0, 0, 0, 0]


def test_scheduler_context_manager_stops_the_thread(heads):
    with arl.HeadScheduler(arl.TeacherStore(heads), ['a', 'b', 'c']) as sched:
        for lease in sched:
            break
    assert not sched._thread.is_alive() and sched._staged.empty()
    unused = arl.HeadScheduler(arl.TeacherStore(heads), ['a', 'b']).start()
    unused.close()                                      # never iterated: still stops
    assert not unused._thread.is_alive()


def test_teacher_ids_out_of_range_and_buffers_of_another_teacher(distill_setup):
    teachers, root, trajs, teacher_ids, buf, student = distill_setup
    store = arl.TeacherStore(root)
    with pytest.raises(ValueError, match='teacher_ids'):
        arl.fill_hidden_buffer(store, trajs, [-1] + teacher_ids[1:], 0,
                               arl.HiddenBuffer(torch.float64))
    with pytest.raises(ValueError, match='teacher_ids'):
        arl.scheduled_distill_step(copy.deepcopy(student), store, trajs,
                                   [3] + teacher_ids[1:], 0, buf, 0.5)
    shifted = [(t + 1) % 3 for t in teacher_ids]        # buffered by other teachers
    with pytest.raises(ValueError, match='buffered by teachers'):
        arl.scheduled_distill_step(copy.deepcopy(student), store, trajs, shifted, 0, buf,
                                   0.5)


def test_load_trunk_rejects_an_incomplete_trunk(tmp_path):
    store = arl.TeacherStore(tmp_path)
    store.save('t', _agent(0))
    path = tmp_path / 't' / store.TRUNK
    state = load_file(path)
    with safe_open(path, 'pt') as f:
        metadata = f.metadata()
    del state['blocks.layers.0.mlp.0.bias']
    save_file(state, path, metadata=metadata)
    with pytest.raises(ValueError, match='whole trunk'):
        store.load_trunk('t')


def test_fused_linear_kl_rejects_mixed_dtypes_and_keeps_beta_keyword_only():
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    hs, wt = torch.randn(3, 2), torch.randn(5, 2)
    with pytest.raises(TypeError, match='teacher_hidden'):
        arl.fused_linear_kl(h, w, hs.double(), wt)
    with pytest.raises(TypeError, match='student_hidden'):
        arl.fused_linear_kl(h.detach().bfloat16(), w, hs, wt)
    with pytest.raises(TypeError):
        arl.fused_linear_kl(h, w, hs, wt, 2, 0.5)       # beta is keyword-only


def test_load_head_sharded_needs_a_process_group(heads):
    with pytest.raises(RuntimeError, match='process group'):
        arl.load_head_sharded(arl.TeacherStore(heads), 'a')


# ------------------------------------------ non-finite inputs and hangs (reliability issue)

def _fused_case(seed=0):
    h, w = _randn(6, D, seed=seed), _randn(V, D, seed=seed + 1)
    hs, wt = _randn(6, D, seed=seed + 2), _randn(V, D, seed=seed + 3)
    return dict(student_hidden=h, student_weight=w, teacher_hidden=hs, teacher_weight=wt)


@pytest.mark.parametrize('beta', [0.0, 0.5, 1.0])
@pytest.mark.parametrize('bad', [float('nan'), float('inf'), -float('inf')])
@pytest.mark.parametrize('arg', ['student_hidden', 'student_weight', 'teacher_hidden',
                                 'teacher_weight'])
def test_fused_linear_kl_refuses_non_finite_inputs(arg, bad, beta):
    """Issue item 3: NaN on the side whose probabilities are not the weights (the
    student at beta = 1, the teacher at beta = 0) used to give a divergence of 0."""
    case = _fused_case()
    case[arg] = case[arg].clone()
    case[arg][1, 2] = bad
    with pytest.raises(ValueError, match=arg):
        arl.fused_linear_kl(*case.values(), 4, beta=beta)


def test_finiteness_check_sums_but_never_misjudges():
    """The check sums each tensor (no temporary as large as a head); a sum that
    overflows from finite values is not a reason to refuse, +inf and -inf together
    are."""
    from agentrl.fused_kl import _all_finite
    inf = float('inf')
    assert _all_finite(torch.tensor([3e38, 3e38]))            # the sum overflows
    assert not _all_finite(torch.tensor([1.0, inf, -inf]))   # the sum is NaN
    assert not _all_finite(torch.tensor([1.0, -inf]))
    assert not _all_finite(torch.tensor([float('nan'), 0.0]))
    assert _all_finite(torch.zeros(0))
    w = torch.randn(64, 8, requires_grad=True)
    assert _all_finite(w) and w.grad is None                  # no graph, no gradient


def test_fused_linear_kl_refuses_tensors_on_two_devices():
    """Issue item 3: a head on another device must not be read as garbage."""
    case = _fused_case()
    case['teacher_weight'] = torch.empty(V, D, dtype=torch.float64, device='meta')
    with pytest.raises(ValueError, match='one device'):
        arl.fused_linear_kl(*case.values(), 4)


def _finishes(fn, seconds=10.0):
    """Run fn in a daemon thread; (finished, what it raised or returned)."""
    box = {}

    def target():
        try:
            box['value'] = fn()
        except BaseException as e:            # noqa: BLE001 - reported to the test
            box['error'] = e
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), box


@pytest.mark.parametrize('prefetch', [False, True])
def test_iterating_a_closed_scheduler_raises_instead_of_hanging(heads, prefetch):
    """Issue item 6: iterating after close() (or after `with s: pass`) blocked."""
    store = arl.TeacherStore(heads)
    with arl.HeadScheduler(store, ['a', 'b'], prefetch=prefetch) as sched:
        pass
    done, box = _finishes(lambda: [lease.name for lease in sched])
    assert done, 'iterating a closed scheduler hangs'
    assert isinstance(box.get('error'), RuntimeError)
    closed = arl.HeadScheduler(store, ['a'], prefetch=prefetch)
    closed.close()
    done, box = _finishes(lambda: list(closed))
    assert done and isinstance(box.get('error'), RuntimeError)


def test_close_from_another_thread_wakes_the_iterating_caller(heads):
    """Issue item 6: close() from another thread left the caller blocked forever."""
    release = threading.Event()
    slow = arl.TeacherStore(heads)
    original = slow.load_head

    def blocked_load(name, **kw):             # the second head never arrives on its own
        if name == 'b':
            release.wait(30)
        return original(name, **kw)
    slow.load_head = blocked_load
    sched = arl.HeadScheduler(slow, ['a', 'b'], prefetch=True)
    first = threading.Event()

    def consume():
        for lease in sched:
            first.set()
    errors = []
    thread = threading.Thread(target=_record, args=(consume, errors), daemon=True)
    thread.start()
    assert first.wait(10)
    closer = threading.Thread(target=sched.close, daemon=True)
    closer.start()
    time.sleep(0.2)
    release.set()                             # let the loader finish so close can join
    closer.join(10)
    thread.join(10)
    assert not closer.is_alive() and not thread.is_alive(), 'close did not wake the caller'
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)


def _record(fn, errors):
    try:
        fn()
    except BaseException as e:                # noqa: BLE001
        errors.append(e)


# ------------------------------------------------ a train_opd run through the scheduler

def _long_agent(seed, vocab, dtype=torch.float32):
    """A tiny TinyAgent that fits whole episodes (max_len 256)."""
    torch.manual_seed(seed)
    return arl.TinyAgent(vocab, d_model=16, n_layers=1, n_heads=2, max_len=256).to(dtype).eval()


class _GradsAfterEachStep(arl.UpdateTerm):
    """Records the student's gradient once each update's micro-batches are done."""
    def __init__(self, model, grads):
        self.model, self.grads = model, grads

    def epoch_end(self, epoch, stats):
        self.grads.append([p.grad.clone() for p in self.model.parameters()])


@pytest.mark.parametrize('micro_batch_size', [2, 32])
def test_scheduled_distillation_trains_like_train_opd_step_for_step(micro_batch_size, tmp_path):
    """Issue (joints) item 5: chapter 15's loop with the scheduled part equals the plain
    loop in float64: every step's loss, gradient and the weights after every update."""
    tasks = [t for t in arl.make_tasks('train') if t.family in ('calc', 'max')][:8]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    make = lambda seed: _long_agent(seed, len(tok), torch.float64)
    student = make(0)
    teachers = {'calc': make(1), 'max': make(2)}
    store = arl.TeacherStore(tmp_path)
    for family, model in teachers.items():
        store.save(family, model)
    cfg = arl.OPDConfig(tasks_per_step=4, max_tokens=40, max_turns=2,
                        micro_batch_size=micro_batch_size)
    runs = []
    for part in (arl.Distillation(teachers, cfg), arl.ScheduledDistillation(store, cfg, tok.pad_id)):
        model, grads = copy.deepcopy(student), []
        history = arl.train_opd(model, teachers, tasks, tok, cfg, 3, progress=False,
                                parts=(part, _GradsAfterEachStep(model, grads)))
        runs.append((history, grads, model))
    (plain, plain_g, plain_m), (sched, sched_g, sched_m) = runs
    assert len(plain_g) == len(sched_g) == 3
    for a, b in zip(plain, sched):
        assert b['loss'] == pytest.approx(a['loss'], rel=1e-10, abs=0)
        assert b['max_resident'] == 1 and b['head_loads'] == b['trunks_read'] >= 1
    for ga, gb in zip(plain_g, sched_g):
        for x, y in zip(ga, gb):
            assert torch.allclose(x, y, rtol=1e-10, atol=1e-14)
    for p, q in zip(plain_m.parameters(), sched_m.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-14)
    assert any(not torch.equal(p, q) for p, q in zip(plain_m.parameters(),
                                                     student.parameters()))


def test_scheduled_distillation_rejects_a_family_without_a_stored_teacher(tmp_path):
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    store = arl.TeacherStore(tmp_path)
    store.save('calc', _long_agent(1, len(tok)))
    tasks = [t for t in arl.make_tasks('train') if t.family == 'max'][:2]
    teachers = {'max': _long_agent(2, len(tok))}
    cfg = arl.OPDConfig(tasks_per_step=2, max_tokens=30, max_turns=2)
    with pytest.raises(ValueError, match='no teacher named'):
        arl.train_opd(_long_agent(0, len(tok)), teachers, tasks, tok, cfg, 1,
                      progress=False, parts=(arl.ScheduledDistillation(store, cfg, tok.pad_id),))
    with pytest.raises(ValueError, match="'jsd'"):
        arl.ScheduledDistillation(store, arl.OPDConfig(loss='sft'), tok.pad_id)
