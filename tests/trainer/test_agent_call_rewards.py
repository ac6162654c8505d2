"""An agent's rewards per model call: each lands on the last sampled token of its call's answer, TRL gets the run's
total, the tree estimator credits the return-to-go; a wrong length, calls in other chains (an agent that rewrote its
history), a list without the tree estimator and a non-finite reward are each refused or skipped in one line."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

openai = pytest.importorskip("openai")

from appo_trl.rollout.types import Trajectory  # noqa: E402
from appo_trl.trainer.turn_rewards import call_rewards_per_turn, place_turn_rewards  # noqa: E402
from tests.trainer.test_agent_chain_rows import compacting_agent  # noqa: E402
from tests.trainer.test_agents import TOOLS, make_trainer  # noqa: E402
from tests.trainer.test_trainer import spy_loss  # noqa: E402

FIRST = 0.25  # the tool-call turn's reward; the answer turn's: 1 when it says 42


def test_call_rewards_land_on_each_calls_last_sampled_token():
    # turns: tokens 0-1, 4-6, 8; call 3 was answered empty (budget spent): its reward joins call 2's token 6
    row = Trajectory(prompt_ids=[9], completion_ids=list(range(9)), loss_mask=[1, 1, 0, 0, 1, 1, 1, 0, 1], chain=0)
    answered = [(0, 1), (0, 6), (0, 6), (0, 8)]
    per_turn = call_rewards_per_turn(answered, row, [0.5, 1.0, 2.0, -1.0])
    assert per_turn == [0.5, 3.0, -1.0]
    placed = place_turn_rewards([row], torch.tensor([[2.5]]), ["agent_reward"], [2.0], {("agent_reward", 0): per_turn},
                                10)  # fmt: skip
    assert placed[0].tolist() == [0, 1.0, 0, 0, 0, 0, 6.0, 0, -2.0, 0]  # weight 2
    with pytest.raises(ValueError, match=r"^returned 3 per-call rewards for a run of 4 model call\(s\); return one "):
        call_rewards_per_turn(answered, row, [0.5, 1.0, 2.0])
    with pytest.raises(ValueError, match=r"^returned per-call rewards, but 1 of its 4 calls started other chains"):
        call_rewards_per_turn([(1, 3), *answered[1:]], row, [0.5, 1.0, 2.0, -1.0])


LOCK, SEEN = threading.Lock(), []


def per_call_agent(row, base_url, model, extra=0):
    """The `openai` SDK tool loop of `test_agents.sdk_agent`, rewarding each call: FIRST, then 1 if it says 42."""
    client = openai.OpenAI(base_url=base_url, api_key="-")
    messages, rewards = list(row["prompt"]), []
    for _ in range(4):
        msg = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        rewards.append(FIRST if msg.tool_calls else float("42" in (msg.content or "")))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] * args["b"])})
    client.close()
    with LOCK:
        SEEN.append(list(rewards))
    return rewards + [0.0] * extra


def test_per_call_rewards_train_on_their_turns_return_to_go(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    tok = tiny_chat_tokenizer
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tok, per_call_agent, "arpo", branch_probability=0.0,
                              advantage_estimator="tree", beam_size=2)  # fmt: skip
    seen = spy_loss(trainer)
    SEEN.clear()
    trainer.train()
    assert sorted(map(tuple, SEEN)) == [(FIRST, 0.0)] * 4 + [(FIRST, 1.0)] * 4  # every group: one 42, one 41
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2 and all(h["reward"] == pytest.approx(FIRST + 0.5) for h in logs)  # TRL: the run's total
    end = tok.convert_tokens_to_ids("<|im_end|>")
    mean = FIRST + 0.5
    checked = 0
    for inputs in seen:
        for ids, mask, adv in zip(inputs["completion_ids"], inputs["tool_mask"], inputs["advantages"]):
            ids, mask, adv = ids.tolist(), mask.tolist(), adv.tolist()
            answer = float("<answer> 42" in tok.decode(ids))  # (the tool result, masked, says 42 too)
            first_end = ids.index(end)  # the call turn's own end-of-turn token (sampled)
            assert mask[first_end] == 1 and mask[first_end + 1] == 0
            sampled = [t for t, m in enumerate(mask) if m]
            # no branch, default weights: A_t = 2 * (return-to-go from t - the group's mean return)
            for t in sampled:
                rtg = (FIRST + answer) if t <= first_end else answer
                assert adv[t] == pytest.approx(2 * (rtg - mean), abs=1e-5)
            checked += 1
    assert checked == 8


@pytest.mark.parametrize(
    "agent,estimator,line",
    [
        (lambda row, url, model: per_call_agent(row, url, model, extra=1), "tree",
         r"failed: returned 3 per-call rewards for a run of 2 model call\(s\); return one reward per call"),
        (lambda row, url, model: [compacting_agent(row, url, model)] * 4, "tree",
         r"failed: returned per-call rewards, but 2 of its 4 calls started other chains"),
        (per_call_agent, "grpo", r"failed: TypeError: agent '.*' returned a list \(one reward per model call\); "
         r"per-call rewards need advantage_estimator: tree"),
    ],
    ids=["wrong-length", "other-chains", "no-tree"],
)  # fmt: skip
def test_refused_per_call_rewards_are_one_line_and_reward_0(tmp_path, caplog, tiny_chat_tokenizer,
                                                            tiny_chat_model_path, agent, estimator, line):  # fmt: skip
    strategy = "arpo" if estimator == "tree" else "grpo"
    extra = {"branch_probability": 0.0, "beam_size": 2, "advantage_estimator": "tree"} if estimator == "tree" else {}
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, agent, strategy, max_steps=1,
                              **extra)  # fmt: skip
    with caplog.at_level("WARNING"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0]
    assert __import__("re").search(line, warned[0]), warned[0]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert logs and all(h["reward"] == 0.0 and h["agent/errors"] == 4 for h in logs)


def test_a_non_finite_per_call_reward_is_none_with_one_warning(tmp_path, caplog, tiny_chat_tokenizer,
                                                               tiny_chat_model_path):  # fmt: skip
    def agent(row, base_url, model):
        rewards = per_call_agent(row, base_url, model)
        return [rewards[0], math.inf] if "(0)" in row["prompt"][0]["content"] else rewards

    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, agent, "arpo", max_steps=1,
                              branch_probability=0.0, beam_size=2, advantage_estimator="tree")  # fmt: skip
    seen = spy_loss(trainer)
    with caplog.at_level("WARNING"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(warned) == 1 and " returned inf; " in warned[0]
    for inputs in seen:
        assert torch.isfinite(inputs["advantages"]).all()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert logs and all(h["reward"] == pytest.approx(FIRST + 0.5) for h in logs)  # prompt (1)'s runs only


def test_per_call_rewards_with_a_branch_credit_each_node(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """arpo branches every run at its answer (P = 1): the tool-call turn is shared by the run and its branch (the
    branch's first call is replayed), the answers are each row's own. By hand (default weights, 1/sqrt(rows)):
    V(root) = mean total return = FIRST + 1/2; the shared node's Q = the same, so its tokens get 0 in both rows;
    each answer node (one row) gets (a - V(root)) + (a - V(shared node)) = 2 * (a - FIRST - 1/2)."""
    tok = tiny_chat_tokenizer
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tok, per_call_agent, "arpo", initial_rollouts=1,
                              branch_probability=1.0, advantage_estimator="tree")  # fmt: skip
    batches, strat = [], trainer.rounds.strategy
    real = strat.generate
    strat.generate = lambda *a, **k: batches.append(real(*a, **k)) or batches[-1]
    seen = spy_loss(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "agent/branches" in h]
    assert len(logs) == 2 and all(h["agent/branches"] == 2 and h["agent/errors"] == 0 for h in logs)
    assert all(h["agent/replay_divergence"] == 0 for h in logs)
    forks = {r.uid: r.branch_pos for b in batches for r in b.rows if r.parent is not None}
    assert len(forks) == 4
    mean, checked = FIRST + 0.5, 0
    for inputs in seen:
        for ids, mask, adv in zip(inputs["completion_ids"], inputs["tool_mask"], inputs["advantages"]):
            ids, mask, adv = ids.tolist(), mask.tolist(), adv.tolist()
            answer = float("<answer> 42" in tok.decode(ids))
            p = next(t for t in range(1, len(mask)) if mask[t] and not mask[t - 1])  # the answer's first token
            for t in (t for t, m in enumerate(mask) if m):
                assert adv[t] == pytest.approx(0.0 if t < p else 2 * (answer - mean), abs=1e-5)
            checked += 1
    assert checked == 8


def test_an_agents_number_wins_over_per_turn_lists(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """Issue 48, cause 1: the agent returns 1.0 for every run while a reward function returns per-turn lists; the
    agent's number wins, so no list is placed and every token's advantage is 0 (all runs' rewards are equal)."""
    from tests.trainer.test_agents import sdk_agent

    def always_one(row, base_url, model):
        sdk_agent(row, base_url, model)
        return 1.0

    def per_turn(completions, **kw):  # one reward per assistant turn, different on every turn and row
        return [[0.3 * (i + 1) + 0.1 * t for t, m in enumerate(c) if m["role"] == "assistant"]
                for i, c in enumerate(completions)]  # fmt: skip

    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, always_one, "arpo",
                              reward_funcs=[per_turn], branch_probability=0.0, advantage_estimator="tree",
                              beam_size=2, max_steps=1)  # fmt: skip
    seen = spy_loss(trainer)
    trainer.train()
    assert seen
    for inputs in seen:
        assert torch.all(inputs["advantages"] == 0), inputs["advantages"].abs().max()
