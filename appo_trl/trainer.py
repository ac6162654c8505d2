"""`APPOTrainer`: TRL's `GRPOTrainer` with the agentic tool loop, branching rollouts and branch-aware losses.

Override points (spec/trl-internals.md §8), everything else is TRL's:

- `_generate(prompts)`: (for in-process `grpo` with no `tools`, TRL's own sampler runs unchanged) replaces TRL's sampler and tool loop with `appo_trl.rollout`'s engine, driven by the
  configured strategy (`appo_trl.strategies.STRATEGIES`: grpo, arpo, aepo, appo). Returns TRL's 8-tuple with
  the exact sampled ids, `tool_mask` = 1 on sampled tokens only, sampler logprobs (NaN on tool tokens), and
  re-emits TRL's generation metrics plus `branch/*` and `tools/*`. Weights are synced to the vLLM server once
  per round, on every rank, before the first request.
- `_calculate_rewards`: unchanged, but the gathered rewards are kept for the strategy's advantages.
- `_generate_and_score_completions`: calls TRL once, then lets the strategy replace the advantages (APPO's
  dual-group (B, T) advantages) and removes the rows that must not reach the loss (APPO's branch rows), with
  `num_items_in_batch` recomputed as the global mask sum of the remaining rows.
- `_compute_loss`: TRL's own loss for `loss_mode=clip`; `appo_trl.trainer_loss` for dual_clip, future_kl and
  entropy_balanced (and for AEPO's entropy-aware advantage).

Groups never cross ranks (`APPOConfig` validates the batch shape) and no collective runs inside a
variable-length loop: every rank issues the same gathers per round and per micro-step.
"""

from __future__ import annotations

import copy
import json
import math

import torch
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from appo_trl.config import APPOConfig
from appo_trl.console import canonical_metrics, install_step_line
from appo_trl.rollout_dump import dump_round
from appo_trl.strategies import STRATEGIES, GRPOStrategy, RoundBatch
from appo_trl.trainer_loss import compute_policy_loss
from appo_trl.trainer_utils import pad_rows, select_rows


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

    `use_vllm=True` (server mode; colocate is rejected by `APPOConfig`) samples through vLLM's HTTP server at
    `vllm_server_base_url` (or host:port); otherwise the policy samples in-process (`TransformersBackend`).
    """
    from appo_trl.rollout import RolloutConfig, RolloutEngine, TransformersBackend, VLLMServerBackend
    from appo_trl.tools import ToolExecutor, build_tools

    args = trainer.args
    tool_config = json.loads(args.tool_config) if isinstance(args.tool_config, str) else args.tool_config
    tools = build_tools(args.tools, tool_config or {})
    if args.use_vllm:
        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        backend = VLLMServerBackend(base_url, max_concurrency=args.rollout_concurrency)
    else:
        backend = TransformersBackend(trainer.model, trainer._tokenizer, accelerator=trainer.accelerator)
    # prompt + completion must fit the sampler: vLLM's --max-model-len when given, else the model's positions
    max_model_len = args.vllm_max_model_length or getattr(
        trainer.model.config, "max_position_embeddings", None) or 32768  # fmt: skip
    config = RolloutConfig(
        max_completion_length=args.max_completion_length,
        max_model_len=max_model_len,
        call_limit=args.tool_call_limit,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k if args.top_k else -1,
        tool_tags=list(tools) or ["python", "search"],
        entropy_topk=args.entropy_topk,
        entropy_window=args.entropy_tokens,
        record_entropies=(args.rollout_strategy == "appo" and args.branch_entropy_source == "sampler_topk")
        or (args.rollout_strategy == "aepo" and args.dynamic_rollouts),
        hook_mode=args.arpo_entropy_timing,
        concurrency=args.rollout_concurrency,
    )
    return RolloutEngine(
        backend, trainer._tokenizer, config, ToolExecutor(tools, max_workers=args.rollout_concurrency)
    )


class APPOTrainer(GRPOTrainer):
    """GRPO, ARPO, AEPO and APPO for tool-using LLMs, as one `GRPOTrainer` subclass.

    Same constructor as `GRPOTrainer` (minus TRL's own tool/environment arguments, replaced by `args.tools`),
    plus `rollout_engine`: an object with the `appo_trl.rollout.RolloutEngine` interface (`rollout`,
    `branch_many`, `run`), built from the config when omitted.
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
        rollout_engine=None,
    ):
        if not isinstance(args, APPOConfig):
            raise TypeError("APPOTrainer needs an APPOConfig (it carries the strategy, tools and loss settings).")
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
        )
        if self._custom_loss and self._entropy_bonus_enabled:
            raise ValueError(f"loss_mode={args.loss_mode} does not add TRL's entropy bonus; set entropy_coef=0.")
        self.strategy = STRATEGIES[args.rollout_strategy](self)
        self.eval_strategy = GRPOStrategy(self)  # validation: no branching (spec/algorithms.md §2.1)
        self._rollout_engine = rollout_engine
        # in-process GRPO without tools and without an injected engine is exactly TRL's own sampler: keep it
        self._trl_sampler = (
            args.rollout_strategy == "grpo" and not args.tools and not args.use_vllm and rollout_engine is None
        )
        if args.dump_rollouts and self._trl_sampler:
            raise ValueError(
                "dump_rollouts needs appo-trl's rollout engine, but grpo without tools runs TRL's own sampler: "
                "enable a tool (tools: [python]) or use TRL's log_completions instead."
            )
        install_step_line(self)  # one readable console line per step; the trackers still get every metric
        self._round: RoundBatch | None = None
        self._round_rewards: torch.Tensor | None = None
        self._round_index = 0
        self._old_logps_cache: list[torch.Tensor] | None = None

    @property
    def _custom_loss(self) -> bool:
        return self.args.loss_mode != "clip" or self.args.entropy_balanced_advantage

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
        if self.use_vllm and self.state.global_step != self._last_loaded_step:
            self.vllm_generation.sync_weights()  # once per round, on every rank, before any request
            self._last_loaded_step = self.state.global_step
        strategy = self.strategy if mode == "train" else self.eval_strategy
        batch = strategy.generate(prompt_ids[::n], n, self._round_seed())
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
        if is_conversational({"prompt": prompts[0]}):
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
