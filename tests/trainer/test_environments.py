"""TRL's `environment_factory` on `APPOTrainer`: one instance per rollout, branches in their parent's state.

`Counter` is a small stateful environment: `reset(start=...)` sets a total, `add(k)` adds to it and returns the
new total, and `get_reward()` is a position-weighted sum over the *whole* call history (sum of (i+1)·k_i), so a
branch whose instance missed its prefix's calls, or carried calls made by its parent after the fork, scores
differently from what its own row shows. The sampler is scripted: every request after c tool results emits one
`add` call with k taken from the request seed (rollouts and branches differ), until 3 calls, then an answer.
Every row is checked against its own tokens: the results the model saw are the running totals of its calls,
and the reward is recomputed from the row's call records.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoTokenizer

from appo_trl.rollout import Segment
from appo_trl.trainer.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU

RESETS: list[int] = []
QWEN = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
REWARDS: list[tuple[int, ...]] = []
LOCK = threading.Lock()


class Counter:
    """A counter: the reward depends on every call, in order."""

    def __init__(self):
        self.start = 0
        self.history: list[int] = []

    def reset(self, start: int = 0, **kwargs) -> str:
        with LOCK:
            RESETS.append(int(start))
        self.start, self.history = int(start), []
        return f" The counter starts at {self.start}."

    @property
    def total(self) -> int:
        return self.start + sum(self.history)

    def add(self, k: int) -> str:
        """Add k to the counter and return the new total.

        Args:
            k: how much to add.
        """
        self.history.append(int(k))
        return str(self.total)

    def get_reward(self) -> float:
        with LOCK:
            REWARDS.append(tuple(self.history))
        return float(sum((i + 1) * k for i, k in enumerate(self.history)))


class ReplayCounter(Counter):
    """A counter that cannot be deep-copied but is deterministic given reset() and its calls."""

    branch_mode = "replay"

    def __deepcopy__(self, memo):
        raise TypeError("holds a live connection")


class Uncopyable(Counter):
    def __deepcopy__(self, memo):
        raise TypeError("holds a live connection")


class CounterPolicy:
    """Scripted sampler: `add(k)` with k = 1 + seed % 5 while fewer than 3 results, then an answer and EOS.

    It continues a turn it already started (ARPO's look-ahead samples a turn in two requests): k is read back
    from the turn's text when it is there.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.result = tokenizer.convert_tokens_to_ids("</tool_response>")
        self.header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def turn(self, prompt_ids):
        """The ids of the assistant turn being sampled (after the last assistant header)."""
        h = len(self.header)
        return prompt_ids[max(i + h for i in range(len(prompt_ids) - h + 1) if prompt_ids[i : i + h] == self.header) :]

    async def generate(self, prompt_ids, params):
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        tail = self.turn(prompt_ids)
        if sum(1 for t in prompt_ids if t == self.result) >= 3:
            ids, reason, stop = enc(" <answer> done </answer>") + [self.tok.eos_token_id], "eos", None
        else:
            said = re.search(r"add (\d)", self.tok.decode(tail))
            k = int(said.group(1)) if said else 1 + params.seed % 5
            call = '<tool_call>\n{"name": "add", "arguments": {"k": ' + str(k) + "}}\n</tool_call>"
            # the turn ends with the sampled end of turn, as a Qwen model's (the engine runs a turn's calls then)
            ids, reason, stop = enc(f"<think> add {k} </think>\n" + call) + [self.tok.eos_token_id], "eos", None
        assert ids[: len(tail)] == tail, "the scripted turn does not continue its own prefix"
        ids = ids[len(tail) :]
        if len(ids) > params.max_tokens:
            ids, reason, stop = ids[: params.max_tokens], "length", None
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, reason, stop)


@pytest.fixture
def tok(tiny_chat_model_path):
    """The tiny tokenizer with TRL's Qwen2.5 template (TRL parses environment calls with its response schema,
    which it knows for the templates it ships)."""
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_path)
    tok.chat_template = QWEN
    return tok


def dataset(k=2):
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"count ({i})."}] for i in range(k)],
        "start": [10 * (i + 1) for i in range(k)],
    })  # fmt: skip


STRATEGY = {
    "grpo": {},
    "arpo": dict(initial_rollouts=2, branch_probability=1.0, beam_size=2),
    "aepo": dict(initial_rollouts=2, branch_probability=0.0, beam_size=2),  # AEPO: P = 1 - tau/f
    "appo": dict(initial_rollouts=2, min_remaining_tokens=2),
}


