"""The RL stage: build tokenizer, dataset, rewards and `APPOTrainer` from parsed recipe arguments, train, save.

Run it as `appo train --config recipes/<model>/<stage>.yaml [--key value ...]`, or under accelerate as
`accelerate launch --config_file accelerate_configs/zero3.yaml appo_trl/train.py --config ...` (what
`appo train --accelerate_config zero3` does for you).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("appo_trl.train")


def dataclass_types() -> tuple[type, ...]:
    from trl import ModelConfig

    from appo_trl.config import APPOConfig, APPOScriptArguments

    return (APPOScriptArguments, APPOConfig, ModelConfig)


def _check_model_path(name_or_path: str | None) -> None:
    if not name_or_path:
        raise ValueError("No model given: set `model_name_or_path` in the recipe or pass --model_name_or_path.")
    looks_local = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.rstrip("/").split(os.sep, 1)[0]
    if looks_local and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(
            f"Model folder {name_or_path!r} does not exist. For the tiny CPU model run "
            f"`appo tiny-model {name_or_path}` first (or `make demo`, which does it for you)."
        )


def main(script_args, training_args, model_args) -> APPOTrainer:  # noqa: F821
    """Train with already-parsed arguments and return the trainer (its state holds the log history)."""
    from transformers import AutoTokenizer, set_seed
    from trl import get_peft_config

    from appo_trl.checkpoints import resolve_resume_checkpoint
    from appo_trl.data import load_rl_dataset
    from appo_trl.hub import defer_push, push_model
    from appo_trl.rewards import get_reward_func
    from appo_trl.trackers import prepare_trackers
    from appo_trl.trainer import APPOTrainer

    prepare_trackers(training_args)  # a missing tracker package fails here; wandb offline without an account
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_model_path(model_args.model_name_or_path)
    set_seed(training_args.seed)

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        "trust_remote_code": getattr(training_args, "trust_remote_code", False),
    }
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, padding_side="left"
    )
    train_dataset = load_rl_dataset(script_args)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = load_rl_dataset(script_args, split=script_args.dataset_test_split)
    reward_funcs = [get_reward_func(name) for name in script_args.reward_funcs]
    push = defer_push(training_args)  # one push of the final model at the end, not from Trainer.__init__

    trainer = APPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    state = trainer.accelerator.state
    logger.info(
        "process %d of world_size=%d (%s), strategy=%s",
        state.process_index,
        state.num_processes,
        state.distributed_type,
        getattr(training_args, "rollout_strategy", "grpo"),
    )
    checkpoint = resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model(training_args.output_dir)  # also saves the tokenizer; main process only
    trainer.save_state()  # trainer_state.json (the log history `appo plot OUTPUT_DIR` draws)
    logger.info("Saved model to %s", training_args.output_dir)
    if push:
        push_model(
            trainer,
            algorithm=getattr(training_args, "rollout_strategy", "grpo"),
            args=(script_args, training_args, model_args),
        )
    return trainer


def cli(argv: list[str] | None = None) -> int:
    from appo_trl.recipes import RecipeError, maybe_relaunch, parse_recipe

    argv = list(sys.argv[1:] if argv is None else argv)
    code = maybe_relaunch(argv, __file__)
    if code is not None:
        return code
    try:
        script_args, training_args, model_args = parse_recipe(dataclass_types(), argv)
    except RecipeError as exc:
        print(f"appo train: {exc}", file=sys.stderr)
        return 2
    main(script_args, training_args, model_args)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
