"""Resuming a checkpoint of another kind, refused in one line: a LoRA checkpoint into a full model, a full one into a
LoRA run, or a LoRA checkpoint whose adapter has another shape (rank, target modules, modules to save, DoRA).

transformers would stop on each with a raw traceback ("Can't find a checkpoint index", "parameter group that doesn't
match", "Error(s) in loading state_dict") that says nothing about the setting. `resume_kind_problem` reads only the
checkpoint's `adapter_config.json` / weight file names, so `appo train` runs it before the model loads
(`stages.train`), and `APPOTrainer._load_from_checkpoint` runs it again for a run started from Python.

What it does not do: compare options that change no tensor shape (lora_alpha, dropout), or full checkpoints'
architectures (transformers names those itself).
"""

from __future__ import annotations

import json
import os

from appo_trl.configs.errors import ConfigError

_FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_SHAPE = (("r", "lora_r"), ("use_dora", "use_dora"))


class ResumeKindError(ConfigError):
    """The checkpoint to resume and the run's model are not of one kind (see the module head)."""


def resume_kind_problem(checkpoint: str, peft_config) -> str | None:
    """One line naming what does not match between `checkpoint` and a run with `peft_config` (None: a full model)."""
    adapter = os.path.join(checkpoint, "adapter_config.json")
    saved = None
    if os.path.isfile(adapter):
        with open(adapter, encoding="utf-8") as fh:
            saved = json.load(fh)
    where = f"resume_from_checkpoint={checkpoint}"
    if saved is not None and peft_config is None:
        return (f"{where} holds a LoRA adapter (r={saved.get('r')}), but this run trains the full model (use_peft is "
                "false): set use_peft: true with the checkpoint's LoRA options, or resume a full checkpoint")  # fmt: skip
    if saved is None and peft_config is not None:
        if any(os.path.exists(os.path.join(checkpoint, n)) for n in _FULL_WEIGHTS):
            return (f"{where} holds full model weights and no LoRA adapter, but this run trains one (use_peft is "
                    "true): set use_peft: false, or resume a LoRA checkpoint")  # fmt: skip
        return None
    if saved is None:
        return None
    differ = [f"{option} {saved.get(key)!r} there, {getattr(peft_config, key, None)!r} here" for key, option in _SHAPE
              if saved.get(key) != getattr(peft_config, key, None)]  # fmt: skip
    targets = getattr(peft_config, "target_modules", None)
    if isinstance(targets, (list, set, tuple)) and set(targets) != set(saved.get("target_modules") or ()):
        differ.append(f"lora_target_modules {sorted(saved.get('target_modules') or ())} there, {sorted(targets)} here")
    to_save = set(getattr(peft_config, "modules_to_save", None) or ())
    if to_save != set(saved.get("modules_to_save") or ()):
        differ.append(f"lora_modules_to_save {sorted(saved.get('modules_to_save') or ())} there, {sorted(to_save)} here")
    if differ:
        return f"{where} holds a LoRA adapter of another shape ({'; '.join(differ)}): resume with the same options"
    return None


def check_resume_kind(checkpoint: str | None, peft_config) -> None:
    """`ResumeKindError` when `resume_kind_problem` finds one; nothing without a checkpoint."""
    if checkpoint is None:
        return
    problem = resume_kind_problem(checkpoint, peft_config)
    if problem is not None:
        raise ResumeKindError(problem)


__all__ = ["ResumeKindError", "check_resume_kind", "resume_kind_problem"]
