"""`max_staleness >= 1`: which weights a background round is corrected and scored with.

Pinned: the decoupled-PPO correction on a hand-computed two-token case, the importance weight computed at
hand-over from the proximal policy, and TRL's four importance-sampling modes on background rounds; APPO's
selection forward never overlaps an optimizer step and reads the weights of its hand-over (m = 2 too), an
evaluation between two hand-overs does not wait for it, and `async_fv_policy: sampler` scores on the sampler copy.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from transformers import TrainerCallback

from appo_trl.config import APPOConfig
from appo_trl.trainer.async_rounds import (
    AsyncRounds,
    OptimizerStepLock,
)
from tests.trainer.async_helpers import GRPO, Round, _weights
from tests.trainer.fakes import ScriptedEngine
from tests.trainer.test_trainer import CPU, RewardSpy, dataset, make_trainer


def _two_token_inputs(trainer):
    ln = math.log
    inputs = {
        "prompt_ids": torch.tensor([[5]]),
        "prompt_mask": torch.tensor([[1]]),
        "completion_ids": torch.tensor([[7, 8]]),
        "completion_mask": torch.tensor([[1, 1]]),
        "tool_mask": torch.tensor([[1, 1]]),
        "advantages": torch.tensor([1.0]),
        "old_per_token_logps": torch.tensor([[ln(0.4), ln(0.25)]]),  # proximal: the trainer at hand-over
        "sampling_per_token_logps": torch.tensor([[ln(0.2), ln(0.5)]]),  # behaviour: the sampler
        "num_items_in_batch": torch.tensor(2.0),
    }
    # TRL's truncated importance weight, as `_generate_and_score_completions` computes it (token_truncate, max 3)
    inputs["importance_sampling_ratio"] = torch.tensor([[0.4 / 0.2, 0.25 / 0.5]])
    current = torch.tensor([[ln(0.5), ln(0.25)]], requires_grad=True)  # π_θ

    def forward(model, input_ids, attention_mask, logits_to_keep, **kw):
        return current, torch.zeros(1, 2), None

    trainer._get_per_token_logps_and_entropies = forward
    return inputs


@pytest.mark.parametrize("loss_mode", ["clip", "dual_clip"])
def test_decoupled_ppo_correction_on_two_tokens(tmp_path, tiny_tokenizer, tiny_model_path, loss_mode):
    """r = π_θ/π_prox = (1.25, 1.0), clipped to (1.2, 1.0) (ε 0.2, A = 1); weight π_prox/π_behav = (2.0, 0.5);
    bnpo: −(1.2·2.0 + 1.0·0.5)/2 = −1.45 with the correction, −(1.2 + 1.0)/2 = −1.1 synchronously in-process."""
    losses = {}
    for k in (0, 1):
        trainer = make_trainer(
            tmp_path / str(k), tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(),
            max_staleness=k, loss_type="bnpo", loss_mode=loss_mode, vllm_importance_sampling_mode="token_truncate",
            gradient_accumulation_steps=1, max_steps=1, **GRPO,
        )  # fmt: skip
        inputs = _two_token_inputs(trainer)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train
        losses[k] = trainer._compute_loss(trainer.model, inputs).item()
        assert trainer.use_vllm is False  # the flag is raised only for the span of TRL's loss
    assert losses[1] == pytest.approx(-1.45, abs=1e-6)
    assert losses[0] == pytest.approx(-1.1, abs=1e-6)


def test_importance_weight_is_computed_at_hand_over_from_the_proximal_policy(
    tmp_path, tiny_tokenizer, tiny_model_path
):
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(), max_steps=2,
        max_staleness=1, vllm_importance_sampling_mode="token_truncate", **GRPO,
    )  # fmt: skip
    seen = []
    orig = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: seen.append(orig(inputs)) or seen[-1]
    trainer.train()
    for out in seen:
        mask = (out["completion_mask"] * out["tool_mask"]).bool()
        expected = torch.exp(out["old_per_token_logps"] - (-0.5)).clamp(max=3.0)  # scripted sampler logprob −0.5
        torch.testing.assert_close(out["importance_sampling_ratio"][mask], expected[mask])
    assert len(seen) == 2


class FarSampler(ScriptedEngine):
    """Odd rows of a group get sampler logprob −30 on their sampled tokens: their weight exp(old − sampler) is far
    above `vllm_importance_sampling_clip_max` (3), so truncation and masking give different weights."""

    async def rollout(self, prompts, n, **kw):
        groups = await super().rollout(prompts, n, **kw)
        for group in groups:
            for j, t in enumerate(group):
                if j % 2:
                    t.logprobs = [-30.0 if m else lp for m, lp in zip(t.loss_mask, t.logprobs)]
        return groups


def expected_is_weight(out, mode, clip_max=3.0):
    """TRL 1.16's vLLM importance-sampling weight for `mode`, from the batch's proximal and sampler logprobs."""
    mask = out["completion_mask"] * out["tool_mask"]
    diff = torch.nan_to_num((out["old_per_token_logps"] - out["sampling_per_token_logps"]) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    return ratio.clamp(max=clip_max) if mode.endswith("truncate") else ratio.masked_fill(ratio > clip_max, 0.0)


@pytest.mark.parametrize("loss_mode", ["clip", "future_kl"])
@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
def test_trls_importance_sampling_modes_apply_to_background_rounds(
    tmp_path, tiny_tokenizer, tiny_model_path, mode, loss_mode
):
    """Each of TRL's four `vllm_importance_sampling_mode`s, with TRL's loss and with future_kl: 2 async steps (one
    synchronous round, one from the background) train with a finite loss, and the weight of every round is TRL's
    for that mode (the mask modes zero the odd rows, the truncate modes cap them at 3)."""
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, FarSampler(tiny_tokenizer), RewardSpy(), max_steps=2,
        max_staleness=1, vllm_importance_sampling_mode=mode, loss_mode=loss_mode, **GRPO,
    )  # fmt: skip
    seen = []
    orig = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: seen.append(orig(inputs)) or seen[-1]
    trainer.train()
    assert [h.background for h in trainer.rounds.async_rounds.history] == [False, True]
    for out in seen:
        expected = expected_is_weight(out, mode)
        torch.testing.assert_close(out["importance_sampling_ratio"], expected)
        sampled = (out["completion_mask"] * out["tool_mask"])[1::2].bool()
        far = expected[1::2] if mode.startswith("sequence") else expected[1::2][sampled]
        assert (far == (0.0 if mode.endswith("mask") else 3.0)).all()
    logs = [e for e in trainer.state.log_history if "rollout/staleness/max" in e]
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs)
    assert all("sampling/importance_sampling_ratio/mean" in e for e in logs)


def test_appo_selection_forward_never_overlaps_an_optimizer_step(
    tmp_path, tiny_tokenizer, tiny_model_path, monkeypatch
):
    spans = {"forward": [], "step": []}
    real_step = torch.optim.AdamW.step

    def slow_step(self, *a, **k):
        t0 = time.monotonic()
        time.sleep(0.05)
        out = real_step(self, *a, **k)
        spans["step"].append((t0, time.monotonic()))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", slow_step)
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(),
        rollout_strategy="appo", num_generations=4, initial_rollouts=2, per_device_train_batch_size=4,
        max_completion_length=64, min_remaining_tokens=1, tools=["python"], max_steps=4, max_staleness=1,
        branch_entropy_source="trainer",
    )  # fmt: skip
    real_forward = trainer._get_per_token_logps_and_entropies

    def forward(*a, **k):
        if threading.current_thread() is threading.main_thread():
            return real_forward(*a, **k)
        t0 = time.monotonic()
        time.sleep(0.3)  # a slow selection forward: without the lock it would straddle an optimizer step
        out = real_forward(*a, **k)
        spans["forward"].append((t0, time.monotonic()))
        return out

    trainer._get_per_token_logps_and_entropies = forward
    trainer.train()
    assert len(spans["forward"]) == 3 and len(spans["step"]) == 4
    for f0, f1 in spans["forward"]:
        for s0, s1 in spans["step"]:
            assert f1 <= s0 or s1 <= f0, "an APPO selection forward overlapped an optimizer step"
    # async_fv_policy=proximal: the round launched at step j scores after optimizer step j (its proximal weights)
    for (f0, _), (_, s1) in zip(spans["forward"], spans["step"]):
        assert f0 >= s1


class SlowStepEnd(TrainerCallback):
    """Pauses after each optimizer step: a selection forward that may run before its hand-over runs then."""

    def on_step_end(self, args, state, control, **kw):
        time.sleep(0.3)


def test_appo_selection_forward_reads_the_hand_over_weights_with_two_steps_per_round(
    tmp_path, tiny_tokenizer, tiny_model_path
):
    """m = 2 optimizer steps per round (steps_per_generation 2, max_staleness 3): the round launched at step v
    scores its branches on the weights of its hand-over, v + 2, the proximal policy of its loss (with a ticket of
    v + 1 it read the weights of step v + 1, between the two steps)."""
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(),
        rollout_strategy="appo", num_generations=4, initial_rollouts=2, per_device_train_batch_size=4,
        steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=64, min_remaining_tokens=1,
        tools=["python"], max_steps=6, max_staleness=3, branch_entropy_source="trainer",
    )  # fmt: skip
    assert trainer.rounds.async_rounds.m == 2
    trainer.add_callback(SlowStepEnd())
    scored, handed = [], {}
    real_forward = trainer._get_per_token_logps_and_entropies

    def forward(model, *a, **k):
        if threading.current_thread() is not threading.main_thread():  # inside trainer_forward: weights_lock held
            scored.append((trainer.rounds.async_rounds.optimizer_steps, _weights(model)))
        return real_forward(model, *a, **k)

    real_next_round = trainer.rounds.async_rounds.next_round

    def next_round(inputs, step, *a, **k):
        handed[step] = _weights(trainer.model)
        return real_next_round(inputs, step, *a, **k)

    trainer._get_per_token_logps_and_entropies = forward
    trainer.rounds.async_rounds.next_round = next_round
    trainer.train()
    assert [(h.step, h.version, h.background) for h in trainer.rounds.async_rounds.history] == [
        (0, 0, False), (2, 0, True), (4, 2, True)
    ]  # fmt: skip
    assert [steps for steps, _ in scored] == [2, 4]
    for steps, weights in scored:
        assert all(torch.equal(weights[k], handed[steps][k]) for k in weights), f"not the weights of step {steps}"


def test_evaluation_between_hand_overs_drops_a_round_waiting_for_its_weights():
    """m = 2: evaluation after the first of the two steps must not wait for a selection forward that waits for the
    second (a deadlock): that round is dropped and regenerated at its hand-over; a round without such a forward
    is kept."""
    rounds = AsyncRounds(3, 1, 2, 2, sync_fn=lambda: None)
    lock = OptimizerStepLock(rounds)

    def optimizer_step():
        lock.on_pre_optimizer_step(None, None, None)
        lock.on_optimizer_step(None, None, None)

    def appo_job(inputs):
        def job():
            with rounds.trainer_forward():
                return Round(rows=[("scored at", rounds.optimizer_steps)] * 4)

        return job

    it = iter([["a"], ["b"], ["c"], ["d"], ["e"], ["f"]])
    (a,) = rounds.lookahead.pull(it, 1)
    rounds.next_round(a, 0, lambda: Round(rows=["a"] * 4), appo_job)
    optimizer_step()
    evaluation = threading.Thread(target=rounds.before_foreground_round, args=(1,), daemon=True)  # at step 1
    evaluation.start()
    evaluation.join(timeout=10)
    if evaluation.is_alive():
        rounds.closed = True  # releases the waiting forward (and with it the evaluation thread)
        pytest.fail("evaluation waited for a round that waited for the weights of the step after evaluation")
    assert rounds.pending is None and rounds.discarded_rounds == 1
    optimizer_step()
    rounds.lookahead.pull(it, 1)
    (c,) = rounds.lookahead.pull(it, 1)
    plain_job = lambda inputs: lambda: Round(rows=[inputs[0]] * 4)  # noqa: E731 - no trainer forward (GRPO)
    out = rounds.next_round(c, 2, lambda: Round(rows=["c now"] * 4), plain_job)
    assert out.rows == ["c now"] * 4 and not rounds.history[-1].background
    optimizer_step()
    rounds.before_foreground_round(3)  # evaluation at step 3: the round for e finishes and is kept
    assert rounds.pending is not None and rounds.discarded_rounds == 1
    optimizer_step()
    rounds.lookahead.pull(it, 1)
    (e,) = rounds.lookahead.pull(it, 1)
    out = rounds.next_round(e, 4, lambda: Round(rows=["e now"] * 4), plain_job)
    assert out.rows == ["e"] * 4 and rounds.history[-1].background


def test_evaluation_between_hand_overs_in_training(tmp_path, tiny_tokenizer, tiny_model_path):
    """APPO, m = 2, evaluation after every step: the evaluation at step 1 drops the round waiting for the weights of
    step 2 (generated at its hand-over instead), and training ends instead of waiting forever."""
    from appo_trl.trainer.trainer import APPOTrainer

    kw = dict(rollout_strategy="appo", num_generations=4, initial_rollouts=2, per_device_train_batch_size=4,
              steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=64, min_remaining_tokens=1,
              tools=["python"], max_steps=4, max_staleness=3, branch_entropy_source="trainer", eval_strategy="steps",
              eval_steps=1, per_device_eval_batch_size=4, num_generations_eval=1)  # fmt: skip
    trainer = APPOTrainer(
        model=tiny_model_path, reward_funcs=[RewardSpy()], args=APPOConfig(output_dir=str(tmp_path), **{**CPU, **kw}),
        train_dataset=dataset(), eval_dataset=dataset(4), processing_class=tiny_tokenizer,
        rollout_engine=ScriptedEngine(tiny_tokenizer),
    )  # fmt: skip
    run = threading.Thread(target=trainer.train, daemon=True)
    run.start()
    run.join(timeout=60)
    if run.is_alive():
        trainer.rounds.async_rounds.closed = True  # releases the waiting forward
        pytest.fail("evaluation between two hand-overs waited for a round that waited for the next step")
    assert [(h.step, h.version, h.background) for h in trainer.rounds.async_rounds.history] == [
        (0, 0, False),
        (2, 2, False),
    ]
    assert trainer.rounds.async_rounds.discarded_rounds == 1 and trainer.state.global_step == 4
    assert [e["step"] for e in trainer.state.log_history if "eval_reward" in e] == [1, 2, 3, 4]


def test_appo_selection_with_the_sampler_copy(tmp_path, tiny_tokenizer, tiny_model_path):
    trainer = make_trainer(
        tmp_path, tiny_tokenizer, tiny_model_path, ScriptedEngine(tiny_tokenizer), RewardSpy(),
        rollout_strategy="appo", num_generations=4, initial_rollouts=2, per_device_train_batch_size=4,
        max_completion_length=64, min_remaining_tokens=1, tools=["python"], max_steps=3, max_staleness=1,
        branch_entropy_source="trainer", async_fv_policy="sampler",
    )  # fmt: skip
    models = []
    real_forward = trainer._get_per_token_logps_and_entropies

    def forward(model, *a, **k):
        if threading.current_thread() is not threading.main_thread():
            models.append(model)
        return real_forward(model, *a, **k)

    trainer._get_per_token_logps_and_entropies = forward
    trainer.train()
    assert len(models) == 2 and all(m is trainer.rounds.sampler.model for m in models)
