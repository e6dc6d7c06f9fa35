"""Unit tests for agentrl.tasks (chapter 2): tasks, calculator, tokenizer, environment."""
import math
import re
from collections import Counter

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

KEY_FAMILIES = ("lookup", "chain", "sum")
SPLITS3 = ("train", "heldout", "ood")


@pytest.fixture(scope="module")
def splits():
    return {s: arl.make_tasks(s) for s in SPLITS3}


def keys_in(task):
    """The store keys a prompt names, in order."""
    return [w for w in re.findall("[a-z]+", task.prompt) if w in arl.KEYS]


def held(task):
    """The store as a dict, without the transient-failure entries."""
    return {k: v for k, v in task.store if not k.startswith(arl.FAIL)}


def flaky(task):
    """{key: n}: the first n `get key` calls fail."""
    return {k[len(arl.FAIL + "get "):]: n for k, n in task.store if k.startswith(arl.FAIL)}


def oracle(task):
    """The answer computed from prompt and store alone (Python's own arithmetic)."""
    store = held(task)
    if task.family == "max":
        return str(max(int(store.get(i, i)) for i in task.prompt.split()[1:]))
    if task.family == "lookup":
        return next((str(store[k]) for k in keys_in(task) if k in store), arl.NONE)
    if task.family in ("chain", "sum") and any(k not in store for k in keys_in(task)):
        return arl.NONE
    expr = re.sub("[a-z]+", lambda m: str(store[m.group()]), task.prompt)
    assert re.fullmatch(r"[0-9]+([-+*][0-9]+)*", expr), expr  # no parentheses, no unary -
    parts = re.split("([-+])", expr)                            # terms and their signs
    terms = [math.prod(int(f) for f in term.split("*")) for term in parts[::2]]
    return str(terms[0] + sum(v if sign == "+" else -v
                              for sign, v in zip(parts[1::2], terms[1:])))


def size(task):
    """Items (max), operands (calc) or keys (lookup, chain, sum) of a task."""
    if task.family == "max":
        return len(task.prompt.split()) - 1
    if task.family == "calc":
        return len(re.findall("[0-9]+", task.prompt))
    return len(keys_in(task))


def test_make_tasks_is_deterministic():
    for split in SPLITS3:
        assert arl.make_tasks(split) == arl.make_tasks(split)
    assert arl.make_tasks("train", seed=1) != arl.make_tasks("train", seed=0)
    assert arl.make_tasks("ood", seed=1) != arl.make_tasks("ood", seed=0)


def test_splits_sizes(all_tasks, splits):
    F = len(arl.FAMILIES)
    assert len(splits["train"]) == 48 * F
    assert len(splits["heldout"]) == len(splits["ood"]) == 32 * F  # >= 32 per family
    assert all_tasks == splits["train"] + splits["heldout"]
    for split in SPLITS3:
        counts = Counter(t.family for t in splits[split])
        assert set(counts) == set(arl.FAMILIES) and len(set(counts.values())) == 1
    assert min(Counter(t.family for t in splits["heldout"]).values()) >= 32


def test_splits_share_no_prompt_and_heldout_prompts_unique(splits):
    prompts = {s: [t.prompt for t in splits[s]] for s in SPLITS3}
    for a, b in [("train", "heldout"), ("train", "ood"), ("heldout", "ood")]:
        assert not set(prompts[a]) & set(prompts[b]), (a, b)
    assert len(set(prompts["heldout"])) == len(prompts["heldout"])
    assert len(set(prompts["ood"])) == len(prompts["ood"])
    ident = [(t.prompt, t.store) for t in splits["train"]]      # train: distinct pairs
    assert len(set(ident)) == len(ident)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 50))
def test_any_seed_splits_disjoint_and_demonstrations_solve(seed):
    splits = {s: arl.make_tasks(s, seed=seed) for s in SPLITS3}
    prompts = {s: {t.prompt for t in ts} for s, ts in splits.items()}
    assert not prompts["train"] & prompts["heldout"]
    assert not (prompts["train"] | prompts["heldout"]) & prompts["ood"]
    assert len(prompts["heldout"]) == len(splits["heldout"])
    env = arl.make_env()
    for t in [t for ts in splits.values() for t in ts]:
        assert len(t.calls) <= arl.MAX_EXPERT_CALLS
        assert arl.play_episode(env, t, arl.expert_actions(t))[1] == 1.0, t
        assert t.answer == oracle(t), t


