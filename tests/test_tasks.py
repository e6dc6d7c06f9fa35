"""Unit tests for agentrl.tasks (chapter 2): tasks, calculator, tokenizer, environment."""
import math

import pytest
from hypothesis import given, settings, strategies as st

import agentrl as arl


@pytest.fixture(scope="module")
def all_tasks():
    return arl.make_tasks("all")


@pytest.fixture(scope="module")
def tok(all_tasks):
    return arl.build_tokenizer(all_tasks)


# ---------------------------------------------------------------- tasks

def test_make_tasks_is_deterministic():
    assert arl.make_tasks("train") == arl.make_tasks("train")
    assert arl.make_tasks("heldout") == arl.make_tasks("heldout")
    assert arl.make_tasks("train", seed=1) != arl.make_tasks("train", seed=0)


def test_splits_sizes_and_disjoint(all_tasks):
    train, heldout = arl.make_tasks("train"), arl.make_tasks("heldout")
    assert len(train) == 48 * len(arl.FAMILIES) and len(heldout) == 8 * len(arl.FAMILIES)
    assert all_tasks == train + heldout
    ident = lambda t: (t.prompt, t.store)  # noqa: E731
    assert not {ident(t) for t in train} & {ident(t) for t in heldout}
    assert len({ident(t) for t in all_tasks}) == len(all_tasks)


def test_unique_names_and_every_family(all_tasks):
    assert len({t.name for t in all_tasks}) == len(all_tasks)
    for split in ("train", "heldout"):
        assert {t.family for t in arl.make_tasks(split)} == set(arl.FAMILIES)
    assert all(t.name.startswith(t.family + "-") for t in all_tasks)


@settings(max_examples=25, deadline=None)
@given(n_train=st.integers(0, 12), n_heldout=st.integers(0, 6), seed=st.integers(0, 10**6),
       split=st.sampled_from(["train", "heldout"]))
def test_every_prefix_is_round_robin_by_family(n_train, n_heldout, seed, split):
    tasks = arl.make_tasks(split, n_train=n_train, n_heldout=n_heldout, seed=seed)
    F = len(arl.FAMILIES)
    assert [t.family for t in tasks] == list(arl.FAMILIES) * (len(tasks) // F)
    for k in range(len(tasks) // F + 1):                      # k of each family in tasks[:k*F]
        counts = {f: sum(t.family == f for t in tasks[:k * F]) for f in arl.FAMILIES}
        assert set(counts.values()) == {k}


def test_small_splits_and_bad_arguments():
    tasks = arl.make_tasks("all", n_train=3, n_heldout=0, seed=5)
    assert len(tasks) == 3 * len(arl.FAMILIES)
    assert arl.make_tasks("heldout", n_train=3, n_heldout=0) == []
    with pytest.raises(ValueError, match="split"):
        arl.make_tasks("test")
    with pytest.raises(ValueError, match="n_train"):
        arl.make_tasks("train", n_train=-1)
    with pytest.raises(ValueError, match="n_heldout"):
        arl.make_tasks("train", n_heldout=1.5)


def test_answers_are_right(all_tasks):
    for t in all_tasks:
        store = dict(t.store)
        if t.family == "max":
            assert t.answer == str(max(int(x) for x in t.prompt.split()[1:]))
        elif t.family == "lookup":
            assert t.answer == str(store[t.prompt[:-1]])
        elif t.family == "sum":
            assert t.answer == str(sum(store[k] for k in t.prompt.split("+")))
        elif t.family == "chain":
            k, op, c = t.prompt[:2], t.prompt[2], int(t.prompt[3:])
            assert t.answer == str(store[k] + c if op == "+" else store[k] * c)
        else:
            assert t.answer == str(arl.calculate(t.prompt))


# ---------------------------------------------------------------- calculator

def _expressions(depth=0):
    """Strategy: (text, value) of a + - * expression; the value uses Python's integer arithmetic."""
    number = st.integers(0, 10**4).map(lambda n: (str(n), n))
    if depth >= 3:
        factor = number
    else:
        sub = st.deferred(lambda: _expressions(depth + 1))
        factor = st.one_of(number, sub.map(lambda e: (f"({e[0]})", e[1])),
                           number.map(lambda e: ("-" + e[0], -e[1])))
    term = st.lists(factor, min_size=1, max_size=3).map(
        lambda fs: ("*".join(t for t, _ in fs), math.prod(v for _, v in fs)))
    signed = st.tuples(st.sampled_from("+-"), term)
    return st.tuples(term, st.lists(signed, max_size=3)).map(
        lambda x: (x[0][0] + "".join(s + t for s, (t, _) in x[1]),
                   x[0][1] + sum(v if s == "+" else -v for s, (_, v) in x[1])))


@settings(max_examples=150, deadline=None)
@given(_expressions(), st.booleans())
def test_calculate_matches_python(expr, spaced):
    text, value = expr
    if spaced:  # spaces between operators are ignored
        text = text.replace("+", " + ").replace("*", " * ")
    assert arl.calculate(text) == value


@pytest.mark.parametrize("bad", ["", "1+", "+", "(1", "1)", "2**3", "7/2", "1 2", "k1", "()", "1+*2",
                                 "(" * 200 + "1" + ")" * 200, "-" * 500 + "1"])
def test_calculate_rejects_malformed(bad):
    with pytest.raises(ValueError):
        arl.calculate(bad)


def test_calculate_type_error():
    with pytest.raises(TypeError, match="expr"):
        arl.calculate(12)


def test_run_tool():
    store = {"k1": 42}
    assert arl.run_tool("get k1", store) == "42"
    assert arl.run_tool("calc 6*7", store) == "42"
    for bad in ["get k2", "calc 6*", "calc", "search k1", "", "get"]:
        assert arl.run_tool(bad, store) == arl.ERROR


# ---------------------------------------------------------------- tokenizer

def test_vocabulary(tok):
    assert tok.itos[:len(arl.SPECIAL_TOKENS)] == list(arl.SPECIAL_TOKENS)
    assert tok.pad_id == 0 and tok.bos_id == 1
    assert len(tok) == len(set(tok.itos))
    assert all(tok.stoi[s] == i for i, s in enumerate(tok.itos))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_tokenizer_round_trip(tok, data):
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=60))
    assert tok.encode(tok.decode(ids)) == ids
    text = "".join(data.draw(st.lists(st.sampled_from(tok.itos), max_size=60)))
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_round_trip_demonstrations(tok, all_tasks):
    for t in all_tasks:
        text = arl.demonstration(t)
        assert tok.decode(tok.encode(text)) == text


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=5).filter(lambda s: any(c not in "0123456789+-*() ?acegklmortx" for c in s)))
def test_tokenizer_rejects_unknown_characters(tok, text):
    if all(p in tok.stoi for p in arl.split_tokens(text)):  # e.g. text that spells a special token
        return
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode(text)


