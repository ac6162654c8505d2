"""`appo demo`: the main job on the embedded default, offline on CPU, in about a minute.

1. builds the tiny random Qwen3 model (once, in `outputs/tiny-qwen3`);
2. cold-starts it with SFT on the tiny tool-integrated traces (`recipes/tiny/sft.yaml`, 120 steps), so that
   it writes `<think>`, `<python>` and `<answer>` blocks;
3. trains it with RL (`recipes/tiny/appo.yaml` by default: APPO with the sandboxed python tool) on the tiny
   arithmetic set, the python calls running for real in the sandbox;
4. reloads the saved checkpoint with plain `transformers` and prints the per-step log.

The model is tiny and the run is short: rewards are not expected to climb. The demo proves that every stage
runs end to end (SFT, tool loop, branching, rewards, loss, checkpoint) on a machine with no GPU and no Hub.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from appo_trl.recipes import REPO_ROOT

LOG_KEYS = ("reward", "reward_std", "loss", "tools/call_frequency", "branch/points_per_prompt",
            "branch/loss_rows_frac", "completions/mean_length")  # fmt: skip


def _resolve(path: str) -> str:
    """Recipe and data paths are relative to the repository when not found from the working directory."""
    if not path or os.path.exists(path):
        return path
    candidate = REPO_ROOT / path
    return str(candidate) if candidate.exists() else path


def _parse(types, recipe: str, overrides: list[str]):
    from appo_trl.recipes import parse_recipe

    parsed = parse_recipe(types, ["--config", _resolve(recipe), *overrides])
    parsed[0].dataset_name = _resolve(parsed[0].dataset_name)
    return parsed


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appo demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default="recipes/tiny/appo.yaml", help="RL recipe (default: %(default)s)")
    p.add_argument("--sft_recipe", default="recipes/tiny/sft.yaml", help="cold-start recipe (default: %(default)s)")
    p.add_argument("--sft_steps", type=int, default=120, help="cold-start steps; 0 skips SFT (default: %(default)s)")
    p.add_argument("--rl_steps", type=int, default=4, help="RL steps (default: %(default)s)")
    p.add_argument("--workdir", default="outputs", help="where models and checkpoints go (default: %(default)s)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further `--key value` overrides for the RL recipe")
    a = p.parse_args(argv)

    from appo_trl.tiny import build_tiny_model

    start = time.time()
    base, sft_dir, rl_dir = (str(Path(a.workdir, name)) for name in ("tiny-qwen3", "tiny-sft", "tiny-rl"))
    if not Path(base, "config.json").is_file():
        print(f"[demo] 1/4 building the tiny offline model in {base}")
        build_tiny_model(base)
    else:
        print(f"[demo] 1/4 tiny model found in {base}")

    policy = base
    if a.sft_steps > 0:
        from appo_trl import sft

        print(f"[demo] 2/4 SFT cold start ({a.sft_steps} steps) -> {sft_dir}")
        sft_args = _parse(sft.dataclass_types(), a.sft_recipe, [
            "--model_name_or_path", base, "--output_dir", sft_dir, "--max_steps", str(a.sft_steps),
            "--learning_rate", "3e-3", "--save_strategy", "no", "--logging_steps", str(max(1, a.sft_steps // 4)),
        ])  # fmt: skip
        sft.main(*sft_args)
        policy = sft_dir

    from appo_trl.train import dataclass_types
    from appo_trl.train import main as train

    rl_args = _parse(dataclass_types(), a.recipe, [
        "--model_name_or_path", policy, "--output_dir", rl_dir, "--max_steps", str(a.rl_steps),
        "--save_strategy", "no", *a.extra,
    ])  # fmt: skip
    strategy = getattr(rl_args[1], "rollout_strategy", "grpo")
    print(f"[demo] 3/4 RL with {a.recipe} ({strategy}, tools: {rl_args[1].tools}) -> {rl_dir}")
    trainer = train(*rl_args)

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(rl_dir)  # the checkpoint loads in plain transformers
    print("[demo] 4/4 checkpoint reloaded with transformers; per-step log:")
    for entry in trainer.state.log_history:
        if "step" in entry and any(k in entry for k in LOG_KEYS):
            shown = ", ".join(f"{k}={entry[k]:.4g}" for k in LOG_KEYS if k in entry)
            print(f"  step {entry['step']}: {shown}")
    print(f"[demo] done in {time.time() - start:.0f} s. Next: `appo train --config {a.recipe}` or README, GPU usage.")
    return 0
