"""The agent runner's faults: runs that fail before any request, non-finite rewards, stuck agents, failed rounds.

Same scripted sampler and `openai` SDK agents as `test_agents.py`; every check is on the tiny chat model.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

from tests.trainer.test_agents import make_trainer, sdk_agent, train_until_ctrl_c  # noqa: E402
from tests.trainer.test_trainer import spy_loss  # noqa: E402


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


class Returns:
    """An agent whose runs return `values` in turn (after one request each)."""

    __name__ = "returns_inf"

    def __init__(self, values):
        self.values, self.i, self.lock = list(values), 0, threading.Lock()

    def __call__(self, row, base_url, model):
        openai.OpenAI(base_url=base_url, api_key="-").chat.completions.create(model=model, messages=row["prompt"])
        with self.lock:
            self.i += 1
            return self.values[(self.i - 1) % len(self.values)]


def test_non_finite_agent_rewards_are_none_with_one_warning(tmp_path, caplog, tiny_chat_tokenizer,
                                                             tiny_chat_model_path):  # fmt: skip
    """inf, -inf, 1e308 (its float32 group std overflows) and NaN: as None (TRL's NaN), one warning naming the agent;
    the group's other runs keep finite advantages (before: `reward inf`, and the group's gradient was dropped)."""
    agent = Returns([math.inf, 1.0, -math.inf, 0.0, 1e308, 1.0, math.nan, 0.0])
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, agent, max_steps=2,
                              num_generations=4, initial_rollouts=4, per_device_train_batch_size=4)  # fmt: skip
    seen = spy_loss(trainer)
    with caplog.at_level("WARNING"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("agent 'returns_inf' returned ")
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2 and all(math.isfinite(h["reward"]) and h["reward"] == 0.5 for h in logs)
    assert all(h["rewards/agent_reward/mean"] == 0.5 for h in logs)  # TRL's nanmean: over the finite runs
    for inputs in seen:
        assert torch.isfinite(inputs["advantages"]).all() and inputs["advantages"].abs().sum() > 0
    reference = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text()
    logged = {k for h in logs for k in h if k.startswith("agent/")}
    assert len(logged) >= 9 and all(f"| `{k}` | " in reference for k in logged)  # docs/reference.md lists each one


STUCK = threading.Semaphore(0)


def stuck_sync_agent(row, base_url, model):
    """A sync agent that hangs after its first request (a tool or socket without a timeout)."""
    openai.OpenAI(base_url=base_url, api_key="-").chat.completions.create(model=model, messages=row["prompt"])
    STUCK.release()
    time.sleep(60)


def test_ctrl_c_with_64_stuck_sync_agents_exits_within_10_s(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """Before: each stuck thread was joined for 10 s, one after another (4 agents: 43 s; 64: over 10 minutes)."""
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, stuck_sync_agent, max_steps=1,
                              num_generations=32, initial_rollouts=32, per_device_train_batch_size=64)  # fmt: skip
    stopped = []

    def ctrl_c_once_all_are_stuck():
        for _ in range(64):
            STUCK.acquire(timeout=120)
        stopped.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_once_all_are_stuck, daemon=True).start()
    train_until_ctrl_c(trainer)
    assert stopped and time.monotonic() - stopped[0] <= 10.0
    assert trainer.rounds.path.agents.endpoint is None


def timing_out_agent(row, base_url, model):
    openai.OpenAI(base_url=base_url, api_key="-").chat.completions.create(model=model, messages=row["prompt"])
    time.sleep(30)


def test_train_returns_promptly_after_done_with_abandoned_agents(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path,
                                                                   caplog):  # fmt: skip
    """Runs past agent_timeout_s are abandoned, not waited for: the end (`close`) takes at most `EXIT_GRACE_S` for
    all of them together (before: 10 s per stuck thread, one after another: 80 s for these 8)."""
    from appo_trl.trainer.agents import EXIT_GRACE_S

    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, timing_out_agent, max_steps=2,
                              agent_timeout_s=0.5)  # fmt: skip
    agents, closing = trainer.rounds.path.agents, []
    real_close = agents.close

    def close():
        start = time.monotonic()
        real_close()
        closing.append(time.monotonic() - start)

    agents.close = close
    with caplog.at_level("WARNING", logger="appo_trl.trainer.agents"):
        trainer.train()
    assert trainer.state.global_step == 2 and closing[0] <= EXIT_GRACE_S + 1.0
    assert any("8 run(s) of agent 'timing_out_agent' did not stop within" in r.getMessage() for r in caplog.records)


async def blocking_async_agent(row, base_url, model):
    """`async def` with a blocking call inside: before, it held the agents' shared loop (no timeout could fire)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="-")
    await client.chat.completions.create(model=model, messages=row["prompt"])
    time.sleep(2.5)
    return 1.0