def make_trainer(tmp_path, path, tok, strategy="grpo", factory=Counter, reward_funcs=None, data="default", **kw):
    base = dict(output_dir=str(tmp_path), **CPU, rollout_strategy=strategy, num_generations=4,
                per_device_train_batch_size=4, max_steps=1, max_completion_length=200, tool_call_limit=5,
                **STRATEGY[strategy])  # fmt: skip
    base.update(kw)
    return APPOTrainer(model=path, reward_funcs=reward_funcs, args=APPOConfig(**base),
                       train_dataset=dataset() if data == "default" else data, processing_class=tok,
                       environment_factory=factory)  # fmt: skip


def capture_rows(trainer):
    """Each round's rows (trajectories) and the environment instances handed to the reward step."""
    seen = []
    orig = trainer._generate

    def wrapped(prompts):
        out = orig(prompts)
        seen.append((trainer.rounds.current.rows, list(trainer.environments)))
        return out

    trainer._generate = wrapped
    return seen


def check_row(traj, env, start):
    """The row's tool results are the running totals of its own calls, and its instance holds exactly them."""
    ks = [json.loads(c.query)["k"] for c in traj.tool_calls]
    assert [c.result for c in traj.tool_calls] == [str(start + sum(ks[: i + 1])) for i in range(len(ks))]
    assert env.history == ks and env.start == start


@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
def test_every_row_has_its_own_environment_in_the_right_state(tmp_path, strategy, tiny_chat_model_path, tok):
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, strategy)
    assert trainer.reward_func_names == ["Counter"]  # the environment owns the reward (TRL's column name)
    trainer.rollout_engine.backend = CounterPolicy(tok)
    seen = capture_rows(trainer)
    RESETS.clear()
    REWARDS.clear()
    trainer.train()
    [(rows, envs)] = seen
    assert len(rows) == len(envs) == 4 and len({id(e) for e in envs}) == 4  # one instance per rollout
    prompt = tok.decode(rows[0].prompt_ids)
    assert "The counter starts at 10." in prompt and '"name": "add"' in prompt  # reset's observation + schema
    for traj, env in zip(rows, envs):
        check_row(traj, env, start=10 if traj.group == 0 else 20)
    # get_reward() once per row, branches included, on each row's own history
    assert sorted(REWARDS) == sorted(tuple(e.history) for e in envs)
    origins = [t.meta.get("origin") for t in rows]
    if strategy in ("arpo", "aepo"):
        assert "fork" in origins
    if strategy == "appo":
        assert origins.count("branch") == 2
    if strategy != "grpo":  # a branch starts from its parent's state at the fork, not before it nor after it
        for traj in rows:
            if traj.parent is not None:
                [parent] = [p for p in rows if p.uid == traj.parent]
                inherited = [c for c in traj.tool_calls if c.end <= traj.branch_pos]
                assert [c.query for c in inherited] == [c.query for c in parent.tool_calls[: len(inherited)]]
    logged = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert "rewards/Counter/mean" in logged


def test_plain_training_with_a_factory_updates_the_model(tmp_path, tiny_chat_model_path, tok):
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo")
    trainer.rollout_engine.backend = CounterPolicy(tok)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("strategy", ["arpo", "aepo", "appo"])
def test_replay_environments_branch_from_a_fresh_instance(tmp_path, strategy, tiny_chat_model_path, tok):
    """`branch_mode = "replay"`: no deep copy is ever made; the child's instance is reset and re-fed the calls."""
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, strategy, factory=ReplayCounter)
    trainer.rollout_engine.backend = CounterPolicy(tok)
    seen = capture_rows(trainer)
    RESETS.clear()
    trainer.train()
    [(rows, envs)] = seen
    for traj, env in zip(rows, envs):
        check_row(traj, env, start=10 if traj.group == 0 else 20)
    children = [t for t in rows if t.parent is not None]
    assert children and len(RESETS) >= 4 + len(children)


class Drifting(Counter):
    """Deterministic in name only: every call adds a process-wide call number to its result."""

    branch_mode = "replay"
    calls = 0

    def add(self, k: int) -> str:
        """Add k to the counter and return the new total.

        Args:
            k: how much to add.
        """
        Drifting.calls += 1
        self.history.append(int(k))
        return f"{self.total} (call {Drifting.calls})"


def test_replay_that_diverges_fails_with_its_cause(tmp_path, tiny_chat_model_path, tok):
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "arpo", factory=Drifting)
    trainer.rollout_engine.backend = CounterPolicy(tok)
    with pytest.raises(RuntimeError, match="Drifting .*replaying call 1 add.*not deterministic"):
        trainer.train()


