"""Model cards: the right base model and method for every strategy, and a recipe block that re-runs."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import yaml

from appo_trl.configs.recipes import REPO_ROOT, parse_recipe
from appo_trl.reporting.hub import push_model, recipe_dict
from appo_trl.stages.train import dataclass_types


class FakeHfApi:
    """Records the card that `upload_folder` would push."""

    calls: list = []

    def create_repo(self, repo_id, **kw):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, **kw):
        with open(f"{folder_path}/README.md", encoding="utf-8") as f:
            self.calls.append(("upload_folder", repo_id, f.read()))
        return SimpleNamespace(commit_url="https://huggingface.co/x/commit/abc")


def _card_recipe(card: str) -> dict:
    block = re.search(r"## Recipe\n.*?```yaml\n(.*?)```", card, re.S)
    assert block, card
    return yaml.safe_load(block.group(1))


def _push(args, tmp_path, strategy):
    cfg = args[1]
    cfg.output_dir = str(tmp_path / "out")
    (tmp_path / "out").mkdir(exist_ok=True)
    trainer = SimpleNamespace(is_world_process_zero=lambda: True, args=cfg, state=SimpleNamespace(log_history=[]))
    FakeHfApi.calls = []
    push_model(trainer, algorithm=strategy, args=args, recipe=recipe_dict(*args), api=FakeHfApi())
    return FakeHfApi.calls[-1][-1]


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
def test_pushed_card_recipe_parses_back_to_the_same_settings(strategy, tmp_path):
    args = parse_recipe(dataclass_types(), ["--config", f"recipes/tiny/{strategy}.yaml"])
    card = _push(args, tmp_path, strategy)  # (sets output_dir to a temporary folder)
    original = recipe_dict(*args)
    emitted = _card_recipe(card)
    assert "accelerator_config" not in emitted
    assert not {"generation_batch_size", "steps_per_generation"} <= set(emitted)
    path = tmp_path / "card_recipe.yaml"
    path.write_text(yaml.safe_dump(emitted))
    again = parse_recipe(dataclass_types(), ["--config", str(path)])
    assert recipe_dict(*again) == original
    assert again[2].model_name_or_path == "outputs/tiny-qwen3"
    assert again[1].rollout_strategy == strategy and again[1].num_generations == args[1].num_generations
    if strategy == "appo":
        assert emitted["min_remaining_tokens"] == 4 == again[1].min_remaining_tokens  # a setting, not a secret


@pytest.mark.parametrize(
    "strategy,paper,other",
    [("grpo", "arXiv:2402.03300", "2507.19849"), ("arpo", "arXiv:2507.19849", "DeepSeekMath"),
     ("aepo", "arXiv:2510.14545", "DeepSeekMath"), ("appo", "arXiv:2606.12384", "DeepSeekMath")],
)  # fmt: skip
def test_pushed_card_cites_the_strategy_paper(strategy, paper, other, tmp_path):
    args = parse_recipe(dataclass_types(), ["--config", "recipes/tiny/grpo.yaml", "--rollout_strategy", strategy])
    card = _push(args, tmp_path, strategy)
    assert paper in card and other not in card
    assert "- **Base model:** `outputs/tiny-qwen3`" in card


@pytest.mark.parametrize(
    "strategy,title",
    [("grpo", "DeepSeekMath: Pushing the Limits"), ("arpo", "Agentic Reinforced Policy Optimization"),
     ("aepo", "Agentic Entropy-Balanced Policy Optimization"), ("appo", "Agentic Procedural Policy Optimization")],
)  # fmt: skip
def test_trl_local_card_names_strategy_method_and_local_base_model(strategy, title, tiny_model_path, tmp_path):
    from transformers import AutoConfig

    from appo_trl.reporting.hub import strategy_card
    from appo_trl.trainer.trainer import APPOTrainer

    trainer = object.__new__(APPOTrainer)  # only what TRL's create_model_card reads
    trainer.model = SimpleNamespace(config=AutoConfig.from_pretrained(tiny_model_path))
    trainer.args = SimpleNamespace(output_dir=str(tmp_path))
    trainer.hub_model_id = None
    trainer.is_world_process_zero = lambda: True
    trainer._name, trainer._paper = strategy_card(strategy)
    trainer._tag_names = ["trl", "appo-trl", strategy]
    trainer.create_model_card(model_name="run")
    card = (tmp_path / "README.md").read_text()
    name = strategy.upper()
    assert f"This model was trained with {name}, a method introduced in [{title}" in card
    assert "[None]" not in card and f"fine-tuned version of the local model `{tiny_model_path}`" in card
    if strategy != "grpo":
        assert "DeepSeekMath" not in card


SHIPPED_RL_RECIPES = sorted(
    str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "recipes").glob("*/*.yaml") if not p.stem.startswith("sft")
)


@pytest.mark.parametrize("path", SHIPPED_RL_RECIPES)
def test_every_shipped_rl_recipe_round_trips_through_the_card_recipe(path, tmp_path):
    args = parse_recipe(dataclass_types(), ["--config", str(REPO_ROOT / path), "--use_cpu", "true", "--bf16", "false"])
    emitted = recipe_dict(*args)
    out = tmp_path / "r.yaml"
    out.write_text(yaml.safe_dump(emitted))
    assert recipe_dict(*parse_recipe(dataclass_types(), ["--config", str(out)])) == emitted
