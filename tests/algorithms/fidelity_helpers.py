"""What the fidelity tests share: a config with a reference preset or our defaults, and a stand-in trainer."""

from __future__ import annotations

from types import SimpleNamespace

from appo_trl.config import APPOConfig

BASE = dict(output_dir="/tmp/appo-fidelity-test", use_cpu=True, bf16=False, report_to="none", save_strategy="no")


def make(**kw) -> APPOConfig:
    return APPOConfig(**{**BASE, "num_generations": 4, "per_device_train_batch_size": 4, **kw})


def _trainer(cfg, ga: int = 1):
    return SimpleNamespace(
        args=cfg,
        beta=cfg.beta,
        epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon,
        current_gradient_accumulation_steps=ga,
        accelerator=SimpleNamespace(num_processes=1),
    )
