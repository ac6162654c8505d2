"""Per-turn rewards in the trainer: a reward function returns one reward per assistant turn; each lands on exactly
that turn's tokens, with the turn boundaries read from the chat template's own markers (`<|im_start|>assistant`,
`<|im_end|>`) and the tool result between them masked. Also: one-line errors for a wrong number of turns, and for a
per-turn list without the tree estimator."""

from __future__ import annotations

import pytest

from appo_trl.trainer.reward_checks import RewardFunctionError
from tests.trainer.test_tree_trainer import VariedChat, train_recording

R1 = {t: 0.1 * (k + 1) for k, t in enumerate(VariedChat.THOUGHTS)}  # turn 1: which thought
R2 = 1.0  # turn 2: the right answer (42)


class TurnReward:
    __name__ = "turn_reward"

    def __init__(self, turns=2):
        self.turns = turns

    def __call__(self, completions, **kw):
        out = []
        for messages in completions:
            said = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
            first = next(v for t, v in R1.items() if t in said[0])
            out.append([first, R2 * ("42" in said[-1])][: self.turns])
        return out


def make(tmp_path, tokenizer, model_path, reward, **kw):
    from appo_trl.config import APPOConfig
    from appo_trl.trainer.trainer import APPOTrainer
    from tests.trainer.test_chat_tools import multiply, prompts
    from tests.trainer.test_trainer import CPU

    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy="arpo", num_generations=4,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1,
                      max_completion_length=120, tool_format="chat", initial_rollouts=2, branch_probability=0.0,
                      beam_size=2, **kw)  # fmt: skip
    trainer = APPOTrainer(model=model_path, reward_funcs=[reward], args=args, train_dataset=prompts(),
                          processing_class=tokenizer, tools=[multiply])  # fmt: skip
    trainer.rollout_engine.backend = VariedChat(tokenizer)
    return trainer


def find(ids: list[int], pattern: list[int]) -> list[int]:
    return [i for i in range(len(ids) - len(pattern) + 1) if ids[i : i + len(pattern)] == pattern]


def test_each_turn_reward_lands_on_its_turn(tiny_chat_model_path, tiny_chat_tokenizer, tmp_path):
    tok = tiny_chat_tokenizer
    trainer = make(tmp_path, tok, tiny_chat_model_path, TurnReward(), advantage_estimator="tree")
    seen, _ = train_recording(trainer, compare=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    checked = 0
    for inputs in seen:  # one micro-batch = one group (4 independent rows: no branch at probability 0)
        rows = []
        for ids, cmask, tmask, adv in zip(inputs["completion_ids"], inputs["completion_mask"], inputs["tool_mask"],
                                          inputs["advantages"]):  # fmt: skip
            n = int(cmask.sum())
            ids = ids[:n].tolist()
            turn1_end = ids.index(end)  # the first assistant turn ends with its own <|im_end|>
            (turn2_start,) = [i + len(header) for i in find(ids, header)]  # the template's next assistant header
            text1, text2 = tok.decode(ids[: turn1_end + 1]), tok.decode(ids[turn2_start:])
            r1, r2 = next(v for t, v in R1.items() if t in text1), R2 * ("42" in text2)
            assert tmask[turn1_end + 1 : turn2_start].eq(0).all() and tmask[: turn1_end + 1].eq(1).all()
            rows.append((adv[:n].tolist(), turn1_end, turn2_start, r1, r2))
        mean_return = sum(r1 + r2 for *_, r1, r2 in rows) / len(rows)
        for adv, turn1_end, _, r1, r2 in rows:
            # no branch, default weights: A_t = 2·(return-to-go from t − group mean of the returns)
            assert adv[: turn1_end + 1] == pytest.approx([2 * (r1 + r2 - mean_return)] * (turn1_end + 1), abs=1e-5)
            assert adv[turn1_end + 1 :] == pytest.approx([2 * (r2 - mean_return)] * (len(adv) - turn1_end - 1),
                                                         abs=1e-5)  # fmt: skip
            checked += 1
    assert checked == 8 and len({round(r1, 3) for *_, r1, _ in rows}) > 1


def test_wrong_turn_count_and_no_tree_estimator_are_one_line(tiny_chat_model_path, tiny_chat_tokenizer, tmp_path):
    trainer = make(tmp_path / "a", tiny_chat_tokenizer, tiny_chat_model_path, TurnReward(turns=1),
                   advantage_estimator="tree")  # fmt: skip
    with pytest.raises(RewardFunctionError, match=r"'turn_reward' returned 1 per-turn rewards for completion 0, "
                                                  r"which has 2 assistant turn\(s\)"):  # fmt: skip
        trainer.train()
    trainer = make(tmp_path / "b", tiny_chat_tokenizer, tiny_chat_model_path, TurnReward())
    with pytest.raises(RewardFunctionError, match="per-turn rewards: set advantage_estimator=tree"):
        trainer.train()


def test_an_environment_reports_a_reward_after_each_tool_call(tiny_chat_model_path, tok, tmp_path):
    """TRL's `environment_factory`: `get_reward()` returns the rewards its tool recorded after each call, then the
    answer turn's; each lands on the last sampled token of the turn that made the call (ARPO branches included)."""
    import json

    import torch

    from appo_trl.rollout.group_tree import turn_ends
    from tests.trainer.envs_helpers import Counter, CounterPolicy, make_trainer

    class StepCounter(Counter):
        def add(self, k: int) -> str:
            """Add k to the counter and return the new total.

            Args:
                k: how much to add.
            """
            self.steps = getattr(self, "steps", []) + [0.1 * int(k)]  # the reward of this call
            return super().add(k)

        def get_reward(self) -> list[float]:
            return list(getattr(self, "steps", [])) + [1.0]  # one per call turn, then the answer turn

    trainer = make_trainer(tmp_path, tiny_chat_model_path, tok, "arpo", factory=StepCounter,
                           advantage_estimator="tree")  # fmt: skip
    trainer.rollout_engine.backend = CounterPolicy(tok)
    seen = []
    finish = trainer.rounds.finish

    def recorded(out):
        rnd = trainer.rounds.current
        result = finish(out)
        seen.append((rnd.rows, rnd.token_rewards.clone()))
        return result

    trainer.rounds.finish = recorded
    trainer.train()
    ((rows, placed),) = seen
    assert any(r.parent is not None for r in rows), "the case is not trivial: ARPO branched"
    for i, r in enumerate(rows):
        ks = [json.loads(c.query)["k"] for c in r.tool_calls]
        ends = turn_ends(r.loss_mask)
        assert len(ends) == len(ks) + 1
        want = torch.zeros(placed.size(1), dtype=placed.dtype)
        want[ends] = torch.tensor([0.1 * k for k in ks] + [1.0], dtype=placed.dtype)
        assert torch.allclose(placed[i], want), (i, ks)
