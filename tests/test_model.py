"""Unit tests for agentrl.model (chapter 3): TinyAgent, masks, KV cache, log-probs, peak-memory meter."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import agentrl as arl

V = 20


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return arl.TinyAgent(V, d_model=32, n_layers=2, n_heads=4, max_len=64).eval()


def _ids(B=3, T=17, seed=0):
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- TinyAgent

def test_shapes_and_attributes(model):
    ids = _ids()
    logits, hidden = model(ids, return_hidden=True)
    assert logits.shape == (3, 17, V) and hidden.shape == (3, 17, 32)
    assert torch.equal(model(ids), logits)
    assert model.blocks.layers[1].self_attn.num_heads == 4
    h = model.tok_emb(ids) + model.pos_emb(torch.arange(17))
    assert torch.allclose(model.head(model.norm(model.blocks(h))), logits, atol=1e-6)
    assert torch.allclose(model.head(hidden), logits, atol=1e-6)


@settings(max_examples=10, deadline=None)
@given(t=st.integers(0, 15), seed=st.integers(0, 100))
def test_causal(model, t, seed):
    ids = _ids(B=2, T=16, seed=seed)
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % V
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_too_long_and_bad_arguments(model):
    with pytest.raises(ValueError, match="max_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    cache = model.new_cache(1, max_len=8)
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="max_len=64"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=_full_cache(model))
    with pytest.raises(ValueError, match="ids"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="ids"):
        model(torch.zeros(1, 5))
    # the message names the constructor's own argument, n_heads
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_heads=4"):
        arl.TinyAgent(V, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        arl.TinyAgent(V, n_layers=0)


def _full_cache(model):
    cache = model.new_cache(1)
    cache.length = model.max_len
    return cache


# ---------------------------------------------------------------- masks

def test_mask_conventions_equivalent(model):
    ids = _ids(B=2, T=12)
    B, T, H = 2, 12, 4
    h = model.tok_emb(ids) + model.pos_emb(torch.arange(T))
    blocked = ~torch.ones(T, T, dtype=torch.bool).tril()
    fmask = torch.zeros(T, T).masked_fill(blocked, float("-inf"))
    with torch.no_grad():
        ref = model.blocks(h)
        for mask in [fmask, blocked, fmask.expand(B * H, T, T), blocked.expand(B * H, T, T),
                     fmask.expand(B, T, T), blocked.expand(B, T, T), fmask.expand(B, 1, T, T),
                     blocked.expand(B, H, T, T)]:
            assert torch.allclose(model.blocks(h, mask=mask), ref, atol=1e-6)
        # a per-sequence mask: row 1 may only see itself -> differs from causal for row 1 only
        own = blocked.expand(B, T, T).clone()
        own[1] = ~torch.eye(T, dtype=torch.bool)
        out = model.blocks(h, mask=own)
        assert torch.allclose(out[0], ref[0], atol=1e-6) and not torch.allclose(out[1], ref[1])


def test_bad_masks(model):
    h = torch.zeros(2, 5, 32)
    with pytest.raises(ValueError, match="first dimension"):
        model.blocks(h, mask=torch.zeros(3, 5, 5))
    with pytest.raises(ValueError):
        model.blocks(h, mask=torch.zeros(2, 3, 5, 5))
    with pytest.raises(TypeError, match="bool or floating"):
        model.blocks(h, mask=torch.zeros(5, 5, dtype=torch.long))


# ---------------------------------------------------------------- KV cache

def test_cache_equals_full_forward(model):
    ids = _ids(B=4, T=30)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(4)
        pieces, t = [], 0
        for width in [5, 1, 1, 4, 1, 7, 1, 1, 9]:
            pieces.append(model(ids[:, t:t + width], cache=cache))
            t += width
        assert t == 30 and cache.length == 30
        assert (torch.cat(pieces, 1) - full).abs().max() <= 1e-5


def test_cache_keep_rows(model):
    ids = _ids(B=5, T=20)
    rows = torch.tensor([1, 4])
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(5)
        first = model(ids[:, :8], cache=cache)
        cache.keep(rows)
        rest = [model(ids[rows, t:t + 1], cache=cache) for t in range(8, 20)]
    assert (torch.cat([first[rows]] + rest, 1) - full[rows]).abs().max() <= 1e-5


class _CopyEverySlot(arl.KVCache):
    """The straightforward keep: every slot of the kept rows gathered into new tensors."""
    def keep(self, rows):
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]
        if self.lengths is not None:
            self.lengths = self.lengths[rows]


def _twin_caches(model, B, max_len):
    """The book's cache and the copy-every-slot one, both empty."""
    attn = model.blocks.layers[0].self_attn
    args = (len(model.blocks.layers), B, attn.num_heads, attn.head_dim, max_len)
    return arl.KVCache(*args), _CopyEverySlot(*args)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), ragged=st.booleans(),
       drops=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1,
                      max_size=4))