class LateDrift(ReplayCounter):
    """Its calls replay exactly, but reset() words its observation differently from the 5th reset on: TRL's
    four instances of the batch see one observation, every new instance (a replayed branch's) another."""

    resets = 0

    def reset(self, start: int = 0, **kwargs) -> str:
        LateDrift.resets += 1
        observation = super().reset(start=start, **kwargs)
        return observation if LateDrift.resets <= 4 else observation.replace("starts at", "begins at")


@pytest.mark.parametrize("strategy", ["arpo", "appo"])
def test_a_new_instance_whose_reset_observation_differs_fails_naming_it(tmp_path, strategy, tiny_chat_model_path,
                                                                         tok):  # fmt: skip
    """A replayed branch's instance is reset() with its group's row; its observation is checked against the prompt
    the group was sampled on (as TRL's own instances are), instead of branching from a state the prompt never
    showed."""
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, strategy, factory=LateDrift)
    trainer.rollout_engine.backend = CounterPolicy(tok)
    LateDrift.resets = 0
    with pytest.raises(ValueError, match="a new LateDrift instance reset\\(\\) with row 0 returned ' The counter "
                                         "begins at 10.', a different observation from the one its group was "
                                         "sampled on; .*seed its randomness from the row"):  # fmt: skip
        trainer.train()
    assert LateDrift.resets > 4  # TRL's four, then the new ones (APPO makes its branches concurrently)


@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
def test_an_environment_that_can_neither_copy_nor_replay_fails_at_start_up(tmp_path, strategy, tiny_chat_model_path,
                                                                           tok):  # fmt: skip
    if strategy == "grpo":  # no branches: nothing to copy
        make_trainer(tmp_path, tiny_chat_model_path, tok, strategy, factory=Uncopyable)
        return
    with pytest.raises(ValueError, match=f"Uncopyable cannot be deep-copied .*rollout_strategy={strategy} "):
        make_trainer(tmp_path, tiny_chat_model_path, tok, strategy, factory=Uncopyable)


class RandomStart(Counter):
    def reset(self, **kwargs) -> str:
        self.start, self.history = random.randint(0, 10**6), []
        return f" The counter starts at {self.start}."


def test_random_observations_per_rollout(tmp_path, tiny_chat_model_path, tok):
    """grpo samples each row on its own reset observation, as TRL; a branching strategy cannot (shared prompt)."""
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", factory=RandomStart)
    trainer.rollout_engine.backend = CounterPolicy(tok)
    seen = capture_rows(trainer)
    trainer.train()
    [(rows, envs)] = seen
    for traj, env in zip(rows, envs):
        assert f"The counter starts at {env.start}." in tok.decode(traj.prompt_ids)
        check_row(traj, env, start=env.start)
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "appo", factory=RandomStart)
    trainer.rollout_engine.backend = CounterPolicy(tok)
    with pytest.raises(
        ValueError, match="reset\\(\\) returned a different observation for row 1 .*rollout_strategy: grpo"
    ):
        trainer.train()


def test_tags_format_is_refused_before_the_model_loads(tmp_path, tok):
    with pytest.raises(ValueError, match="environment methods are chat-template tools"):
        make_trainer(tmp_path, "/nonexistent-model", tok, "grpo", tool_format="tags")


def test_background_rounds_with_environments_are_refused_before_the_model_loads(tmp_path, tok):
    with pytest.raises(ValueError, match="environment_factory with max_staleness >= 1 is not supported"):
        make_trainer(tmp_path, "/nonexistent-model", tok, "grpo", max_staleness=1)


# ---- TRL's own behaviours (GRPOTrainer's ValueErrors and reward columns), on APPOTrainer -------------------------


def answer_len(completions, **kwargs):
    return [float(len(json.dumps(c))) / 1000 for c in completions]


class PlainCounter(Counter):
    get_reward = None  # no reward of its own (TRL looks for a function named get_reward)


def routed(names):
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"count ({i})."}] for i in range(len(names))],
        "start": [10 * (i + 1) for i in range(len(names))],
        "environment": names,
    })  # fmt: skip


def test_unknown_environment_name_in_the_data(tmp_path, tiny_chat_model_path, tok):
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", factory={"counter": Counter},
                           data=routed(["abacus", "abacus"]))  # fmt: skip
    trainer.rollout_engine.backend = CounterPolicy(tok)
    with pytest.raises(ValueError, match="environment='abacus'.* not among the environments"):
        trainer.train()


