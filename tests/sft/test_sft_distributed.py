"""SFT under DeepSpeed on CPU, 2 processes: ZeRO-2 through `appo sft`, ZeRO-3 through `accelerate launch sft/train.py`.

Slow (two process launches). Both runs see
the same data and settings, so ZeRO-2 and ZeRO-3 must end with the same weights.
"""

import os
import subprocess
import sys

import pytest
import torch

from appo_trl.configs.recipes import REPO_ROOT

RECIPE = str(REPO_ROOT / "recipes" / "tiny" / "sft.yaml")
COMMON = ["--config", RECIPE, "--max_steps", "2", "--save_steps", "2"]


def _launch(cmd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "APPO_LAUNCHED": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env, cwd=REPO_ROOT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    model = ["--model_name_or_path", tiny_model_path]
    logs = {
        "zero2": _launch(
            [
                sys.executable,
                "-m",
                "appo_trl.cli",
                "sft",
                *COMMON,
                *model,
                "--output_dir",
                str(out / "zero2"),
                "--accelerate_config",
                "zero2",
                "--num_processes",
                "2",
                "--mixed_precision",
                "no",
                "--main_process_port",
                "29541",
            ]
        ),
        "zero3": _launch(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                str(REPO_ROOT / "accelerate_configs" / "zero3.yaml"),
                "--num_processes",
                "2",
                "--mixed_precision",
                "no",
                "--main_process_port",
                "29542",
                str(REPO_ROOT / "sft" / "train.py"),
                *COMMON,
                *model,
                "--output_dir",
                str(out / "zero3"),
            ]
        ),
    }
    return out, logs


def _weights(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_two_process_sft(runs, stage, tiny_model_path):
    out, logs = runs
    for rank in (0, 1):
        assert f"process {rank} of world_size=2 (DistributedType.DEEPSPEED)" in logs[stage]
    trained, initial = _weights(out / stage), _weights(tiny_model_path)  # plain transformers, no conversion
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    ckpt = _weights(out / stage / "checkpoint-2")
    for k in trained:
        torch.testing.assert_close(ckpt[k], trained[k])


@pytest.mark.slow
def test_zero2_and_zero3_agree(runs):
    out, _ = runs
    z2, z3 = _weights(out / "zero2"), _weights(out / "zero3")
    for k in z2:
        torch.testing.assert_close(z2[k], z3[k], rtol=1e-4, atol=1e-5)
