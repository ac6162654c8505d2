"""A killed-and-resumed run samples exactly the completions of the uninterrupted run (issue 21).

Every round's sampling seed derives from `(seed, global_step, rank, round counter)`; the counter is saved in
the checkpoint (`appo_sampler_state.json`) and restored on resume. Real sampling here: the in-process
transformers backend on the tiny model (APPO rounds: initial rollouts, branch selection, branches), with the
completion ids of each step recorded by the reward function.
"""

from __future__ import annotations

import json

import torch
from transformers import TrainerCallback

from appo_trl.config import APPOConfig
from appo_trl.trainer.checkpoints import SAMPLER_STATE_NAME
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, dataset


class CompletionLog:
    """A reward that records the sampled completion ids per optimizer step (and rewards length variety)."""

    __name__ = "length_reward"

    def __init__(self):
        self.trainer = None
        self.by_step: dict[int, list[list[int]]] = {}

    def __call__(self, completions, completion_ids, **kw):
        step = self.trainer.state.global_step + 1
        self.by_step.setdefault(step, []).extend(list(map(int, ids)) for ids in completion_ids)
        return [len(ids) / 16.0 for ids in completion_ids]


class StopAt(TrainerCallback):
    """Stops training after step `k` (after its checkpoint is saved): what a kill right after the save leaves."""

    def __init__(self, k):
        self.k = k

    def on_save(self, args, state, control, **kw):
        if state.global_step >= self.k:
            control.should_training_stop = True


def _trainer(out, model_path, tokenizer, log, callbacks=()):
    args = APPOConfig(
        output_dir=str(out), **{**CPU, "save_strategy": "steps", "learning_rate": 5e-3}, save_steps=2, max_steps=4, rollout_strategy="appo",
        initial_rollouts=2, num_generations=4, per_device_train_batch_size=4, max_completion_length=12,
        min_remaining_tokens=2, temperature=1.0,
    )  # fmt: skip
    trainer = APPOTrainer(
        model=model_path, reward_funcs=[log], args=args, train_dataset=dataset(), processing_class=tokenizer,
        callbacks=list(callbacks),
    )  # fmt: skip
    log.trainer = trainer
    return trainer


def test_resumed_run_samples_the_uninterrupted_completions(tmp_path, tiny_model_path, tiny_tokenizer):
    full = CompletionLog()
    _trainer(tmp_path / "full", tiny_model_path, tiny_tokenizer, full).train()
    assert sorted(full.by_step) == [1, 2, 3, 4]

    killed = CompletionLog()
    _trainer(tmp_path / "run", tiny_model_path, tiny_tokenizer, killed, [StopAt(2)]).train()
    assert sorted(killed.by_step) == [1, 2]
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / SAMPLER_STATE_NAME).read_text())
    assert saved["round_index"] == 2  # one round per step here

    torch.manual_seed(1234)  # a new process: nothing of the first run's in-memory state survives
    resumed = CompletionLog()
    trainer = _trainer(tmp_path / "run", tiny_model_path, tiny_tokenizer, resumed)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 4 and sorted(resumed.by_step) == [3, 4]
    for step in (3, 4):
        assert resumed.by_step[step] == full.by_step[step], f"step {step} sampled other completions after resume"
    assert trainer.rounds.round_index == 4
    assert full.by_step[3] != full.by_step[4]  # the comparison has teeth: steps differ from each other
