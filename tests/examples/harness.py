"""Running one of TRL's agent examples under `GRPOTrainer` or `APPOTrainer` with the scripted policy.

What every example test changes, and nothing else: the model (the tiny Qwen3 model, for "Qwen/Qwen3-...");
the dataset (local rows with the example's columns); the device and size (`use_cpu`, `bf16=False`, 4
generations, a batch of 4, `max_steps`, `max_completion_length=160`, the output dir, `report_to="none"`,
`save_strategy="no"`); the sampler (scripted, `scripted.py`); `GRPOTrainer`/`GRPOConfig` swapped for
`APPOTrainer`/`APPOConfig` with the strategy's sizes (`initial_rollouts=2` and its own knobs, as the trainer
tests use); `log_completions=True` for the strategy runs.
"""

from __future__ import annotations

import functools

from trl import GRPOConfig, GRPOTrainer

from appo_trl.config import APPOConfig
from appo_trl.trainer.trainer import APPOTrainer
from tests.examples.scripted import ScriptedTurns

STRATEGY = {
    "grpo": {},
    "arpo": dict(initial_rollouts=2, branch_probability=1.0, beam_size=2),
    "aepo": dict(initial_rollouts=2, branch_probability=0.0, beam_size=2),
    "appo": dict(initial_rollouts=2, min_remaining_tokens=2),
}
SIZE = dict(use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, beta=0.0,
            num_generations=4, per_device_train_batch_size=4, max_completion_length=160)  # fmt: skip


def run(model: str, out: str, turn, strategy: str | None, steps: int, config: dict | None = None, **trainer_kw):
    """Train `steps` steps; `strategy=None` is stock `GRPOTrainer`. Returns the trainer (its `state.log_history`)."""
    from transformers import AutoTokenizer

    script = ScriptedTurns(AutoTokenizer.from_pretrained(model), turn)
    kw = {**SIZE, "max_steps": steps, **(config or {})}
    if strategy is None:
        trainer = GRPOTrainer(model=model, args=GRPOConfig(out, **kw), **trainer_kw)
        trainer._generate_single_turn = functools.partial(script.trl_single_turn, trainer)
    else:
        kw.setdefault("log_completions", strategy != "grpo")
        args = APPOConfig(out, rollout_strategy=strategy, **STRATEGY[strategy], **kw)
        trainer = APPOTrainer(model=model, args=args, **trainer_kw)
        trainer.rollout_engine.backend = script
    trainer.train()
    assert trainer.state.global_step == steps
    return trainer


def tool_stats(trainer) -> list[tuple[float, float]]:
    """Per step: TRL's `tools/call_frequency` and `tools/failure_frequency`."""
    return [(h["tools/call_frequency"], h.get("tools/failure_frequency", 0.0)) for h in trainer.state.log_history
            if "tools/call_frequency" in h]  # fmt: skip