def test_tokenizer_errors(tok):
    with pytest.raises(ValueError, match="'M'"):
        tok.encode("Max")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([len(tok)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(TypeError):
        tok.encode(None)
    with pytest.raises(ValueError, match="single characters"):
        arl.Tokenizer(["ab"])


# ---------------------------------------------------------------- environment

def test_demonstrations_reach_reward_one(all_tasks):
    env = arl.make_env()
    for t in all_tasks:
        turns, reward = arl.play_episode(env, t, arl.expert_actions(t))
        assert reward == 1.0 and env.outcome == "correct" and env.done
        assert "".join(text for _, text in turns) == arl.demonstration(t)
        assert env.turns == len(t.calls)


def _task(family):
    return next(t for t in arl.make_tasks("train") if t.family == family)


def test_malformed_call_is_an_observation():
    t, env = _task("calc"), arl.make_env()
    env.reset(t)
    for action in ["<call>calc 1+</call>", "<call>nope</call>", "junk</call>", "<call></call>"]:
        obs, done, reward = env.step(action)
        assert (obs, done, reward) == ("<obs>error</obs>", False, 0.0)
    _, done, reward = env.step(f"<ans>{t.answer}</ans>")
    assert done and reward == 1.0


def test_wrong_answer():
    t, env = _task("lookup"), arl.make_env()
    env.reset(t)
    for answer in [" " + t.answer, t.answer + "0", ""]:
        env.reset(t)
        assert env.step(f"<ans>{answer}</ans>") == ("", True, 0.0) and env.outcome == "wrong"
    env.reset(t)
    assert env.step("</ans>")[2] == 0.0 and env.outcome == "wrong"


def test_turn_limit():
    t = _task("lookup")
    env = arl.make_env(arl.EnvConfig(max_turns=2, max_tokens=1000))
    env.reset(t)
    assert not env.step("<call>get k0</call>")[1]
    assert not env.step("<call>get k0</call>")[1]
    assert env.step("<call>get k0</call>") == ("", True, 0.0)
    assert env.outcome == "turn_limit"
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<ans>1</ans>")


def test_token_limit():
    t = _task("calc")
    env = arl.make_env(arl.EnvConfig(max_turns=6, max_tokens=20))
    prompt = env.reset(t)
    room = 20 - len(arl.split_tokens(prompt))
    assert env.step("1" * room) == ("", True, 0.0) and env.outcome == "token_limit"
    # an observation that would cross the limit also ends the episode
    env.reset(t)
    action = "<call>calc " + "1" * (room - 8) + "</call>"          # one token below the limit
    assert env.length + len(arl.split_tokens(action)) == 19
    assert env.step(action)[1] and env.outcome == "token_limit"
    # an action below the limit must end in </call> or </ans>
    env.reset(t)
    with pytest.raises(ValueError, match="must end"):
        env.step("<call>calc 1")


def test_env_errors():
    with pytest.raises(ValueError):
        arl.ToolEnv(max_turns=-1)
    with pytest.raises(ValueError):
        arl.ToolEnv(max_tokens=0)
    with pytest.raises(RuntimeError):
        arl.ToolEnv().step("<ans>1</ans>")
    with pytest.raises(ValueError, match="still running"):
        arl.play_episode(arl.make_env(), _task("calc"), ["<call>calc 1</call>"])
