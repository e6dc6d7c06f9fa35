"""Tests for agentrl/low_precision.py (chapter 16): FP4/FP8 formats, MX and NVFP4
quantisation, the exact MXFP4 -> FP8 cast, quantised inference-only models."""
import copy

import pytest
import torch

import agentrl as arl


def _bits(x):
    return x.float().view(torch.int32)


# ---- element formats
def test_e2m1_has_the_eight_magnitudes_of_the_spec_and_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    values = arl.e2m1_decode(codes)
    assert values[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.equal(values[8:], -values[:8])
    assert torch.signbit(values[8])                         # code 8 is -0
    assert torch.equal(arl.e2m1_encode(values), codes)


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, 6.5, 1e9, -7.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, 6.0, -6.0]
    assert arl.e2m1_decode(arl.e2m1_encode(x)).tolist() == want


def test_e2m1_encode_is_nearest_on_random_inputs():
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3
    got = arl.e2m1_decode(arl.e2m1_encode(x))
    grid = torch.tensor(arl.E2M1_MAGNITUDES)
    best = (x.abs().clamp(max=6)[:, None] - grid).abs().min(1).values
    assert torch.allclose((got.abs() - x.abs().clamp(max=6)).abs(), best)
    assert torch.equal(torch.signbit(got), torch.signbit(x))


@pytest.mark.parametrize('bad', [float('nan'), float('inf')])
def test_non_finite_inputs_raise(bad):
    x = torch.ones(2, 32)
    x[0, 3] = bad
    for f in (arl.e2m1_encode, arl.e4m3_encode, arl.quantize_mx, arl.quantize_nvfp4):
        with pytest.raises(ValueError, match='NaN or Inf'):
            f(x)


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(1),
                          dtype=torch.uint8)
    packed = arl.pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(arl.unpack_fp4(packed), codes)
    assert arl.pack_fp4(torch.tensor([0x3, 0xA], dtype=torch.uint8)).item() == 0xA3
    with pytest.raises(ValueError, match='even'):
        arl.pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match='0..15'):
        arl.pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))


def test_every_e4m3_value_round_trips_bit_for_bit():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = bits.view(torch.float8_e4m3fn).float()
    finite = ~values.isnan()
    assert int(finite.sum()) == 254                        # S.1111.111 are the NaNs
    back = arl.e4m3_encode(values[finite]).view(torch.uint8)
    assert torch.equal(back, bits[finite])
    assert values[finite].abs().max() == arl.E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max


def test_e4m3_encode_saturates_where_a_plain_cast_might_not():
    x = torch.tensor([449.0, 1e6, -1e30, 464.0])
    assert arl.e4m3_encode(x).float().tolist() == [448.0, 448.0, -448.0, 448.0]


# ---- MX and NVFP4
@pytest.mark.parametrize('elem,bits', [('fp4_e2m1', 4.25), ('fp8_e4m3', 8.25)])
@pytest.mark.parametrize('mode', ['floor', 'rceil'])
def test_quantize_mx_bytes_scales_and_shapes(elem, bits, mode):
    x = torch.randn(6, 2, 96, generator=torch.Generator().manual_seed(2))
    q = arl.quantize_mx(x, elem, 32, mode)
    assert q.nbytes * 8 / x.numel() == bits == q.bits_per_element
    assert q.scales.dtype == torch.uint8 and q.scales.shape == (6, 2, 3)
    scales = q.scales.view(torch.float8_e8m0fnu).float()
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))   # powers of 2
    assert q.dequantize().shape == x.shape
    err = (q.dequantize() - x).norm() / x.norm()
    assert err < (0.2 if elem == 'fp4_e2m1' else 0.05)


