"""`push_to_hub` of a LoRA run (`appo train`, tiny APPO recipe, `use_peft`) against the fake `HfApi`: the adapter is
uploaded (no full weights) with a card that names the base model and loads the adapter on it."""

import json

import yaml

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
from tests.reporting.test_hub import FakeHfApi, fake_api  # noqa: F401 - the fixture


def test_lora_run_pushes_the_adapter_with_a_card_naming_the_base_model(tiny_model_path, tmp_path,
                                                                       fake_api):  # noqa: F811 # fmt: skip
    from appo_trl.stages.train import dataclass_types, main

    out = tmp_path / "tiny-appo-lora"
    argv = ["--config", str(REPO_ROOT / "recipes/tiny/appo.yaml"), "--model_name_or_path", tiny_model_path,
            "--output_dir", str(out), "--max_steps", "1", "--save_steps", "1", "--use_peft", "true",
            "--lora_r", "8", "--lora_target_modules", "all-linear", "--push_to_hub", "true",
            "--hub_model_id", "someone/tiny-lora"]  # fmt: skip
    main(*parse_recipe(dataclass_types(), argv))
    assert [c[0] for c in FakeHfApi.calls] == ["create_repo", "upload_folder"]
    _, repo, files, _, _, card = FakeHfApi.calls[1]
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= set(files)
    assert "model.safetensors" not in files and not any(f.startswith("checkpoint-") for f in files)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_model_path
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == tiny_model_path and meta["library_name"] == "peft"
    assert {"lora", "appo"} <= set(meta["tags"])
    assert f'PeftModel.from_pretrained(base, "{repo}")' in card and f'from_pretrained("{tiny_model_path}")' in card
    assert "(r = 8, alpha = " in card
