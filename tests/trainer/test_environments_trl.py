"""TRL's own environment behaviours on `APPOTrainer`: its ValueErrors, reward columns and per-row routing.

Unknown environment names, an environment's reward beside reward functions, mixed environments scoring only
their own rows, each row seeing and calling only its environment's tools, environment-owned data, undocumented
methods, and standalone tools beside an environment (the `Counter` of tests/trainer/envs_helpers.py).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from datasets import Dataset

from appo_trl.config import APPOConfig
from appo_trl.rollout import Segment
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.envs_helpers import (
    LOCK,
    Counter,
    CounterPolicy,
    ReplayCounter,
    capture_rows,
    check_row,
    dataset,
    make_trainer,
)
from tests.trainer.test_trainer import CPU


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