def test_quantize_mx_floor_follows_the_spec_and_rceil_never_clips():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 7.9, 0.3        # floor(log2 7.9) - 2 = 0: scale 1, 7.9 clips to 6
    floor = arl.quantize_mx(x, 'fp4_e2m1', 32, 'floor')
    assert floor.scale_exponents().item() == 0 and floor.clipped == 1
    assert floor.dequantize()[0, 0] == 6.0
    rceil = arl.quantize_mx(x, 'fp4_e2m1', 32, 'rceil')
    assert rceil.scale_exponents().item() == 1 and rceil.clipped == 0
    y = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * 10
    for elem in ('fp4_e2m1', 'fp8_e4m3'):
        assert arl.quantize_mx(y, elem, 32, 'rceil').clipped == 0
    # an exact power-of-two block maximum equal to 6 * 2^k: both rules agree, no clip
    z = torch.full((1, 32), 0.75)
    z[0, 0] = 6.0 * 2 ** -3
    for mode in ('floor', 'rceil'):
        q = arl.quantize_mx(z, 'fp4_e2m1', 32, mode)
        assert q.clipped == 0 and torch.equal(q.dequantize(), z)


def test_quantize_mx_is_exact_on_representable_values():
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    codes[:, ::32] = 7                                        # each block holds a 6
    exps = torch.randint(-20, 20, (8, 2), generator=gen)
    x = torch.ldexp(arl.e2m1_decode(codes), exps.repeat_interleave(32, 1))
    assert torch.equal(_bits(arl.quantize_mx(x).dequantize()), _bits(x))
    e4 = torch.randn(8, 64, generator=gen).to(torch.float8_e4m3fn).float()
    assert torch.equal(arl.quantize_mx(e4, 'fp8_e4m3', 32, 'rceil').dequantize(), e4)


def test_zero_blocks_dequantize_to_zero():
    q = arl.quantize_mx(torch.zeros(2, 64))
    assert q.scale_exponents().eq(-127).all() and q.dequantize().eq(0).all()
    assert arl.quantize_nvfp4(torch.zeros(2, 32)).dequantize().eq(0).all()


def test_block_shape_and_argument_errors():
    with pytest.raises(ValueError, match='multiple of block_size=32'):
        arl.quantize_mx(torch.randn(4, 48))
    with pytest.raises(ValueError, match='multiple of block_size=16'):
        arl.quantize_nvfp4(torch.randn(4, 40))
    with pytest.raises(ValueError, match='elem'):
        arl.quantize_mx(torch.randn(4, 32), 'int8')
    with pytest.raises(ValueError, match='scale_mode'):
        arl.quantize_mx(torch.randn(4, 32), scale_mode='ceil')
    with pytest.raises(ValueError, match='block_size'):
        arl.quantize_mx(torch.randn(4, 32), block_size=3)
    with pytest.raises(TypeError, match='floating-point'):
        arl.quantize_mx(torch.ones(4, 32, dtype=torch.long))


def test_nvfp4_storage_and_accuracy():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    q = arl.quantize_nvfp4(x)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (64, 64)
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (64, 8)
    assert q.nbytes * 8 == x.numel() * 4.5 + 32
    assert q.scales.float().max() <= 448
    mx = arl.quantize_mx(x)
    err = lambda t: ((t.dequantize() - x).norm() / x.norm()).item()
    assert err(q) < err(mx) < 0.2


def test_quantize_fp8_per_tensor():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(6)) * 1e-3
    q = arl.quantize_fp8(x)
    assert q.nbytes == x.numel() + 4 and q.clipped == 0
    assert ((q.dequantize() - x).norm() / x.norm()) < 0.05
    with pytest.raises(ValueError, match='2-D'):
        arl.quantize_fp8(torch.randn(32))


# ---- MXFP4 -> FP8
def test_exactness_bound_matches_an_independent_enumeration():
    h, bound = arl.fp4_to_fp8_exact_spread()
    assert (h, bound) == (arl.FP4_TO_FP8_SHIFT, arl.FP4_TO_FP8_MAX_SPREAD)
    assert 6 * 2 ** h <= 448 < 6 * 2 ** (h + 1)
    values = arl.e2m1_decode(torch.arange(16, dtype=torch.uint8)).double()
    exact_upto = None
    for d in range(40):
        target = values * 2.0 ** (h - d)
        back = target.float().to(torch.float8_e4m3fn).double()
        if not torch.equal(back, target):
            exact_upto = d - 1
            break
    assert exact_upto == bound