def test_cache_keep_is_the_copy_of_every_slot(model, seed, ragged, drops):
    """keep in place, filled slots only: the same logits, bit for bit, as gathering every
    slot into new tensors, over several keeps in a row; slots past the filled ones stay 0."""
    B, T = 6, 30
    ids = _ids(B=B, T=T, seed=seed)
    fast, slow = _twin_caches(model, B, 40)
    rows_left = torch.arange(B)
    with torch.no_grad():
        for cache in (fast, slow):
            model(ids[:, :10], cache=cache)
            if ragged:          # rows at their own positions (chapter 18)
                cache.lengths = 4 + torch.arange(B) % 5
        for step, drop in enumerate(drops):
            keep = torch.tensor([r for r, d in enumerate(drop[:len(rows_left)]) if not d]
                                or [0])
            rows_left = rows_left[keep]
            fast.keep(keep)
            slow.keep(keep)
            if ragged:
                x = ids[rows_left, fast.lengths][:, None]
            else:
                x = ids[rows_left, 10 + step][:, None]
            out_fast, out_slow = model(x, cache=fast), model(x, cache=slow)
            assert torch.equal(out_fast, out_slow)
    filled = max([fast.length] + ([int(fast.lengths.max())] if ragged else []))
    for a, b in zip(fast.k + fast.v, slow.k + slow.v):
        assert a.shape == b.shape and torch.equal(a, b)
        assert not a[:, :, filled:].any()


# ---------------------------------------------------------------- log-probs

def test_selected_log_probs_stable():
    logits = torch.tensor([[1e4, 0.0, -1e4]]).expand(3, 3)
    out = arl.selected_log_probs(logits, torch.tensor([0, 1, 2]))
    assert torch.equal(out, torch.tensor([0.0, -1e4, -2e4]))
    assert torch.isfinite(arl.selected_log_probs(torch.tensor([[1e38, -1e38]]), torch.tensor([1]))).all()


@settings(max_examples=30, deadline=None)
@given(shape=st.sampled_from([(7,), (2, 5), (2, 3, 4)]), vocab=st.integers(1, 50),
       scale=st.sampled_from([1.0, 30.0, 1e3]), seed=st.integers(0, 1000))
def test_selected_log_probs_matches_log_softmax(shape, vocab, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(*shape, vocab, generator=g)
    ids = torch.randint(vocab, shape, generator=g)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None]).squeeze(-1)
    out = arl.selected_log_probs(logits, ids)
    assert out.dtype == torch.float32 and out.shape == shape
    assert (out.double() - ref).abs().max() <= 1e-6 * max(1.0, ref.abs().max().item())


def test_selected_log_probs_bf16_and_errors():
    logits = torch.randn(4, 10).bfloat16()
    ids = torch.randint(10, (4,))
    out = arl.selected_log_probs(logits, ids)
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.log_softmax(logits.float(), -1)[torch.arange(4), ids])
    with pytest.raises(ValueError, match="must match"):
        arl.selected_log_probs(logits, torch.zeros(5, dtype=torch.long))


