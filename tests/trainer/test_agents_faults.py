"""The agent runner's faults: runs that fail before any request, non-finite rewards, stuck agents, failed rounds.

Same scripted sampler and `openai` SDK agents as `test_agents.py`; every check is on the tiny chat model.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from tests.trainer.test_agents import make_trainer, sdk_agent  # noqa: E402


def raises_at_once(row, base_url, model):
    raise RuntimeError("no sandbox")


def raises_on_prompt_1(row, base_url, model):
    """Prompt (1)'s runs fail before any request; prompt (0)'s run the SDK loop."""
    if "(1)" in row["prompt"][0]["content"]:
        raise RuntimeError("no sandbox")
    return sdk_agent(row, base_url, model)


@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
@pytest.mark.parametrize("agent", [raises_at_once, raises_on_prompt_1], ids=["all", "some"])
def test_a_run_that_fails_before_its_first_request_gets_reward_0(tmp_path, strategy, agent, tiny_chat_tokenizer,
                                                                  tiny_chat_model_path):  # fmt: skip
    """appo's sampler_topk branch rule read the failed runs' missing entropies and stopped the run (issue 40 #1)."""
    initial = 4 if strategy == "grpo" else 2
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, agent, strategy, max_steps=1,
                              num_generations=4, initial_rollouts=initial, per_device_train_batch_size=8,
                              min_remaining_tokens=2)  # fmt: skip
    trainer.train()
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    if agent is raises_at_once:
        assert log["reward"] == 0.0 and log["agent/errors"] >= 4
    else:
        assert log["agent/errors"] >= 2 and 0.0 <= log["reward"] < 0.5
