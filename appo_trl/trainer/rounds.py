"""The round runner: the scheduler of `APPOTrainer`'s generation rounds, from TRL's generation batch to a `Round`.

`RoundRunner` owns what scheduling needs (the strategies, the rollout engine, the background scheduler, the seeds,
the sampler copy, the weight sync) and fills the `Round` (`strategies.record`) of the
`_generate_and_score_completions` call in progress; what a round is made of (its prompts' preparation, its sampling,
its completions and extra fields, its rows after scoring, the end) belongs to the sampling path
(`sampling_paths`). The trainer's TRL hooks only delegate here. It does not compute losses or rewards. The walk
through one training step: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from appo_trl import trl_rules
from appo_trl.reporting.console import canonical_metrics
from appo_trl.reporting.rollout_dump import dump_round
from appo_trl.strategies import STRATEGIES, GRPOStrategy, RolloutStrategy, Round
from appo_trl.trainer import trl_seams
from appo_trl.trainer.async_rounds import build_async_rounds, split_cpu_threads
from appo_trl.trainer.rows import select_rows
from appo_trl.trainer.setup import build_rollout_engine
from appo_trl.trainer.sharded import full_weights_for_round
from appo_trl.trainer.stream_rounds import StreamCheckpoint, build_stream_rounds
from appo_trl.trainer.turn_rewards import token_rewards
from appo_trl.trainer.weight_sync import generate_round, held_adapter

logger = logging.getLogger(__name__)


class RoundRunner:
    """Produces the rounds of one `APPOTrainer`; `current` is the round of the scoring call in progress (else None).

    Args:
        trainer: the `APPOTrainer` (its TRL state, tokenizer, accelerator and metrics sink).
        engine: an injected rollout engine, or None to build the configured one on first use.
    """

    def __init__(self, trainer, engine=None):
        self.trainer = trainer
        self.strategy: RolloutStrategy = STRATEGIES[trainer.args.rollout_strategy](trainer)
        self.eval_strategy: RolloutStrategy = GRPOStrategy(trainer)  # validation: no branching (released code)
        self._engine = engine
        self.current: Round | None = None
        self._scoring: tuple | None = None  # (TRL's generation batch, mode) of the scoring call in progress
        self.round_index = 0  # seeds derive from it; checkpointed (`state`)
        self.tool_idle_rounds = 0
        # the sampling path resolved at start-up (`sampling_paths`): every round, foreground or background, is its
        # `sample()`, and the path owns the round's life
        self.path = trainer.sampling_path().bind(self)
        self.stream = build_stream_rounds(trainer, self)  # rollout_stream: groups stream (stream_rounds), else None
        # None unless max_staleness >= 1 without streaming (async_rounds)
        self.async_rounds = build_async_rounds(trainer) if self.stream is None else None
        owner = self.async_rounds if self.async_rounds is not None else self.stream
        self.sampler = owner.sampler if owner is not None else None  # the in-process sampler copy, or None
        self.gate = self.stream.gate if self.stream is not None else None  # its decode steps (streaming in process)
        backend = getattr(engine, "backend", None)
        if self.sampler is not None and getattr(backend, "model", None) is trainer.model:
            backend.model, backend.accelerator = self.sampler.model, None  # decode with the copy, not the policy
            if self.gate is not None:
                backend.gate = self.gate

    @property
    def engine(self):
        if self._engine is None:
            sampler_model = self.sampler.model if self.sampler is not None else None
            clock = self.stream.clock if self.stream is not None else None
            self._engine = build_rollout_engine(self.trainer, sampler_model=sampler_model, clock=clock,
                                                gate=self.gate)  # fmt: skip
        return self._engine

    @property
    def lookahead(self):
        """The `BatchLookahead` the trainer's batches go through (background rounds, streaming), else None."""
        owner = self.async_rounds if self.async_rounds is not None else self.stream
        return None if owner is None else owner.lookahead

    def stream_inputs(self, inputs):
        """rollout_stream, training: TRL's generation batch -> the rows of the groups the stream hands over."""
        if self.stream is None or not self.trainer.model.training:
            return inputs
        return self.stream.inputs_for(inputs)

    # ---- seeds and checkpoints ------------------------------------------------------------------------------
    def next_seed(self) -> int:
        t = self.trainer
        self.round_index += 1
        return hash((t.args.seed, t.state.global_step, t.accelerator.process_index, self.round_index)) % (2**31)

    def state(self) -> dict:
        state = {"round_index": self.round_index, "tool_idle_rounds": self.tool_idle_rounds}
        if self.stream is not None:  # the groups carried over from earlier batches (rollout_stream)
            state["stream"] = self.stream.checkpoint(self.trainer.state.global_step).to_json()
        return state

    def load_state(self, state: dict) -> None:
        self.round_index = int(state["round_index"])
        self.tool_idle_rounds = int(state.get("tool_idle_rounds", 0))
        if "stream" in state:
            carried = StreamCheckpoint.from_json(state["stream"])
            if self.stream is not None:
                self.stream.restore(carried)
            elif carried.groups:
                logger.warning("[resume] the checkpoint holds %d group(s) a rollout_stream run carried over; this run "
                               "does not stream (rollout_stream: false), so they are not sampled again",
                               len(carried.groups))  # fmt: skip

    # ---- spans ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def training(self):
        """Around `Trainer.train`: background rounds reset (a resume loads other weights), torch's threads split with
        the sampler copy; on exit (Ctrl-C included) no launch, the engine closed (cancelling a round in flight), the
        round thread joined."""
        rounds = self.async_rounds
        if rounds is not None:
            rounds.reset()
        if self.stream is not None:
            self.stream.reset()
        with split_cpu_threads() if self.sampler is not None else contextlib.nullcontext():
            try:
                yield
            finally:
                if rounds is not None:
                    rounds.closed = True
                if self.stream is not None:
                    self.stream.close()  # no group starts; those in flight are cancelled with the engine
                self.path.close()
                closer = getattr(self._engine, "close", None)
                if closer is not None:
                    closer()
                if rounds is not None:
                    rounds.close()

    @contextlib.contextmanager
    def scoring(self, inputs):
        """The span of one `_generate_and_score_completions` call: its round is `current` from its hand-over to TRL
        (`generate`) to `finish`, cleared on any exit (TRL's own sampler: no round)."""
        self._scoring, self.current = (inputs, "train" if self.trainer.model.training else "eval"), None
        try:
            yield
        finally:
            self._scoring, self.current = None, None

    @contextlib.contextmanager
    def behaviour_correction(self):
        """Within: TRL's behaviour-policy correction applies to the in-process sampler copy too.

        TRL computes the proximal old logps and the importance weight under `if self.use_vllm and
        self.vllm_importance_sampling_correction`; rows of `SamplerCopy` come from a separate sampler like a server,
        so the flag is raised for the span of TRL's scoring and loss (background rounds, and streaming in process).
        Without a sampler copy, or with vLLM, this does nothing.
        """
        trainer = self.trainer
        if self.sampler is None or trainer.args.use_vllm:
            yield
            return
        with trl_seams.trl_importance_correction(trainer):
            yield

    @contextlib.contextmanager
    def round_weights(self):
        """In-process sampling: the round's forwards (sampler, APPO's selection) run on weights gathered once
        (`appo_trl.trainer.sharded`); a vLLM server or an engine without such a backend needs nothing."""
        hold = getattr(getattr(self.engine, "backend", None), "unwrapped_for_rollout", None)
        if hold is None:
            yield
            return
        with full_weights_for_round(self.trainer) as model, hold(model):
            yield

    @contextlib.contextmanager
    def selection_forward(self):
        """The model APPO's branch-selection forward runs on: the policy; with background rounds the proximal weights,
        never mid optimizer step (`AsyncRounds.trainer_forward`), or the sampler copy (`async_fv_policy: sampler`)."""
        trainer, rounds = self.trainer, self.async_rounds
        if rounds is None:
            yield trainer.model
        elif trainer.args.async_fv_policy == "sampler":
            yield self.sampler.model
        else:
            with rounds.trainer_forward():
                yield trainer.model

    # ---- the round's data, hook by hook ---------------------------------------------------------------------
    def old_logps_for(self, model, input_ids, logits_to_keep: int, compute_entropy: bool) -> torch.Tensor | None:
        """The current round's cached old logps, for TRL's no-grad, entropy-free old-logp forward of its own rows."""
        rnd = self.current
        if rnd is None or rnd.old_logps is None or compute_entropy or torch.is_grad_enabled():
            return None
        if model is not self.trainer.model:
            return None
        return rnd.take_old_logps(input_ids, logits_to_keep)

    def record_rewards(self, rewards_per_func: torch.Tensor) -> None:
        if self.current is not None:
            self.current.rewards = rewards_per_func  # gathered (N_global, F), for the strategy's advantages

    def record_turn_rewards(self, name: str, row: int, values: list[float]) -> None:
        if self.current is not None:
            self.current.turn_rewards[(name, row)] = values

    def generate(self, prompts: list) -> tuple:
        """TRL's `_generate` contract: (prompt ids, completion ids, tool mask, completions, sampler logprobs, extra
        fields, None, []) with the exact sampled ids; the current round keeps the rows, ids and version."""
        t = self.trainer
        inputs, mode = self._scoring or (None, "train" if t.model.training else "eval")
        n = t.num_generations if mode == "train" else t.num_generations_eval
        strategy = self.strategy if mode == "train" else self.eval_strategy
        self.path.prepare(strategy, prompts, n)
        prompt_ids = trl_seams.tokenize_prompts(t, prompts)
        if self.stream is not None and mode == "train":  # the groups `stream_inputs` handed over
            rnd, version = self.stream.take_round(inputs)
        else:
            rnd, version = self._sample(inputs, mode, strategy, prompt_ids, n)
        self.path.hand_over(rnd, mode, prompts)  # trainer's thread: an agent's metrics, a round's own environments
        rows = rnd.rows
        if len(rows) != len(prompts) or any(len(g) != n for g in rnd.groups):
            raise RuntimeError(f"strategy {strategy.name} returned {len(rows)} rows for {len(prompts)} prompts")
        completion_ids = [list(r.completion_ids) for r in rows]
        tool_mask = [[int(m) for m in r.loss_mask] for r in rows]
        logprobs = [[float(x) for x in r.logprobs] for r in rows]
        for i in range(len(rows)):
            if not len(completion_ids[i]) == len(tool_mask[i]) == len(logprobs[i]):
                raise RuntimeError(f"row {i}: completion_ids, loss_mask and logprobs lengths differ")
        texts = t.processing_class_tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions, extra_fields = self.path.completions(rows, texts, prompts), self.path.extra_fields(rows)
        row_prompt_ids = [list(r.prompt_ids) for r in rows]
        self._log(mode, strategy, rnd, row_prompt_ids, completion_ids, tool_mask)
        rnd.inputs, rnd.mode, rnd.policy_version = inputs, mode, version
        rnd.prompt_ids, rnd.completion_ids = row_prompt_ids, completion_ids
        if self._scoring is not None:
            self.current = rnd
        if mode == "train" and self.async_rounds is not None:
            for key, value in self.async_rounds.metrics().items():
                trl_seams.log_metric(t, mode, key, value)
        if mode == "train" and self.stream is not None:
            for key, value in self.stream.metrics.items():
                trl_seams.log_metric(t, mode, key, value)
        # rows without cached logps get ratio 1 (they are dropped); background rounds: the proximal forward runs
        if rnd.selection_logps is not None and self.async_rounds is None and trl_rules.runs_old_logp_pass(t):
            nan0 = [torch.nan_to_num(torch.tensor(lp, dtype=torch.float32), nan=0.0) for lp in logprobs]
            rnd.old_logps = [c if c is not None else nan0[i] for i, c in enumerate(rnd.selection_logps)]
        return row_prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, None, []

    def _sample(self, inputs, mode: str, strategy, prompt_ids, n: int) -> tuple[Round, int]:
        """The round and the optimizer step of the weights that sampled it."""
        t, rounds = self.trainer, self.async_rounds
        step = t.state.global_step

        def sample(seed: int):
            return self.path.sample(strategy, prompt_ids, n, seed, inputs)

        def own_thread_round():  # max_staleness >= 1, a round on this thread: with vLLM, re-run after a restart
            seed = self.next_seed()  # (args.use_vllm: `behaviour_correction` raises `use_vllm` in-process)
            return generate_round(t, lambda: sample(seed)) if t.args.use_vllm else sample(seed)

        if rounds is not None and mode == "train":  # the round may come from the background
            rnd = rounds.next_round(inputs, step, own_thread_round, self._background_job)
            return rnd, rounds.history[-1].version
        if rounds is not None:  # evaluation: the background round finishes and the sampler syncs first
            rounds.before_foreground_round(step)
            return own_thread_round(), step
        # in-process sampling under ZeRO-3 / FSDP2: weights gathered once on every rank, no collective inside;
        # vLLM: the weight sync once per round (server: the round again, same seed, after a server restart;
        # colocate: the KV cache awake for the round)
        if self.stream is not None:  # evaluation while groups stream: the weights move in flight, as at a hand-over
            self.stream.sync_to(step)
        seed = self.next_seed()
        with self.round_weights():
            return generate_round(t, lambda: sample(seed)), step

    def _background_job(self, inputs):
        """On the trainer's thread: tokenise generation batch `inputs` and fix its seed; the returned job samples the
        round on the round's thread (`AsyncRounds.next_round`'s `make_job`)."""
        trainer = self.trainer
        job = self.path.background_job(self.strategy, inputs, trainer.num_generations, self.next_seed())

        def held_job():  # LoRA adapter-only sync: the round keeps the adapter version it starts on
            with held_adapter(trainer):
                return job()

        return held_job

    def finish(self, out: dict) -> dict:
        """TRL's scored batch of the current round, then the strategy's advantages, the path's `after_scoring` (an
        agent's other chains) and without the rows that must not reach the loss (with `num_items_in_batch` the
        global mask sum of the remaining rows). TRL's own sampler (no round): unchanged."""
        t, rnd = self.trainer, self.current
        if rnd is None:
            return out
        strategy = self.strategy if rnd.mode == "train" else self.eval_strategy
        num_rows = len(rnd.inputs)
        start = t.accelerator.process_index * num_rows
        local = rnd.rewards[start : start + num_rows]
        rewards = trl_rules.scored_rewards(t, local)  # NaN: unscorable (TRL's rule), in no baseline, advantage 0
        if rnd.turn_rewards:  # per-turn rewards: each on its turn's last token (the tree estimator reads them)
            rnd.token_rewards = token_rewards(t, rnd.rows, local, rnd.turn_rewards, out)
        advantages = strategy.advantages(rnd, rewards, out["advantages"], out["completion_ids"].size(1))
        out["advantages"] = trl_rules.zero_unscorable(advantages, rewards)
        if rnd.mode == "train" and t.args.dump_rollouts:  # sample groups for `appo rollouts OUTPUT_DIR`
            dump_round(t, rnd.inputs, rnd, rewards, out)
        out, keep = self.path.after_scoring(out, rnd, list(rnd.keep))
        if self.path.reshapes_rows or not all(keep):  # (every rank alike, whatever its own rows)
            out = select_rows(out, torch.tensor([i for i, k in enumerate(keep) if k], dtype=torch.long), len(keep))
            mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
            out["num_items_in_batch"] = t.accelerator.gather(mask.sum()).sum()
        return out

    # ---- metrics ----------------------------------------------------------------------------------------------
    def _log(self, mode, strategy, rnd: Round, prompt_ids, completion_ids, tool_mask) -> None:
        """TRL's generation metrics (counted on sampled tokens) plus `tools/*` and `branch/*`; fixed collectives."""
        t = self.trainer
        device, gather, m = t.accelerator.device, t.accelerator.gather, trl_seams.step_metrics(t, mode)
        rows = rnd.rows
        prompt_len = gather(torch.tensor([len(p) for p in prompt_ids], device=device))
        full_len = gather(torch.tensor([len(c) for c in completion_ids], device=device))
        sampled = gather(torch.tensor([sum(x) for x in tool_mask], device=device))
        new_tokens = gather(
            torch.tensor([sum(x[r.branch_pos or 0 :]) for x, r in zip(tool_mask, rows)], device=device)
        )
        truncated = gather(torch.tensor([r.finish_reason == "length" for r in rows], device=device))
        calls = gather(torch.tensor([int(r.num_calls) for r in rows], device=device))
        refused = gather(torch.tensor([r.finish_reason == "call_limit" for r in rows], device=device))
        kept = gather(torch.tensor([float(k) for k in rnd.keep], device=device))
        trl_rules.log_generation(t, mode, m, prompt_len.sum() + full_len.sum(), sampled, truncated.bool())
        m["tools/call_frequency"].append(calls.float().mean().item())  # executed calls: `tools/calls` (engine)
        if mode == "train":
            self._warn_if_no_tool_calls(int(calls.sum().item()), strategy, int(refused.sum().item()))
        m["rollout/sampled_tokens"].append(new_tokens.sum().item())  # branch prefixes counted once, in the parent
        m["branch/loss_rows_frac"].append(kept.mean().item())
        engine = self._engine
        if engine is not None and hasattr(engine, "metrics"):  # local engine/tool statistics (no collective)
            metrics = self.path.tool_metrics(canonical_metrics(engine.metrics()), rows)
            for key, value in metrics.items():  # one name per quantity
                if isinstance(value, (int, float)):
                    m[key if "/" in key else f"rollout/{key}"].append(float(value))
            if hasattr(engine, "reset_metrics"):
                engine.reset_metrics()
        if strategy.metric_keys:
            values = [rnd.metrics.get(k, math.nan) for k in strategy.metric_keys]
            agg = gather(torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(0))
            for key, value in zip(strategy.metric_keys, agg.nanmean(dim=0).tolist()):
                m[key].append(value)

    def _warn_if_no_tool_calls(self, total_calls: int, strategy, refused: int = 0) -> None:
        """Say so when tools are configured but no rollout of a whole round called one (first idle round of a run
        of idle rounds, then every 10th): for arpo/aepo/appo that round could not branch after a tool result.
        `refused`: rollouts that ended `call_limit` (their calls were refused by the limits, not missing)."""
        t = self.trainer
        if not t.tool_specs:
            return
        if total_calls > 0:
            self.tool_idle_rounds = 0
            return
        self.tool_idle_rounds += 1
        if self.tool_idle_rounds == 1 or self.tool_idle_rounds % 10 == 0:
            from appo_trl.tools.callables import tool_label

            names = ", ".join(sorted(s if isinstance(s, str) else getattr(s, "__name__", tool_label(s))
                                     for s in t.tool_specs))  # fmt: skip
            what = strategy.no_tool_calls_note
            if refused:
                a = t.args
                logger.warning(
                    "No tool call ran (%s) in %d round(s) in a row (step %d): %d rollout(s) called tools, but the "
                    "limits refused the calls (tool_call_limit=%s per rollout, max_tool_calling_iterations=%s turns;"
                    " a turn whose calls would pass either runs none).%s Raise tool_call_limit if the calls are "
                    "wanted.", names, self.tool_idle_rounds, t.state.global_step, refused,
                    a.tool_call_limit, a.max_tool_calling_iterations, what,
                )  # fmt: skip
                return
            logger.warning(
                "No rollout called a tool (%s) in %d round(s) in a row (step %d, tool_format=%s).%s Check the "
                "system prompt / chat template, or cold-start the model with `appo sft`.",
                names, self.tool_idle_rounds, t.state.global_step, t.tool_format, what,
            )  # fmt: skip


__all__ = ["Round", "RoundRunner"]
