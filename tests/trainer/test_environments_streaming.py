"""`environment_factory` under `rollout_stream: true`: every streamed group samples on instances of its own, reset on
the trainer's thread with its rows, concurrently with other groups on the same engine (`rollout(environments=)`),
and TRL's reward step gets each row's own instance; environment-owned data (reset() drawing a task per row) too.

The `Counter` environment and its scripted sampler are `test_environments.py`'s (tests/trainer/envs_helpers.py);
the pausable fake vLLM server takes the in-flight syncs (`rollout_stream` needs a server with `/pause`).
"""

from __future__ import annotations

import re
import threading

import pytest

from appo_trl.trainer.streaming import GroupStream
from bench.pausable_vllm import PausableVLLM
from tests.trainer.async_helpers import loss_rows
from tests.trainer.envs_helpers import REWARDS, CounterPolicy, dataset, make_trainer
from tests.trainer.test_environments_background import PoolWatch, RandomTask, capture_rounds
from tests.trainer.test_trainer import spy_loss

pytestmark = pytest.mark.network
STREAM = dict(use_vllm=True, vllm_mode="server", num_generations=2, per_device_train_batch_size=4, max_steps=4,
              max_staleness=2, rollout_stream=True, stream_overprovision=1.0,
              vllm_importance_sampling_mode="token_truncate")  # fmt: skip


class SlowFirstPolicy(CounterPolicy):
    """`CounterPolicy` whose requests on the counter started at 10 take 0.2 s: the other groups pass that one."""

    async def generate(self, prompt_ids, params):
        if "starts at 10." in self.tok.decode(prompt_ids):
            import asyncio

            await asyncio.sleep(0.2)
        return await super().generate(prompt_ids, params)


