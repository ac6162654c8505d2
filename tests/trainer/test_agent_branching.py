"""ARPO / AEPO branch the user's agent runs by replay: their in-loop rule applied to the recorded runs.

The agent and the scripted sampler are `test_agents`'s (one tool turn with two parallel calls, then the answer), so
every run has one fork point: the first sampled token of the answer after the tool results.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import types

import pytest

pytest.importorskip("openai")

from appo_trl.config import APPOConfig  # noqa: E402
from appo_trl.rollout import RolloutConfig, RolloutEngine, Trajectory  # noqa: E402
from appo_trl.strategies import ARPOStrategy, BranchHook  # noqa: E402
from appo_trl.strategies.arpo_replay import EntropyWindow, decide  # noqa: E402
from appo_trl.trainer.trainer import APPOTrainer  # noqa: E402
from bench.fake_vllm import ScriptedPolicy  # noqa: E402
from tests.rollout.conftest import ScriptedTool  # noqa: E402
from tests.trainer.test_agents import make_trainer, prompts, sdk_agent  # noqa: E402
from tests.trainer.test_trainer import CPU, spy_loss  # noqa: E402

nan = math.nan


def window(timing="lookahead", size=2):
    return EntropyWindow(types.SimpleNamespace(entropy_window=size, entropy_reduce="sum", entropy_normalize=False,
                                               hook_mode=timing), 100)  # fmt: skip


def test_fork_points_of_a_recorded_row_by_hand(tmp_path):
    """Sampled 0-1, a result 2-3, sampled 4-6, a result 7, sampled 8-9: fork points 4 and 8 (window 2, sum)."""
    row = Trajectory(prompt_ids=[1], completion_ids=list(range(10)), loss_mask=[1, 1, 0, 0, 1, 1, 1, 0, 1, 1],
                     logprobs=[-1.0] * 10, entropies=[0.1, 0.2, nan, nan, 0.4, 0.8, 1.6, nan, 2.0, 3.0])  # fmt: skip
    w = window()
    assert w.root(row) == pytest.approx(0.3)
    a, b = w.fork_points(row)
    assert (a.position, a.turns, b.position, b.turns) == (4, 1, 8, 2)
    assert (a.segment_entropy, a.lookahead_entropy) == (pytest.approx(0.3), pytest.approx(1.2))
    assert (b.segment_entropy, b.lookahead_entropy) == (pytest.approx(1.2), pytest.approx(5.0))
    assert window("faithful").fork_points(row)[0].lookahead_entropy is None
    # a branch at 4 owns only the fork points after it
    assert [p.position for p in w.fork_points(dataclasses.replace(row, uid="b", parent=row.uid, branch_pos=4))] == [8]
    # ARPO's rule on them: P = clip(τ + β·(H − H_root)) = 0.5 + 0.2·0.9 = 0.68, then clip(0.5 + 0.2·4.7) = 1
    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy="arpo", branch_probability=0.5,
                      entropy_weight=0.2, beam_size=2, branch_penalty=0.05, num_generations=2,
                      per_device_train_batch_size=2)  # fmt: skip
    hook = BranchHook(args, seed=0, penalty=False)
    row.seed = 3
    copies = [decide(hook, row, p, w.root(row), created=1, target=2, active=1) for p in (a, b)]
    assert hook.calls == 2 and hook.prob_sum == pytest.approx(0.68 + 1.0)
    assert copies[1] == 1  # P = 1: one copy, the group's one free slot
    assert decide(hook, row, b, w.root(row), created=2, target=2, active=1) == 0  # no slot left


@pytest.mark.parametrize("timing", ["faithful", "lookahead"])
def test_recorded_fork_points_are_what_the_in_loop_hook_saw(tiny_tokenizer, timing):
    """The engine's own tool loop with a hook that records its contexts: the recorded row gives the same ones."""
    tok = tiny_tokenizer
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    rclose = tok.convert_tokens_to_ids("</result>")
    turns = [enc("<think>add</think><python>print(2+3)</python>"), enc("<search>capital</search>"),
             enc("<answer>5</answer>") + [tok.eos_token_id]]  # fmt: skip

    def script(ctx, rng):
        turn = turns[min(ctx.count(rclose), 2)]
        since = len(ctx) - 1 - ctx[::-1].index(rclose) if rclose in ctx else None
        done = ctx[since + 1 :] if since is not None else []
        return turn[len(done) :] if done and turn[: len(done)] == done else turn

    tools = {"python": ScriptedTool("python", lambda q: "5"), "search": ScriptedTool("search", lambda q: "city")}
    cfg = RolloutConfig(max_completion_length=256, max_model_len=512, hook_mode=timing, entropy_window=3,
                        entropy_topk=4)  # fmt: skip
    engine = RolloutEngine(ScriptedPolicy(tok, script), tok, cfg, tools)
    seen = []

    def hook(ctx):
        seen.append((ctx.position, ctx.segment_entropy, ctx.lookahead_entropy, ctx.root_entropy))
        return 0

    try:
        [[row]] = engine.run(engine.rollout([enc("What is 2 plus 3?")], 1, seed=0, hook=hook))
    finally:
        engine.close()
    w = EntropyWindow(cfg, len(tok))
    points = w.fork_points(row)
    assert len(seen) == len(points) == 2
    for (pos, seg, look, root), p in zip(seen, points):
        assert p.position == pos and w.root(row) == pytest.approx(root)
        if timing == "lookahead":
            assert p.lookahead_entropy == pytest.approx(look) and not math.isnan(look)
        else:  # the hook reads the segment before the call
            assert p.lookahead_entropy is None and look is None and p.segment_entropy == pytest.approx(seg)


