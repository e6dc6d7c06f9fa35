"""Chapter 22's BPE tokenizer, token-in-token-out demonstrations, the retokenisation drift,
the transformers adapter (HFAgent) and the cost projection (agentrl.real_models)."""
import copy
import math

import pytest
import torch

import agentrl as arl

pytest.importorskip('transformers')


@pytest.fixture(scope='module')
def tok():
    return arl.train_bpe(arl.make_demo_tasks(60), vocab_size=128)


@pytest.fixture(scope='module')
def agent(tok):
    return arl.new_hf_agent(tok, seed=0, hidden_size=32, heads=2, kv_heads=1,
                            intermediate_size=64, layers=1)


def texts():
    return [arl.demonstration(t) for t in arl.make_tasks('all')]


# ---- the tokenizer

def test_plain_segments_drop_the_markers():
    text = '<bos>max ab 3<call>get ab</call><obs>7</obs><ans>7</ans>'
    assert arl.plain_segments([text]) == ['max ab 3', 'get ab', '7', '7']


def test_bpe_is_lossless_deterministic_and_keeps_markers_whole(tok):
    assert isinstance(tok, arl.TokenizerLike) and len(tok) == 128
    assert arl.train_bpe(arl.make_demo_tasks(60), vocab_size=128).itos == tok.itos
    for marker in arl.SPECIAL_TOKENS:
        assert tok.encode(marker) == [tok.stoi[marker]]
    for text in texts():
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ''.join(tok.itos[i] for i in ids) == text
    # every character of chapter 2's vocabulary encodes, one token per digit
    chars = [c for c in arl.build_tokenizer(arl.make_tasks('all')).itos
             if c not in arl.SPECIAL_TOKENS]
    assert all(len(tok.encode(c)) == 1 for c in chars)
    assert len(tok.encode('1234')) == 4
    merged = arl.train_bpe(arl.make_demo_tasks(60), 128, split_digits=False)
    pair = next(t for t in merged.itos if len(t) == 2 and t.isdigit())
    assert merged.encode(pair) == [merged.stoi[pair]] and len(tok.encode(pair)) == 2


def test_transformers_loads_the_same_ids(tok, tmp_path):
    from transformers import PreTrainedTokenizerFast
    tok.save(tmp_path / 'tokenizer.json')
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / 'tokenizer.json'))
    again = arl.BPETokenizer.from_file(tmp_path / 'tokenizer.json')
    for text in texts()[:50]:
        assert fast.encode(text, add_special_tokens=False) == tok.encode(text)
        assert again.encode(text) == tok.encode(text)


