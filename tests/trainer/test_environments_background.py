"""`environment_factory` in background rounds (`max_staleness: 1`): the next round samples on instances of its own,
built from the factory, while TRL resets its pooled instances on the trainer's thread for the round it scores; under
grpo and appo, with the tool loop's staleness bound, exact rows and Ctrl-C behaviour.

Same `Counter` environment and scripted sampler as `test_environments.py` (tests/trainer/envs_helpers.py).
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from transformers import TrainerCallback

from tests.trainer.async_helpers import assert_one_step_stale, loss_rows
from tests.trainer.envs_helpers import REWARDS, Counter, CounterPolicy, check_row, dataset, make_trainer
from tests.trainer.test_trainer import spy_loss

BACKGROUND = dict(max_steps=4, max_staleness=1, vllm_importance_sampling_mode="token_truncate")


class PoolWatch(Counter):
    """A `Counter` that records the thread of every `reset()` and `add()` on it (per instance)."""

    def __init__(self):
        super().__init__()
        self.threads: list[str] = []

    def reset(self, start: int = 0, **kwargs) -> str:
        self.threads.append(threading.current_thread().name)
        return super().reset(start, **kwargs)

    def add(self, k: int) -> str:
        """Add k to the counter and return the new total.

        Args:
            k: how much to add.
        """
        self.threads.append(threading.current_thread().name)
        return super().add(k)


def capture_rounds(trainer, tok):
    """Each round handed to TRL: its batch and the instances its rows leave for TRL's reward step, each row checked
    against its instance there (TRL resets its pooled instances again for later rounds) and their histories kept."""
    seen, orig = [], trainer._generate

    def wrapped(prompts):
        out = orig(prompts)
        batch, envs = trainer.rounds.current, list(trainer.environments)
        for traj, env in zip(batch.rows, envs):  # each row's instance holds exactly its own calls
            start = int(re.search(r"starts at (\d+)\.", tok.decode(traj.prompt_ids)).group(1))
            check_row(traj, env, start)
        seen.append((batch, envs, [tuple(e.history) for e in envs]))
        return out

    trainer._generate = wrapped
    return seen


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
def test_environments_in_background_rounds(tmp_path, strategy, tiny_chat_model_path, tok):
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, strategy, factory=PoolWatch, data=dataset(8),
                           **BACKGROUND)  # fmt: skip
    trainer.rollout_engine.backend = CounterPolicy(tok)
    generated_on, path = [], trainer.rounds.path
    real = path.sample
    path.sample = lambda *a, **k: generated_on.append(threading.current_thread().name) or real(*a, **k)
    rounds, seen = capture_rounds(trainer, tok), spy_loss(trainer)
    REWARDS.clear()
    trainer.train()
    assert_one_step_stale(trainer, generated_on)
    pool = {id(e) for envs in trainer._environment_pool.values() for e in envs}
    assert len(rounds) == 4
    for r, (batch, envs, _) in enumerate(rounds):
        assert len(batch.rows) == len(envs) == 4 and len({id(e) for e in envs}) == 4  # one instance per row
        if r > 0:  # a background round's rows: instances of its own, never TRL's pooled ones
            assert not pool & {id(e) for e in envs}
    # TRL's pooled instances: reset on the trainer's thread only, called only by the synchronous first round
    for envs in trainer._environment_pool.values():
        for env in envs:
            assert not any(t.startswith("appo-round") for t in env.threads)
    # get_reward() once per row on the instance the row was sampled with
    assert sorted(REWARDS) == sorted(h for _, _, histories in rounds for h in histories)
    # exact rows: the loss saw the sampler's rows token for token (as a multiset: TRL may reorder within a batch)
    trained = [r for b, _, _ in rounds for r, k in zip(b.rows, b.keep) if k]
    for row in trained:
        row.check()
    losses = loss_rows(seen)
    assert len(losses) == len(trained) == 4 * (4 if strategy == "grpo" else 2)
    assert sorted(losses) == sorted((tuple(r.completion_ids), tuple(r.loss_mask)) for r in trained)


class SlowPolicy(CounterPolicy):
    """`CounterPolicy` that takes `delay` seconds per request on a round thread (the background round is in flight)."""

    def __init__(self, tok, delay: float):
        super().__init__(tok)
        self.delay = delay

    async def generate(self, prompt_ids, params):
        if threading.current_thread().name != "MainThread":
            import asyncio

            await asyncio.sleep(self.delay)
        return await super().generate(prompt_ids, params)


class InterruptAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_ctrl_c_with_a_background_environment_round_in_flight(tmp_path, tiny_chat_model_path, tok):
    """As the tool loop's and the agent's: Ctrl-C stops both sides, the round thread is joined, nothing pending."""
    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", data=dataset(8), **BACKGROUND)
    trainer.rollout_engine.backend = SlowPolicy(tok, delay=1.0)
    trainer.add_callback(InterruptAt(1))
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    rounds = trainer.rounds.async_rounds
    assert rounds.last_thread is not None and not rounds.last_thread.is_alive() and rounds.closed
    assert rounds.pending is None and time.monotonic() - t0 < 20
    assert not [t for t in threading.enumerate() if t.name.startswith("appo-round") and t.is_alive()]


class RandomTask(Counter):
    """A `reset()` that draws its own task (start) each time, whatever the row."""

    draws = iter(range(100, 10**6, 7))

    def reset(self, start: int = 0, **kwargs) -> str:
        return super().reset(next(RandomTask.draws), **kwargs)


def test_reward_step_reads_the_prompts_a_background_round_sampled_on(tmp_path, tiny_chat_model_path, tok):
    """TRL resets its own instances for the round it scores and renders its prompts from their observations; a
    background round's rows were sampled on their own instances' observations, which TRL's reward step then reads
    (grpo samples each row on its own prompt when the observations of one prompt's rows differ)."""
    mismatched, checked = [], []

    def prompt_reward(prompts, completions, environments, **kwargs):
        for prompt, env in zip(prompts, environments):
            checked.append(env.start)
            if f"starts at {env.start}." not in prompt[-1]["content"]:
                mismatched.append((prompt[-1]["content"], env.start))
        return [0.0] * len(prompts)

    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "grpo", factory=RandomTask, data=dataset(8),
                           reward_funcs=[prompt_reward], **BACKGROUND)  # fmt: skip
    trainer.rollout_engine.backend = CounterPolicy(tok)
    rounds = capture_rounds(trainer, tok)  # each row checked against its own instance's task
    trainer.train()
    assert [h.background for h in trainer.rounds.async_rounds.history] == [False, True, True, True]
    assert len(rounds) == 4 and len(set(checked)) == len(checked) == 16  # every row its own task
    assert not mismatched