def test_environment_reward_beside_reward_functions(tmp_path, tiny_chat_model_path, tok):
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "appo", reward_funcs=[answer_len])
    assert trainer.reward_func_names == ["answer_len", "Counter"]
    trainer.rollout_engine.backend = CounterPolicy(tok)
    trainer.train()
    logged = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert "rewards/answer_len/mean" in logged and "rewards/Counter/mean" in logged


def test_mixed_environments_score_only_their_own_rows(tmp_path, tiny_chat_model_path, tok):
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "arpo", reward_funcs=[answer_len],
                           factory={"counter": Counter, "plain": PlainCounter},
                           data=routed(["counter", "plain"]), per_device_train_batch_size=8)  # fmt: skip
    assert trainer.reward_func_names == ["answer_len", "Counter"]
    trainer.rollout_engine.backend = CounterPolicy(tok)
    rewards = []
    orig = trainer._calculate_rewards
    trainer._calculate_rewards = lambda *a: rewards.append(orig(*a)) or rewards[-1]
    seen = capture_rows(trainer)
    trainer.train()
    [(rows, envs)] = seen
    [r] = rewards
    assert len(envs) == 8 and {type(e) for e in envs} == {Counter, PlainCounter}
    for i, env in enumerate(envs):
        # TRL: None (NaN) for rows of an environment without get_reward
        assert torch.isnan(r[i, 1]) == (type(env) is PlainCounter)
    schema = tok.decode(rows[0].prompt_ids)
    assert '"name": "add"' in schema


RESET_KEYS: list[tuple[str, ...]] = []


class RoutedCounter(ReplayCounter):
    """A counter (tool `add`) that notes the keyword arguments of every reset(), replayed branches' included."""

    def reset(self, **kwargs) -> str:
        with LOCK:
            RESET_KEYS.append(tuple(sorted(kwargs)))
        return super().reset(**kwargs)


class Abacus:
    """A second environment with another tool, `times`, and no reward of its own."""

    branch_mode = "replay"

    def __init__(self):
        self.value, self.history = 1, []

    def reset(self, **kwargs) -> str:
        with LOCK:
            RESET_KEYS.append(tuple(sorted(kwargs)))
        self.value, self.history = int(kwargs.get("start", 1)), []
        return f" The abacus shows {self.value}."

    def times(self, k: int) -> str:
        """Multiply the abacus by k and return the new value.

        Args:
            k: the factor.
        """
        self.history.append(int(k))
        self.value *= int(k)
        return str(self.value)


class BothToolsPolicy(CounterPolicy):
    """Scripted sampler: every turn calls `add(k)` then `times(k)` (one of them is not the row's environment's),
    k from the request seed; after two such turns (4 results) an answer and EOS."""

    async def generate(self, prompt_ids, params):
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        tail = self.turn(prompt_ids)
        if sum(1 for t in prompt_ids if t == self.result) >= 4:
            ids = enc(" <answer> done </answer>") + [self.tok.eos_token_id]
        else:
            said = re.search(r"use (\d)", self.tok.decode(tail))
            k = int(said.group(1)) if said else 2 + params.seed % 5
            calls = "\n".join(
                '<tool_call>\n{"name": "' + name + '", "arguments": {"k": ' + str(k) + "}}\n</tool_call>"
                for name in ("add", "times")
            )
            ids = enc(f"<think> use {k} </think>\n" + calls) + [self.tok.eos_token_id]
        assert ids[: len(tail)] == tail, "the scripted turn does not continue its own prefix"
        ids = ids[len(tail) :]
        reason = "eos"
        if len(ids) > params.max_tokens:
            ids, reason = ids[: params.max_tokens], "length"
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, reason, None)