def test_tokenizer_refuses_what_it_cannot_encode(tok):
    with pytest.raises(ValueError, match="'Ä' is not in the alphabet"):
        tok.encode('get Ä')
    with pytest.raises(TypeError, match='text must be a str'):
        tok.encode(b'get')
    with pytest.raises(ValueError, match='outside the vocabulary'):
        tok.decode([len(tok)])
    with pytest.raises(ValueError, match='vocab_size must hold'):
        arl.train_bpe(arl.make_demo_tasks(10), vocab_size=20)
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    with pytest.raises(ValueError, match='lacks the markers'):
        arl.BPETokenizer(Tokenizer(models.BPE()))
    # a normaliser that composes 'e' + U+0301 into one character: each character
    # round-trips alone, the text does not
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(['get ab'], trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(arl.SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    with pytest.raises(ValueError, match='does not decode back'):
        arl.BPETokenizer(backend).encode('cafe\u0301')


# ---- demonstrations as ids

def test_segments_rebuild_the_text_and_mark_the_policy():
    for text in texts()[:100]:
        parts = arl.episode_segments(text)
        assert ''.join(p for p, _ in parts) == text
        for part, is_policy in parts:
            assert is_policy == part.startswith(('<call>', '<ans>'))
            assert not part.startswith('<obs>') or part.endswith('</obs>')


def test_demonstration_ids_are_the_samplers_ids(tok):
    for task in arl.make_tasks('heldout')[:40]:
        demo = arl.demonstration_ids(task, tok)
        parts = arl.episode_segments(arl.demonstration(task))
        assert tok.decode(demo.ids) == arl.demonstration(task)
        expected = []                       # each segment encoded on its own
        for part, _ in parts:
            expected += tok.encode(part)
        assert demo.ids.tolist() == expected
        prompt = tok.encode(arl.make_env().reset(task))
        assert demo.ids[:len(prompt)].tolist() == prompt
        policy = ''.join(tok.itos[i] for i, m in zip(demo.ids[1:].tolist(),
                                                     demo.action_mask) if m)
        assert policy == ''.join(p for p, own in parts if own)


def test_train_on_demonstrations_lowers_the_loss(tok):
    model = arl.new_hf_agent(tok, seed=3, hidden_size=32, heads=2, kv_heads=1,
                             intermediate_size=64, layers=1)
    demos = [arl.demonstration_ids(t, tok) for t in arl.make_tasks('train')[:16]]
    losses = arl.train_on_demonstrations(model, demos, tok.pad_id, steps=40,
                                         batch_size=8, lr=1e-2, progress=False)
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert not model.training
    with pytest.raises(ValueError, match='demos must hold'):
        arl.train_on_demonstrations(model, [], tok.pad_id)
    with pytest.raises(ValueError, match='steps must be >= 1'):
        arl.train_on_demonstrations(model, demos, tok.pad_id, steps=0)


# ---- the adapter

def test_cache_path_matches_the_full_forward_and_keep_drops_rows(agent, tok):
    ids = torch.randint(len(tok), (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = agent(ids)
        cache = agent.new_cache(3)
        parts = [agent(ids[:, :5], cache=cache)]
        parts += [agent(ids[:, t:t + 1], cache=cache) for t in range(5, 24)]
        assert cache.length == 24
        assert (torch.cat(parts, 1) - full).abs().max() < 1e-4
        cache = agent.new_cache(3)
        agent(ids[:, :5], cache=cache)
        cache.keep(torch.tensor([2, 0]))
        rest = torch.cat([agent(ids[[2, 0], t:t + 1], cache=cache)
                          for t in range(5, 24)], 1)
        assert (rest - full[[2, 0], 5:]).abs().max() < 1e-4
        logits, hidden = agent(ids, return_hidden=True)
        assert torch.allclose(logits, hidden @ agent.head.weight.T, atol=1e-5)
        assert torch.equal(agent.hidden(ids), hidden)


def test_adapter_refuses_what_it_does_not_support(agent, tok):
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match='takes no mask'):
        agent(ids, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match='integer tensor'):
        agent(ids.float())
    with pytest.raises(ValueError, match='exceeds max_len'):
        agent(torch.zeros(1, agent.max_len + 1, dtype=torch.long))
    cache = agent.new_cache(2, max_len=5)
    with pytest.raises(ValueError, match='exceeds max_len=5'):
        agent(torch.zeros(2, 6, dtype=torch.long), cache=cache)
    cache.lengths = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match='lockstep'):
        agent(ids[:, :1], cache=cache)
    with pytest.raises(ValueError, match='hidden_size % heads'):
        arl.qwen3_config(100, hidden_size=30, heads=4)


def test_tied_weights_are_stored_once_and_round_trip(agent, tmp_path):
    from safetensors.torch import load_file, save_file
    state = agent.state_dict()
    assert len({t.data_ptr() for t in state.values()}) == len(state)
    save_file(state, tmp_path / 'w.safetensors')
    other = copy.deepcopy(agent)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(load_file(tmp_path / 'w.safetensors'))
    assert arl.model_hash(other) == arl.model_hash(agent)
    assert other.head.weight.data_ptr() == other.lm.get_input_embeddings().weight.data_ptr()
    with pytest.raises(RuntimeError, match='missing keys'):
        other.load_state_dict({k: v for k, v in state.items() if 'norm' not in k})
    assigned = copy.deepcopy(agent)
    assigned.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    assert assigned.head.weight is assigned.lm.get_input_embeddings().weight
    assert arl.model_hash(assigned) == arl.model_hash(agent)


def test_sample_groups_runs_on_the_adapter_and_recomputation_matches(agent, tok):
    cfg = arl.SamplingConfig(group_size=3, max_tokens=48)
    tasks = arl.make_tasks('heldout')[:4]
    trajs = arl.sample_groups(agent, lambda: arl.make_env(cfg), tasks, tok, cfg, seed=5)
    again = arl.sample_groups(agent, lambda: arl.make_env(cfg), tasks, tok, cfg, seed=5)
    assert [t.ids.tolist() for t in trajs] == [t.ids.tolist() for t in again]
    assert len(trajs) == 12 and any(t.action_mask.sum() > 0 for t in trajs)
    for t, task in zip(trajs, [t for t in tasks for _ in range(3)]):
        prompt = tok.encode(arl.make_env(cfg).reset(task))
        assert t.ids[:len(prompt)].tolist() == prompt
    drift = arl.retokenization_drift(agent, trajs, tok)
    assert drift['token_error'] < 1e-4 and drift['kept'].abs().max() < 1e-3


# ---- re-encoding

def _episode(tok, pieces):
    """A Trajectory from (text, sampled) pieces, each encoded on its own (the policy's
    pieces token by token, as a policy that spells in characters would write them)."""
    ids, mask = [], []
    for text, sampled in pieces:
        new = [tok.stoi[c] for c in arl.split_tokens(text)] if sampled else tok.encode(text)
        ids += new
        mask += [float(sampled)] * len(new)
    return arl.Trajectory(ids=torch.tensor(ids), action_mask=torch.tensor(mask[1:]),
                          sample_logp=torch.zeros(len(ids) - 1), reward=0.0)


def test_retokenized_merges_what_the_policy_spelled_in_pieces(tok):
    spelled = _episode(tok, [('<bos>max ab 3 cd 4', False), ('<call>get ab</call>', True),
                             ('<obs>3</obs>', False), ('<ans>3</ans>', True)])
    ids, mask = arl.retokenized(spelled, tok)
    assert tok.decode(ids) == tok.decode(spelled.ids)
    assert len(ids) < len(spelled.ids)                  # 'g', 'e', 't' became 'get'
    policy = ''.join(tok.itos[i] for i, m in zip(ids[1:].tolist(), mask) if m)
    assert policy == '<call>get ab</call><ans>3</ans>'
    canonical = arl.Trajectory(ids=torch.tensor(tok.encode(tok.decode(spelled.ids))),
                               action_mask=mask, sample_logp=torch.zeros(len(mask)),
                               reward=0.0)
    again, again_mask = arl.retokenized(canonical, tok)
    assert torch.equal(again, canonical.ids) and torch.equal(again_mask, mask)


def test_drift_flags_changed_episodes_and_their_log_ratio(agent, tok):
    spelled = _episode(tok, [('<bos>max ab 3 cd 4', False), ('<call>get ab</call>', True)])
    with torch.no_grad():
        logp = arl.sequence_log_probs(agent, spelled.ids[None])[0]
    spelled.sample_logp = logp * spelled.action_mask
    drift = arl.retokenization_drift(agent, [spelled], tok)
    assert drift['changed'].tolist() == [True]
    assert abs(drift['kept'].item()) < 1e-5
    assert abs(drift['drift'].item()) > 1e-3


# ---- the runs

def test_hf_recipe_checks_keys_and_reads_the_portable_seed(monkeypatch):
    with pytest.raises(ValueError, match='unknown recipe keys'):
        arl.hf_recipe(dict(width=3))
    monkeypatch.setenv(arl.RECIPE_SEED_VARIABLE, '7')
    assert arl.hf_recipe()['seed'] == 7 and arl.hf_recipe(dict(seed=2))['seed'] == 2


def test_hf_base_and_rl_are_cached(monkeypatch, tmp_path):
    monkeypatch.setenv('AGENTRL_CACHE', str(tmp_path))
    monkeypatch.delenv(arl.RECIPE_SEED_VARIABLE, raising=False)
    recipe = dict(vocab_size=96, hidden_size=32, heads=2, kv_heads=1,
                  intermediate_size=64, layers=1, demos_per_family=8, steps=3,
                  batch_size=4)
    tok = arl.hf_tokenizer(recipe)
    base, losses = arl.make_hf_base(tok, recipe)
    again, losses_again = arl.make_hf_base(tok, recipe)
    assert len(losses) == 3 and losses == losses_again
    assert arl.model_hash(base) == arl.model_hash(again)
    assert len(list(tmp_path.glob('hf_base-*.safetensors'))) == 1
    cfg = arl.RLConfig(tasks_per_step=2, group_size=2, max_tokens=48)
    tasks = arl.make_tasks('train')[:6]
    model, history = arl.train_rl_on_hf(base, tasks, tok, cfg, 1)
    model2, history2 = arl.train_rl_on_hf(base, tasks, tok, cfg, 1)
    assert history == history2 and arl.model_hash(model) == arl.model_hash(model2)
    assert len(list(tmp_path.glob('hf_rl-*.json'))) == 1


# ---- costs

@pytest.mark.parametrize('name', sorted(arl.QWEN3_RELEASED))
def test_model_shapes_count_what_transformers_builds(name):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(**arl.QWEN3_RELEASED[name])
    with torch.device('meta'):
        lm = Qwen3ForCausalLM(config)
    shapes = arl.model_shapes(config)
    assert shapes == arl.model_shapes(arl.QWEN3_RELEASED[name])
    assert shapes['params'] == sum(p.numel() for p in lm.parameters())
    embed = lm.model.embed_tokens.weight.numel()
    norms = sum(p.numel() for n, p in lm.named_parameters() if 'norm' in n)
    head = 0 if config.tie_word_embeddings else lm.lm_head.weight.numel()
    assert shapes['matrix'] == shapes['params'] - norms - head     # one [V, h] counted
    assert shapes['matrix'] > shapes['params'] - embed - norms - head   # the head's


def test_project_step_orders_formats_and_fuses_logits():
    c = arl.QWEN3_RELEASED['Qwen3-8B']
    steps = {r: arl.project_step(c, r) for r in arl.WEIGHT_BYTES}
    assert (steps['mxfp4']['rollout_weights'] < steps['fp8']['rollout_weights']
            < steps['bf16']['rollout_weights'])
    assert steps['mxfp4']['decode'] < steps['fp8']['decode'] < steps['bf16']['decode']
    assert steps['bf16']['train'] == 3 * steps['bf16']['old_logp']
    fused = arl.project_step(c, fused_kl=True, micro_tokens=8192, chunk=512)
    plain = arl.project_step(c, micro_tokens=8192)
    assert math.isclose(plain['logits'] / fused['logits'], 16)
    assert plain['train_state'] == 16 * arl.model_shapes(c)['params']
    with pytest.raises(ValueError, match='rollout must be one of'):
        arl.project_step(c, 'int3')
    with pytest.raises(ValueError, match='sampled'):
        arl.project_step(c, tokens=100, sampled=200)
    with pytest.raises(ValueError, match='mfu must be > 0'):
        arl.project_step(c, mfu=0)
    with pytest.raises(ValueError, match='busy must be <= 1'):
        arl.project_step(c, busy=2)
    with pytest.raises(ValueError, match='config lacks'):
        arl.model_shapes(dict(c, head_dim=None))
    small = arl.QWEN3_RELEASED['Qwen3-0.6B']
    taught = arl.project_step(small, teacher=c)
    alone = arl.project_step(small)
    assert taught['teacher'] > 5 * alone['teacher']             # an 8B teacher's pass
    assert alone['teacher'] == alone['old_logp']                # a teacher of its size
    half, full = (arl.project_step(c, busy=b)['decode'] for b in (0.5, 1.0))
    assert math.isclose(half, 2 * full)


def test_retokenized_needs_character_spans():
    char_tok = arl.build_tokenizer(arl.make_tasks('all'))
    demo = arl.demonstration_trajectory(arl.make_tasks('train')[0], char_tok)
    with pytest.raises(TypeError, match='encode_offsets'):
        arl.retokenized(demo, char_tok)
