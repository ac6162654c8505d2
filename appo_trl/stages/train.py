"""The RL stage: build tokenizer, dataset, rewards and `APPOTrainer` from parsed recipe arguments, train, save.

Run it as `appo train --config recipes/<model>/<stage>.yaml [--key value ...]`, or under accelerate as
`accelerate launch --config_file accelerate_configs/zero3.yaml appo_trl/stages/train.py --config ...` (what
`appo train --accelerate_config zero3` does for you).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("appo_trl.stages.train")


def dataclass_types() -> tuple[type, ...]:
    from trl import ModelConfig

    from appo_trl.config import APPOConfig, APPOScriptArguments

    return (APPOScriptArguments, APPOConfig, ModelConfig)


def _check_model_path(name_or_path: str | None) -> None:
    from appo_trl.configs.preflight import check_model_source

    check_model_source(name_or_path)


def load_tokenizer(model_args):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, padding_side="left"
    )


def model_settings(model_args, training_args):
    """What the trainer takes from `model_args`, checked before the model loads: `training_args.model_init_kwargs`
    (revision, attention, dtype, trust_remote_code; the recipe's own keys win) and the returned PEFT config (None
    without `use_peft`). `appo train` and the demo's RL stage both go through here, so neither drops a setting."""
    from trl import get_peft_config

    from appo_trl.configs import preflight

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        "trust_remote_code": training_args.trust_remote_code,
    }
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    preflight.check_model_source(
        model_args.model_name_or_path, model_args.model_revision, model_init_kwargs["trust_remote_code"]
    )
    preflight.check_quantization(model_args, training_args)
    preflight.check_peft(model_args, training_args)
    return get_peft_config(model_args)


def weight_sync_line(args, spec, peft: bool) -> str:
    """The start-up line naming how the sampler gets the policy's weights: in-process, colocated, or a server route
    (`spec.weight_sync`: adapter, disk or nccl, of the merged weights under LoRA)."""
    if not args.use_vllm:
        if args.max_staleness >= 1:
            return "weight sync: in-process (no vLLM; a copy of the policy samples ahead, updated every weight_sync_steps)"
        return "weight sync: in-process (no vLLM; the policy samples itself, nothing to sync)"
    if args.vllm_mode == "colocate":
        return "weight sync: colocated vLLM engine, " + ("merged LoRA " if peft else "") + "weights in process (TRL's)"
    n = f"{len(spec.urls)} vLLM server{'s' if len(spec.urls) > 1 else ''}"
    merged = "merged LoRA weights" if peft else "full weights"
    return {
        "adapter": f"weight sync: adapter (only the LoRA adapter, loaded on {n} each round)",
        "disk": f"weight sync: disk ({merged} as safetensors, reload_weights on {n} each round)",
        "nccl": f"weight sync: NCCL ({merged} broadcast to {n} each round)",
    }.get(spec.weight_sync, f"weight sync: {spec.weight_sync} ({n})")


def main(script_args, training_args, model_args, recipe=None, tool_dirs=()) -> APPOTrainer:  # noqa: F821
    """`train`, with `appo serve-search` running on `script_args.search_corpus` when it is set.

    The server (127.0.0.1, a free port; its log `<output_dir>/search_server.log`) is started after the checks of
    `appo_trl.configs.search_corpus`, the search tool's `url` points at it, and it is stopped when training ends or
    fails. The pushed card's recipe is the one as given (with `search_corpus`, not the run's port).
    """
    import contextlib
    import os

    from appo_trl.configs import preflight
    from appo_trl.configs.search_corpus import check_search_corpus, search_tool_config
    from appo_trl.reporting.hub import recipe_dict
    from appo_trl.stages.logs import setup_logging

    corpus = check_search_corpus(script_args, training_args)
    if corpus is None:
        return train(script_args, training_args, model_args, recipe, tool_dirs)
    from appo_trl.tools.search_process import search_server

    setup_logging()  # the server's line below, at INFO
    recipe = recipe if recipe is not None else recipe_dict(script_args, training_args, model_args)
    preflight.check_output_dir(training_args.output_dir)
    os.makedirs(training_args.output_dir, exist_ok=True)
    log = os.path.join(training_args.output_dir, "search_server.log")
    with contextlib.ExitStack() as stack:
        try:
            srv = stack.enter_context(search_server(corpus, log))
        except RuntimeError as exc:  # exited early or never healthy: one line naming its log
            raise preflight.PreflightError(f"search_corpus {corpus!r}: {exc}") from exc
        logger.info("search: appo serve-search on %s over %s (pid %d, log %s)", srv.url, corpus, srv.pid, log)
        training_args.tool_config = search_tool_config(training_args, srv.url)
        return train(script_args, training_args, model_args, recipe, tool_dirs)


