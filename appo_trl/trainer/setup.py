"""Setting up an `APPOTrainer`: reward names, tools, the chat tool format and the rollout engine.

Functions of the trainer (they read and set its attributes), kept out of `trainer.py` so that it reads in one
sitting: `resolve_reward_funcs` (reward names of `appo_trl.rewards`), `resolve_startup_plan` (the run's
`appo_trl.configs.plan.StartupPlan`: reward columns checked, every tool resolved and built once, before the model
loads), `setup_chat_tools` (the chat template's tool markers and TRL's schema rendering, environments' methods
included) and `build_rollout_engine` (the backend and `RolloutEngine` the config asks for). What it does not do: sample, score or train.
"""

from __future__ import annotations

from trl.data_utils import is_conversational

from appo_trl.trainer import trl_seams


def resolve_reward_funcs(reward_funcs):
    """Map reward names of `appo_trl.rewards.REWARD_FUNCS` to callables; other entries go to TRL unchanged."""
    if reward_funcs is None:
        return None
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    names = [f for f in funcs if isinstance(f, str)]
    if not names:
        return reward_funcs
    from appo_trl import rewards

    registry = getattr(rewards, "REWARD_FUNCS", {})
    return [rewards.get_reward_func(f) if isinstance(f, str) and f in registry else f for f in funcs]


def build_rollout_engine(trainer, sampler_model=None, clock=None, gate=None):
    """The rollout engine the config asks for: tools from `tools`/`tool_config`, backend from `use_vllm`.

    `use_vllm=True` samples through the vLLM servers resolved at start-up (`trainer.vllm_server`, a `ServerSpec`:
    the router with several replicas) in server mode, or through TRL's in-process engine
    (`trainer.vllm_generation.llm`) in colocate mode; otherwise the policy samples in-process (`TransformersBackend`),
    or `sampler_model` (the sampler copy, max_staleness >= 1) does. `clock` (rollout_stream): the server sampler
    streams and stamps each token with its policy version; `gate` (rollout_stream in process): the copy's decode
    steps, between which its weights are swapped (`appo_trl.rollout.decode_gate`).
    """
    from appo_trl.rollout import RolloutConfig, RolloutEngine, TransformersBackend
    from appo_trl.tools import ToolExecutor

    args = trainer.args
    tools = trainer.startup_plan.take_tools()  # the planned tools; a second engine (after close) gets fresh ones
    if args.use_vllm and args.vllm_mode == "colocate":
        from appo_trl.vllm import VLLMColocateBackend

        llm = trainer.vllm_generation.llm
        backend = VLLMColocateBackend(llm, sleep_mode=args.vllm_enable_sleep_mode)
        max_model_len = llm.llm_engine.model_config.max_model_len
    elif args.use_vllm:
        backend = trainer.vllm_server.backend(max_concurrency=args.rollout_concurrency,
                                              server_wait_s=args.vllm_server_wait_s,
                                              timeout_s=args.vllm_request_timeout_s,
                                              **({} if clock is None else {"clock": clock}))  # fmt: skip
    elif sampler_model is not None:  # max_staleness >= 1: the sampler copy decodes
        backend = TransformersBackend(sampler_model, trl_seams.tokenizer(trainer), gate=gate)
    else:
        backend = TransformersBackend(trainer.model, trl_seams.tokenizer(trainer), accelerator=trainer.accelerator)
    # prompt + completion must fit the sampler: the colocated engine's length, vLLM's --max-model-len when given,
    # else the model's positions
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        max_model_len = args.vllm_max_model_length or getattr(
            trainer.model.config, "max_position_embeddings", None) or 32768  # fmt: skip
    config = RolloutConfig(
        max_completion_length=args.max_completion_length,
        max_model_len=max_model_len,
        call_limit=args.tool_call_limit,
        turn_limit=args.max_tool_calling_iterations,  # TRL counts turns (None: no limit)
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k if args.top_k else -1,
        tool_tags=(list(tools) if trainer.tool_format == "tags" else None) or ["python", "search"],
        entropy_topk=args.entropy_topk,
        entropy_window=args.entropy_tokens,
        record_entropies=args.strategy_class.needs_sampler_entropies(args),
        hook_mode=args.arpo_entropy_timing,
        concurrency=args.rollout_concurrency,
    )
    return RolloutEngine(
        backend, trl_seams.tokenizer(trainer), config, ToolExecutor(tools, max_workers=args.rollout_concurrency),
        chat=trainer.chat_tool_format,
    )  # fmt: skip


def has_tools(args, tools) -> bool:
    """Whether tools are configured (`tools=`, the `StartupPlan` `appo train` passes, or `APPOConfig.tools`)."""
    from appo_trl.configs.plan import StartupPlan

    return bool(tools.tool_specs if isinstance(tools, StartupPlan) else (tools or args.tools))


def resolve_startup_plan(trainer, args, tools, tool_dirs, reward_funcs, train_dataset, environments=False) -> None:
    """`trainer.startup_plan`: the `StartupPlan` `appo train` passed as `tools=`, else one resolved here (reward
    columns checked, every tool resolved and built once), before the model loads; sets `tool_specs`, `tool_format`."""
    from appo_trl.configs.plan import StartupPlan

    plan = tools
    if not isinstance(plan, StartupPlan):
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        plan = StartupPlan.resolve(args, tools, tool_dirs, reward_funcs=funcs, dataset=train_dataset,
                                   environments=environments)  # fmt: skip
    trainer.startup_plan = plan
    trainer.tool_specs, trainer.tool_format = plan.tool_specs, plan.tool_format


def setup_chat_tools(trainer, train_dataset) -> None:
    """Chat format: check the template can call tools, learn its markers, and let TRL render the schemas."""
    trainer.chat_tool_format = None
    if trainer.tool_format != "chat" or not (trainer.tool_specs or trainer.environment_factories):
        return
    from trl.chat_template_utils import supports_tool_calling

    from appo_trl.rollout.chat_format import ChatToolFormat

    if not supports_tool_calling(trainer.processing_class):
        raise ValueError(
            "tool_format=chat: the model's chat template cannot render a tool-calling conversation "
            "(user -> assistant with tool_calls -> tool); use a tool-capable template or tool_format=tags."
        )
    trainer.chat_tool_format = ChatToolFormat(trl_seams.tokenizer(trainer), trainer.chat_template, trainer.chat_template_kwargs)
    # TRL's `_tokenize_prompts` renders `trainer.tools` into every prompt (schemas from get_json_schema); with
    # environments, each row's `_env_tools[name]`: the standalone tools, then its environment's methods (TRL's)
    standalone = [t.func for t in trainer.startup_plan.tools.values()] if trainer.startup_plan.tools else []
    trl_seams.prepend_tools(trainer, standalone)
    if train_dataset is not None and "prompt" in getattr(train_dataset, "column_names", []) and len(train_dataset):
        if not is_conversational({"prompt": train_dataset[0]["prompt"]}):
            raise ValueError(
                "tool_format=chat needs conversational prompts (lists of messages), so that the chat template "
                "can render the tool schemas; set a system_prompt or give `prompt` as messages."
            )