def _tiles(spread, rows=256, cols=256, seed=0, codes=None):
    gen = torch.Generator().manual_seed(seed)
    if codes is None:
        codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    exp = torch.randint(0, spread + 1, (rows, cols // 32), generator=gen)
    # the first block of every 128 x 128 tile: 0 in one row, `spread` in the next
    exp[::128, ::4], exp[1::128, ::4] = 0, spread
    scales = (exp - 30 + arl.E8M0_BIAS).to(torch.uint8)
    return arl.MXTensor('fp4_e2m1', 32, (rows, cols), arl.pack_fp4(codes), scales)


@pytest.mark.parametrize('spread', [0, 3, 14])
def test_mxfp4_to_fp8_is_exact_within_the_bound(spread):
    q = _tiles(spread)
    fp8, report = arl.mxfp4_to_fp8(q)
    assert fp8.values.dtype == torch.float8_e4m3fn and fp8.scales.shape == (2, 2)
    assert torch.equal(_bits(fp8.dequantize()), _bits(q.dequantize()))
    assert report['exact'].all() and report['guaranteed'].all()
    scales = fp8.scales
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))


def test_mxfp4_to_fp8_refuses_or_reports_beyond_the_bound():
    codes = torch.full((128, 128), 1, dtype=torch.uint8)        # every element 0.5
    q = _tiles(arl.FP4_TO_FP8_MAX_SPREAD + 1, 128, 128, codes=codes)
    with pytest.raises(ValueError, match='not exact'):
        arl.mxfp4_to_fp8(q)
    fp8, report = arl.mxfp4_to_fp8(q, on_inexact='report')
    assert not report['exact'].any() and not report['guaranteed'].any()
    assert not torch.equal(fp8.dequantize(), q.dequantize())
    # beyond the bound but with only large codes (6): still exact, and allowed
    q6 = _tiles(arl.FP4_TO_FP8_MAX_SPREAD + 1, 128, 128,
                codes=torch.full((128, 128), 7, dtype=torch.uint8))
    fp8, report = arl.mxfp4_to_fp8(q6)
    assert report['exact'].all() and not report['guaranteed'].any()
    assert torch.equal(fp8.dequantize(), q6.dequantize())


def test_mxfp4_to_fp8_partial_tiles_and_errors():
    x = torch.randn(200, 96, generator=torch.Generator().manual_seed(7))
    q = arl.quantize_mx(x)
    fp8, report = arl.mxfp4_to_fp8(q)
    assert fp8.scales.shape == (2, 1) and report['spread'].shape == (2, 1)
    assert torch.equal(fp8.dequantize(), q.dequantize())
    with pytest.raises(ValueError, match='multiple of the block size'):
        arl.mxfp4_to_fp8(q, tile=100)
    with pytest.raises(TypeError, match='MXTensor'):
        arl.mxfp4_to_fp8(arl.quantize_mx(x, 'fp8_e4m3'))


# ---- models
@pytest.fixture(scope='module')
def tiny():
    tasks = arl.make_tasks('heldout')[:8]
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    torch.manual_seed(0)
    return arl.TinyAgent(len(tok), 64, 2, 4, 256), tok, tasks


def test_quantize_model_formats_bytes_and_fp32_identity(tiny):
    model, tok, _ = tiny
    ids = torch.randint(0, len(tok), (3, 20), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want_bits = dict(fp32=32, fp8_e4m3=8, mxfp8=8.25, mxfp4=4.25, nvfp4=4.5)
    for fmt in arl.FORMATS:
        q = arl.quantize_model(model, fmt)
        total, n = arl.linear_weight_bytes(q)
        assert 0 <= 8 * total / n - want_bits[fmt] < 0.01
        assert isinstance(q, arl.TinyAgent) and not q.training
        logits = q(ids)
        if fmt == 'fp32':
            assert torch.equal(logits, model(ids))
        else:
            assert not torch.equal(logits, model(ids))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match='fmt'):
        arl.quantize_model(model, 'int4')
    with pytest.raises(TypeError, match='TinyAgent'):
        arl.quantize_model(torch.nn.Linear(2, 2), 'fp32')


def test_quantize_model_refuses_training(tiny):
    model, tok, _ = tiny
    q = arl.quantize_model(model, 'mxfp4')
    with pytest.raises(RuntimeError, match='inference only'):
        q.train()
    q.eval()                                                   # eval stays allowed
    ids = torch.randint(0, len(tok), (2, 10), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match='inference only'):
        q(ids).logsumexp(-1).sum().backward()
    logits, hidden = q(ids, return_hidden=True)
    with pytest.raises(RuntimeError, match='inference only'):
        hidden.sum().backward()
    assert not any(p.requires_grad for p in q.parameters())
    with torch.no_grad():
        assert not q(ids).requires_grad