@pytest.mark.parametrize("strategy", ["grpo", "arpo"])
def test_each_row_sees_and_calls_only_its_own_environments_tools(tmp_path, strategy, tiny_chat_model_path, tok):
    """TRL's per-row routing with two environments with different tools: a row's prompt lists only its
    environment's tools, its calls to the other's method get TRL's `Tool ... not found.` result and leave its
    instance untouched, and reset() never gets the dataset's `environment` key (TRL drops it in multi-environment
    mode), on TRL's instances and on the new instances of replayed branches alike."""
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, strategy, reward_funcs=[answer_len],
                           factory={"counter": RoutedCounter, "abacus": Abacus}, data=routed(["counter", "abacus"]),
                           per_device_train_batch_size=8)  # fmt: skip
    trainer.rollout_engine.backend = BothToolsPolicy(tok)
    seen = capture_rows(trainer)
    RESET_KEYS.clear()
    trainer.train()
    [(rows, envs)] = seen
    assert len(envs) == 8 and {type(e) for e in envs} == {RoutedCounter, Abacus}
    for traj, env in zip(rows, envs):
        own, other = ("add", "times") if type(env) is RoutedCounter else ("times", "add")
        prompt = tok.decode(traj.prompt_ids)
        assert f'"name": "{own}"' in prompt and f'"name": "{other}"' not in prompt  # its own tools only
        assert [c.tag for c in traj.tool_calls] == ["add", "times"] * 2
        for c in traj.tool_calls:
            if c.tag == other:
                assert c.result == str({"error": f"Tool {other} not found."}) and not c.ok
        assert env.history == [json.loads(c.query)["k"] for c in traj.tool_calls if c.tag == own]
    assert RESET_KEYS and set(RESET_KEYS) == {("prompt", "start")}  # no `environment` key
    children = [t for t in rows if t.parent is not None]
    assert (strategy == "arpo") == bool(children) and len(RESET_KEYS) == 8 + len(children)  # replays reset too


def test_environment_owned_data_needs_max_steps(tmp_path, tiny_chat_model_path, tok):
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "aepo", data=None, max_steps=1)
    trainer.rollout_engine.backend = CounterPolicy(tok)
    seen = capture_rows(trainer)
    trainer.train()
    [(rows, envs)] = seen
    for traj, env in zip(rows, envs):
        check_row(traj, env, start=0)  # reset() got TRL's placeholder row (no `start`)
    with pytest.raises(ValueError, match="`max_steps` must be set"):
        make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", data=None, max_steps=-1)


def test_several_environments_need_a_dataset(tmp_path, tiny_chat_model_path, tok):
    with pytest.raises(ValueError, match="requires a `train_dataset` with an `environment` column"):
        make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", data=None, max_steps=1,
                     factory={"a": Counter, "b": Counter})  # fmt: skip


def test_an_undocumented_environment_method_fails_naming_it(tmp_path, tiny_chat_model_path, tok):
    class Bad(Counter):
        def poke(self, x: int) -> int:
            return x

    with pytest.raises(ValueError, match="environment_factory: tool 'Bad.poke' has no docstring"):
        make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", factory=Bad)


def double(x: int) -> int:
    """Double a number.

    Args:
        x: the number.
    """
    return 2 * x


def test_standalone_tools_beside_an_environment(tmp_path, tiny_chat_model_path, tok):
    """TRL's order: the standalone tools, then the environment's methods (rendered per row, callable per row)."""
    args = APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=4,
                      max_steps=1, max_completion_length=200)  # fmt: skip
    trainer = APPOTrainer(model=tiny_chat_model_path, args=args, train_dataset=dataset(), processing_class=tok,
                          tools=[double], environment_factory=Counter)  # fmt: skip
    assert [f.__name__ for f in trainer._env_tools[None]] == ["double", "add"]
    assert [f.__name__ for f in trainer.tools] == ["double", "add"] and trainer._standalone_tools == [double]
    assert list(trainer.rollout_engine.executor.tools) == ["double"]  # `add` runs on each row's own instance


# ---- several calls in one assistant turn on one environment ------------------------------------------------------


class SlowCounter(Counter):
    """A counter whose `add` takes longer for a larger k: run concurrently, a turn's second (smaller) call would
    land first and the history would not be the calls in order."""

    def add(self, k: int) -> str:
        """Add k to the counter and return the new total.

        Args:
            k: how much to add.
        """
        time.sleep(0.03 * int(k))
        self.history.append(int(k))
        return str(self.total)


class ReplaySlowCounter(SlowCounter):
    """`SlowCounter` whose branches replay the parent's calls into a new instance (it cannot be deep-copied)."""

    branch_mode = "replay"

    def __deepcopy__(self, memo):
        raise TypeError("holds a live connection")