@pytest.mark.parametrize(
    ("strategy", "extra"),  # τ at its bound: P = 1
    [("arpo", {"branch_probability": 1.0}), ("aepo", {"branch_probability": 0.0}),
     ("aepo", {"branch_probability": 0.0, "aepo_penalty_scope": "prompt"})],
)  # fmt: skip
def test_arpo_and_aepo_branch_agent_runs_by_replay(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path, strategy,
                                                   extra):  # fmt: skip
    tok = tiny_chat_tokenizer
    trainer, backend = make_trainer(tmp_path, tiny_chat_model_path, tok, sdk_agent, strategy, initial_rollouts=1,
                                    **extra)  # fmt: skip
    batches, strat = [], trainer.rounds.strategy
    real = strat.generate
    strat.generate = lambda *a, **k: batches.append(real(*a, **k)) or batches[-1]
    seen = spy_loss(trainer)
    trainer.train()
    assert trainer.state.global_step == 2 and len(batches) == 2
    for batch in batches:
        assert batch.keep == [True] * 4  # ARPO / AEPO: branch rows reach the loss
        assert batch.metrics["branch/points_per_prompt"] == 1.0 and batch.metrics["branch/refill_per_prompt"] == 0
        for root, fork in batch.groups:
            assert root.origin == "root" and fork.origin == "fork" and fork.parent == root.uid
            p = fork.branch_pos
            # the fork point: the answer's first sampled token, right after the masked tool turn
            assert root.loss_mask[p - 1] == 0 and root.loss_mask[p] == 1 and 0 in root.loss_mask[:p]
            assert fork.prompt_ids == root.prompt_ids and fork.completion_ids[:p] == root.completion_ids[:p]
            assert fork.loss_mask[:p] == root.loss_mask[:p] and fork.logprobs[:p] == root.logprobs[:p]
            assert fork.root_entropy == root.root_entropy and not math.isnan(root.root_entropy)
            fork.check()
            assert root.prompt_ids + root.completion_ids[:p] in backend.prompts  # the branch call sampled on it
    logs = [h for h in trainer.state.log_history if "agent/branches" in h]
    assert len(logs) == 2 and all(h["agent/branches"] == 2.0 and h["agent/replay_divergence"] == 0.0 for h in logs)
    # each branch's first call is answered from the record, and its branch call matched the recorded request
    assert all(h["agent/replayed_calls"] == 4.0 for h in logs)
    assert sum(s["completion_ids"].size(0) for s in seen) == 8  # 2 steps x 4 rows, branches included


def test_arpo_agent_group_without_a_fork_is_refilled(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """P = 0: no fork, so the group gets one fresh run (a refill), as the engine refills."""
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, sdk_agent, "arpo", max_steps=1,
                              initial_rollouts=1, branch_probability=0.0, entropy_weight=0.0)  # fmt: skip
    batches, strat = [], trainer.rounds.strategy
    real = strat.generate
    strat.generate = lambda *a, **k: batches.append(real(*a, **k)) or batches[-1]
    trainer.train()
    [batch] = batches
    assert [[t.origin for t in g] for g in batch.groups] == [["root", "refill"]] * 2
    assert all(t.parent is None for t in batch.rows) and batch.metrics["branch/probability_mean"] == 0.0
    [log] = [h for h in trainer.state.log_history if "agent/branches" in h]
    assert log["agent/branches"] == 0.0


def test_aepo_dynamic_budget_reads_an_agent_probe(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path, monkeypatch):
    """The probe run's H_root (its first answer) and H_tool (segments at 0 and at its fork point) are measured."""
    import appo_trl.algorithms.arpo as arpo_maths

    seen, real = [], arpo_maths.aepo_initial_rollouts
    monkeypatch.setattr(arpo_maths, "aepo_initial_rollouts", lambda h, t, n: seen.append((h, t)) or real(h, t, n))
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, sdk_agent, "aepo", max_steps=1,
                              initial_rollouts=1, dynamic_rollouts=True)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 1 and len(seen) == 2
    assert all(math.isfinite(h) and math.isfinite(t) and h != t for h, t in seen)


def test_a_strategy_without_replay_is_refused_with_agents(tmp_path, monkeypatch):
    monkeypatch.setattr(ARPOStrategy, "branches_by_replay", False)
    args = APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=2, per_device_train_batch_size=4,
                      rollout_strategy="arpo", initial_rollouts=1)  # fmt: skip
    with pytest.raises(ValueError, match="'sdk_agent' with rollout_strategy=arpo: this strategy cannot branch"):
        APPOTrainer(model="missing", args=args, train_dataset=prompts(), agent=sdk_agent)


def test_engine_hook_is_still_refused_by_agent_runs():
    from appo_trl.trainer.agents import AgentEngine

    engine = AgentEngine.__new__(AgentEngine)
    with pytest.raises(RuntimeError, match="branching is by replay"):
        asyncio.run(engine.rollout([[1]], 1, seed=0, hook=lambda ctx: 0))
