"""TRL's `examples/scripts/openenv/echo.py` (huggingface/trl) with a local stand-in for the echo server (issue 34).

`reward_func`, the dataset and `EchoToolEnv` are the example's, unchanged (`EchoToolEnv` moved out of `main()`,
its `args.env_host` read from a module-level `args`). The OpenEnv client package `echo_env` is not installed
here: a stand-in module of that name (`EchoEnv(base_url).step(EchoAction(message))`, echoing the message with
reward 0.1 per character, as OpenEnv's echo environment) takes its place in `sys.modules`. Config as the script's
(`chat_template_kwargs`, `log_completions=True`), plus the changes of `tests/examples/harness.py`.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
from datasets import Dataset

from tests.examples.harness import run, tool_stats
from tests.examples.scripted import call


@pytest.fixture(autouse=True)
def echo_env(monkeypatch):
    """The stand-in for OpenEnv's echo client and server, in process."""
    module, models = types.ModuleType("echo_env"), types.ModuleType("echo_env.models")

    class EchoAction:
        def __init__(self, message: str):
            self.message = message

    class EchoEnv:
        def __init__(self, base_url: str):
            self.base_url = base_url

        def step(self, action):
            obs = SimpleNamespace(echoed_message=action.message, reward=0.1 * len(action.message))
            return SimpleNamespace(observation=obs)

    module.EchoEnv, models.EchoAction, module.models = EchoEnv, EchoAction, models
    monkeypatch.setitem(sys.modules, "echo_env", module)
    monkeypatch.setitem(sys.modules, "echo_env.models", models)
    globals().update(EchoEnv=EchoEnv, EchoAction=EchoAction)


args = SimpleNamespace(env_host="http://127.0.0.1:8000")


def reward_func(environments, **kwargs):
    return [env.reward for env in environments]


dataset = Dataset.from_dict(
    {
        "prompt": [
            [{"role": "user", "content": "Try to echo 'Hello World!' in the environment."}],
            [{"role": "user", "content": "Make the environment echo 'Goodbye World!'"}],
            [{"role": "user", "content": "Can you ask the environment to echo 'TRL is great!'?"}],
            [{"role": "user", "content": "What happens if you ask the environment to echo 'I love RLHF!'?"}],
            [{"role": "user", "content": "Try to make the environment echo 'OpenEnv is awesome!'"}],
        ],
    }
)


class EchoToolEnv:
    def __init__(self):
        self.env = EchoEnv(base_url=args.env_host)  # noqa: F821 - the stand-in module's class (fixture)
        self.reward = 0.0

    def reset(self, **kwargs) -> None | str:
        self.reward = 0.0
        return None

    def echo(self, message: str) -> str:
        """
        Echo the message back from the environment.

        Args:
            message: The message to echo

        Returns:
            The echoed message.
        """
        observation = self.env.step(EchoAction(message=message))  # noqa: F821
        self.reward = observation.observation.reward
        return observation.observation.echoed_message


def turn(text: str, results: int) -> str:
    return call("echo", '{"message": "Hello World!"}') if results == 0 else "Echoed."


CONFIG = dict(chat_template_kwargs={"enable_thinking": False}, log_completions=True, num_completions_to_print=1)
KW = dict(train_dataset=dataset, reward_funcs=reward_func, environment_factory=EchoToolEnv)


def test_grpo_matches_trl_tool_calls(qwen3_tiny, tmp_path):
    trl_run = run(qwen3_tiny, str(tmp_path / "trl"), turn, None, 1, CONFIG, **KW)
    ours = run(qwen3_tiny, str(tmp_path / "grpo"), turn, "grpo", 1, CONFIG, **KW)
    assert tool_stats(ours) == tool_stats(trl_run) == [(1.0, 0.0)]
    assert ours.state.log_history[0]["reward"] == pytest.approx(trl_run.state.log_history[0]["reward"]) == 1.2


@pytest.mark.parametrize("strategy", ["arpo", "aepo", "appo"])
def test_branching_strategies_train_two_steps(qwen3_tiny, tmp_path, strategy):
    trainer = run(qwen3_tiny, str(tmp_path), turn, strategy, 2, CONFIG, **KW)
    assert [h["reward"] for h in trainer.state.log_history if "reward" in h] == pytest.approx([1.2, 1.2])
    assert len(list((tmp_path / "completions").glob("*.parquet"))) == 2
