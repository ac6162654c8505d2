"""Every recipe under recipes/ parses into its stage's dataclasses (no model or dataset is loaded).

Keys must be real fields of the stage's dataclasses. `PENDING_FIELDS` lists the APPOConfig fields the paper
recipes use that the trainer has not declared yet: while a pending key is not a field it is stripped with a
warning; as soon as it is a field, it is parsed (and type-checked) like any other key. Delete the list once
every name is declared.
"""

import dataclasses
import warnings
from pathlib import Path

import pytest
import yaml

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe, valid_keys

RECIPES = sorted(p for p in (REPO_ROOT / "recipes").rglob("*.yaml") if "data" not in p.parts)
PENDING_FIELDS = {
    "rollout_strategy", "initial_rollouts", "beam_size", "branch_probability", "entropy_weight",
    "tool_call_limit", "loss_mode", "fv_gamma", "reward_scale_discount",
}  # fmt: skip
PAPER_RECIPES = {
    "qwen2.5-7b-instruct": {"sft", "grpo", "arpo", "aepo", "appo"},
    "qwen3-8b": {"arpo", "aepo", "appo"},
    "qwen3-14b": {"appo"},
    "llama3.1-8b-instruct": {"arpo", "appo"},
    "tiny": {"sft", "grpo"},
}


def _stage_types(path: Path):
    if path.stem.startswith("sft"):
        from appo_trl.stages.sft import dataclass_types
    else:
        from appo_trl.stages.train import dataclass_types
    return dataclass_types()


def test_every_paper_recipe_exists():
    for model, stages in PAPER_RECIPES.items():
        found = {p.stem for p in (REPO_ROOT / "recipes" / model).glob("*.yaml")}
        assert stages <= found, f"recipes/{model} lacks {sorted(stages - found)}"


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(REPO_ROOT / "recipes")) for p in RECIPES])
def test_recipe_parses(path, tmp_path):
    types = _stage_types(path)
    known = valid_keys(types)
    recipe = yaml.safe_load(path.read_text())
    pending = sorted(k for k in recipe if k not in known and k in PENDING_FIELDS)
    if pending:
        warnings.warn(f"{path.name}: APPOConfig does not declare {pending} yet; not checked", stacklevel=1)
        recipe = {k: v for k, v in recipe.items() if k not in pending}
    stripped = tmp_path / path.name
    stripped.write_text(yaml.safe_dump(recipe))
    # `use_cpu` only so that bf16 recipes validate on a CPU machine; nothing is loaded.
    parsed = parse_recipe(types, ["--config", str(stripped), "--use_cpu", "true"])
    values = {f.name: getattr(obj, f.name) for obj in parsed for f in dataclasses.fields(obj)}
    for key, value in recipe.items():
        if key in ("env", "use_cpu"):
            continue
        got = values[key]
        got = getattr(got, "value", got)  # enums (lr_scheduler_type, save_strategy, ...)
        if key == "report_to":
            assert got == ([value] if isinstance(value, str) and value != "none" else [] if value == "none" else value)
        elif isinstance(value, float):
            assert got == pytest.approx(value), key
        else:
            assert got == value, key
    if not path.stem.startswith("sft"):
        cfg = parsed[1]
        assert cfg.generation_batch_size % cfg.num_generations == 0


def test_paper_rl_batch_arithmetic():
    """The 8-process batch sizes reproduce the scripts' train/mini batch (prompts x n)."""
    expected = {  # (train_batch_size, ppo_mini_batch_size) of the released training scripts
        "qwen2.5-7b-instruct/arpo": (128, 16),
        "qwen2.5-7b-instruct/aepo": (128, 16),
        "qwen2.5-7b-instruct/grpo": (128, 16),
        "qwen2.5-7b-instruct/appo": (96, 16),
        "qwen3-8b/arpo": (128, 16),
        "qwen3-8b/aepo": (128, 16),
        "qwen3-8b/appo": (128, 16),
        "qwen3-14b/appo": (64, 8),
        "llama3.1-8b-instruct/arpo": (128, 16),
        "llama3.1-8b-instruct/appo": (96, 16),
    }
    for name, (batch, mini) in expected.items():
        r = yaml.safe_load((REPO_ROOT / "recipes" / f"{name}.yaml").read_text())
        n, per_dev = r["num_generations"], r["per_device_train_batch_size"]
        assert per_dev * 8 * r["gradient_accumulation_steps"] == mini * n, name
        assert per_dev * 8 * r["steps_per_generation"] == batch * n, name
