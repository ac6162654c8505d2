"""TRL's `environment_factory` examples (`docs/source/grpo_trainer.md`, huggingface/trl, section "Environments"),
with and without a dataset, on `GRPOTrainer` and on `APPOTrainer` with each strategy (issue 34).

`IncrementEnv` and its dataset are TRL's, unchanged except: the docstring of `increment` is written out in the
dataset variant (TRL's text says "see the full docstring above"), and the classes are renamed `IncrementEnv` /
`RowIncrementEnv` to live in one module. The rest of what changes is listed in `tests/examples/harness.py`.
Without a dataset each `reset()` samples its own target, so the branching strategies give the rows of a group
the first row's task (a deep copy of its instance, `share_group_tasks`); with a dataset the row carries it.
"""

from __future__ import annotations

import random
import re

import pytest
from datasets import Dataset

from tests.examples.harness import run, tool_stats
from tests.examples.scripted import call


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


# Each row carries the prompt and the task data (here, the counter target to reach).
dataset = Dataset.from_dict(
    {
        "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
        "target": list(range(1, 7)),
    }
)


class RowIncrementEnv:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:  # exposed as a tool (see the full docstring above)
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def turn(text: str, results: int) -> str:
    """Call `increment` with the asked amount once, then answer."""
    k = int(re.findall(r"counter (?:by|to) (\d)", text)[-1])
    return call("increment", f'{{"step": {k}}}') if results == 0 else "Done."


EXAMPLES = {
    "env_owned": dict(environment_factory=IncrementEnv),
    "dataset": dict(environment_factory=RowIncrementEnv, train_dataset=dataset),
}
CONFIG = dict(chat_template_kwargs={"enable_thinking": False})


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_grpo_matches_trl_tool_calls(qwen3_tiny, tmp_path, example):
    random.seed(0)
    trl_run = run(qwen3_tiny, str(tmp_path / "trl"), turn, None, 1, CONFIG, **EXAMPLES[example])
    random.seed(0)
    ours = run(qwen3_tiny, str(tmp_path / "grpo"), turn, "grpo", 1, CONFIG, **EXAMPLES[example])
    assert tool_stats(ours) == tool_stats(trl_run) == [(1.0, 0.0)]
    assert ours.state.log_history[0]["reward"] == trl_run.state.log_history[0]["reward"] == 1.0


@pytest.mark.parametrize("strategy", ["arpo", "aepo", "appo"])
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_branching_strategies_train_two_steps(qwen3_tiny, tmp_path, example, strategy):
    trainer = run(qwen3_tiny, str(tmp_path), turn, strategy, 2, CONFIG, **EXAMPLES[example])
    assert [h["reward"] for h in trainer.state.log_history if "reward" in h] == [1.0, 1.0]
    assert len(list((tmp_path / "completions").glob("*.parquet"))) == 2
