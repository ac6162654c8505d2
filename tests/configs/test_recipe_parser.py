"""Recipe parsing: YAML defaults, CLI precedence, unknown keys, env export, launch flags."""

import os
import sys

import pytest
import yaml

from appo_trl.configs.recipes import RecipeError, launch_command, parse_recipe, split_launch_args
from appo_trl.stages.train import dataclass_types


def _write(tmp_path, data):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


BASE = {"model_name_or_path": "m", "output_dir": "out", "use_cpu": True, "bf16": False, "report_to": "none"}


def test_yaml_values_and_cli_override(tmp_path):
    path = _write(
        tmp_path,
        {
            **BASE,
            "learning_rate": 3e-6,
            "num_generations": 4,
            "reward_funcs": ["qa_f1"],
            "generation_kwargs": {"top_k": 5},
            "per_device_train_batch_size": 4,
        },
    )
    script, cfg, model = parse_recipe(dataclass_types(), ["--config", path, "--learning_rate", "1e-5"])
    assert cfg.learning_rate == 1e-5  # CLI wins
    assert cfg.num_generations == 4  # YAML beats the dataclass default (8)
    assert cfg.generation_kwargs == {"top_k": 5}
    assert script.reward_funcs == ["qa_f1"]
    assert model.model_name_or_path == "m"


def test_unknown_yaml_key_names_key_and_suggestion(tmp_path):
    path = _write(tmp_path, {**BASE, "learning_rat": 1e-6})
    with pytest.raises(RecipeError) as err:
        parse_recipe(dataclass_types(), ["--config", path])
    assert "learning_rat" in str(err.value) and "learning_rate" in str(err.value)


def test_unknown_cli_flag(tmp_path):
    path = _write(tmp_path, BASE)
    with pytest.raises(RecipeError, match="num_generation.*num_generations"):
        parse_recipe(dataclass_types(), ["--config", path, "--num_generation", "4"])


def test_env_block_exported(tmp_path, monkeypatch):
    monkeypatch.delenv("APPO_TEST_VAR", raising=False)
    path = _write(tmp_path, {**BASE, "env": {"APPO_TEST_VAR": 7}})
    parse_recipe(dataclass_types(), ["--config", path])
    assert os.environ["APPO_TEST_VAR"] == "7"


def test_missing_recipe_file():
    with pytest.raises(RecipeError, match="not found"):
        parse_recipe(dataclass_types(), ["--config", "/nonexistent/recipe.yaml"])


def test_launch_flags_are_split_and_build_accelerate_command():
    launch, rest = split_launch_args(
        ["--config", "r.yaml", "--num_processes", "2", "--accelerate_config=zero2", "--learning_rate", "1"]
    )
    assert launch == {"--num_processes": "2", "--accelerate_config": "zero2"}
    assert rest == ["--config", "r.yaml", "--learning_rate", "1"]
    cmd = launch_command(launch, "entry.py", rest)
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--config_file") + 1].endswith("accelerate_configs/zero2.yaml")
    assert cmd[-5:] == ["entry.py", "--config", "r.yaml", "--learning_rate", "1"]
    plain = launch_command({"--num_processes": "2"}, "entry.py", [])
    assert "--multi_gpu" in plain and "--cpu" not in plain and plain[plain.index("--mixed_precision") + 1] == "no"
    multi = launch_command(
        {"--accelerate_config": "zero3", "--machine_rank": "1", "--main_process_ip": "10.0.0.1"}, "entry.py", []
    )
    assert multi[multi.index("--machine_rank") + 1] == "1" and "--main_process_ip" in multi
    with pytest.raises(RecipeError, match="Unknown accelerate config"):
        launch_command({"--accelerate_config": "zero9"}, "entry.py", [])


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3", "fsdp"])
def test_shipped_accelerate_configs_parse(name):
    from appo_trl.configs.recipes import resolve_accelerate_config

    cfg = yaml.safe_load(resolve_accelerate_config(name).read_text())
    assert cfg["mixed_precision"] == "bf16"
    if name == "zero3":
        assert cfg["deepspeed_config"]["zero3_save_16bit_model"] is True
