"""LoRA options checked before the model loads (`use_peft`): numbers peft would take with a traceback after loading
(or take and train nothing with), and module names that match nothing in the model.

`check_lora(model_args, trust_remote_code)`: `lora_r` a positive integer, `lora_alpha` finite and not 0 (the adapter's
scale is alpha / r: 0 trains nothing), `lora_dropout` in [0, 1) (1 drops every input: nothing trains); then the model
is built on the meta device from its config alone (no weights read, no memory), and `lora_target_modules` and
`lora_modules_to_save` are matched against its module names with peft's own rules: a target that matches no module,
or a module to save that names none, is one `PreflightError` line (peft ignores such a module to save silently, and
records it in `adapter_config.json`).

What it does not do: check options peft validates itself at no cost (`lora_task_type`), or run when the model cannot
be built from its config alone (then peft's own check at load time stands).
"""

from __future__ import annotations

import logging
import math

from appo_trl.configs.errors import PreflightError

logger = logging.getLogger(__name__)


def check_lora(model_args, trust_remote_code: bool = False) -> None:
    """Refuse LoRA options that cannot train (see the module head); nothing without `use_peft`."""
    if not getattr(model_args, "use_peft", False):
        return
    r, alpha, dropout = model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise PreflightError(f"lora_r={r!r}: the LoRA rank must be a whole number >= 1.")
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha == 0:
        raise PreflightError(f"lora_alpha={alpha!r}: the adapter's scale is lora_alpha / lora_r, so it must be a "
                             "finite number other than 0 (0 trains nothing).")  # fmt: skip
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise PreflightError(f"lora_dropout={dropout!r} must be in [0, 1) (1 drops every input: nothing trains).")
    targets, to_save = model_args.lora_target_modules, model_args.lora_modules_to_save
    if isinstance(targets, (list, tuple)) and not targets:
        raise PreflightError("lora_target_modules is an empty list: name the modules (or all-linear), or leave it "
                             "unset for peft's default of the model type.")  # fmt: skip
    for option, given in (("lora_target_modules", targets), ("lora_modules_to_save", to_save)):
        if given is not None and any(not name for name in ([given] if isinstance(given, str) else given)):
            raise PreflightError(f"{option}={given!r} holds an empty name, which would match every module.")
    names = _module_names(model_args, trust_remote_code)
    if names is None:
        return
    _check_targets(model_args.lora_target_modules, names[0], names[1])
    for name in model_args.lora_modules_to_save or ():
        if not any(key.endswith(name) for key in names[0]):  # peft's rule (`_set_trainable`)
            raise PreflightError(f"lora_modules_to_save: {name!r} names no module of the model (its modules end in "
                                 f"{_examples(names[0])}); peft would skip it without a word.")  # fmt: skip


def _module_names(model_args, trust_remote_code: bool) -> tuple[list[str], str] | None:
    """The model's module names and its model type, from a meta-device build of its config; None when that fails."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                            trust_remote_code=trust_remote_code)  # fmt: skip
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - not ours to judge here: peft checks the names at load time
        logger.debug("LoRA module names not checked before loading: %s: %s", type(exc).__name__, exc)
        return None
    return [name for name, _ in model.named_modules() if name], config.model_type


def _check_targets(targets, names: list[str], model_type: str) -> None:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    if targets == "all-linear":
        return
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        if model_type not in DEFAULTS:
            raise PreflightError(f"lora_target_modules is unset and peft has no default for model type "
                                 f"{model_type!r}: name the modules (or all-linear).")  # fmt: skip
        return
    if isinstance(targets, str):
        config = LoraConfig(target_modules=targets)
        if not any(check_target_module_exists(config, key) for key in names):
            raise PreflightError(
                f"lora_target_modules={targets!r} matches no module of the model (its modules end in "
                f"{_examples(names)}); a single name is a regular expression over the whole module name to peft "
                f"(e.g. '.*{targets}'), so list two or more names, or write the pattern."
            )  # fmt: skip
        return
    for target in targets:
        config = LoraConfig(target_modules=[target])
        if not any(check_target_module_exists(config, key) for key in names):
            raise PreflightError(f"lora_target_modules: {target!r} matches no module of the model (its modules end "
                                 f"in {_examples(names)}); peft would skip it.")  # fmt: skip


def _examples(names: list[str]) -> str:
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    return ", ".join(leaves[:12]) + (", ..." if len(leaves) > 12 else "")


__all__ = ["check_lora"]
