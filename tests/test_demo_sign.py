"""Sign check of the whole RL update path on the real `APPOTrainer` (issue 12: "rule out a sign bug").

One optimiser step on scripted trajectories (tests/trainer/fakes.py) whose reward is 1 for the answer `0` and 0
otherwise. Whatever the strategy, advantage and loss mode, the update must raise the log-probability of every
rewarded row that reached the loss and lower that of every unrewarded one: a flipped sign in the reward ->
advantage -> loss -> normaliser chain, or an advantage attached to the wrong row, fails here.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.fakes import ScriptedEngine


def reward_answer_zero(completions, **kwargs):
    return [1.0 if "<answer> 0 </answer>" in c[0]["content"] else 0.0 for c in completions]


def _row_logps(model, rows) -> list[float]:
    """Per trajectory, the summed log-probability of its sampled tokens at the positions where the rows differ.

    Tokens shared by every row (the scripted `<think>` segment) get opposite pushes from the rows of opposite
    advantage and mostly follow the larger one, so only the distinguishing tokens carry the per-row sign.
    """
    width = min(len(t.completion_ids) for t in rows)
    same = [len({t.completion_ids[i] for t in rows}) == 1 for i in range(width)]
    out = []
    with torch.no_grad():
        for t in rows:
            ids = torch.tensor([list(t.prompt_ids) + list(t.completion_ids)])
            logits = model(input_ids=ids).logits[0, len(t.prompt_ids) - 1 : -1]
            lp = torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(t.prompt_ids) :, None])[:, 0]
            keep = [m and not (i < width and same[i]) for i, m in enumerate(t.loss_mask)]
            out.append(float((lp * torch.tensor(keep, dtype=torch.float32)).sum()))
    return out


STRATEGIES = {
    "grpo": dict(rollout_strategy="grpo"),
    "grpo_bnpo": dict(rollout_strategy="grpo", loss_type="bnpo"),
    "appo": dict(rollout_strategy="appo", initial_rollouts=2, min_remaining_tokens=4),
    "appo_clip_group": dict(
        rollout_strategy="appo", initial_rollouts=2, min_remaining_tokens=4, loss_mode="clip", advantage_mode="group"
    ),
    "aepo": dict(
        rollout_strategy="aepo", initial_rollouts=4, loss_mode="entropy_balanced", entropy_balanced_advantage=True
    ),
}


# kept rows with advantages of equal size and opposite sign (GRPO: rewards 1, 0, 0, 1 around their mean 0.5). In
# the APPO variants the one rewarded row's advantage is 3x the others' (rewards 1, 0 plus two 0-reward branch rows),
# so its push on the shared context may also lift the unrewarded row's tokens: only the weighted sum is pinned.
BALANCED = {"grpo": True, "grpo_bnpo": True, "appo": False, "appo_clip_group": False, "aepo": True}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_one_step_raises_rewarded_rows_and_lowers_the_others(name, tmp_path, tiny_tokenizer, tiny_model_path):
    engine = ScriptedEngine(tiny_tokenizer)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "what is 3 times 4"}]] * 4})
    kw = {"loss_type": "dapo", **STRATEGIES[name]}
    args = APPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0, beta=0.0,
        learning_rate=1e-3, tools=["python"], num_generations=4, per_device_train_batch_size=4, max_steps=1,
        max_completion_length=64, **kw,
    )  # fmt: skip
    trainer = APPOTrainer(
        model=tiny_model_path, reward_funcs=[reward_answer_zero], args=args, train_dataset=data,
        processing_class=tiny_tokenizer, rollout_engine=engine,
    )  # fmt: skip
    trainer.train()
    rows = engine.initial  # the rows that reach the loss (APPO drops its branch rows)
    assert len(rows) == (2 if name.startswith("appo") else 4)
    before = _row_logps(_fresh(tiny_model_path), rows)
    after = _row_logps(trainer.model.eval(), rows)
    rewards = reward_answer_zero([[{"content": tiny_tokenizer.decode(t.completion_ids)}] for t in rows])
    assert 0 < sum(rewards) < len(rows)  # both signs of advantage are present
    mean = sum(rewards) / len(rewards)
    gain = sum((r - mean) * (a - b) for r, a, b in zip(rewards, after, before))
    assert gain > 0, (name, rewards, before, after)  # the advantage-weighted log-likelihood went up
    for r, b, a in zip(rewards, before, after):
        if r > 0:  # every rewarded row became more likely
            assert a > b, (name, rewards, before, after)
        elif BALANCED[name]:  # equal and opposite advantages: every unrewarded row became less likely
            assert a < b, (name, rewards, before, after)


def _fresh(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()