def test_quantized_model_samples_and_kl(tiny):
    model, tok, tasks = tiny
    cfg = arl.SamplingConfig(group_size=2)
    q = arl.quantize_model(model, 'nvfp4')
    trajs = arl.sample_groups(q, lambda: arl.make_env(cfg), tasks[:2], tok, cfg,
                              torch.Generator().manual_seed(0))
    batch = arl.collate(trajs, tok.pad_id)
    kl = arl.teacher_forced_kl(model, q, batch)
    assert kl.shape == (int(batch['action_mask'].sum()),) and (kl > 0).all()
    assert arl.teacher_forced_kl(model, model, batch).abs().max() < 1e-5


class ParityEnv(arl.ToolEnv):
    """Reward 1 when an episode ends on an even token count: an untrained model then
    gets mixed groups, so the update really runs (as in test_rl_loop.py)."""
    def _finish(self, outcome, reward=0.0):
        return super()._finish(outcome, float(self.length % 2 == 0))


def test_train_rl_quantized_rollout_runs_and_measures_mismatch(tiny, monkeypatch):
    model, tok, tasks = tiny
    monkeypatch.setattr(arl, 'make_env',
                        lambda cfg=None: ParityEnv(cfg.max_turns, cfg.max_tokens))
    cfg = arl.RLConfig(seed=0, tasks_per_step=3, group_size=4, max_tokens=40,
                       max_turns=2, micro_batch_size=8)
    hist = {}
    for fmt in ('fp32', 'mxfp4'):
        m = copy.deepcopy(model)
        hist[fmt] = arl.train_rl_quantized_rollout(m, tasks, tok, cfg, 3, fmt,
                                                   tis_cap=2.0, progress=False)
        assert len(hist[fmt]) == 3
        assert any(r['kept'] for r in hist[fmt])              # the update ran
        assert not all(torch.equal(a, b)
                       for a, b in zip(m.parameters(), model.parameters()))
    fp32_steps = [r for r in hist['fp32'] if 'mismatch_share' in r]
    assert fp32_steps and all(r['mismatch_share'] == 0 and r['mismatch_abs_log'] < 1e-4
                              for r in fp32_steps)
    mx_steps = [r for r in hist['mxfp4'] if 'mismatch_abs_log' in r]
    assert mx_steps and all(r['mismatch_abs_log'] > 1e-3 for r in mx_steps)
    with pytest.raises(ValueError, match='tis_cap'):
        arl.train_rl_quantized_rollout(model, tasks, tok, cfg, 1, 'mxfp4', tis_cap=0)
    with pytest.raises(ValueError, match='steps'):
        arl.train_rl_quantized_rollout(model, tasks, tok, cfg, 0)


# ---- quantisation-aware training: the trainer computes with the sampler's weights
def _qat_model():
    torch.manual_seed(0)
    return arl.TinyAgent(20, d_model=64, n_layers=1, n_heads=2, max_len=16)


@pytest.mark.parametrize('fmt', ['mxfp4', 'nvfp4', 'mxfp8', 'fp8_e4m3', 'fp32'])
def test_trainer_weight_is_the_formats_rounding(fmt):
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(arl.trainer_weight(w, fmt),
                       arl.quantize_weight(w, fmt).dequantize())


