"""Errors that help: bad input raises TypeError / ValueError naming the argument and the
limit, at the call the user made (configs when they are made)."""
import math

import pytest
import torch

import agentrl as arl


@pytest.mark.parametrize('cls, field, bad, error', [
    (arl.EnvConfig, 'max_turns', -1, ValueError),
    (arl.EnvConfig, 'max_tokens', 0, ValueError),
    (arl.EnvConfig, 'max_tokens', 16.5, TypeError),
    (arl.SamplingConfig, 'group_size', 0, ValueError),
    (arl.SamplingConfig, 'tasks_per_step', 0, ValueError),
    (arl.SamplingConfig, 'tasks_per_step', True, TypeError),
    (arl.SamplingConfig, 'temperature', 0.0, ValueError),
    (arl.SamplingConfig, 'temperature', math.nan, ValueError),
    (arl.SamplingConfig, 'temperature', '1', TypeError),
    (arl.RLConfig, 'lr', math.nan, ValueError),
    (arl.RLConfig, 'lr', -1.0, ValueError),
    (arl.RLConfig, 'lr', math.inf, ValueError),
    (arl.RLConfig, 'clip_eps', -0.2, ValueError),
    (arl.RLConfig, 'max_grad_norm', 0.0, ValueError),
    (arl.RLConfig, 'max_grad_norm', math.nan, ValueError),
    (arl.RLConfig, 'seed', -1, ValueError),
    (arl.RLConfig, 'epochs', 1.0, TypeError),
    (arl.RLConfig, 'tasks_per_step', 0, ValueError),     # inherited checks run too
    (arl.OPDConfig, 'group_size', 0, ValueError),
])
def test_configs_refuse_bad_fields_when_made(cls, field, bad, error):
    with pytest.raises(error, match=field):
        cls(**{field: bad})


def test_configs_accept_the_limits_the_book_uses():
    arl.RLConfig(lr=0.0, max_grad_norm=math.inf, clip_eps=0.0)   # no step, no clipping
    arl.SamplingConfig(group_size=1, temperature=arl.GREEDY_TEMPERATURE)
    arl.EnvConfig(max_turns=0, max_tokens=1)


def test_build_tokenizer_names_its_argument():
    with pytest.raises(TypeError, match='tasks must be a list of Task'):
        arl.build_tokenizer('abc')
    with pytest.raises(TypeError, match='tasks must be a list of Task, got a int'):
        arl.build_tokenizer([1, 2])
    tasks = arl.make_tasks('train')[:3]
    assert arl.build_tokenizer(iter(tasks)).itos == arl.build_tokenizer(tasks).itos


def test_sample_groups_names_a_missing_tokenizer():
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    model = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=64)
    cfg = arl.SamplingConfig(group_size=1, max_tokens=20)
    with pytest.raises(TypeError, match='tok must have what arl.TokenizerLike lists'):
        arl.sample_groups(model, lambda: arl.make_env(cfg), arl.make_tasks('train')[:1],
                          None, cfg, torch.Generator().manual_seed(0))


@pytest.mark.parametrize('bad', [math.nan, math.inf, -math.inf])
def test_bootstrap_interval_refuses_non_finite_values(bad):
    with pytest.raises(ValueError, match='finite'):
        arl.bootstrap_interval([0.1, bad, 0.3])


# ---------------------------------------------------------------- the cache's code key

SOURCE = '''"""Module docstring."""
import math


def f(x):
    """Docstring."""
    # a comment
    return math.sqrt(x) + 1


class C:
    """Class docstring."""
    def g(self):
        """Only a docstring."""
'''


def test_code_fingerprint_ignores_docstrings_comments_and_layout():
    same = (SOURCE.replace('Docstring.', 'Another docstring, longer.')
            .replace('# a comment', '# another comment\n\n')
            .replace('"""Module docstring."""', '"""Changed."""'))
    assert arl.code_fingerprint(same) == arl.code_fingerprint(SOURCE)


