"""SFT on a CUDA device: bf16 in-process, and FSDP through `accelerate launch sft/train.py` (skipped on CPU)."""

import os
import subprocess
import sys

import pytest
import torch

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe

RECIPE = str(REPO_ROOT / "recipes" / "tiny" / "sft.yaml")
GPU = ["--use_cpu", "false", "--bf16", "true", "--max_steps", "2"]


def _weights(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.gpu
def test_sft_bf16_on_cuda(tiny_model_path, tmp_path):
    from appo_trl.stages.sft import dataclass_types, main

    args = parse_recipe(
        dataclass_types(),
        [
            "--config",
            RECIPE,
            "--model_name_or_path",
            tiny_model_path,
            "--output_dir",
            str(tmp_path / "bf16"),
            *GPU,
            "--save_strategy",
            "no",
        ],
    )
    trainer = main(*args)
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert trainer.state.global_step == 2
    trained, initial = _weights(tmp_path / "bf16"), _weights(tiny_model_path)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)


@pytest.mark.gpu
@pytest.mark.slow
def test_sft_fsdp_on_cuda(tiny_model_path, tmp_path):
    out = tmp_path / "fsdp"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO_ROOT / "accelerate_configs" / "fsdp.yaml"),
        "--num_processes",
        str(torch.cuda.device_count()),
        "--main_process_port",
        "29544",
        str(REPO_ROOT / "sft" / "train.py"),
        "--config",
        RECIPE,
        "--model_name_or_path",
        tiny_model_path,
        "--output_dir",
        str(out),
        *GPU,
        "--save_steps",
        "2",
    ]
    env = {**os.environ, "APPO_LAUNCHED": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env, cwd=REPO_ROOT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "(DistributedType.FSDP)" in log
    trained, initial = _weights(out), _weights(tiny_model_path)  # full state dict: plain transformers loads it
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    assert (out / "checkpoint-2" / "model.safetensors").is_file() or (out / "checkpoint-2").is_dir()