@pytest.mark.parametrize('fmt', ['mxfp4', 'nvfp4'])
def test_quantization_aware_forward_is_the_samplers_and_trains_the_master(fmt):
    model = _qat_model()
    ids = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(2))
    sampler = arl.quantize_model(model, fmt)
    n_params = len(list(model.parameters()))
    with arl.quantization_aware(model, fmt) as trainer:
        assert trainer is model and len(list(model.parameters())) == n_params
        assert torch.equal(model(ids), sampler(ids))            # the same weights
        model(ids).square().mean().backward()
        masters = {n: p for n, p in model.named_parameters() if 'original' in n}
        grads = {n: p.grad.clone() for n, p in masters.items()}
    # straight through: the master's gradient is the gradient at the rounded weight
    plain = copy.deepcopy(model)                    # on exit: rounded, plain Linear
    assert all(type(m) is torch.nn.Linear for m in plain.modules()
               if isinstance(m, torch.nn.Linear))
    assert torch.equal(plain(ids), sampler(ids))
    plain(ids).square().mean().backward()
    for name, g in grads.items():
        module = name.split('.parametrizations')[0]
        assert torch.allclose(g, plain.get_submodule(module).weight.grad, atol=1e-7)
    with pytest.raises(ValueError, match='fmt'):
        with arl.quantization_aware(_qat_model(), 'int3'):
            pass


def test_quantization_aware_updates_move_the_master_not_the_rounding():
    model = _qat_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(3))
    with arl.quantization_aware(model, 'mxfp4'):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        model(ids).square().mean().backward()
        opt.step()
        head = model.head.parametrizations.weight
        assert not torch.equal(head.original, before['head.weight'])   # master moved
        assert torch.equal(model.head.weight, arl.trainer_weight(head.original, 'mxfp4'))


# ---- quantised models as files
def test_state_dict_holds_the_stored_tensors_and_the_hash_sees_them(tiny):
    model, _, _ = tiny
    q = arl.quantize_model(model, 'mxfp4')
    sd = q.state_dict()
    assert sd['head.codes'].dtype == torch.uint8                 # two E2M1 codes a byte
    assert sd['head.codes'].shape == (len(sd['tok_emb.weight']), 32)
    assert sd['head.scales'].shape == (len(sd['tok_emb.weight']), 2)   # one per 32
    assert not any(k.endswith('head.weight') for k in sd)        # no float32 copy
    hashes = {f: arl.model_hash(arl.quantize_model(model, f)) for f in arl.FORMATS}
    assert len(set(hashes.values())) == len(arl.FORMATS)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.head.weight.mul_(2)
    assert arl.model_hash(arl.quantize_model(other, 'mxfp4')) != hashes['mxfp4']


@pytest.mark.parametrize('fmt', ['fp32', 'fp8_e4m3', 'mxfp8', 'mxfp4', 'nvfp4'])
def test_save_and_load_quantized_round_trip(tiny, tmp_path, fmt):
    model, tok, _ = tiny
    ids = torch.randint(0, len(tok), (3, 20), generator=torch.Generator().manual_seed(1))
    q = arl.quantize_model(model, fmt)
    path = tmp_path / f'{fmt}.safetensors'
    written = arl.save_quantized(q, path)
    assert written == path.stat().st_size
    state = torch.get_rng_state()
    loaded = arl.load_quantized(path)
    assert torch.equal(torch.get_rng_state(), state)          # loading draws nothing
    assert type(loaded) is arl.QuantizedAgent and loaded.fmt == fmt
    assert not loaded.training
    assert torch.equal(loaded(ids), q(ids))
    assert arl.model_hash(loaded) == arl.model_hash(q)
    assert arl.linear_weight_bytes(loaded) == arl.linear_weight_bytes(q)
    with pytest.raises(RuntimeError, match='inference only'):
        loaded.train()


def test_mxfp4_file_is_smaller_by_the_formats_bits(tiny, tmp_path):
    model, _, _ = tiny
    sizes = {f: arl.save_quantized(arl.quantize_model(model, f), tmp_path / f)
             for f in ('fp32', 'mxfp4')}
    stored, n = arl.linear_weight_bytes(arl.quantize_model(model, 'mxfp4'))
    # the file shrinks by the linear weights' saving, up to the metadata's bytes
    saving = 4 * n - stored
    assert abs(sizes['fp32'] - sizes['mxfp4'] - saving) < 2048


def test_save_and_load_quantized_refuse_bad_input(tiny, tmp_path):
    model, _, _ = tiny
    with pytest.raises(TypeError, match='QuantizedAgent'):
        arl.save_quantized(model, tmp_path / 'plain.safetensors')
    from safetensors.torch import save_file
    save_file(model.state_dict(), tmp_path / 'plain.safetensors')
    with pytest.raises(ValueError, match='save_quantized'):
        arl.load_quantized(tmp_path / 'plain.safetensors')