@pytest.mark.parametrize('old, new', [('+ 1', '+ 2'), ('math.sqrt(x)', 'math.exp(x)'),
                                      ('def g(self):', 'def h(self):')])
def test_code_fingerprint_changes_with_any_statement(old, new):
    assert arl.code_fingerprint(SOURCE.replace(old, new)) != arl.code_fingerprint(SOURCE)


def test_run_modules_cover_what_chapter_7_runs_execute():
    # chapter 7's loop calls arl.rl_update and arl.train_rl; wherever those are defined
    # must be in the key of its cached runs (and of every chapter that extends them)
    for name in ('rl_update', 'train_rl', 'sample_step', 'compute_advantages',
                 'sample_groups', 'evaluate', 'set_torch_threads'):
        module = getattr(arl, name).__module__.split('.')[-1]
        assert module in arl.RUN_MODULES, (name, module)
    assert arl.code_hash() == arl.source_hash(arl.RUN_MODULES)
    assert arl.source_hash(('tasks', 'tasks')) == arl.source_hash(('tasks',))
    assert arl.RUN_MODULES == arl.book_modules('rl_loop')


def test_book_modules_are_the_book_up_to_a_chapter():
    assert arl.book_modules('introduction') == ('introduction',)
    assert arl.book_modules('kl') == arl.RUN_MODULES + ('off_policy', 'kl')
    assert arl.book_modules('real_models') == arl._MODULES
    assert arl.distill_modules() == arl.book_modules('distillation')
    with pytest.raises(ValueError, match='upto'):
        arl.book_modules('nope')


def test_a_changed_statement_in_any_module_up_to_the_owner_changes_the_key(monkeypatch):
    from agentrl import sft
    before = {m: arl.code_hash(arl.book_modules(m)) for m in ('rl_loop', 'kl', 'scaling')}
    real = sft._module_code
    monkeypatch.setattr(sft, '_module_code', lambda m: real(m) + ('x' if m == 'kl' else ''))
    after = {m: arl.code_hash(arl.book_modules(m)) for m in ('rl_loop', 'kl', 'scaling')}
    assert after['rl_loop'] == before['rl_loop']          # kl is after chapter 7
    assert after['kl'] != before['kl'] and after['scaling'] != before['scaling']


def test_sample_groups_takes_any_tokenizer_with_the_protocol():
    """TokenizerLike (chapter 2) names what the engine needs: an object that is not
    arl.Tokenizer but has those members samples the very same episodes."""
    tok = arl.build_tokenizer(arl.make_tasks('all'))

    class Wrapped:                  # the members TokenizerLike lists, and nothing else
        def __init__(self, inner):
            self.itos, self.stoi = inner.itos, inner.stoi
            self.pad_id, self.bos_id = inner.pad_id, inner.bos_id
            self.encode, self.decode = inner.encode, inner.decode
            self._n = len(inner)

        def __len__(self):
            return self._n

    wrapped = Wrapped(tok)
    assert isinstance(wrapped, arl.TokenizerLike) and not isinstance(wrapped, arl.Tokenizer)
    torch.manual_seed(0)
    model = arl.TinyAgent(len(tok), d_model=16, n_layers=1, n_heads=2, max_len=64)
    cfg = arl.SamplingConfig(group_size=2, max_tokens=40)
    tasks = arl.make_tasks('train')[:2]
    runs = [arl.sample_groups(model, lambda: arl.make_env(cfg), tasks, t, cfg, seed=3)
            for t in (tok, wrapped)]
    assert [t.ids.tolist() for t in runs[0]] == [t.ids.tolist() for t in runs[1]]
    del Wrapped.__len__             # one member missing: refused, naming the protocol
    with pytest.raises(TypeError, match='TokenizerLike'):
        arl.sample_groups(model, lambda: arl.make_env(cfg), tasks, wrapped, cfg, seed=3)
