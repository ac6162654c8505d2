"""`appo train --help` reads like `trl grpo --help`: every field, its help and default, grouped; `--config R -h`
exits 0; dash-style flags (`--learning-rate`) work as TRL accepts them."""

from __future__ import annotations

import dataclasses
import re

import pytest

from appo_trl.cli import main
from appo_trl.configs.arguments import field_groups, normalize_flags
from appo_trl.configs.recipes import REPO_ROOT, parse_recipe, split_launch_args

TINY = REPO_ROOT / "recipes" / "tiny"


def _train_types():
    from appo_trl.stages.train import dataclass_types

    return dataclass_types()


@pytest.fixture(scope="module")
def train_help():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["train", "--help"]) == 0
    return buf.getvalue()


def test_train_help_lists_every_field_with_help_and_default(train_help):
    names = {f.name for dc in _train_types() for f in dataclasses.fields(dc) if f.init}
    listed = set(re.findall(r"^  --(\w+)", train_help, flags=re.M))
    assert names - listed == set()
    # one "(default: ...)" per field (the `--no_x` spellings show none)
    assert train_help.count("(default:") >= len(names)
    for key, text in {
        "rollout_strategy": "Rollout strategy",
        "min_remaining_tokens": "branch point needs",
        "learning_rate": "learning rate",
        "model_name_or_path": "Model checkpoint",
    }.items():
        block = train_help.split(f"  --{key} ", 1)[1].split("\n  --", 1)[0]
        assert text.lower() in block.lower() and "(default:" in block, key


def test_train_help_groups_in_trl_order(train_help):
    headings = re.findall(r"^(\w[\w &]*):$", train_help, flags=re.M)
    assert headings[:5] == ["model", "data", "rollout", "strategy", "loss"]
    assert {"vllm", "training", "logging", "checkpoints & hub"} <= set(headings)
    groups = field_groups(_train_types())
    expected = {
        "model_name_or_path": "model", "lora_r": "model", "dataset_name": "data", "reward_funcs": "data",
        "num_generations": "rollout", "tools": "rollout", "temperature": "rollout", "rollout_strategy": "strategy",
        "min_remaining_tokens": "strategy", "beam_size": "strategy", "loss_mode": "loss", "beta": "loss",
        "epsilon": "loss", "future_kl_weight": "loss", "use_vllm": "vllm", "vllm_server_base_url": "vllm",
        "learning_rate": "training", "report_to": "logging", "output_dir": "checkpoints & hub",
    }  # fmt: skip
    assert {k: groups[k] for k in expected} == expected


def test_config_then_h_exits_0_and_shows_recipe_values(capsys):
    assert main(["train", "--config", str(TINY / "appo.yaml"), "-h"]) == 0
    out = capsys.readouterr().out
    block = out.split("  --rollout_strategy ", 1)[1].split("\n  --", 1)[0]
    assert "(default: appo)" in " ".join(block.split())


def test_sft_config_then_help_exits_0(capsys):
    assert main(["sft", "--config", str(TINY / "sft.yaml"), "--help"]) == 0
    assert "--max_length" in capsys.readouterr().out


def test_normalize_flags_changes_names_only():
    argv = ["--learning-rate", "1e-4", "--no-use-peft", "--output-dir=a-b", "--system_prompt", "x-y", "-h"]
    assert normalize_flags(argv) == [
        "--learning_rate", "1e-4", "--no_use_peft", "--output_dir=a-b", "--system_prompt", "x-y", "-h"
    ]  # fmt: skip


def test_dash_style_flags_parse_like_trl(tmp_path):
    script, training, model = parse_recipe(_train_types(), [
        "--config", str(TINY / "grpo.yaml"), "--learning-rate", "0.25", "--output-dir", str(tmp_path),
        "--max-completion-length=40", "--no-shuffle-dataset", "--reward-funcs", "math_verify",
    ])  # fmt: skip
    assert training.learning_rate == 0.25 and training.max_completion_length == 40
    assert training.output_dir == str(tmp_path) and training.shuffle_dataset is False
    assert script.reward_funcs == ["math_verify"]


def test_dash_style_launch_flags():
    launch, rest = split_launch_args(["--num-processes", "2", "--accelerate-config=zero2", "--max-steps", "3"])
    assert launch == {"--num_processes": "2", "--accelerate_config": "zero2"}
    assert rest == ["--max_steps", "3"]
