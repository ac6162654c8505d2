"""TRL's `environment_factory` on `APPOTrainer`: one instance per rollout, branches in their parent's state.

Every row is checked against its own tokens (the `Counter` of tests/trainer/envs_helpers.py): the results the model
saw are the running totals of its calls, and the reward is recomputed from the row's call records. Also: replayed
branches, replays that diverge, two calls in one turn, environment methods' deadlines, and the start-up refusals.
TRL's own behaviours (its errors, reward columns, per-row routing, standalone tools): test_environments_trl.py.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tests.trainer.envs_helpers import (
    RESETS,
    REWARDS,
    Counter,
    CounterPolicy,
    Drifting,
    ReplayCounter,
    ReplaySlowCounter,
    SlowCounter,
    TwoCallPolicy,
    Uncopyable,
    capture_rows,
    check_row,
    make_trainer,
)


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
    origins = [t.origin for t in rows]
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


# ---- several calls in one assistant turn on one environment ------------------------------------------------------


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