class TwoCallPolicy(CounterPolicy):
    """Scripted sampler: each assistant turn holds two `add` calls, k1 = 3 + seed % 3 then k2 = 1 + seed % 2
    (k1 > k2), and ends with the sampled `<|im_end|>`; after two such turns (4 results) an answer and EOS. It
    continues a turn it already started (a branch point inside the turn): the k's are read back from its text."""

    async def generate(self, prompt_ids, params):
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        tail = self.turn(prompt_ids)
        if sum(1 for t in prompt_ids if t == self.result) >= 4:
            ids, reason = enc(" <answer> done </answer>") + [self.tok.eos_token_id], "eos"
        else:
            said = re.search(r"add (\d) then (\d)", self.tok.decode(tail))
            k1, k2 = (int(said.group(1)), int(said.group(2))) if said else (3 + params.seed % 3, 1 + params.seed % 2)
            calls = "\n".join(
                '<tool_call>\n{"name": "add", "arguments": {"k": ' + str(k) + "}}\n</tool_call>" for k in (k1, k2)
            )
            ids, reason = enc(f"<think> add {k1} then {k2} </think>\n" + calls) + [self.tok.eos_token_id], "eos"
        assert ids[: len(tail)] == tail, "the scripted turn does not continue its own prefix"
        ids = ids[len(tail) :]
        if len(ids) > params.max_tokens:
            ids, reason = ids[: params.max_tokens], "length"
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, reason, None)


@pytest.mark.parametrize(
    "strategy, factory",
    [(s, SlowCounter) for s in ("grpo", "arpo", "aepo", "appo")]
    + [("arpo", ReplaySlowCounter), ("appo", ReplaySlowCounter)],
)
def test_two_calls_per_turn_run_in_call_order_and_branches_fork_the_right_state(tmp_path, strategy, factory,
                                                                               tiny_chat_model_path, tok):  # fmt: skip
    """Two `add` calls per turn on one instance: its history is the calls in order (results are running totals),
    and each fork's or branch's instance, captured the moment it is made, is the parent's after the calls before
    the fork (ARPO/AEPO: right after a two-call turn; APPO: wherever its branch points fall), whether it is a deep
    copy or a new instance that replayed them."""
    from appo_trl.rollout.environments import RoundEnvironments

    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, strategy, factory=factory, tool_call_limit=6,
                           rollout_concurrency=4)  # fmt: skip
    trainer.rollout_engine.backend = TwoCallPolicy(tok)
    seen, at_fork = capture_rows(trainer), {}
    orig_fork = RoundEnvironments.fork

    async def spy(self, child, parent):
        await orig_fork(self, child, parent)
        at_fork[child.uid] = (list(self.env_of(child).history), list(self.env_of(parent).history), child.num_calls)

    RoundEnvironments.fork = spy
    try:
        trainer.train()
    finally:
        RoundEnvironments.fork = orig_fork
    [(rows, envs)] = seen
    for traj, env in zip(rows, envs):
        check_row(traj, env, start=10 if traj.group == 0 else 20)
        assert len(traj.tool_calls) == 4 and traj.num_calls == 4
        ks = env.history
        assert ks[0] > ks[1] and ks[2] > ks[3]  # each turn's calls in call order (run together: reversed)
    children = [t for t in rows if t.parent is not None]
    assert len(at_fork) == len(children) and (strategy != "grpo") == bool(children)
    assert strategy != "appo" or len(children) == 2
    for child in children:
        [parent] = [p for p in rows if p.uid == child.parent]
        state, parent_now, k = at_fork[child.uid]
        assert k in (0, 2, 4) and state == parent_now[:k]  # the parent's state after the calls before the fork
        assert envs[rows.index(parent)].history[:k] == state


class StuckCounter(Counter):
    """A counter whose `add` hangs until the test ends."""

    release = threading.Event()

    def add(self, k: int) -> str:
        """Add k to the counter and return the new total.

        Args:
            k: how much to add.
        """
        self.release.wait(60)
        return super().add(k)


def test_environment_methods_take_tool_config_deadlines_and_are_abandoned(tmp_path, tiny_chat_model_path, tok):
    StuckCounter.release.clear()
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", factory=StuckCounter,
                           tool_config={"add": {"timeout": 0.3}}, tool_call_limit=1)  # fmt: skip
    trainer.rollout_engine.backend = CounterPolicy(tok)
    seen = capture_rows(trainer)
    start = time.monotonic()
    try:
        trainer.train()
    finally:
        StuckCounter.release.set()
    assert time.monotonic() - start < 30
    [(rows, _)] = seen
    assert all(c.result == "Error: Tool(add) timed out after 0.3 seconds." for t in rows for c in t.tool_calls)
    assert sum(len(t.tool_calls) for t in rows) == 4
    with pytest.raises(ValueError, match=r"tool_config names \['sub'\], which are neither tools nor environment"):
        make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", tool_config={"sub": {"timeout": 1}})
