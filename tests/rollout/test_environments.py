"""`RoundEnvironments` in the rollout engine: a branch's environment is its parent's at the fork, in both modes.

A parent rollout makes three `add(k)` calls on a `Counter` (tests/trainer/envs_helpers.py); branches are then
made after the parent has finished (as APPO does) at positions inside the first turn, right after a call's stop
tag (the call is re-run on the child's instance), and right after each result. The child's instance is captured
the moment it is created and compared with the parent's first k calls; the parent's instance must not change.
"""

from __future__ import annotations

import copy
import json

import pytest

from appo_trl.rollout import RolloutConfig, RolloutEngine
from appo_trl.rollout.chat_format import ChatToolFormat
from appo_trl.rollout.environments import RoundEnvironments, branch_mode, environment_methods
from tests.trainer.envs_helpers import (
    QWEN,
    Counter,
    CounterPolicy,
    Drifting,
    ReplayCounter,
    ReplaySlowCounter,
    SlowCounter,
    TwoCallPolicy,
    Uncopyable,
)


@pytest.fixture
def tok(tiny_chat_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model_path)
    tok.chat_template = QWEN
    return tok


def fresh(cls):
    env = cls()
    env.reset(start=10)
    return env


def setup(tok, cls, mode, snapshots=True):
    engine = RolloutEngine(CounterPolicy(tok), tok, RolloutConfig(max_completion_length=400, call_limit=5),
                           {}, chat=ChatToolFormat(tok))  # fmt: skip
    envs = RoundEnvironments([[fresh(cls)]], make=[lambda: fresh(cls)], modes=[mode], snapshots=snapshots)
    engine.environments = envs
    at_fork = {}
    orig = envs.fork

    async def spy(child, parent):
        await orig(child, parent)
        at_fork[child.uid] = copy.copy(envs.env_of(child).history)

    envs.fork = spy
    messages = [{"role": "user", "content": "count. The counter starts at 10."}]
    prompt = tok.apply_chat_template(messages, tools=list(environment_methods(Counter()).values()),
                                     add_generation_prompt=True, tokenize=True, return_dict=False)  # fmt: skip
    return engine, envs, at_fork, list(prompt)


@pytest.mark.parametrize("cls, mode", [(Counter, "deepcopy"), (ReplayCounter, "replay")])
def test_a_branch_starts_in_its_parents_state_at_the_fork(tok, cls, mode):
    engine, envs, at_fork, prompt = setup(tok, cls, mode)
    [[parent]] = engine.run(engine.rollout([prompt], 1, seed=3))
    parent_env = envs.env_of(parent)
    ks = [json.loads(c.query)["k"] for c in parent.tool_calls]
    assert len(ks) == 3 and parent_env.history == ks
    calls = parent.tool_calls
    positions = [calls[0].start - 3, calls[0].start, calls[0].end, calls[1].start, calls[1].end, calls[2].end]
    inherited = [0, 0, 1, 1, 2, 3]
    children = engine.run(engine.branch_many([(parent, p) for p in positions], seed=4))
    assert envs.env_of(parent) is parent_env and parent_env.history == ks  # untouched by its branches
    for child, k in zip(children, inherited):
        assert at_fork[child.uid] == ks[:k]  # the parent's state after its first k calls, nothing after
        env = envs.env_of(child)
        assert env is not parent_env and env.start == 10
        own = [json.loads(c.query)["k"] for c in child.tool_calls]
        assert own[:k] == ks[:k] and env.history == own  # then only the child's own calls
        assert [c.result for c in child.tool_calls] == [str(10 + sum(own[: i + 1])) for i in range(len(own))]


