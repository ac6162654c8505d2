"""`appo demo`: the main job on the embedded default, offline on CPU.

Builds the tiny random Qwen3 model (once, in `outputs/tiny-qwen3`), trains it with a tiny recipe for a
couple of steps, reloads the saved checkpoint with plain `transformers`, and prints what happened. The model
is random, so rewards are not expected to rise; the demo proves the whole pipeline runs end to end.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from appo_trl.recipes import REPO_ROOT


def _resolve(path: str) -> str:
    if os.path.exists(path):
        return path
    candidate = REPO_ROOT / path
    return str(candidate) if candidate.exists() else path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appo demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default="recipes/tiny/grpo.yaml", help="tiny recipe to run (default: %(default)s)")
    p.add_argument("--model_dir", default="outputs/tiny-qwen3", help="where the tiny model is built")
    p.add_argument("--output_dir", default=None, help="override the recipe's output_dir")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further `--key value` recipe overrides")
    a = p.parse_args(argv)

    from appo_trl.tiny import build_tiny_model

    start = time.time()
    if not Path(a.model_dir, "config.json").is_file():
        print(f"[demo] building the tiny offline model in {a.model_dir}")
        build_tiny_model(a.model_dir)
    recipe = _resolve(a.recipe)
    overrides = ["--model_name_or_path", a.model_dir]
    if a.output_dir:
        overrides += ["--output_dir", a.output_dir]
    from appo_trl.recipes import parse_recipe
    from appo_trl.train import dataclass_types
    from appo_trl.train import main as train

    script_args, training_args, model_args = parse_recipe(dataclass_types(), ["--config", recipe, *overrides, *a.extra])
    if not os.path.exists(script_args.dataset_name or ""):
        script_args.dataset_name = _resolve(script_args.dataset_name)
    print(f"[demo] training with {recipe} -> {training_args.output_dir}")
    trainer = train(script_args, training_args, model_args)

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(training_args.output_dir)  # the checkpoint loads in plain transformers
    print("\n[demo] per-step log:")
    keys = ("reward", "loss", "completions/mean_length", "tools/call_frequency", "branch/points_per_prompt")
    for entry in trainer.state.log_history:
        if "step" in entry and any(k in entry for k in keys):
            shown = ", ".join(f"{k}={entry[k]:.4g}" for k in keys if k in entry)
            print(f"  step {entry['step']}: {shown}")
    print(f"\n[demo] done in {time.time() - start:.1f} s; checkpoint in {training_args.output_dir} reloads in transformers.")
    return 0