def train(script_args, training_args, model_args, recipe=None, tool_dirs=()) -> APPOTrainer:  # noqa: F821
    """Train with already-parsed arguments and return the trainer (its state holds the log history).

    `recipe` is what the pushed model card prints; default: the settings as parsed, before this function
    fills in run-specific values (`appo_trl.reporting.hub.recipe_dict`), so the card's recipe re-runs.
    `tool_dirs`: folders searched first for dotted tool paths (`appo train`: the recipe's folder).

    Everything that can be checked without the weights is checked first (`appo_trl.configs.preflight`): the model
    source, 4-bit loading, the data (bad rows, prompts too long for the model) and the columns the rewards need,
    the tools and the search server, Hub access when pushing. A failure there raises a `ConfigError` before the
    model loads.
    """
    from transformers import set_seed

    from appo_trl.configs import preflight
    from appo_trl.data import load_rl_dataset
    from appo_trl.reporting.hub import defer_push, push_model, recipe_dict
    from appo_trl.reporting.trackers import prepare_trackers
    from appo_trl.rewards import get_reward_func
    from appo_trl.stages.logs import setup_logging
    from appo_trl.trainer.checkpoints import resolve_resume_checkpoint, save_final_model
    from appo_trl.trainer.resume_kind import check_resume_kind
    from appo_trl.trainer.trainer import APPOTrainer

    prepare_trackers(training_args)  # a missing tracker package fails here; wandb offline without an account
    setup_logging()  # INFO; request loggers at WARNING; agent endpoint secrets redacted
    recipe = recipe if recipe is not None else recipe_dict(script_args, training_args, model_args)
    peft_config = model_settings(model_args, training_args)
    preflight.check_output_dir(training_args.output_dir)  # read-only or missing parent: one line, before the model
    preflight.check_rollouts_dir(training_args.output_dir, training_args.dump_rollouts)
    preflight.check_agent_port(training_args)  # a taken agent_port: one line, before the model
    checkpoint = resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    check_resume_kind(checkpoint, peft_config)  # a LoRA checkpoint into a full run (or back): one line, before the model
    try:
        reward_funcs = [get_reward_func(name) for name in script_args.reward_funcs]
    except ValueError as exc:
        raise preflight.PreflightError(str(exc)) from exc
    limit = preflight.prompt_token_limit(training_args, model_args)  # bad rows: one line naming file and row
    tokenizer = None if limit is None else load_tokenizer(model_args)  # prompts too long: tokenizer only, no model
    train_dataset = load_rl_dataset(script_args, tokenizer=tokenizer, max_prompt_tokens=limit)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = load_rl_dataset(
            script_args, split=script_args.dataset_test_split, tokenizer=tokenizer, max_prompt_tokens=limit
        )
    preflight.check_hub(training_args)
    training_args.tool_config = preflight.default_search_cache(training_args)
    plan = preflight.plan_startup(
        training_args, tool_dirs, script_args.reward_funcs, train_dataset, script_args.answer_column
    )  # reward columns; tools resolved and built once
    from appo_trl.tiny import random_weights_note

    note = random_weights_note(model_args.model_name_or_path)
    if note:
        logger.warning(note)
    set_seed(training_args.seed)
    tokenizer = load_tokenizer(model_args) if tokenizer is None else tokenizer
    push = defer_push(training_args)  # one push of the final model at the end, not from Trainer.__init__

    from appo_trl.vllm import ServerNotReadyError
    from appo_trl.vllm.lora import AdapterSyncError

    try:
        trainer = APPOTrainer(
            model=model_args.model_name_or_path,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            tools=plan,  # the tools planned and built above, not again
        )
    except (ServerNotReadyError, AdapterSyncError) as exc:  # a dead server, not vLLM, or no adapter route: one line
        raise preflight.PreflightError(str(exc)) from exc
    state = trainer.accelerator.state
    logger.info(
        "process %d of world_size=%d (%s), strategy=%s",
        state.process_index,
        state.num_processes,
        state.distributed_type,
        training_args.rollout_strategy,
    )
    logger.info(weight_sync_line(training_args, trainer.vllm_server, peft_config is not None))
    if checkpoint is None:  # a SIGTERM line must not name another run's checkpoint
        from appo_trl.stages.interrupts import note_fresh_start

        note_fresh_start(training_args.output_dir)
    trainer.train(resume_from_checkpoint=checkpoint)
    save_final_model(trainer, training_args.output_dir)  # model, tokenizer, trainer_state.json; a full disk: one line
    logger.info("Saved model to %s", training_args.output_dir)
    if push:
        push_model(
            trainer,
            algorithm=training_args.rollout_strategy,
            args=(script_args, training_args, model_args),
            recipe=recipe,
        )
    return trainer


def cli(argv: list[str] | None = None) -> int:
    """`appo train` (and the `accelerate launch` entry): parse, check, train. Raises `ConfigError` on bad input."""
    from appo_trl.configs.recipes import check_before_relaunch, maybe_relaunch, parse_recipe

    argv = list(sys.argv[1:] if argv is None else argv)
    precision = check_before_relaunch(dataclass_types(), argv)  # one line here, not one report per rank
    code = maybe_relaunch(argv, __file__, precision)
    if code is not None:
        return code
    parsed = parse_recipe(dataclass_types(), argv)
    script_args, training_args, model_args = parsed
    from appo_trl.stages.interrupts import run_interruptible

    # Ctrl-C and SIGTERM: one line naming the checkpoint kept, exit code 130 / 143
    return run_interruptible(
        "appo train",
        training_args.output_dir,
        lambda: main(script_args, training_args, model_args, tool_dirs=[parsed.folder]),
    )


if __name__ == "__main__":
    from appo_trl.configs.errors import run_cli

    sys.exit(run_cli("appo train", cli, sys.argv[1:]))
