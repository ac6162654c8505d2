"""An agent in background rounds (`max_staleness: 1`): the next round's agent runs sample while the current one
trains, under grpo and appo, with the tool loop's staleness bound; the rows stay the sampler's exact ids.

Same scripted sampler and `openai` SDK agent as `test_agents.py`.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from tests.trainer.async_helpers import assert_one_step_stale, loss_rows  # noqa: E402
from tests.trainer.test_agents import make_trainer, sdk_agent, train_until_ctrl_c  # noqa: E402
from tests.trainer.test_trainer import spy_loss  # noqa: E402


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
def test_agent_runs_in_background_rounds(tmp_path, strategy, tiny_chat_tokenizer, tiny_chat_model_path):
    tok = tiny_chat_tokenizer
    extra = {"initial_rollouts": 1, "min_remaining_tokens": 2} if strategy == "appo" else {}
    trainer, backend = make_trainer(tmp_path, tiny_chat_model_path, tok, sdk_agent, strategy, max_steps=4,
                                    num_prompts=8, max_staleness=1, vllm_importance_sampling_mode="token_truncate",
                                    **extra)  # fmt: skip
    generated_on = []
    real = trainer.rounds.path.agents.generate
    trainer.rounds.path.agents.generate = lambda *a: generated_on.append(threading.current_thread().name) or real(*a)
    batches = []
    real_report = trainer.rounds.path.agents.report
    trainer.rounds.path.agents.report = lambda batch, mode: batches.append(batch) or real_report(batch, mode)
    seen = spy_loss(trainer)
    trainer.train()
    logs = assert_one_step_stale(trainer, generated_on)
    assert all(h["agent/errors"] == 0 and h["agent/requests"] > 0 for h in logs)  # reported once per round
    assert all(0.0 <= h["rewards/agent_reward/mean"] <= 1.0 for h in logs)
    if strategy == "appo":
        assert all(h["agent/branches"] == 2 and h["agent/replay_divergence"] == 0 for h in logs)
    # exact rows: the loss saw the sampler's rows token for token (as a multiset: TRL may reorder within a batch)
    trained = [r for b in batches for r, k in zip(b.rows, b.keep) if k]
    for row in trained:
        row.check()
        assert row.prompt_ids + row.completion_ids[: row.loss_mask.index(1)] in backend.prompts  # sampled on
    losses = loss_rows(seen)
    assert len(losses) == len(trained) == 4 * (4 if strategy == "grpo" else 2)
    assert sorted(losses) == sorted((tuple(r.completion_ids), tuple(r.loss_mask)) for r in trained)
    assert trainer.rounds.path.agents.endpoint is None


class StuckAfter:
    """`sdk_agent` for its first `k` runs (the synchronous first round), then stuck in a call (sync, uncancellable)."""

    __name__ = "stuck_after"

    def __init__(self, k: int):
        self.k, self.calls, self.stuck, self.lock = k, 0, threading.Semaphore(0), threading.Lock()

    def __call__(self, row, base_url, model):
        with self.lock:
            self.calls += 1
            first = self.calls <= self.k
        if first:
            return sdk_agent(row, base_url, model)
        openai.OpenAI(base_url=base_url, api_key="-").chat.completions.create(model=model, messages=row["prompt"])
        self.stuck.release()
        time.sleep(60)


def test_ctrl_c_with_a_background_agent_round_in_flight(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """As the tool loop's background rounds: Ctrl-C stops both sides; the stuck runs are abandoned within the bound."""
    agent = StuckAfter(4)
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, agent, max_steps=4, num_prompts=8,
                              max_staleness=1, vllm_importance_sampling_mode="token_truncate")  # fmt: skip
    stopped = []

    def ctrl_c_once_the_background_round_is_stuck():
        for _ in range(4):
            agent.stuck.acquire(timeout=120)
        stopped.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_once_the_background_round_is_stuck, daemon=True).start()
    train_until_ctrl_c(trainer)
    assert stopped and time.monotonic() - stopped[0] <= 10.0
    assert trainer.rounds.path.agents.endpoint is None
    assert [(h.step, h.background) for h in trainer.rounds.async_rounds.history][:1] == [(0, False)]
    assert not [t for t in threading.enumerate() if t.name.startswith("appo-round")]
