"""AEPO's dynamic budget with a multi-call chat turn: the turn's calls share `end`, so its segment counts once."""

from __future__ import annotations

import math
from types import SimpleNamespace

from appo_trl.algorithms.arpo import aepo_initial_rollouts
from appo_trl.rollout import RolloutConfig
from appo_trl.rollout.types import ToolCallRecord, Trajectory
from appo_trl.strategies import AEPOStrategy


def test_a_multi_call_turn_is_one_tool_segment():
    nan = math.nan
    # sampled [0, 0] | tool turn of two calls (mask 0, NaN entropies) | sampled [2, 2]: H_tool = mean(0, 4) = 2
    probe = Trajectory(prompt_ids=[1], completion_ids=list(range(8)), loss_mask=[1, 1, 0, 0, 0, 0, 1, 1],
                       logprobs=[-1.0] * 8, entropies=[0.0, 0.0, nan, nan, nan, nan, 2.0, 2.0])  # fmt: skip
    probe.tool_calls = [
        ToolCallRecord("f", "{}", "1", True, 0.0, 2, 6),
        ToolCallRecord("f", "{}", "2", True, 0.0, 4, 6),
    ]
    probe.root_entropy = 0.0
    calls = []
    engine = SimpleNamespace(config=RolloutConfig(entropy_window=2, entropy_normalize=False), replays_branches=False,
                             run=lambda coro: (coro.close(), [[probe]])[1],
                             rollout=lambda *a, **k: (calls.append(k), _noop())[1])  # fmt: skip
    args = SimpleNamespace(dynamic_rollouts=True, dynamic_rollouts_source="probe", initial_rollouts=4)
    trainer = SimpleNamespace(args=args, rollout_engine=engine, processing_class_tokenizer=[0] * 10)
    counts, kept = AEPOStrategy(trainer).initial_counts([[1]], 8, seed=0, engine=engine)
    assert counts == [aepo_initial_rollouts(0.0, 2.0, 8)] == [3]  # counted twice, H_tool = 8/3 would give 2
    assert kept == [[]]
    assert calls == [{"seed": 7919, "route_seed": 0}]  # other samples, the group's routing key (its replica)


async def _noop():
    return None
