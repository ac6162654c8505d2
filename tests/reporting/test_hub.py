"""Hub push against a fake `HfApi`: the model card, what is uploaded, and that only rank 0 pushes."""

import fnmatch
import os
from types import SimpleNamespace

import pytest
import yaml

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
from appo_trl.reporting.hub import build_model_card, defer_push, key_metrics, push_model, recipe_dict


class FakeHfApi:
    """Records calls; `upload_folder` lists the files that would be uploaded (ignore patterns applied)."""

    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def whoami(self):  # the start-up check (appo_trl.configs.preflight.check_hub)
        return {"name": "someone", "auth": {"accessToken": {"role": "write"}}}

    def create_repo(self, repo_id, private=None, exist_ok=False, **kw):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        return SimpleNamespace(repo_id=repo_id)

    def create_branch(self, repo_id, branch, exist_ok=False, **kw):
        self.calls.append(("create_branch", repo_id, branch))

    def upload_folder(self, repo_id, folder_path, commit_message, revision=None, ignore_patterns=(), **kw):
        files = []
        for root, _, names in os.walk(folder_path):
            for name in names:
                rel = os.path.relpath(os.path.join(root, name), folder_path)
                if not any(fnmatch.fnmatch(rel, p) for p in ignore_patterns):
                    files.append(rel)
        readme = open(os.path.join(folder_path, "README.md")).read()
        self.calls.append(("upload_folder", repo_id, sorted(files), commit_message, revision, readme))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc")


@pytest.fixture
def fake_api(monkeypatch):
    import huggingface_hub

    FakeHfApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the fake Hub is "online"
    return FakeHfApi


def test_sft_recipe_push_uploads_final_model_and_card(tiny_model_path, tmp_path, fake_api, monkeypatch):
    import transformers.trainer as hf_trainer

    from appo_trl.stages.sft import dataclass_types, main

    def no_network(*a, **k):
        raise AssertionError("transformers tried to push by itself")

    monkeypatch.setattr(hf_trainer, "create_repo", no_network, raising=False)
    out = tmp_path / "tiny-sft"
    args = parse_recipe(
        dataclass_types(),
        [
            "--config",
            str(REPO_ROOT / "recipes/tiny/sft.yaml"),
            "--model_name_or_path",
            tiny_model_path,
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--save_steps",
            "1",
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "someone/tiny-sft",
            "--hub_private_repo",
            "true",
            "--hub_token",
            "hf_SECRET",
        ],
    )
    main(*args)
    kinds = [c[0] for c in fake_api.calls]
    assert kinds == ["create_repo", "upload_folder"]
    assert fake_api.calls[0] == ("create_repo", "someone/tiny-sft", True, True)
    _, repo, files, message, revision, card = fake_api.calls[1]
    assert repo == "someone/tiny-sft" and revision is None and "sft" in message
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= set(files)
    assert not any(f.startswith("checkpoint-") for f in files) and "training_args.bin" not in files
    assert os.path.isdir(out / "checkpoint-1")  # checkpoints exist locally but are not uploaded
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == tiny_model_path and "sft" in meta["tags"] and "datasets" not in meta
    assert "SFT cold start" in card and "recipes/tiny/data/sft_tir.jsonl" in card
    recipe = yaml.safe_load(card.split("```yaml")[1].split("```")[0])
    assert recipe["learning_rate"] == 1e-3 and recipe["max_length"] == 512 and recipe["max_steps"] == 2
    assert "hf_SECRET" not in card and "hub_token" not in recipe
    assert "| train_loss |" in card and "| global_step | 2 |" in card


def test_push_only_from_main_process(tmp_path):
    class Api:
        def __getattr__(self, name):
            raise AssertionError(f"rank 1 called HfApi.{name}")

    trainer = SimpleNamespace(is_world_process_zero=lambda: False)
    assert push_model(trainer, algorithm="appo", args=(), api=Api()) is None


def test_rl_card_names_algorithm_hub_datasets_and_metrics(tmp_path):
    from trl import ModelConfig

    from appo_trl.config import APPOConfig, APPOScriptArguments

    script = APPOScriptArguments(dataset_name={"dongguanting/ARPO-RL-DeepSearch-1K": 1.0, "./local.parquet": 0.5})
    cfg = APPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        learning_rate=1e-6,
        push_to_hub=True,
        hub_model_id="me/qwen3-8b-appo",
        hub_revision="v1",
        report_to="none",
    )
    model = ModelConfig(model_name_or_path="Qwen/Qwen3-8B")
    assert defer_push(cfg) is True and cfg.push_to_hub is False
    history = [
        {"loss": 0.5, "reward": 0.1, "step": 1},
        {"loss": 0.4, "reward": 0.3, "tools/call_frequency": 1.5, "step": 2},
    ]
    trainer = SimpleNamespace(is_world_process_zero=lambda: True, args=cfg, state=SimpleNamespace(log_history=history))
    api = FakeHfApi()
    FakeHfApi.calls = []
    url = push_model(trainer, algorithm="appo", args=(script, cfg, model), api=api)
    assert url == "https://huggingface.co/me/qwen3-8b-appo/commit/abc"
    assert [c[0] for c in FakeHfApi.calls] == ["create_repo", "create_branch", "upload_folder"]
    card = FakeHfApi.calls[-1][-1]
    assert FakeHfApi.calls[-1][4] == "v1"
    meta = yaml.safe_load(card.split("---")[1])
    assert meta == {
        "library_name": "transformers",
        "tags": ["appo-trl", "trl", "appo"],
        "base_model": "Qwen/Qwen3-8B",
        "datasets": ["dongguanting/ARPO-RL-DeepSearch-1K"],
    }
    assert "APPO (Agentic Procedural Policy Optimization" in card
    assert "| reward | 0.3 |" in card and "| tools/call_frequency | 1.5 |" in card and "| loss | 0.4 |" in card


def test_recipe_dict_and_metrics():
    from trl import ModelConfig

    recipe = recipe_dict(ModelConfig(model_name_or_path="m", lora_r=8))
    assert recipe == {"model_name_or_path": "m", "lora_r": 8}
    assert key_metrics([{"loss": 1.0, "step": 1}, {"train_loss": 0.5, "step": 2}]) == {
        "loss": 1.0,
        "global_step": 2.0,
        "train_loss": 0.5,
    }
    card = build_model_card(algorithm="grpo", base_model=None, datasets=None, recipe={}, metrics={}, repo_id="x")
    assert "No metrics were logged." in card and "GRPO" in card


def test_recipe_from_argv_is_the_yaml_plus_overrides():
    from appo_trl.reporting.hub import recipe_from_argv

    recipe = recipe_from_argv(
        [
            "--config",
            str(REPO_ROOT / "recipes/tiny/sft.yaml"),
            "--learning_rate",
            "2e-5",
            "--packing=true",
            "--num_processes",
            "2",
            "--hub_token",
            "hf_x",
            "--use_peft",
        ]
    )
    assert recipe["learning_rate"] == 2e-5 and recipe["packing"] is True and recipe["use_peft"] is True
    assert recipe["mask_tool_results"] is True and recipe["dataset_name"] == "data/sft_tir.jsonl"
    assert "env" not in recipe and "num_processes" not in recipe and "hub_token" not in recipe
