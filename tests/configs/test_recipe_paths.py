"""Recipes work from anywhere: recipe-relative input paths, shipped recipes found from any directory, and the
wheel carries recipes, accelerate configs and tiny data so `appo demo` runs outside a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from appo_trl.configs.paths import find_recipe, resolve_recipe_paths
from appo_trl.configs.recipes import parse_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_relative_input_paths_resolve_against_the_recipe(tmp_path):
    (tmp_path / "exp" / "data").mkdir(parents=True)
    (tmp_path / "exp" / "data" / "a.jsonl").write_text("{}\n")
    (tmp_path / "exp" / "data" / "b.jsonl").write_text("{}\n")
    (tmp_path / "exp" / "cache.json").write_text("{}")
    recipe = tmp_path / "exp" / "r.yaml"
    a, b = str(tmp_path / "exp" / "data" / "a.jsonl"), str(tmp_path / "exp" / "data" / "b.jsonl")
    config = {
        "dataset_name": "data/a.jsonl",
        "model_name_or_path": "outputs/tiny-qwen3",  # not next to the recipe: stays relative to the cwd
        "output_dir": "data",  # outputs are never rewritten
        "tool_config": {"search": {"cache_path": "cache.json", "url": "cache.json"}, "python": {"timeout_s": 5}},
    }
    out = resolve_recipe_paths(config, recipe)
    assert out["dataset_name"] == a
    assert out["model_name_or_path"] == "outputs/tiny-qwen3" and out["output_dir"] == "data"
    assert out["tool_config"]["search"] == {"cache_path": str(tmp_path / "exp" / "cache.json"), "url": "cache.json"}
    assert out["tool_config"]["python"] == {"timeout_s": 5}
    # the mixture forms and Hub ids
    assert resolve_recipe_paths({"dataset_name": {"data/a.jsonl": 1.0, "org/name": 0.5}}, recipe)["dataset_name"] == {
        a: 1.0,
        "org/name": 0.5,
    }
    assert resolve_recipe_paths({"dataset_name": "data/a.jsonl@0.5,data/b.jsonl@2"}, recipe)["dataset_name"] == (
        f"{a}@0.5,{b}@2"
    )
    assert resolve_recipe_paths({"dataset_name": "dongguanting/ARPO-RL-Reasoning-10K"}, recipe)["dataset_name"] == (
        "dongguanting/ARPO-RL-Reasoning-10K"
    )
    assert config["dataset_name"] == "data/a.jsonl"  # the input mapping is not modified


def test_tiny_recipe_runs_from_another_directory(tmp_path, monkeypatch):
    from appo_trl.stages.train import dataclass_types

    monkeypatch.chdir(tmp_path)
    assert find_recipe("recipes/tiny/grpo.yaml") == ROOT / "recipes" / "tiny" / "grpo.yaml"
    script, training, _ = parse_recipe(dataclass_types(), ["--config", "recipes/tiny/grpo.yaml"])
    assert Path(script.dataset_name) == ROOT / "recipes" / "tiny" / "data" / "arith.jsonl"
    assert training.output_dir == "outputs/tiny-grpo"  # relative to where the user runs it
    from appo_trl.stages import sft

    args = parse_recipe(sft.dataclass_types(), ["--config", str(ROOT / "recipes" / "tiny" / "sft.yaml")])
    assert Path(args[0].dataset_name).is_file()


def _build_wheel(tmp_path: Path) -> Path:
    """`pip wheel --no-deps` on a copy of the sources (no build/ or egg-info left in the checkout)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "setup.cfg"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.bm25s")
    for name in ("appo_trl", "recipes", "accelerate_configs", "eval"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"),
         str(src)], check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "whl").glob("appo_trl-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_ships_recipes_configs_and_data_and_demo_runs_outside_a_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        "appo_trl/_resources/recipes/tiny/grpo.yaml", "appo_trl/_resources/recipes/tiny/sft.yaml",
        "appo_trl/_resources/recipes/tiny/data/arith.jsonl", "appo_trl/_resources/recipes/tiny/data/sft_tir.jsonl",
        "appo_trl/_resources/recipes/qwen3-8b/appo.yaml", "appo_trl/_resources/accelerate_configs/zero3.yaml",
        "appo_trl/_resources/eval/tiny.yaml", "appo_trl/tools/_zygote.py", "appo_trl/reporting/viewer/viewer.js",
        "appo_trl/reporting/viewer/viewer.css", "appo_trl/reporting/viewer/page.html",  # the rollout viewer
    }  # fmt: skip
    assert shipped <= names, sorted(shipped - names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", "import appo_trl, appo_trl.configs.recipes as r; print(appo_trl.__file__); "
         "print(r.resolve_accelerate_config('zero3'))"], cwd=cwd, env=env, capture_output=True, text=True,
    )  # fmt: skip
    file_, zero3 = probe.stdout.split()
    assert file_.startswith(str(site)) and zero3.startswith(str(site))  # the installed copy, not the checkout
    demo = subprocess.run(
        [sys.executable, "-m", "appo_trl.cli", "demo", "--sft_steps", "2", "--num_sft", "16", "--rl_steps", "1",
         "--checkpoints", "0", "--num_heldout", "4", "--eval_samples", "1"], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert (cwd / "outputs" / "demo" / "report.json").is_file()