def test_forks_inside_the_loop_copy_the_live_parent(tok):
    """Without snapshots (ARPO/AEPO fork right after a call) the live instance is copied; later it is refused."""
    engine, envs, at_fork, prompt = setup(tok, Counter, "deepcopy", snapshots=False)
    [[parent]] = engine.run(engine.rollout([prompt], 1, seed=3))
    [child] = engine.run(engine.branch_many([(parent, parent.tool_calls[2].end)], seed=4))
    assert at_fork[child.uid] == envs.env_of(parent).history  # 3 calls: the parent's live (final) state
    with pytest.raises(RuntimeError, match="no environment snapshot after 1 calls"):
        engine.run(engine.branch_many([(parent, parent.tool_calls[0].end)], seed=4))


def test_replay_that_diverges_raises(tok):
    engine, envs, _, prompt = setup(tok, Drifting, "replay")
    [[parent]] = engine.run(engine.rollout([prompt], 1, seed=3))
    with pytest.raises(RuntimeError, match="replaying call 1 add.*the parent got '1[0-9] \\(call"):
        engine.run(engine.branch_many([(parent, parent.tool_calls[0].end)], seed=4))


def test_branch_mode_is_declared_or_found_by_a_deep_copy():
    assert branch_mode(Counter()) == "deepcopy"
    assert branch_mode(ReplayCounter()) == "replay"
    with pytest.raises(ValueError, match="Uncopyable cannot be deep-copied \\(TypeError: holds a live connection\\)"):
        branch_mode(Uncopyable(), "appo")

    class Typo(Counter):
        branch_mode = "copy"

    with pytest.raises(ValueError, match="branch_mode='copy'; valid: deepcopy, replay"):
        branch_mode(Typo())
    assert list(environment_methods(Counter())) == ["add"]  # not reset, get_reward, properties or _private


@pytest.mark.parametrize("cls, mode", [(SlowCounter, "deepcopy"), (ReplaySlowCounter, "replay")])
def test_two_calls_per_turn_snapshot_per_call_and_branch_inside_the_turn(tok, cls, mode):
    """Two `add` calls per turn (`SlowCounter`: run concurrently, the second would land first): the history is the
    calls in order, each call is noted on its own (deepcopy: a snapshot after each call, not only after the turn;
    replay: one call record each), and branches inside a two-call turn (between its calls' text, or right after
    its end of turn) re-run both calls from the state before it; a replaying branch re-feeds exactly the calls
    before it."""
    engine, envs, at_fork, prompt = setup(tok, cls, mode)
    engine.backend = TwoCallPolicy(tok)
    [[parent]] = engine.run(engine.rollout([prompt], 1, seed=3))
    ks = [json.loads(c.query)["k"] for c in parent.tool_calls]
    assert len(ks) == 4 and envs.env_of(parent).history == ks and ks[0] > ks[1] and ks[2] > ks[3]
    state = envs._states[parent.uid]
    assert [(c.index, json.loads(c.arguments)["k"]) for c in state.calls] == list(enumerate(ks))
    if mode == "deepcopy":
        assert {j: s.history for j, s in state.snapshots.items()} == {j: ks[:j] for j in range(5)}
    else:
        assert state.snapshots is None
    calls = parent.tool_calls
    assert calls[0].end == calls[1].end  # one tool turn for both calls
    between = calls[0].start - 12  # inside the first turn's second call
    assert '"k": ' + str(ks[1]) not in tok.decode(parent.completion_ids[:between])
    positions = [between, calls[0].start, calls[1].end, calls[2].start - 12, calls[2].start, calls[3].end]
    inherited = [0, 0, 2, 2, 2, 4]
    children = engine.run(engine.branch_many([(parent, p) for p in positions], seed=4))
    for child, k in zip(children, inherited):
        assert at_fork[child.uid] == ks[:k]
        own = [json.loads(c.query)["k"] for c in child.tool_calls]
        assert own[:k] == ks[:k] and envs.env_of(child).history == own and len(own) == 4
        assert [c.result for c in child.tool_calls] == [str(10 + sum(own[: i + 1])) for i in range(4)]
    with pytest.raises(ValueError, match="inside the result of tool call 'add'"):
        engine.run(engine.branch_many([(parent, calls[1].start)], seed=4))