def test_sequence_log_probs(model):
    ids = _ids(B=2, T=9)
    out = arl.sequence_log_probs(model, ids)
    assert out.shape == (2, 8)
    ref = torch.log_softmax(model(ids), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (out - ref).abs().max() <= 1e-6


@settings(max_examples=8, deadline=None)
@given(chunk_size=st.integers(1, 40), seed=st.integers(0, 1000))
def test_chunked_equals_naive_values_and_gradients(model, chunk_size, seed):
    ids = _ids(B=2, T=25, seed=seed)
    naive = arl.sequence_log_probs(model, ids)
    model.zero_grad()
    naive.sum().backward()
    g_naive = torch.cat([p.grad.flatten() for p in model.parameters()])
    _, hidden = model(ids, return_hidden=True)
    chunked = arl.chunked_log_probs(hidden[:, :-1], model.head.weight, ids[:, 1:], chunk_size)
    model.zero_grad()
    chunked.sum().backward()
    g_chunked = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert chunked.shape == naive.shape
    assert (chunked - naive).abs().max() <= 1e-6
    assert (g_chunked - g_naive).norm() <= 1e-6 * g_naive.norm()


def test_chunked_errors():
    h, w, ids = torch.zeros(1, 4, 8), torch.zeros(10, 8), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size"):
        arl.chunked_log_probs(h, w, ids, 0)
    with pytest.raises(ValueError, match="weight"):
        arl.chunked_log_probs(h, torch.zeros(10, 7), ids)
    with pytest.raises(ValueError, match="ids"):
        arl.chunked_log_probs(h, w, torch.zeros(1, 5, dtype=torch.long))


# ---------------------------------------------------------------- peak-memory meter

@pytest.mark.parametrize("shape,dtype", [((1000, 1000), torch.float32), ((123, 45), torch.float64),
                                         ((77,), torch.int8)])
def test_meter_known_size(shape, dtype):
    peak, out = arl.measure_peak_memory(lambda: torch.empty(shape, dtype=dtype))
    expected = out.nbytes
    assert abs(peak - expected) <= 64


def test_meter_max_not_sum_and_result():
    def fn():
        a = torch.ones(100_000)        # 400 kB
        del a
        b = torch.ones(300_000)        # 1.2 MB
        del b
        return "done"
    peak, result = arl.measure_peak_memory(fn)
    assert result == "done" and abs(peak - 1_200_000) <= 64

    def both_alive():
        a, b = torch.ones(100_000), torch.ones(300_000)
        return a.sum() + b.sum()
    peak, _ = arl.measure_peak_memory(both_alive)
    assert abs(peak - 1_600_000) <= 64


def test_meter_ignores_views_inplace_and_preexisting():
    x = torch.zeros(1_000_000)
    peak, _ = arl.measure_peak_memory(lambda: (x.add_(1), x.view(1000, 1000), x[10:], x.mul_(2)))
    assert peak == 0


def test_meter_sees_backward():
    w = torch.randn(300, 300, requires_grad=True)
    x = torch.randn(50, 300, requires_grad=True)
    with arl.StorageMeter() as meter:
        torch.tanh(x @ w).sum().backward()
    ops = [name for name, _ in meter.timeline]
    assert "tanh_backward.default" in ops and ops.count("mm.default") == 3
    assert meter.peak >= w.grad.nbytes + x.grad.nbytes


def test_meter_full_vs_chunked():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(5000, 16, generator=g)
    h = torch.randn(1, 64, 16, generator=g, requires_grad=True)
    ids = torch.randint(5000, (1, 64), generator=g)
    logits_bytes = 64 * 5000 * 4
    full, _ = arl.measure_peak_memory(lambda: arl.selected_log_probs(h @ W.T, ids).sum().backward())
    chunked, _ = arl.measure_peak_memory(lambda: arl.chunked_log_probs(h, W, ids, 8).sum().backward())
    assert full >= 3 * logits_bytes and logits_bytes <= chunked < 0.6 * full


def test_meter_errors():
    with pytest.raises(TypeError, match="callable"):
        arl.measure_peak_memory(42)
    with pytest.raises(ValueError, match="device"):
        arl.measure_peak_memory(lambda: None, device="meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_meter_cuda_known_size():
    peak, out = arl.measure_peak_memory(lambda: torch.empty(1000, 1000, device="cuda"), device="cuda")
    assert abs(peak - out.nbytes) <= 2 * 1024 * 1024      # allocator rounds blocks up


def test_hidden_is_forward_without_the_head():
    torch.manual_seed(0)
    model = arl.TinyAgent(30, d_model=32, n_layers=2, n_heads=2, max_len=40).eval()
    ids = torch.randint(0, 30, (3, 17))
    logits, hidden = model(ids, return_hidden=True)
    assert torch.equal(model.hidden(ids), hidden)
    assert torch.equal(model.head(hidden), logits)


def test_per_row_cache_is_the_frozen_ragged_step_bit_for_bit():
    """Chapter 3's per-row cache path computes exactly what chapter 18's own ragged
    decoding step (frozen copy) computed before the two were merged."""
    from frozen.ragged_v1 import decode_step_ragged_v1
    torch.manual_seed(0)
    model = arl.TinyAgent(30, d_model=32, n_layers=2, n_heads=2, max_len=40).eval()
    seqs = [torch.randint(0, 30, (n,)).tolist() for n in (5, 9, 13)]
    cache_a, len_a = arl.prefill_ragged(model, seqs, 40)
    cache_b, len_b = arl.prefill_ragged(model, seqs, 40)
    len_b = len_b.clone()
    tokens = torch.tensor([1, 2, 3])
    for _ in range(6):
        a = arl.decode_step_ragged(model, cache_a, len_a, tokens)
        b = decode_step_ragged_v1(model, cache_b, len_b, tokens)
        assert torch.equal(a, b) and torch.equal(len_a, len_b)
        tokens = a.argmax(-1)
    with pytest.raises(ValueError, match='one token per row'):
        model(torch.zeros(3, 2, dtype=torch.long), cache=cache_a)
