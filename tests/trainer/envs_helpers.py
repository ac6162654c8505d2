"""What the environment tests share: the `Counter` environments, their scripted samplers and a trainer on them.

`Counter` is a small stateful environment: `reset(start=...)` sets a total, `add(k)` adds to it and returns the
new total, and `get_reward()` is a position-weighted sum over the *whole* call history (sum of (i+1)·k_i), so a
branch whose instance missed its prefix's calls, or carried calls made by its parent after the fork, scores
differently from what its own row shows. The sampler is scripted: every request after c tool results emits one
`add` call with k taken from the request seed (rollouts and branches differ), until 3 calls, then an answer.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import trl
from datasets import Dataset

from appo_trl.config import APPOConfig
from appo_trl.rollout import Segment
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
