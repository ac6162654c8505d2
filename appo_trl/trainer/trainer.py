"""`APPOTrainer`: TRL's `GRPOTrainer` with the agentic tool loop, branching rollouts and branch-aware losses.

Override points of TRL's `GRPOTrainer`; everything else is TRL's:

- `__init__`: TRL 1.16's signature and order; no `args` or a plain `GRPOConfig` become an `APPOConfig`, and a
  `rollout_func` runs on TRL's own sampler for grpo (`trl_compat`). TRL's `tools=` (functions, built-in names,
  dotted paths), resolved and checked before the model loads; `tool_format: chat` renders their schemas into
  prompts through TRL's own `_tokenize_prompts` (`self.tools`) and hands completions to rewards in TRL's
  tool-loop message shape.
- `_generate(prompts)`: (for in-process `grpo` with no `tools`, TRL's own sampler runs unchanged) replaces TRL's sampler and tool loop with `appo_trl.rollout`'s engine, driven by the
  configured strategy (`appo_trl.trainer.strategies.STRATEGIES`: grpo, arpo, aepo, appo). Returns TRL's 8-tuple with
  the exact sampled ids, `tool_mask` = 1 on sampled tokens only, sampler logprobs (NaN on tool tokens), and
  re-emits TRL's generation metrics plus `branch/*` and `tools/*`. Weights are synced to the vLLM server once
  per round, on every rank, before the first request. With `max_staleness >= 1` the round was generated in the
  background while the previous one trained (`appo_trl.trainer.async_rounds`: bound, sync points, correction).
- `_calculate_rewards`: TRL's, with every reward function's output checked (`reward_checks`: a string names the
  function; `max_nan_reward_steps` rounds in a row without any reward stop the run); the gathered rewards are
  kept for the strategy's advantages.
- `_generate_and_score_completions`: calls TRL once, then lets the strategy replace the advantages (APPO's
  dual-group (B, T) advantages) and removes the rows that must not reach the loss (APPO's branch rows), with
  `num_items_in_batch` recomputed as the global mask sum of the remaining rows.
- `_get_per_token_logps_and_entropies`: with `tree_forward` (default) every trainer forward (loss, old-logp,
  reference, APPO's `score_trajectories`) runs on prefix tries (`appo_trl.trainer.tree`), results in TRL's layout;
  `_prepare_inputs` then shuffles whole groups instead of rows before the micro-batch split.
- `_compute_loss`: TRL's own loss for `loss_mode=clip`; `appo_trl.trainer.loss` for dual_clip, future_kl and
  entropy_balanced (and for AEPO's entropy-aware advantage).

Groups never cross ranks (`APPOConfig` validates the batch shape) and no collective runs inside a
variable-length loop: every rank issues the same gathers per round and per micro-step. With the in-process
sampler under ZeRO-3 / FSDP2 the full weights are gathered once per round (`appo_trl.trainer.sharded`), so the
sampler's and APPO's selection forwards, whose number differs between ranks, run without collectives.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math

import torch
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from appo_trl.reporting.console import canonical_metrics, install_step_line
from appo_trl.reporting.rollout_dump import dump_round
from appo_trl.trainer.async_rounds import (
    behaviour_correction,
    build_async_rounds,
    round_job_factory,
    split_cpu_threads,
)
from appo_trl.trainer.checkpoints import AtomicCheckpointMixin, read_sampler_state, write_sampler_state
from appo_trl.trainer.config import APPOConfig
from appo_trl.trainer.environments import check_environments, generate_with_environments
from appo_trl.trainer.loss import compute_policy_loss
from appo_trl.trainer.rows import group_permutation, pad_rows, permute_rows, select_rows
from appo_trl.trainer.setup import build_rollout_engine, resolve_reward_funcs, resolve_tool_specs, setup_chat_tools
from appo_trl.trainer.sharded import full_weights_for_round
from appo_trl.trainer.strategies import STRATEGIES, GRPOStrategy, RoundBatch
from appo_trl.trainer.weight_sync import generate_round, prepare_vllm_server

logger = logging.getLogger(__name__)


class APPOTrainer(AtomicCheckpointMixin, GRPOTrainer):
    """GRPO, ARPO, AEPO and APPO for tool-using LLMs, as one `GRPOTrainer` subclass.

    Same constructor as `GRPOTrainer`, with TRL's `tools=`: a list of Python functions (sync or async, typed,
    with a Google-style docstring), built-in names (`python`, `search`) or dotted import paths; or set
    `APPOConfig.tools` instead (not both). With `tool_format="chat"` (the default for functions) the schemas are
    rendered by the chat template and calls are `<tool_call>` JSON, as in TRL; `"tags"` is ARPO's format. Every
    tool is checked here, before the model loads. Plus `rollout_engine`: an object with the
    `appo_trl.rollout.RolloutEngine` interface (`rollout`, `branch_many`, `run`), built from the config when
    omitted, and `tool_dirs`: folders searched first for dotted tool paths (default: the folder of the recipe
    `appo train` parsed, then the working directory). Without `args`, an `APPOConfig("<model>-APPO")` is built as
    TRL builds its `GRPOConfig`; a plain `GRPOConfig` is converted to an `APPOConfig` (`rollout_strategy: grpo`).
    TRL's `rollout_func` is served by TRL's own sampler for `rollout_strategy: grpo` without tools and refused
    otherwise (`appo_trl.trainer.trl_compat`). TRL's `environment_factory` works with every strategy
    (`appo_trl.trainer.environments`: one instance per trajectory, branches included). Checkpoints are saved
    atomically and hold the sampler's round counter (`trainer.checkpoints`), so a resumed run samples the
    completions of the uninterrupted one when sampling is in-process and synchronous (README, "Interruptions").
    """

    _tag_names = ["trl", "grpo", "appo", "appo-trl"]
    _name = "APPO"
    _trl_sampler = True  # TRL's `_generate` unless __init__ picks appo-trl's engine (also for object.__new__ fakes)

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
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        rollout_engine=None,
        tool_dirs=(),
    ):
        from appo_trl.trainer.trl_compat import check_rollout_func, resolve_args, row_forward_where_tree_cannot

        args = resolve_args(model, args)  # None -> APPOConfig("<model>-APPO"); a GRPOConfig -> rollout_strategy grpo
        resolve_tool_specs(self, args, tools, tool_dirs)  # fails here, before the model loads
        check_rollout_func(args, rollout_func, bool(self.tool_specs), rollout_engine, environment_factory)
        if rollout_func is not None and args.max_staleness:
            raise ValueError("APPOTrainer: max_staleness >= 1 runs rounds on appo-trl's rollout engine in the "
                             "background; a rollout_func runs on TRL's own sampler. Set max_staleness: 0.")  # fmt: skip
        if environment_factory is not None:  # environment methods are chat-template tools, as in TRL
            if args.tool_format == "tags":
                raise ValueError("environment_factory: environment methods are chat-template tools (as in TRL); "
                                 "set tool_format: chat (tags is ARPO's tag format for built-in tools)")  # fmt: skip
            if args.max_staleness:
                raise ValueError("environment_factory with max_staleness >= 1 is not supported: a background round "
                                 "would reset environments TRL hands to the current round's rewards. Set "
                                 "max_staleness: 0.")  # fmt: skip
            self.tool_format = "chat"
        from appo_trl.configs.preflight import check_reward_columns  # before the model loads

        check_reward_columns(reward_funcs if isinstance(reward_funcs, list) else [reward_funcs], train_dataset)
        with prepare_vllm_server(args) as self.vllm_server:  # the servers (a ServerSpec); TRL's weight sync
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
                quantization_config=quantization_config,
                peft_config=peft_config,
                rollout_func=rollout_func,
                environment_factory=environment_factory,
            )
        self._check_reward_outputs()
        if self._custom_loss and self._entropy_bonus_enabled:
            raise ValueError(f"loss_mode={args.loss_mode} does not add TRL's entropy bonus; set entropy_coef=0.")
        setup_chat_tools(self, train_dataset)
        check_environments(self)
        self._env_inputs = None
        from appo_trl.reporting.hub import strategy_card

        self._name, self._paper = strategy_card(args.rollout_strategy)  # model card: this strategy's paper
        self._tag_names = ["trl", "appo-trl", args.rollout_strategy]
        self.strategy = STRATEGIES[args.rollout_strategy](self)
        self.eval_strategy = GRPOStrategy(self)  # validation: no branching (as the released code: n = 1, no branching)
        self._rollout_engine = rollout_engine
        # in-process GRPO without tools and without an injected engine is exactly TRL's own sampler: keep it
        # (a rollout_func, checked above to be grpo without tools, is served by TRL's own `_generate` as well)
        self._trl_sampler = rollout_func is not None or (
            args.rollout_strategy == "grpo"
            and not self.tool_specs
            and not args.use_vllm
            and rollout_engine is None
            and self.environment_factories is None
            and args.max_staleness == 0
        )
        if args.dump_rollouts and self._trl_sampler:
            raise ValueError(
                "dump_rollouts needs appo-trl's rollout engine, but grpo without tools runs TRL's own sampler: "
                "enable a tool (tools: [python]) or use TRL's log_completions instead."
            )
        row_forward_where_tree_cannot(args, self.model, self.aux_loss_enabled)  # built config: TRL's forward
        if args.tree_forward:
            self._setup_tree_forward()
        install_step_line(self)  # one readable console line per step; the trackers still get every metric
        self._tool_idle_rounds = 0
        self._round: RoundBatch | None = None
        self._round_rewards: torch.Tensor | None = None
        self._round_index = 0
        self._old_logps_cache: list[torch.Tensor] | None = None
        self._sampler = None  # in-process sampler copy (max_staleness >= 1)
        self._round_inputs = None  # the generation batch being scored (identifies background rounds)
        self._async = build_async_rounds(self)  # None unless max_staleness >= 1 (appo_trl.trainer.async_rounds)
        backend = getattr(rollout_engine, "backend", None)
        if self._sampler is not None and getattr(backend, "model", None) is self.model:
            backend.model, backend.accelerator = self._sampler.model, None  # decode with the copy, not the policy

    def _setup_tree_forward(self) -> None:
        """`tree_forward`: tree attention on the policy and the reference model (`appo_trl.trainer.tree_attention`)."""
        from appo_trl.trainer.tree_attention import install_tree_attention

        if self.aux_loss_enabled:
            raise ValueError("tree_forward=True cannot compute the MoE load-balancing loss; set tree_forward=False.")
        install_tree_attention(self.model)
        if self.ref_model is not None:
            install_tree_attention(self.ref_model)

    def _check_reward_outputs(self) -> None:
        """Wrap each reward function so a bad return value names it; count rounds without any reward."""
        from torch import nn

        from appo_trl.trainer.reward_checks import NaNRewardGuard, checked_reward_func

        self._checked_reward_funcs = [  # used by _calculate_rewards only: `reward_funcs` stays the user's
            f if isinstance(f, nn.Module) else checked_reward_func(f, name)
            for f, name in zip(self.reward_funcs, self.reward_func_names)
        ]
        self._nan_reward_guard = NaNRewardGuard(self.args.max_nan_reward_steps)

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
        call restarts them). With the in-process sampler copy (max_staleness >= 1) torch's thread count is split
        between trainer and sampler for the call and restored after it (`async_rounds.split_cpu_threads`)."""
        if self._async is not None:
            self._async.reset()  # a resume loads other weights: the first round syncs and runs on them
        threads = split_cpu_threads() if self._sampler is not None else contextlib.nullcontext()
        with threads:
            try:
                return super().train(*args, **kwargs)
            finally:
                if self._async is not None:
                    self._async.closed = True  # no launch from here on
                closer = getattr(self._rollout_engine, "close", None)
                if closer is not None:
                    closer()  # cancels the requests of a round in flight
                if self._async is not None:
                    self._async.close()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """`Trainer.get_batch_samples`; with max_staleness >= 1 through a lookahead that can peek the next round."""
        if self._async is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batch_samples = self._async.lookahead.pull(epoch_iterator, num_batches)
        return batch_samples, self._get_num_items_in_batch(batch_samples, device)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card, naming the strategy's method and paper, and a local base model by its path."""
        import os

        from trl.trainer.utils import get_config_model_id

        from appo_trl.reporting.hub import fix_local_base_model

        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            base = get_config_model_id(self.model.config)
            fix_local_base_model(os.path.join(self.args.output_dir, "README.md"), base)

    # ---- checkpoints: the sampler's state (its seeds derive from the round counter) ------------------------------
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        if self.args.should_save:
            write_sampler_state(
                output_dir, {"round_index": self._round_index, "tool_idle_rounds": self._tool_idle_rounds}
            )

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)  # called on every resume, before the first round
        if checkpoint is None:
            return
        state = read_sampler_state(checkpoint)
        if state is None:
            logger.warning(
                "%s has no sampler state (saved by an older version): completions after this resume differ from "
                "the uninterrupted run's", checkpoint,
            )  # fmt: skip
            return
        self._round_index = int(state["round_index"])
        self._tool_idle_rounds = int(state.get("tool_idle_rounds", 0))

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
        strategy = self.strategy if mode == "train" else self.eval_strategy

        def sample(seed: int):
            if self.environment_factories is not None:  # TRL's environment_factory: one instance per trajectory
                return generate_with_environments(self, strategy, prompt_ids, n, seed)
            return strategy.generate(prompt_ids[::n], n, seed)

        def own_thread_round():  # max_staleness >= 1, a round on this thread: with vLLM, re-run after a restart
            seed = self._round_seed()  # (args.use_vllm: `behaviour_correction` raises `use_vllm` in-process)
            return generate_round(self, lambda: sample(seed)) if self.args.use_vllm else sample(seed)

        if self._async is not None and mode == "train":  # max_staleness >= 1: the round may come from the background
            batch = self._async.next_round(
                self._round_inputs, self.state.global_step, own_thread_round, round_job_factory(self)
            )
        elif self._async is not None:  # evaluation: the background round finishes and the sampler syncs first
            self._async.before_foreground_round(self.state.global_step)
            batch = own_thread_round()
        else:
            # in-process sampling under ZeRO-3 / FSDP2: weights gathered once on every rank, no collective inside;
            # vLLM: the weight sync once per round (server: the round again, same seed, after a server restart;
            # colocate: the KV cache awake for the round)
            seed = self._round_seed()
            with self._round_weights():
                batch = generate_round(self, lambda: sample(seed))
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
        if mode == "train" and self._async is not None:
            for key, value in self._async.metrics().items():
                self._metrics[mode][key].append(value)
        # rows without cached logps get ratio 1 (they are dropped); background rounds: the proximal forward runs
        if batch.info.get("old_logps") is not None and self._async is None:
            nan0 = [torch.nan_to_num(torch.tensor(lp, dtype=torch.float32), nan=0.0) for lp in logprobs]
            self._old_logps_cache = [c if c is not None else nan0[i] for i, c in enumerate(batch.info["old_logps"])]
        row_prompt_ids = [list(t.prompt_ids) for t in rows]
        return row_prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, None, []

    @contextlib.contextmanager
    def _round_weights(self):
        """In-process sampling: the round's forwards (sampler, APPO's selection) run on weights gathered once.

        See `appo_trl.trainer.sharded`; a vLLM server or an injected engine without such a backend needs nothing.
        """
        hold = getattr(getattr(self.rollout_engine, "backend", None), "unwrapped_for_rollout", None)
        if hold is None:
            yield
            return
        with full_weights_for_round(self) as model, hold(model):
            yield

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
        if self.args.tree_forward:
            from appo_trl.trainer.tree import trainer_tree_forward

            return trainer_tree_forward(
                self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, **kwargs
            )
        return super()._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            **kwargs,
        )

    def _prepare_inputs(self, generation_batch):
        """TRL's, but with `tree_forward` a generation batch is shuffled by groups, not rows, before it is split
        into micro-batches (`rows.group_permutation`), so that a group's rows share their prompt in one forward."""
        if not (self.args.tree_forward and self.model.training):
            return super()._prepare_inputs(generation_batch)
        from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = split_pixel_values_by_grid(batch)
            batch = permute_rows(batch, group_permutation(batch["prompt_ids"], batch["prompt_mask"]))
            batches = split_tensor_dict(batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(b) for b in batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

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
        model, guard = self.model, contextlib.nullcontext()
        if self._async is not None:  # background rounds: the proximal weights, never mid optimizer step
            if self.args.async_fv_policy == "sampler":
                model = self._sampler.model
            else:
                guard = self._async.trainer_forward()
        with guard, torch.no_grad():
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                model,
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
        funcs, self.reward_funcs = self.reward_funcs, self._checked_reward_funcs
        try:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        if self.model.training:
            self._nan_reward_guard.update(rewards_per_func, self.reward_func_names, self.state.global_step)
        self._round_rewards = rewards_per_func  # gathered (N_global, F), for the strategy's advantages
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._round_inputs = inputs
        self._env_inputs = inputs  # the rows TRL resets the environments with (fresh instances reuse them)
        with behaviour_correction(self):  # background rounds in-process: TRL's proximal + importance weight
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
        with behaviour_correction(self):
            if not self._custom_loss:
                return super()._compute_loss(model, inputs)
            return compute_policy_loss(self, model, inputs)