def test_streamed_groups_each_sample_on_instances_of_their_own(tmp_path, tiny_chat_model_path, tok, monkeypatch):
    handed, take = [], GroupStream.take

    def spy_take(self, *a, **k):  # the fed order of each batch's groups
        batch = take(self, *a, **k)
        handed.append([g.order for g in batch.groups])
        return batch

    monkeypatch.setattr(GroupStream, "take", spy_take)
    server = PausableVLLM().start()
    before = set(threading.enumerate())
    try:
        trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", factory=PoolWatch, data=dataset(8),
                               vllm_server_base_url=server.url, **STREAM)  # fmt: skip
        assert trainer.rounds.stream is not None
        trainer.rollout_engine.backend = SlowFirstPolicy(tok)  # scripted tool calls; the server takes the syncs
        concurrent, real = [], trainer.rollout_engine.rollout

        async def rollout(*a, **k):  # how many streamed groups sample at once on the one engine
            concurrent.append(sum(1 for g in trainer.rounds.stream.stream.in_flight()))
            return await real(*a, **k)

        trainer.rollout_engine.rollout = rollout
        rounds, seen = capture_rounds(trainer, tok), spy_loss(trainer)
        REWARDS.clear()
        trainer.train()
    finally:
        server.stop()
    assert server.calls.count("pause:keep") == 4 and server.calls.count("resume") == 4
    assert max(concurrent) >= 3  # groups of different instances sampled concurrently
    pool = {id(e) for envs in trainer._environment_pool.values() for e in envs}
    starts = []
    for batch, envs, _ in rounds:
        assert len(batch.rows) == len(envs) == 4 and len({id(e) for e in envs}) == 4  # one instance per row
        assert not pool & {id(e) for e in envs}  # the stream's own, never TRL's pooled ones
        for env in envs:  # reset on the trainer's thread, every call on the engine's
            assert env.threads[0] == "MainThread" and "MainThread" not in env.threads[1:]
        starts.append([int(re.search(r"starts at (\d+)\.", tok.decode(r.prompt_ids)).group(1)) for r in batch.rows])
    # the slow group (start 10) was passed by groups fed after it: a streamed order, not the fed one
    slow = next(i for i, step in enumerate(starts) if 10 in step)
    assert any(o > handed[slow][starts[slow].index(10) // 2] for step in handed[:slow] for o in step)
    # get_reward() once per row, on the instance the row was sampled with; rows as trained
    assert sorted(REWARDS) == sorted(h for _, _, histories in rounds for h in histories)
    trained = [r for b, _, _ in rounds for r in b.rows]
    for row in trained:
        row.check()
    losses = loss_rows(seen)  # the loss saw the sampler's rows token for token
    assert len(losses) == len(trained) == 16
    assert sorted(losses) == sorted((tuple(r.completion_ids), tuple(r.loss_mask)) for r in trained)
    left = [t for t in set(threading.enumerate()) - before if t.name.startswith(("appo-round", "appo-rollout"))]
    assert not [t.name for t in left if t.is_alive()]


def test_environment_owned_tasks_stream_row_by_row(tmp_path, tiny_chat_model_path, tok):
    """No train_dataset: reset() draws each row's task, so (grpo) each row samples on its own prompt, as TRL."""
    server = PausableVLLM().start()
    try:
        trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", factory=RandomTask, data=None,
                               vllm_server_base_url=server.url, **{**STREAM, "max_steps": 2})  # fmt: skip
        trainer.rollout_engine.backend = CounterPolicy(tok)
        rounds = capture_rounds(trainer, tok)
        trainer.train()
    finally:
        server.stop()
    assert len(rounds) == 2
    for batch, envs, _ in rounds:
        starts = [int(re.search(r"starts at (\d+)\.", tok.decode(r.prompt_ids)).group(1)) for r in batch.rows]
        assert len(set(starts)) == 4 and [e.start for e in envs] == starts  # each row its own drawn task



def test_agent_runs_stream_through_the_endpoint(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """The agent path: each group is n runs of the user's agent (`AgentRounds.start_group`), groups of several
    prompts run at once, and each batch reports its groups' summed agent/* counts once."""
    pytest.importorskip("openai")
    from tests.trainer.test_agents import make_trainer as make_agent_trainer
    from tests.trainer.test_agents import sdk_agent

    server = PausableVLLM().start()
    before = set(threading.enumerate())
    try:
        trainer, backend = make_agent_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, sdk_agent,
                                              num_prompts=8, vllm_server_base_url=server.url, **STREAM)  # fmt: skip
        agents = trainer.rounds.path.agents
        batches, real_report = [], agents.report
        agents.report = lambda batch, mode: batches.append((batch, dict(batch.agent.metrics), batch.agent.runs.runs)) \
            or real_report(batch, mode)  # fmt: skip
        seen = spy_loss(trainer)
        trainer.train()
    finally:
        server.stop()
    assert trainer.state.global_step == 4 and server.calls.count("pause:keep") == 4
    assert len(batches) == 4
    for batch, metrics, runs in batches:  # 2 groups of 2 runs each: its 4 runs counted, once
        assert len(batch.groups) == 2 and all(len(g) == 2 for g in batch.groups)
        assert batch.agent is None and runs == 4 and metrics["agent/errors"] == 0
    # the endpoint's figures are those served since the last hand-over (groups run ahead): all of them, once
    assert sum(m["agent/requests"] for _, m, _ in batches) >= 16
    trained = [r for b, _, _ in batches for r in b.rows]
    for row in trained:
        row.check()
        assert row.prompt_ids + row.completion_ids[: row.loss_mask.index(1)] in backend.prompts  # sampled on
    losses = loss_rows(seen)
    assert len(losses) == len(trained) == 16
    assert sorted(losses) == sorted((tuple(r.completion_ids), tuple(r.loss_mask)) for r in trained)
    assert agents.endpoint is None  # stopped at the end of training
    left = [t for t in set(threading.enumerate()) - before if t.name.startswith(("appo-round", "appo-rollout"))]
    assert not [t.name for t in left if t.is_alive()]
