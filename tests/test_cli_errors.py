"""Configuration mistakes: one readable line on stderr and exit code 2, found before the model loads.

Two cases run `appo` in a subprocess (what a user sees, `--debug` included); the rest call the same CLI entry
in-process with file-descriptor capture, which sees everything a subprocess would print to stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from appo_trl.cli import main as appo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {
    "output_dir": "out",
    "use_cpu": True,
    "bf16": False,
    "report_to": "none",
    "num_generations": 4,
    "per_device_train_batch_size": 4,
    "max_steps": 1,
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A run folder with a model folder that passes the path check (config.json only: loading it would fail)
    and a small dataset; tests run from inside it, so relative paths resolve there."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def recipe(workdir, **keys) -> str:
    config = {**BASE, "model_name_or_path": "model", "dataset_name": "data.jsonl", **keys}
    path = workdir / "r.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _is_progress(line: str) -> bool:  # `datasets` progress bars (data loaded before a later check fails)
    return "examples/s]" in line or "%|" in line


def one_error_line(capfd) -> str:
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not _is_progress(line)]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def run_appo(*args, cwd):
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "appo_trl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


# ---- as a user sees it ---------------------------------------------------------------------------------------
def test_unknown_strategy_subprocess_one_line_exit_2_and_debug_shows_traceback(workdir):
    path = recipe(workdir, rollout_strategy="apo")
    proc = run_appo("train", "--config", path, cwd=workdir)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("appo train: error:") and "rollout_strategy='apo'" in lines[0]
    debug = run_appo("train", "--config", path, "--debug", cwd=workdir)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "rollout_strategy='apo'" in debug.stderr


def test_missing_tiny_model_subprocess_names_path_and_hint(workdir):
    path = recipe(workdir, model_name_or_path="outputs/tiny-qwen3")
    proc = run_appo("train", "--config", path, cwd=workdir)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "'outputs/tiny-qwen3' is not a local folder" in lines[0]
    assert "appo tiny-model outputs/tiny-qwen3" in lines[0]


# ---- recipe and command-line errors ----------------------------------------------------------------------------
def test_string_for_an_int(workdir, capfd):
    assert appo(["train", "--config", recipe(workdir, num_generations="four")]) == 2
    assert "invalid int value: 'four'" in one_error_line(capfd)


def test_float_for_an_int(workdir, capfd):
    assert appo(["train", "--config", recipe(workdir, num_generations=4.5)]) == 2
    assert "recipe key 'num_generations' expects an integer, got 4.5" in one_error_line(capfd)


def test_malformed_yaml_names_file_line_and_column(workdir, capfd):
    path = workdir / "bad.yaml"
    path.write_text("model_name_or_path: model\nlearning_rate: 1e-6\ntools: [python\n")
    assert appo(["train", "--config", str(path)]) == 2
    line = one_error_line(capfd)
    assert f"{path}:4:1: malformed YAML" in line


def test_missing_recipe_file(workdir, capfd):
    assert appo(["train", "--config", "nope.yaml"]) == 2
    assert "Recipe file not found: nope.yaml" in one_error_line(capfd)


def test_batch_shape_error(workdir, capfd):
    assert appo(["train", "--config", recipe(workdir, per_device_train_batch_size=3)]) == 2
    line = one_error_line(capfd)
    assert "must be divisible by num_generations (4)" in line and "per_device_train_batch_size ×" in line


def test_unknown_keys_are_one_line(workdir, capfd):
    assert appo(["train", "--config", recipe(workdir, learning_rat=1.0, num_generatons=2)]) == 2
    line = one_error_line(capfd)
    assert "learning_rat (did you mean: learning_rate" in line and "num_generatons" in line


def test_scalar_where_a_list_is_expected_is_a_one_element_list(workdir):
    from appo_trl.configs.recipes import parse_recipe
    from appo_trl.stages.train import dataclass_types

    script, config, _ = parse_recipe(dataclass_types(), ["--config", recipe(workdir, tools="python",
                                                                              reward_funcs="math_verify")])  # fmt: skip
    assert config.tools == ["python"] and script.reward_funcs == ["math_verify"]


# ---- model and data ------------------------------------------------------------------------------------------
def test_missing_local_model_folder_is_named(workdir, capfd):
    assert appo(["train", "--config", recipe(workdir, model_name_or_path="./models/mine")]) == 2
    line = one_error_line(capfd)
    assert "Model folder './models/mine' does not exist" in line and str(workdir / "models" / "mine") in line


@pytest.mark.parametrize(
    "keys,expected",
    [
        ({"dataset_name": "data/nope.jsonl"}, "Dataset path 'data/nope.jsonl' does not exist"),
        ({"dataset_name": "empty.jsonl"}, "empty.jsonl' is empty"),  # resolved next to the recipe
        ({"prompt_column": "question"}, "has no prompt column 'question'; columns found: ['answer', 'prompt']"),
        ({"answer_column": "gold"}, "has no answer column 'gold'"),
    ],
)
def test_data_errors(workdir, capfd, keys, expected):
    (workdir / "empty.jsonl").write_text("\n")
    assert appo(["train", "--config", recipe(workdir, **keys)]) == 2
    assert expected in one_error_line(capfd)


def test_builtin_reward_without_answer_column_fails_naming_reward_and_column(workdir, capfd):
    (workdir / "q.jsonl").write_text(json.dumps({"prompt": "What is 1+1?"}) + "\n")
    assert appo(["train", "--config", recipe(workdir, dataset_name="q.jsonl", reward_funcs=["math_verify"])]) == 2
    line = one_error_line(capfd)
    assert "reward 'math_verify' needs gold answers" in line and "no answer column 'answer'" in line


def test_answer_free_reward_loads_data_without_answers(workdir):
    from types import SimpleNamespace

    from appo_trl.configs.plan import check_reward_columns
    from appo_trl.data import load_rl_dataset

    (workdir / "q.jsonl").write_text(json.dumps({"prompt": "What is 1+1?"}) + "\n")
    args = SimpleNamespace(dataset_name="q.jsonl", prompt_column="prompt", answer_column="answer",
                           system_prompt=None, dataset_train_split="train", dataset_config=None)  # fmt: skip
    ds = load_rl_dataset(args)
    assert ds.column_names == ["prompt"]
    check_reward_columns(["format"], ds)  # needs no answer: passes


# ---- checks before the model loads ---------------------------------------------------------------------------
def test_load_in_4bit_fails_before_the_model_loads_without_bitsandbytes_or_cuda(workdir, capfd):
    assert appo(["train", "--config", recipe(workdir, load_in_4bit=True, use_peft=True)]) == 2
    line = one_error_line(capfd)
    assert "load_in_4bit=True" in line and ("bitsandbytes is not installed" in line or "use_cpu=True" in line)


def test_unknown_tool_and_dead_search_server_fail_before_the_model_loads(workdir, capfd):
    assert appo(["train", "--config", recipe(workdir, tools="pyhton")]) == 2
    assert "unknown tool 'pyhton'" in one_error_line(capfd)
    dead = {"search": {"url": "http://127.0.0.1:9/retrieve", "timeout_s": 2}}
    assert appo(["train", "--config", recipe(workdir, tools=["search"], tool_config=dead)]) == 2
    line = one_error_line(capfd)
    assert "no search server at http://127.0.0.1:9/health" in line


def test_push_to_hub_is_checked_before_the_model_loads(workdir, capfd):
    assert appo(["train", "--config", recipe(workdir, push_to_hub=True, hub_model_id="me/run")]) == 2
    assert "push_to_hub=True, but HF_HUB_OFFLINE=1" in one_error_line(capfd)


class FakeApi:
    def __init__(self, who=None, error=None):
        self.who, self.error = who, error

    def whoami(self):
        if self.error:
            raise self.error
        return self.who


@pytest.mark.parametrize(
    "api,repo,expected",
    [
        (FakeApi(error=RuntimeError("401 Unauthorized")), "me/run", "token does not work (401 Unauthorized)"),
        (FakeApi({"name": "me", "auth": {"accessToken": {"role": "read"}}}), "me/run", "read-only"),
        (FakeApi({"name": "me", "orgs": [{"name": "lab"}]}), "other/run", "cannot create 'other/run'"),
        (FakeApi({"name": "me", "orgs": [{"name": "lab"}]}), "lab/run", None),
        (FakeApi({"name": "me"}), None, None),
    ],
)
def test_check_hub(monkeypatch, api, repo, expected):
    from types import SimpleNamespace

    from huggingface_hub import constants

    from appo_trl.configs.errors import PreflightError
    from appo_trl.configs.preflight import check_hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    args = SimpleNamespace(push_to_hub=True, hub_model_id=repo, output_dir="outputs/run", hub_token=None)
    if expected is None:
        check_hub(args, api=api)
    else:
        with pytest.raises(PreflightError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            check_hub(args, api=api)


def test_trainer_api_checks_reward_columns_before_the_model_loads():
    from datasets import Dataset

    from appo_trl.config import APPOConfig
    from appo_trl.configs.errors import PreflightError
    from appo_trl.rewards import REWARD_FUNCS
    from appo_trl.trainer.trainer import APPOTrainer

    args = APPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", num_generations=2,
                      per_device_train_batch_size=2)  # fmt: skip
    data = Dataset.from_list([{"prompt": "What is 1+1?"}])
    with pytest.raises(PreflightError, match="reward 'qa_f1' needs gold answers"):
        APPOTrainer("no/such-model", reward_funcs=[REWARD_FUNCS["qa_f1"]], args=args, train_dataset=data)


def test_config_error_with_launch_flags_is_reported_before_relaunching(workdir, capfd, monkeypatch):
    import appo_trl.configs.recipes

    def no_launch(*args, **kwargs):
        raise AssertionError("relaunched a recipe that does not parse")

    monkeypatch.setattr(appo_trl.configs.recipes, "run_launcher", no_launch)
    monkeypatch.delenv("APPO_LAUNCHED", raising=False)
    assert appo(["train", "--config", recipe(workdir, rollout_strategy="apo"), "--num_processes", "2"]) == 2
    assert "rollout_strategy='apo'" in one_error_line(capfd)


def test_load_in_4bit_builds_trl_quantization_config_when_bitsandbytes_and_cuda_exist(monkeypatch):
    """The QLoRA branch (as `trl grpo`): BitsAndBytesConfig from TRL's get_quantization_config in model_init_kwargs."""
    import importlib.util
    from types import SimpleNamespace

    import torch
    from trl import ModelConfig

    from appo_trl.configs.errors import PreflightError
    from appo_trl.configs.preflight import check_quantization

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "bitsandbytes" else real_find_spec(n, *a)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    training = SimpleNamespace(use_cpu=False, model_init_kwargs={"dtype": "bfloat16"})
    with pytest.raises(PreflightError, match="set use_peft=true"):
        check_quantization(ModelConfig(model_name_or_path="m", load_in_4bit=True), training)
    model_args = ModelConfig(model_name_or_path="m", load_in_4bit=True, use_peft=True, dtype="bfloat16",
                             bnb_4bit_quant_type="nf4")  # fmt: skip
    check_quantization(model_args, training)
    quant = training.model_init_kwargs["quantization_config"]
    assert (
        quant.load_in_4bit and quant.bnb_4bit_quant_type == "nf4" and training.model_init_kwargs["dtype"] == "bfloat16"
    )