def test_unique_names_and_every_family(all_tasks, splits):
    names = [t.name for t in all_tasks + splits["ood"]]
    assert len(set(names)) == len(names)
    assert all(t.name.startswith(t.family + "-") for t in all_tasks + splits["ood"])


@settings(max_examples=25, deadline=None)
@given(n_train=st.integers(0, 12), n_heldout=st.integers(0, 6), seed=st.integers(0, 10**6),
       split=st.sampled_from(["train", "heldout", "ood"]))
def test_every_prefix_is_round_robin_by_family(n_train, n_heldout, seed, split):
    tasks = arl.make_tasks(split, n_train=n_train, n_heldout=n_heldout, seed=seed)
    F = len(arl.FAMILIES)
    assert [t.family for t in tasks] == list(arl.FAMILIES) * (len(tasks) // F)
    for k in range(len(tasks) // F + 1):                      # k of each family in tasks[:k*F]
        counts = {f: sum(t.family == f for t in tasks[:k * F]) for f in arl.FAMILIES}
        assert set(counts.values()) == {k}


def test_small_splits_and_bad_arguments():
    assert "ood" in arl.SPLITS
    tasks = arl.make_tasks("all", n_train=3, n_heldout=0, seed=5)
    assert len(tasks) == 3 * len(arl.FAMILIES)
    assert arl.make_tasks("heldout", n_train=3, n_heldout=0) == []
    assert arl.make_tasks("ood", n_heldout=0) == []
    for bad in ["test", "OOD", None]:
        with pytest.raises(ValueError, match="split"):
            arl.make_tasks(bad)
    with pytest.raises(ValueError, match="n_train"):
        arl.make_tasks("train", n_train=-1)
    with pytest.raises(ValueError, match="n_heldout"):
        arl.make_tasks("train", n_heldout=1.5)


def test_answers_are_right(all_tasks, splits):
    for t in all_tasks + splits["ood"]:
        assert t.answer == oracle(t), t


def test_none_exactly_when_a_needed_key_is_missing(all_tasks, splits):
    tasks = all_tasks + splits["ood"]
    for t in tasks:
        missing = [k for k in keys_in(t) if k not in held(t)]
        if t.family == "lookup":          # the last key is the fallback, always held
            needed_missing = len(missing) == len(keys_in(t))
            assert keys_in(t)[-1] in held(t)
        else:
            needed_missing = bool(missing)
        assert (t.answer == arl.NONE) == needed_missing, t
    # such tasks exist, in every split, in chain and sum; lookups with a missing first key too
    for split in SPLITS3:
        ts = splits[split]
        for family in ("chain", "sum"):
            assert any(t.answer == arl.NONE for t in ts if t.family == family), (split, family)
        assert any(keys_in(t)[0] not in held(t) for t in ts if t.family == "lookup")
    assert not any(t.answer == arl.NONE for t in tasks if t.family in ("max", "calc"))


def test_flaky_keys_and_the_expert_retries_them(all_tasks, splits):
    tasks = all_tasks + splits["ood"]
    for family in ("lookup", "chain"):
        assert any(flaky(t) for t in tasks if t.family == family), family
    for t in tasks:
        for key, n in flaky(t).items():
            assert key in held(t) and 1 <= n <= arl.MIX[t.family][2] <= arl.MAX_FAILS
            assert t.calls.count(f"get {key}") == n + 1       # never dropped, never extra
            assert not [k for k in keys_in(t) if k not in held(t)]  # flaky xor missing
        if t.family not in arl.MIX:
            assert not flaky(t)


def test_near_miss_distractors(all_tasks):
    for family in ("max",) + KEY_FAMILIES:
        tasks = [t for t in all_tasks if t.family == family]
        near = 0
        for t in tasks:
            needed = set(keys_in(t))
            assert len(held(t)) >= 6
            near += any(k not in needed and k[0] in {n[0] for n in needed} for k in held(t))
        assert near >= len(tasks) // 4, family          # a fair share of stores has one


def test_ood_is_larger_than_heldout(splits):
    for family in arl.FAMILIES:
        held_tasks = [t for t in splits["heldout"] if t.family == family]
        ood_tasks = [t for t in splits["ood"] if t.family == family]
        if family == "sum":                              # longer operands: 4 digits, not 3
            def digits(ts):
                return [len(str(held(t)[k])) for t in ts for k in keys_in(t) if k in held(t)]
            assert min(digits(ood_tasks)) > max(digits(held_tasks))
            assert min(map(size, ood_tasks)) >= max(map(size, held_tasks))
        else:                                            # more items / operands / keys
            assert min(map(size, ood_tasks)) > max(map(size, held_tasks)), family


def test_expert_calls_fit_the_turn_limit(all_tasks, splits):
    assert arl.MAX_EXPERT_CALLS == arl.EnvConfig().max_turns == arl.ToolEnv().max_turns
    assert max(len(t.calls) for t in all_tasks + splits["ood"]) <= arl.MAX_EXPERT_CALLS


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
    store = {"qx": 42}
    assert arl.run_tool("get qx", store) == "42"
    assert arl.run_tool("calc 6*7", store) == "42"
    for bad in ["get qy", "calc 6*", "calc", "search qx", "", "get", "get  qx",
                "get " + arl.FAIL + "get qx"]:
        assert arl.run_tool(bad, store) == arl.ERROR
    with pytest.raises(TypeError, match="call"):
        arl.run_tool(None, store)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 5), after=st.integers(1, 3))