def test_an_async_agent_that_blocks_its_loop_times_out_and_is_named(tmp_path, tiny_chat_tokenizer,
                                                                      tiny_chat_model_path, caplog):  # fmt: skip
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, blocking_async_agent, max_steps=1,
                              agent_timeout_s=1.0)  # fmt: skip
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="appo_trl.trainer.agents"):
        trainer.train()
    took = time.monotonic() - start
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["agent/timeouts"] == 4.0 and log["reward"] == 0.0  # before: 0 timeouts, reward 1.0
    blocked = [r.getMessage() for r in caplog.records if "blocked its event loop" in r.getMessage()]
    assert len(blocked) == 1 and blocked[0].startswith("async agent 'blocking_async_agent' blocked its event loop for")
    assert took < 4 * 2.5  # the 4 runs block side by side, not one after another


def test_a_taken_agent_port_is_named_before_the_model_loads_and_at_start(tmp_path, tiny_chat_tokenizer,
                                                                          tiny_chat_model_path):  # fmt: skip
    import socket

    from appo_trl.config import APPOConfig
    from appo_trl.trainer.agents import AgentError
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_agents import prompts
    from tests.trainer.test_trainer import CPU

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args = APPOConfig(output_dir=str(tmp_path / "a"), **CPU, num_generations=2, per_device_train_batch_size=4,
                          agent_port=port)  # fmt: skip
        with pytest.raises(ValueError, match=f"agent 'sdk_agent': agent_port={port} cannot be used on agent_host="):
            APPOTrainer(model="missing", args=args, train_dataset=prompts(), agent=sdk_agent)
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    trainer, _ = make_trainer(tmp_path / "b", tiny_chat_model_path, tiny_chat_tokenizer, sdk_agent, max_steps=1,
                              agent_port=port)  # fmt: skip
    with socket.create_server(("127.0.0.1", port)), pytest.raises(AgentError, match=f"agent_port={port} cannot be"):
        trainer.train()  # taken after the check: the endpoint's own bind names it too


def test_rounds_in_which_every_run_failed_warn_then_stop_the_run(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path,
                                                                   caplog):  # fmt: skip
    """Before: every run failing (e.g. a framework that streams) trained nothing, and the run said `done` and exit 0."""
    from appo_trl.trainer.agents import AgentError

    trainer, _ = make_trainer(tmp_path / "a", tiny_chat_model_path, tiny_chat_tokenizer, raises_at_once, max_steps=5,
                              num_generations=4, initial_rollouts=4)  # fmt: skip
    with caplog.at_level("WARNING", logger="appo_trl.trainer.agents"), pytest.raises(AgentError) as err:
        trainer.train()
    assert str(err.value) == (
        "every run of agent 'raises_at_once' failed (4 runs; most common error, 4x: RuntimeError: no sandbox) in 3 "
        "training rounds in a row (max_failed_agent_rounds=3): nothing trains; fix the agent, or set "
        "max_failed_agent_rounds: 0 to go on"
    )
    assert trainer.state.global_step == 2  # stopped in the third round
    said = [r.getMessage() for r in caplog.records if "so this round trains nothing" in r.getMessage()]
    assert said == ["step 0: every run of agent 'raises_at_once' failed (4 runs; most common error, 4x: RuntimeError: "
                    "no sandbox), so this round trains nothing; after 3 such rounds in a row the run stops"]  # fmt: skip
    caplog.clear()
    trainer, _ = make_trainer(tmp_path / "b", tiny_chat_model_path, tiny_chat_tokenizer, raises_on_prompt_1,
                              max_steps=3, max_failed_agent_rounds=1)  # fmt: skip
    trainer.train()  # half the runs fail: training
    assert trainer.state.global_step == 3 and not [r for r in caplog.records if "trains nothing" in r.getMessage()]
    trainer, _ = make_trainer(tmp_path / "c", tiny_chat_model_path, tiny_chat_tokenizer, raises_at_once, max_steps=4,
                              max_failed_agent_rounds=0)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 4


def test_agent_config_ranges(tmp_path):
    from appo_trl.config import APPOConfig
    from tests.trainer.test_trainer import CPU

    with pytest.raises(ValueError, match=r"max_failed_agent_rounds=-1 must be >= 0 \(0 = never stop\)"):
        APPOConfig(output_dir=str(tmp_path), **CPU, max_failed_agent_rounds=-1)
    with pytest.raises(ValueError, match=r"agent_timeout_s=0 must be > 0"):
        APPOConfig(output_dir=str(tmp_path), **CPU, agent_timeout_s=0)
