"""`appo train` end to end on the tiny model: in-process and as a 2-process (gloo) accelerate launch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
from appo_trl.stages.train import dataclass_types

RECIPE = str(REPO_ROOT / "recipes" / "tiny" / "grpo.yaml")
DATA = str(REPO_ROOT / "recipes" / "tiny" / "data" / "arith.jsonl")


def _params(path):
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


def test_train_in_process_changes_params_and_checkpoint_reloads(tiny_sft_model_path, tmp_path):
    from appo_trl.stages.train import main

    out = tmp_path / "run"
    args = parse_recipe(
        dataclass_types(),
        [
            "--config",
            RECIPE,
            "--model_name_or_path",
            tiny_sft_model_path,
            "--output_dir",
            str(out),
            "--dataset_name",
            DATA,
        ],
    )
    trainer = main(*args)
    assert trainer.state.global_step == 2
    logs = [e for e in trainer.state.log_history if "reward" in e]
    assert len(logs) == 2
    assert sum(e["tools/calls"] for e in logs) > 0, "the cold-started model never called python"
    before, after = _params(tiny_sft_model_path), _params(out)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no parameter moved after two optimizer steps"
    assert (out / "checkpoint-2" / "model.safetensors").is_file()


def test_missing_model_folder_is_a_clear_error(tmp_path):
    from appo_trl.stages.train import main

    args = parse_recipe(
        dataclass_types(),
        ["--config", RECIPE, "--model_name_or_path", "./no/such/model", "--output_dir", str(tmp_path)],
    )
    with pytest.raises(FileNotFoundError, match="appo tiny-model"):
        main(*args)


@pytest.mark.slow
def test_two_process_cli_run(tiny_model_path, tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "appo_trl.cli",
        "train",
        "--config",
        RECIPE,
        "--num_processes",
        "2",
        "--model_name_or_path",
        tiny_model_path,
        "--output_dir",
        str(out),
        "--dataset_name",
        DATA,
        "--max_steps",
        "1",
        "--save_strategy",
        "no",
        "--main_process_port",
        "29517",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "process 0 of world_size=2 (DistributedType.MULTI_CPU)" in log
    assert "process 1 of world_size=2 (DistributedType.MULTI_CPU)" in log
    assert (Path(out) / "model.safetensors").is_file()


@pytest.mark.parametrize("strategy", ["arpo", "aepo", "appo"])
def test_tiny_strategy_recipes_train_with_real_tools(strategy, tiny_sft_model_path, tmp_path):
    """Each tiny recipe end to end: real model, real sandboxed python calls, the strategy's branching and loss."""
    from appo_trl.stages.train import main

    recipe = str(REPO_ROOT / "recipes" / "tiny" / f"{strategy}.yaml")
    args = parse_recipe(
        dataclass_types(),
        [
            "--config",
            recipe,
            "--model_name_or_path",
            tiny_sft_model_path,
            "--output_dir",
            str(tmp_path),
            "--dataset_name",
            DATA,
            "--save_strategy",
            "no",
        ],
    )
    assert args[1].rollout_strategy == strategy
    trainer = main(*args)
    logs = [e for e in trainer.state.log_history if "reward" in e]
    assert len(logs) == trainer.state.global_step == 2
    assert sum(e["tools/python/calls"] for e in logs) > 0
    if strategy == "appo":  # n - initial branch rows per prompt, dropped before the loss
        assert all(e["branch/points_per_prompt"] == 2 and e["branch/loss_rows_frac"] == 0.5 for e in logs)
