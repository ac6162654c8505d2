"""Resuming runs: turn a recipe's `resume_from_checkpoint` into what `Trainer.train` expects.

`resume_from_checkpoint: true` (YAML) or `--resume_from_checkpoint true` (CLI) means "continue from the
newest `checkpoint-N` in `output_dir` if there is one, else start fresh" (transformers itself raises when
asked to resume and no checkpoint exists, which breaks re-running the same recipe after a crash that came
before the first save). A path is used as is and must exist; `false`/empty means no resume.

Checkpoints are plain `transformers` folders (`model.safetensors`, `config.json`, tokenizer files,
`optimizer.pt`, `scheduler.pt`, `trainer_state.json`, `rng_state*.pth`): they load with
`AutoModelForCausalLM.from_pretrained` without any conversion step. Under DeepSpeed ZeRO-3 this needs
`zero3_save_16bit_model: true` in the accelerate config (the shipped zero3.yaml sets it).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

TRUE_VALUES = {"true", "yes", "1", "last"}
FALSE_VALUES = {"false", "no", "0", "none", "null", ""}


def resolve_resume_checkpoint(value: str | bool | None, output_dir: str) -> str | None:
    """Map `resume_from_checkpoint` to a checkpoint folder (or None to start fresh).

    Args:
        value: True / "true" / "last" for the newest checkpoint in `output_dir`; a folder path; or a false value.
        output_dir: the run's output folder, searched for `checkpoint-N` sub-folders.
    """
    from transformers.trainer_utils import get_last_checkpoint

    if value is None or value is False:
        return None
    text = str(value).strip()
    if text.lower() in FALSE_VALUES:
        return None
    if value is True or text.lower() in TRUE_VALUES:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            logger.info("resume_from_checkpoint: no checkpoint in %s yet, starting from scratch", output_dir)
        else:
            logger.info("Resuming from %s", last)
        return last
    if not os.path.isdir(text):
        raise FileNotFoundError(f"resume_from_checkpoint={text!r} is not a folder.")
    return text