def test_transient_failures_then_success(n, after):
    store = {"qx": 42, "qa": 17, arl.FAIL + "get qx": n}
    answers = [arl.run_tool("get qx", store) for _ in range(n + after)]
    assert answers == [arl.ERROR] * n + ["42"] * after     # n failures, then the value
    assert store[arl.FAIL + "get qx"] == 0                  # the failures are used up


def test_transient_failures_leave_other_calls_alone():
    store = {"qx": 42, "qa": 17, arl.FAIL + "get qx": 2}
    assert arl.run_tool("get qa", store) == "17"            # another key
    assert arl.run_tool("calc 1+1", store) == "2"           # another tool
    assert arl.run_tool("get  qx", store) == arl.ERROR      # another (malformed) text
    assert store[arl.FAIL + "get qx"] == 2                  # none of them used a failure
    assert arl.run_tool("get qx", store) == arl.ERROR
    assert store == {"qx": 42, "qa": 17, arl.FAIL + "get qx": 1}


def test_missing_key_and_transient_failure_look_alike():
    flaky_store, plain = {"qx": 42, arl.FAIL + "get qx": 1}, {"qa": 17}
    assert arl.run_tool("get qx", flaky_store) == arl.run_tool("get qx", plain) == arl.ERROR
    assert arl.run_tool("get qx", flaky_store) == "42"      # only calling again tells
    assert arl.run_tool("get qx", plain) == arl.ERROR


def test_environment_copies_the_store():
    t = next(t for t in arl.make_tasks("train") if flaky(t))
    key, n = next(iter(flaky(t).items()))
    env = arl.make_env()
    for _ in range(2):                                      # each episode fails anew
        env.reset(t)
        obs = [env.step(f"<call>get {key}</call>")[0] for _ in range(n + 1)]
        assert obs == ["<obs>error</obs>"] * n + [f"<obs>{held(t)[key]}</obs>"]
    assert dict(t.store)[arl.FAIL + f"get {key}"] == n      # the task is unchanged


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


def test_tokenizer_round_trip_demonstrations(tok, all_tasks, splits):
    for t in all_tasks + splits["ood"]:                     # ood too: built from train+heldout
        text = arl.demonstration(t)
        assert tok.decode(tok.encode(text)) == text


def test_vocabulary_is_fixed(tok, splits):
    chars = set("0123456789+-*()|? ") | set(arl.LETTERS)
    assert len(tok) == len(arl.SPECIAL_TOKENS) + len(chars)
    assert set(tok.itos) == set(arl.SPECIAL_TOKENS) | chars
    assert arl.build_tokenizer(splits["ood"]).itos == arl.build_tokenizer([]).itos == tok.itos


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=5).filter(
    lambda s: any(c not in "0123456789+-*() ?|abcdefghijklmnopqrstuvwxyz" for c in s)))
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

def test_demonstrations_reach_reward_one(all_tasks, splits):
    env = arl.make_env()                                    # the default limits
    for t in all_tasks + splits["ood"]:
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
