"""`APPOTrainer`: TRL's `GRPOTrainer` with the agentic tool loop, branching rollouts and branch-aware losses.

Override points of TRL's `GRPOTrainer`; everything else is TRL's:

- `__init__(..., tools=...)`: TRL's `tools=` (functions, built-in names, dotted paths), resolved and checked
  before the model loads; `tool_format: chat` renders their schemas into prompts through TRL's own
  `_tokenize_prompts` (`self.tools`) and hands completions to rewards in TRL's tool-loop message shape.
- `_generate(prompts)`: (for in-process `grpo` with no `tools`, TRL's own sampler runs unchanged) replaces TRL's sampler and tool loop with `appo_trl.rollout`'s engine, driven by the
  configured strategy (`appo_trl.trainer.strategies.STRATEGIES`: grpo, arpo, aepo, appo). Returns TRL's 8-tuple with
  the exact sampled ids, `tool_mask` = 1 on sampled tokens only, sampler logprobs (NaN on tool tokens), and
  re-emits TRL's generation metrics plus `branch/*` and `tools/*`. Weights are synced to the vLLM server once
  per round, on every rank, before the first request.
- `_calculate_rewards`: unchanged, but the gathered rewards are kept for the strategy's advantages.
- `_generate_and_score_completions`: calls TRL once, then lets the strategy replace the advantages (APPO's
  dual-group (B, T) advantages) and removes the rows that must not reach the loss (APPO's branch rows), with
  `num_items_in_batch` recomputed as the global mask sum of the remaining rows.
- `_compute_loss`: TRL's own loss for `loss_mode=clip`; `appo_trl.trainer.loss` for dual_clip, future_kl and
  entropy_balanced (and for AEPO's entropy-aware advantage).

Groups never cross ranks (`APPOConfig` validates the batch shape) and no collective runs inside a
variable-length loop: every rank issues the same gathers per round and per micro-step.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math

import torch
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from appo_trl.reporting.console import canonical_metrics, install_step_line
from appo_trl.reporting.rollout_dump import dump_round
from appo_trl.trainer.config import APPOConfig
from appo_trl.trainer.environments import check_environments, generate_with_environments
from appo_trl.trainer.loss import compute_policy_loss
from appo_trl.trainer.rows import pad_rows, select_rows
from appo_trl.trainer.strategies import STRATEGIES, GRPOStrategy, RoundBatch
from appo_trl.trainer.weight_sync import prepare_vllm_server

logger = logging.getLogger(__name__)


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


def build_rollout_engine(trainer):
    """The rollout engine the config asks for: tools from `tools`/`tool_config`, backend from `use_vllm`.

    `use_vllm=True` samples through vLLM's HTTP server at `vllm_server_base_url` (or host:port) in server mode,
    or through TRL's in-process engine (`trainer.vllm_generation.llm`) in colocate mode; otherwise the policy
    samples in-process (`TransformersBackend`).
    """
    from appo_trl.rollout import RolloutConfig, RolloutEngine, TransformersBackend, VLLMServerBackend
    from appo_trl.tools import ToolExecutor, build_tools

    args = trainer.args
    tools = trainer._appo_tools
    if tools is None:
        tool_config = json.loads(args.tool_config) if isinstance(args.tool_config, str) else args.tool_config
        tools = build_tools(trainer.tool_specs, tool_config or {}, trainer.tool_format, trainer._tool_dirs)
    trainer._appo_tools = None  # built once; a second engine (after close) builds fresh tools
    if args.use_vllm and args.vllm_mode == "colocate":
        from appo_trl.rollout.vllm_colocate import VLLMColocateBackend

        llm = trainer.vllm_generation.llm
        backend = VLLMColocateBackend(llm, sleep_mode=args.vllm_enable_sleep_mode)
        max_model_len = llm.llm_engine.model_config.max_model_len
    elif args.use_vllm:
        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        backend = VLLMServerBackend(base_url, max_concurrency=args.rollout_concurrency)
    else:
        backend = TransformersBackend(trainer.model, trainer._tokenizer, accelerator=trainer.accelerator)
    # prompt + completion must fit the sampler: the colocated engine's length, vLLM's --max-model-len when given,
    # else the model's positions
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        max_model_len = args.vllm_max_model_length or getattr(
            trainer.model.config, "max_position_embeddings", None) or 32768  # fmt: skip
    config = RolloutConfig(
        max_completion_length=args.max_completion_length,
        max_model_len=max_model_len,
        call_limit=args.tool_call_limit,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k if args.top_k else -1,
        tool_tags=(list(tools) if trainer.tool_format == "tags" else None) or ["python", "search"],
        entropy_topk=args.entropy_topk,
        entropy_window=args.entropy_tokens,
        record_entropies=(args.rollout_strategy == "appo" and args.branch_entropy_source == "sampler_topk")
        or (args.rollout_strategy == "aepo" and args.dynamic_rollouts),
        hook_mode=args.arpo_entropy_timing,
        concurrency=args.rollout_concurrency,
    )
    return RolloutEngine(
        backend, trainer._tokenizer, config, ToolExecutor(tools, max_workers=args.rollout_concurrency),
        chat=trainer.chat_tool_format,
    )  # fmt: skip


class APPOTrainer(GRPOTrainer):
    """GRPO, ARPO, AEPO and APPO for tool-using LLMs, as one `GRPOTrainer` subclass.

    Same constructor as `GRPOTrainer`, with TRL's `tools=`: a list of Python functions (sync or async, typed,
    with a Google-style docstring), built-in names (`python`, `search`) or dotted import paths; or set
    `APPOConfig.tools` instead (not both). With `tool_format="chat"` (the default for functions) the schemas are
    rendered by the chat template and calls are `<tool_call>` JSON, as in TRL; `"tags"` is ARPO's format. Every
    tool is checked here, before the model loads. Plus `rollout_engine`: an object with the
    `appo_trl.rollout.RolloutEngine` interface (`rollout`, `branch_many`, `run`), built from the config when
    omitted, and `tool_dirs`: folders searched first for dotted tool paths (default: the folder of the recipe
    `appo train` parsed, then the working directory). TRL's `environment_factory` works with every strategy
    (`appo_trl.trainer.environments`: one instance per trajectory, branches included); `rollout_func` is not
    supported.
    """

    _tag_names = ["trl", "grpo", "appo", "appo-trl"]
    _name = "APPO"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: APPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        rollout_engine=None,
        tool_dirs=(),
        environment_factory=None,
    ):
        if not isinstance(args, APPOConfig):
            raise TypeError("APPOTrainer needs an APPOConfig (it carries the strategy, tools and loss settings).")
        self._resolve_tool_specs(args, tools, tool_dirs)  # fails here, before the model loads
        if environment_factory is not None:  # environment methods are chat-template tools, as in TRL
            if args.tool_format == "tags":
                raise ValueError("environment_factory: environment methods are chat-template tools (as in TRL); "
                                 "set tool_format: chat (tags is ARPO's tag format for built-in tools)")  # fmt: skip
            self.tool_format = "chat"
        from appo_trl.configs.preflight import check_reward_columns  # before the model loads

        check_reward_columns(reward_funcs if isinstance(reward_funcs, list) else [reward_funcs], train_dataset)
        with prepare_vllm_server(args):  # server checks; disk weight sync on a CPU trainer/server (else TRL's NCCL)
            super().__init__(
                model=model,
                reward_funcs=resolve_reward_funcs(reward_funcs),
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                peft_config=peft_config,
                environment_factory=environment_factory,
            )
        if self._custom_loss and self._entropy_bonus_enabled:
            raise ValueError(f"loss_mode={args.loss_mode} does not add TRL's entropy bonus; set entropy_coef=0.")
        self._setup_chat_tools(train_dataset)
        check_environments(self)
        self._env_inputs = None
        from appo_trl.reporting.hub import strategy_card

        self._name, self._paper = strategy_card(args.rollout_strategy)  # model card: this strategy's paper
        self._tag_names = ["trl", "appo-trl", args.rollout_strategy]
        self.strategy = STRATEGIES[args.rollout_strategy](self)
        self.eval_strategy = GRPOStrategy(self)  # validation: no branching (as the released code: n = 1, no branching)
        self._rollout_engine = rollout_engine
        # in-process GRPO without tools and without an injected engine is exactly TRL's own sampler: keep it
        self._trl_sampler = (
            args.rollout_strategy == "grpo"
            and not self.tool_specs
            and not args.use_vllm
            and rollout_engine is None
            and self.environment_factories is None
        )
        if args.dump_rollouts and self._trl_sampler:
            raise ValueError(
                "dump_rollouts needs appo-trl's rollout engine, but grpo without tools runs TRL's own sampler: "
                "enable a tool (tools: [python]) or use TRL's log_completions instead."
            )
        install_step_line(self)  # one readable console line per step; the trackers still get every metric
        self._tool_idle_rounds = 0
        self._round: RoundBatch | None = None
        self._round_rewards: torch.Tensor | None = None
        self._round_index = 0
        self._old_logps_cache: list[torch.Tensor] | None = None

    def _resolve_tool_specs(self, args, tools, tool_dirs) -> None:
        """Resolve and check every tool (names, dotted paths, schemas, parameters) and build them once."""
        from appo_trl.tools.callables import resolve_callables
        from appo_trl.tools.registry import build_tools, default_tool_format

        if tools is not None and not isinstance(tools, (list, tuple)):
            tools = [tools]
        if tools and args.tools:
            raise ValueError(
                "APPOTrainer: pass tools either as APPOTrainer(tools=...) or APPOConfig(tools=...), not both."
            )
        specs = list(tools or args.tools or [])
        if not tool_dirs:  # `appo train --config R`: the recipe's folder, then the working directory
            from appo_trl.configs import recipes

            tool_dirs = [recipes.LAST_RECIPE_DIR] if recipes.LAST_RECIPE_DIR else []
        self._tool_dirs = tuple(tool_dirs)
        self.tool_format = args.tool_format or default_tool_format(specs)
        self.tool_specs = resolve_callables(specs, self._tool_dirs)
        self._appo_tools = None
        if self.tool_specs:
            tool_config = json.loads(args.tool_config) if isinstance(args.tool_config, str) else args.tool_config
            self._appo_tools = build_tools(self.tool_specs, tool_config or {}, self.tool_format, self._tool_dirs)
        elif args.tool_config:
            raise ValueError(f"APPOConfig: tool_config is set ({args.tool_config}) but no tools are configured.")

    def _setup_chat_tools(self, train_dataset) -> None:
        """Chat format: check the template can call tools, learn its markers, and let TRL render the schemas."""
        self.chat_tool_format = None
        if self.tool_format != "chat" or not (self.tool_specs or self.environment_factories):
            return
        from trl.chat_template_utils import supports_tool_calling

        from appo_trl.rollout.chat_format import ChatToolFormat

        if not supports_tool_calling(self.processing_class):
            raise ValueError(
                "tool_format=chat: the model's chat template cannot render a tool-calling conversation "
                "(user -> assistant with tool_calls -> tool); use a tool-capable template or tool_format=tags."
            )
        self.chat_tool_format = ChatToolFormat(self._tokenizer, self.chat_template, self.chat_template_kwargs)
        # TRL's `_tokenize_prompts` renders `self.tools` into every prompt (schemas from get_json_schema); with
        # environments, each row's `_env_tools[name]`: the standalone tools, then its environment's methods (TRL's)
        standalone = [t.func for t in self._appo_tools.values()] if self._appo_tools else []
        env_methods = list(self.tools) if self.environment_factories is not None else []
        self.tools, self._standalone_tools = standalone + env_methods, standalone
        for name in getattr(self, "_env_tools", None) or {}:
            self._env_tools[name] = standalone + self._env_tools[name]
        if train_dataset is not None and "prompt" in getattr(train_dataset, "column_names", []) and len(train_dataset):
            if not is_conversational({"prompt": train_dataset[0]["prompt"]}):
                raise ValueError(
                    "tool_format=chat needs conversational prompts (lists of messages), so that the chat template "
                    "can render the tool schemas; set a system_prompt or give `prompt` as messages."
                )

    @property
    def _custom_loss(self) -> bool:
        a = self.args
        return a.loss_mode != "clip" or a.entropy_balanced_advantage or (a.kl_clamp is not None and a.beta != 0.0)

    @property
    def processing_class_tokenizer(self):
        return self._tokenizer

    @property
    def rollout_engine(self):
        if self._rollout_engine is None:
            self._rollout_engine = build_rollout_engine(self)
        return self._rollout_engine

    def train(self, *args, **kwargs):
        """`Trainer.train`, then the engine's loop thread, backend worker and sandbox are shut down (a later
        call restarts them)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            closer = getattr(self._rollout_engine, "close", None)
            if closer is not None:
                closer()

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card, naming the strategy's method and paper, and a local base model by its path."""
        import os

        from trl.trainer.utils import get_config_model_id

        from appo_trl.reporting.hub import fix_local_base_model

        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            base = get_config_model_id(self.model.config)
            fix_local_base_model(os.path.join(self.args.output_dir, "README.md"), base)

    # ---- generation ------------------------------------------------------------------------------------------
    def _round_seed(self) -> int:
        self._round_index += 1
        parts = (self.args.seed, self.state.global_step, self.accelerator.process_index, self._round_index)
        return hash(parts) % (2**31)

    def _generate(self, prompts: list):
        if self._trl_sampler:
            return super()._generate(prompts)
        mode = "train" if self.model.training else "eval"
        n = self.num_generations if mode == "train" else self.num_generations_eval
        prompts = copy.deepcopy(prompts)
        prompt_ids, _, _ = self._tokenize_prompts(prompts)
        # sleep mode (colocate) level 2 dropped the weights after the last round: TRL's generate re-pushes them too
        asleep = getattr(self.vllm_generation, "_llm_weights_sleeping", False) if self.use_vllm else False
        if self.use_vllm and (self.state.global_step != self._last_loaded_step or asleep):
            self.vllm_generation.sync_weights()  # once per round, on every rank, before any request
            self._last_loaded_step = self.state.global_step
        strategy = self.strategy if mode == "train" else self.eval_strategy
        backend = getattr(self.rollout_engine, "backend", None)
        with getattr(backend, "awake", contextlib.nullcontext)():  # colocate sleep mode: the KV cache is awake
            if self.environment_factories is not None:  # TRL's environment_factory: one instance per trajectory
                batch = generate_with_environments(self, strategy, prompt_ids, n, self._round_seed())
            else:
                batch = strategy.generate(prompt_ids[::n], n, self._round_seed())
        if getattr(backend, "sleep_mode", False):  # `awake` slept at level 2: TRL's own flag, set as its generate does
            self.vllm_generation._llm_weights_sleeping = True
        rows = batch.rows
        if len(rows) != len(prompts) or any(len(g) != n for g in batch.groups):
            raise RuntimeError(f"strategy {strategy.name} returned {len(rows)} rows for {len(prompts)} prompts")
        completion_ids = [list(t.completion_ids) for t in rows]
        tool_mask = [[int(m) for m in t.loss_mask] for t in rows]
        logprobs = [[float(x) for x in t.logprobs] for t in rows]
        for i in range(len(rows)):
            if not len(completion_ids[i]) == len(tool_mask[i]) == len(logprobs[i]):
                raise RuntimeError(f"row {i}: completion_ids, loss_mask and logprobs lengths differ")
        texts = self._tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if self.chat_tool_format is not None:  # TRL's tool-loop shape: assistant (tool_calls), tool, ..., assistant
            completions = [self.chat_tool_format.completion_messages(t) for t in rows]
        elif is_conversational({"prompt": prompts[0]}):
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            completions = texts
        extra_fields = {
            "num_tool_calls": [int(t.num_calls) for t in rows],
            "branch_origin": [str(t.meta.get("origin", "root")) for t in rows],
            "branch_pos": [-1 if t.branch_pos is None else int(t.branch_pos) for t in rows],
        }
        self._log_round(mode, strategy, batch, [list(t.prompt_ids) for t in rows], completion_ids, tool_mask)
        self._round = batch
        if batch.info.get("old_logps") is not None:  # rows without cached logps get ratio 1 (they are dropped)
            nan0 = [torch.nan_to_num(torch.tensor(lp, dtype=torch.float32), nan=0.0) for lp in logprobs]
            self._old_logps_cache = [c if c is not None else nan0[i] for i, c in enumerate(batch.info["old_logps"])]
        row_prompt_ids = [list(t.prompt_ids) for t in rows]
        return row_prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, None, []

    def _log_round(self, mode, strategy, batch, prompt_ids, completion_ids, tool_mask):
        """TRL's generation metrics (counted on sampled tokens) plus `tools/*` and `branch/*`; fixed collectives."""
        device, gather, m = self.accelerator.device, self.accelerator.gather, self._metrics[mode]
        rows = batch.rows
        prompt_len = gather(torch.tensor([len(p) for p in prompt_ids], device=device))
        full_len = gather(torch.tensor([len(c) for c in completion_ids], device=device))
        sampled = gather(torch.tensor([sum(t) for t in tool_mask], device=device))
        new_tokens = gather(
            torch.tensor([sum(m[r.branch_pos or 0 :]) for m, r in zip(tool_mask, rows)], device=device)
        )
        truncated = gather(torch.tensor([t.finish_reason == "length" for t in rows], device=device))
        calls = gather(torch.tensor([int(t.num_calls) for t in rows], device=device))
        kept = gather(torch.tensor([float(k) for k in batch.keep], device=device))
        if mode == "train":
            self.state.num_input_tokens_seen += (prompt_len.sum() + full_len.sum()).item()
        m["num_tokens"] = [self.state.num_input_tokens_seen]
        m["completions/mean_length"].append(sampled.float().mean().item())
        m["completions/min_length"].append(sampled.float().min().item())
        m["completions/max_length"].append(sampled.float().max().item())
        m["completions/clipped_ratio"].append(truncated.float().mean().item())
        terminated = sampled[~truncated.bool()].float()  # TRL's keys: lengths of completions that ended
        terminated = terminated if terminated.numel() else torch.zeros(1, device=device)
        m["completions/mean_terminated_length"].append(terminated.mean().item())
        m["completions/min_terminated_length"].append(terminated.min().item())
        m["completions/max_terminated_length"].append(terminated.max().item())
        m["tools/call_frequency"].append(calls.float().mean().item())  # executed calls: `tools/calls` (engine)
        if mode == "train":
            self._warn_if_no_tool_calls(int(calls.sum().item()), strategy.name)
        m["rollout/sampled_tokens"].append(new_tokens.sum().item())  # branch prefixes counted once, in the parent
        m["branch/loss_rows_frac"].append(kept.mean().item())
        engine = self._rollout_engine
        if engine is not None and hasattr(engine, "metrics"):  # local engine/tool statistics (no collective)
            for key, value in canonical_metrics(engine.metrics()).items():  # one name per quantity
                if isinstance(value, (int, float)):
                    m[key if "/" in key else f"rollout/{key}"].append(float(value))
            if hasattr(engine, "reset_metrics"):
                engine.reset_metrics()
        if strategy.metric_keys:
            values = [batch.metrics.get(k, math.nan) for k in strategy.metric_keys]
            agg = gather(torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(0))
            for key, value in zip(strategy.metric_keys, agg.nanmean(dim=0).tolist()):
                m[key].append(value)

    def _warn_if_no_tool_calls(self, total_calls: int, strategy: str) -> None:
        """Say so when tools are configured but no rollout of a whole round called one (first idle round of a run
        of idle rounds, then every 10th): for arpo/aepo/appo that round could not branch after a tool result."""
        if not self.tool_specs:
            return
        if total_calls > 0:
            self._tool_idle_rounds = 0
            return
        self._tool_idle_rounds += 1
        if self._tool_idle_rounds == 1 or self._tool_idle_rounds % 10 == 0:
            names = ", ".join(sorted(self._tool_names()))
            what = {
                "grpo": "",
                "appo": " APPO still branches at high-entropy tokens, but no branch follows a tool result.",
            }.get(strategy, f" {strategy.upper()} branches only after tool results: no branching happened.")
            logger.warning(
                "No rollout called a tool (%s) in %d round(s) in a row (step %d, tool_format=%s).%s Check the "
                "system prompt / chat template, or cold-start the model with `appo sft`.",
                names, self._tool_idle_rounds, self.state.global_step, self.tool_format, what,
            )  # fmt: skip

    def _tool_names(self) -> list[str]:
        from appo_trl.tools.callables import tool_label

        return [s if isinstance(s, str) else getattr(s, "__name__", tool_label(s)) for s in self.tool_specs]

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """TRL's forward, except TRL's old-logp pass of an APPO round: it is served from the branch-selection forward.

        That pass is the only no-grad, entropy-free call on the whole generation batch during
        `_generate_and_score_completions`; the cache holds one row per batch row and is used once.
        """
        cache = self._old_logps_cache
        if (
            cache is not None
            and not compute_entropy
            and not torch.is_grad_enabled()
            and input_ids.size(0) == len(cache)
        ):
            self._old_logps_cache = None
            out = torch.zeros(len(cache), logits_to_keep)
            for i, row in enumerate(cache):
                width = min(len(row), logits_to_keep)
                out[i, :width] = row[:width]
            return out.to(input_ids.device), None, None
        return super()._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            **kwargs,
        )

    def score_trajectories(self, trajectories) -> dict[str, torch.Tensor]:
        """No-grad trainer forward on trajectories: per-token logps and exact entropies, (R, T) on CPU."""
        prompts = [list(t.prompt_ids) for t in trajectories]
        width = max(len(p) for p in prompts)
        pad_id = self._tokenizer.pad_token_id
        prompt_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        completion_ids = pad_rows([list(t.completion_ids) for t in trajectories], pad_id)
        completion_mask = pad_rows([[1] * len(t.completion_ids) for t in trajectories], 0)
        device = self.accelerator.device
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).to(device)
        with torch.no_grad():
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
                compute_entropy=True,
            )
        mask = completion_mask.to(device)
        return {"logps": (logps * mask).float().cpu(), "entropies": (entropies * mask).float().cpu()}

    # ---- scoring ---------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._round_rewards = rewards_per_func  # gathered (N_global, F), for the strategy's advantages
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._env_inputs = inputs  # the rows TRL resets the environments with (fresh instances reuse them)
        out = super()._generate_and_score_completions(inputs)
        batch, rewards_per_func = self._round, self._round_rewards
        self._round = self._round_rewards = self._old_logps_cache = None
        if batch is None:  # TRL's own sampler ran (grpo without tools)
            return out
        mode = "train" if self.model.training else "eval"
        strategy = self.strategy if mode == "train" else self.eval_strategy
        num_rows = len(inputs)
        start = self.accelerator.process_index * num_rows
        local = rewards_per_func[start : start + num_rows]
        rewards = (local * self.reward_weights.to(local.device).unsqueeze(0)).nansum(dim=1)
        out["advantages"] = strategy.advantages(batch, rewards, out["advantages"], out["completion_ids"].size(1))
        if mode == "train" and self.args.dump_rollouts:  # sample groups for `appo rollouts OUTPUT_DIR`
            dump_round(self, inputs, batch, rewards, out)
        if not all(batch.keep):
            keep = torch.tensor([i for i, k in enumerate(batch.keep) if k], dtype=torch.long)
            out = select_rows(out, keep, num_rows)
            mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
            out["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        return out

    # ---- loss ------------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        if not self._custom_loss:
            return super()._compute_loss(model, inputs)
        return compute_policy_loss(self, model, inputs)
