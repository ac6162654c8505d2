"""`APPOTrainer`: TRL's `GRPOTrainer` with the agentic tool loop, branching rollouts and branch-aware losses.

Only TRL's override points live here, each a short delegation: sampling to the round runner (`trainer.rounds`), the
losses TRL lacks to `trainer.loss`, the tree forward to `trainer.tree`. Which override does what, in the order TRL
calls them: docs/architecture.md, "One training step".
"""

from __future__ import annotations

import logging

import torch
from trl import GRPOTrainer

from appo_trl.algorithms.rows import pad_rows
from appo_trl.config import APPOConfig
from appo_trl.reporting.console import install_step_line
from appo_trl.strategies.base import TokenScores
from appo_trl.trainer import trl_seams
from appo_trl.trainer.agents import agent_rewards_override
from appo_trl.trainer.checkpoints import AtomicCheckpointMixin, read_sampler_state, write_sampler_state
from appo_trl.trainer.environments import check_environments
from appo_trl.trainer.grad_norms import GradNormWatch
from appo_trl.trainer.loss import compute_policy_loss
from appo_trl.trainer.resume_kind import check_resume_kind
from appo_trl.trainer.rounds import RoundRunner
from appo_trl.trainer.rows import group_permutation, left_pad, permute_rows, split_rows
from appo_trl.trainer.sampling_paths import Given, SamplingPath, TRLSampler, resolve_path
from appo_trl.trainer.setup import has_tools, resolve_reward_funcs, resolve_startup_plan, setup_chat_tools
from appo_trl.trainer.weight_sync import prepare_vllm_server

logger = logging.getLogger(__name__)


class APPOTrainer(AtomicCheckpointMixin, GRPOTrainer):
    """GRPO, ARPO, AEPO and APPO for tool-using LLMs, as one `GRPOTrainer` subclass.

    Same constructor as `GRPOTrainer`, with TRL's `tools=`: a list of Python functions (sync or async, typed,
    with a Google-style docstring), built-in names (`python`, `search`) or dotted import paths; or set
    `APPOConfig.tools` instead (not both). With `tool_format="chat"` (the default for functions) the schemas are
    rendered by the chat template and calls are `<tool_call>` JSON, as in TRL; `"tags"` is ARPO's format. Every
    tool is checked and built here, before the model loads, unless `tools=` is the `appo_trl.configs.plan.StartupPlan`
    `appo train` resolved already. Plus `rollout_engine`: an object with the
    `appo_trl.rollout.RolloutEngine` interface (`rollout`, `branch_many`, `run`), built from the config when
    omitted, and `tool_dirs`: folders searched first for dotted tool paths, before the working directory (a
    recipe's folder: `parse_recipe(...).folder`). Without `args`, an `APPOConfig("<model>-APPO")` is built as
    TRL builds its `GRPOConfig`; a plain `GRPOConfig` is converted to an `APPOConfig` (`rollout_strategy: grpo`).
    TRL's `rollout_func` is served by TRL's own sampler for `rollout_strategy: grpo` without tools and refused
    otherwise (`appo_trl.trainer.sampling_paths`: which sampler serves the rounds is resolved there once, before the
    model loads, and what it cannot honour refused). TRL's `environment_factory` works with every strategy and in
    background rounds (`appo_trl.trainer.environments`: one instance per trajectory, branches included). Checkpoints are saved
    atomically and hold the sampler's round counter (`trainer.checkpoints`), so a resumed run samples the
    completions of the uninterrupted one when sampling is in-process and synchronous (docs/reference.md, "Checkpoints").
    """

    _tag_names = ["trl", "grpo", "appo", "appo-trl"]
    _name = "APPO"
    # the sampling path `__init__` resolves; until then TRL's own (TRL's tests call `_generate` on a trainer built
    # with `object.__new__`, docs/trl-parity.md)
    sampling_path: type[SamplingPath] = TRLSampler

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
        agent=None,
    ):
        from appo_trl.trainer.agents import resolve_agent, with_agent_reward
        from appo_trl.trainer.trl_compat import check_rollout_func, resolve_args, row_forward_where_tree_cannot

        args = resolve_args(model, args)  # None -> APPOConfig("<model>-APPO"); a GRPOConfig -> rollout_strategy grpo
        if args.vllm_sync_adapter == "always" and peft_config is None and not hasattr(model, "peft_config"):
            raise ValueError("vllm_sync_adapter=always sends the LoRA adapter to vLLM, but there is none: pass "
                             "peft_config (use_peft: true), or set vllm_sync_adapter: auto.")  # fmt: skip
        # the user's own agent through the OpenAI-compatible endpoint (`trainer.agents`)
        self.agent = resolve_agent(args, agent, tool_dirs, tools=tools)
        check_rollout_func(rollout_func)
        # which sampler serves the rounds, once, before the model loads; what it cannot honour is refused here
        self.sampling_path = resolve_path(Given(
            args, self.agent, has_tools(args, tools), rollout_func, environment_factory, rollout_engine,
        ))  # fmt: skip
        reward_funcs = with_agent_reward(reward_funcs, args, self.agent)
        resolve_startup_plan(
            self, args, tools, tool_dirs, reward_funcs, train_dataset, environment_factory is not None
        )  # before the model loads
        if environment_factory is not None:  # environment methods are chat-template tools, as in TRL
            self.tool_format = "chat"
        self._env_owns_data = environment_factory is not None and train_dataset is None  # TRL's IncrementEnv pattern
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
        if self._custom_loss and trl_seams.entropy_bonus_enabled(self):
            raise ValueError(f"loss_mode={args.loss_mode} does not add TRL's entropy bonus; set entropy_coef=0.")
        setup_chat_tools(self, train_dataset)
        check_environments(self)
        from appo_trl.reporting.hub import strategy_card

        name, paper = strategy_card(args.rollout_strategy)  # model card: this strategy's paper
        trl_seams.set_card(self, name, paper, ["trl", "appo-trl", args.rollout_strategy])
        row_forward_where_tree_cannot(args, self.model)  # a model the tree cannot serve exactly: TRL's forward
        from appo_trl.tree.forward import PackCache

        self.tree_packs = PackCache()  # rows packed once per batch, for every pass over them (this trainer's)
        if args.tree_forward:
            self._setup_tree_forward()
        install_step_line(self)  # one readable console line per step; the trackers still get every metric
        # strategies, engine, background rounds (max_staleness >= 1), seeds, sampler copy: one round at a time
        self.rounds = RoundRunner(self, rollout_engine)

    def _setup_tree_forward(self) -> None:
        """`tree_forward`: tree attention on the policy and the reference model (`appo_trl.tree.attention`)."""
        from appo_trl.tree.attention import install_tree_attention

        install_tree_attention(self.model)
        if self.ref_model is not None:
            install_tree_attention(self.ref_model)

    def _check_reward_outputs(self) -> None:
        """Wrap each reward function so a bad return value names it; count rounds without any reward."""
        from torch import nn

        from appo_trl.trainer.reward_checks import NaNRewardGuard, checked_reward_func

        args = self.args  # per-turn lists go to the round (built after this); the paper's tree form only
        tree = args.advantage_estimator == "tree" and args.tree_credit_form == "paper"
        turns = (lambda *a: self.rounds.record_turn_rewards(*a)) if tree else None
        self._checked_reward_funcs = [  # used by _calculate_rewards only: `reward_funcs` stays the user's
            f if isinstance(f, nn.Module) else checked_reward_func(f, name, turns)
            for f, name in zip(self.reward_funcs, self.reward_func_names)
        ]
        self._nan_reward_guard = NaNRewardGuard(self.args.max_nan_reward_steps)

    @property
    def _custom_loss(self) -> bool:
        a = self.args
        return a.loss_mode != "clip" or a.entropy_balanced_advantage or (a.kl_clamp is not None and a.beta != 0.0)

    @property
    def processing_class_tokenizer(self):
        return trl_seams.tokenizer(self)

    @property
    def rollout_engine(self):
        return self.rounds.engine

    @property
    def strategy(self):
        return self.rounds.strategy

    @property
    def eval_strategy(self):
        return self.rounds.eval_strategy

    def train(self, *args, **kwargs):
        """`Trainer.train`, then the engine's loop thread, backend worker and sandbox are shut down (a later
        call restarts them). With the in-process sampler copy (max_staleness >= 1) torch's thread count is split
        between trainer and sampler for the call and restored after it (`async_rounds.split_cpu_threads`)."""
        with self.rounds.training():
            return super().train(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """`Trainer.get_batch_samples`; with max_staleness >= 1 through a lookahead that can peek the next round."""
        lookahead = self.rounds.lookahead  # background rounds or streaming
        if lookahead is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batch_samples = lookahead.pull(epoch_iterator, num_batches)
        return batch_samples, trl_seams.num_items_in_batch(self, batch_samples, device)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card, naming the strategy's method and paper, and a local base model by its path."""
        import os

        from trl.trainer.utils import get_config_model_id

        from appo_trl.reporting.hub import fix_local_base_model

        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            base = get_config_model_id(self.model.config)
            fix_local_base_model(os.path.join(self.args.output_dir, "README.md"), base)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        """`Trainer._maybe_log_save_evaluate`, after each optimizer step's grad norm is checked (`grad_norms`)."""
        if getattr(self, "_grad_norms", None) is None:
            self._grad_norms = GradNormWatch(self.state.max_steps)
        self._grad_norms.step(grad_norm, self.state.global_step, self.model)
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """`Trainer._load_from_checkpoint`, after the checkpoint's kind is checked against the model's (`resume_kind`:
        LoRA or full, the adapter's shape), so a mismatch is one line, not a state-dict traceback."""
        from peft import PeftModel

        policy = self.accelerator.unwrap_model(self.model)
        config = policy.peft_config.get(policy.active_adapter) if isinstance(policy, PeftModel) else None
        check_resume_kind(resume_from_checkpoint, config)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    # ---- checkpoints: the sampler's state (its seeds derive from the round counter) ------------------------------
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        if self.args.should_save:
            write_sampler_state(output_dir, self.rounds.state())

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
        self.rounds.load_state(state)

    # ---- generation: the round runner -------------------------------------------------------------------------
    def _generate(self, prompts: list):
        if self.sampling_path.trl_sampler:  # the `trl` sampling path: TRL's own sampler
            return super()._generate(prompts)
        return self.rounds.generate(prompts)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """TRL's forward (the tree forward with `tree_forward`), except TRL's old-logp pass of an APPO round: the
        round's branch-selection forward already computed it (`RoundRunner.old_logps_for`: that round's ids, once)."""
        cached = self.rounds.old_logps_for(model, input_ids, logits_to_keep, compute_entropy)
        if cached is not None:
            return cached, None, None
        if self.args.tree_forward:
            from appo_trl.trainer.tree import trainer_tree_forward

            return trainer_tree_forward(
                self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, **kwargs,
                batch_size=batch_size,  # TRL's chunks: each packed on its own (and cached), see tree.py
            )  # fmt: skip
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
        into micro-batches (`rows.group_permutation`), so that a group's rows share their prompt in one forward; and
        no row is dropped when their count is not a multiple of `steps_per_generation` (a path that adds rows after
        scoring: an agent's other chains)."""
        if not ((self.args.tree_forward or self.sampling_path.reshapes_rows) and self.model.training):
            return super()._prepare_inputs(generation_batch)
        from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

        def make_batches():
            batch = self._generate_and_score_completions(generation_batch)
            batch = split_pixel_values_by_grid(batch)
            ids, mask = batch["prompt_ids"], batch["prompt_mask"]
            order = group_permutation(ids, mask) if self.args.tree_forward else torch.randperm(len(ids))
            batch = permute_rows(batch, order)
            return [unsplit_pixel_values_by_grid(b) for b in split_rows(batch, self.args.steps_per_generation)]

        return trl_seams.buffered_generation(self, make_batches)[trl_seams.micro_step(self) % self.args.steps_per_generation]

    def score_trajectories(self, trajectories) -> TokenScores:
        """No-grad trainer forward on rows (`PolicyForward`): per-token logps and exact entropies, (R, T) on CPU."""
        prompts = [list(t.prompt_ids) for t in trajectories]
        pad_id = trl_seams.tokenizer(self).pad_token_id
        prompt_ids, prompt_mask = left_pad(prompts, pad_id)  # as TRL pads prompts
        completion_ids = pad_rows([list(t.completion_ids) for t in trajectories], pad_id)
        completion_mask = pad_rows([[1] * len(t.completion_ids) for t in trajectories], 0)
        device = self.accelerator.device
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).to(device)
        with self.rounds.selection_forward() as model, torch.no_grad():  # background rounds: proximal weights
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
                compute_entropy=True,
            )
        mask = completion_mask.to(device)
        return TokenScores(logps=(logps * mask).float().cpu(), entropies=(entropies * mask).float().cpu())

    # ---- scoring ---------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        funcs, self.reward_funcs = self.reward_funcs, self._checked_reward_funcs
        try:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        rewards_per_func = agent_rewards_override(self, rewards_per_func)  # an agent's own reward wins
        if self.model.training:
            self._nan_reward_guard.update(rewards_per_func, self.reward_func_names, self.state.global_step)
        self.rounds.record_rewards(rewards_per_func)  # gathered (N_global, F), for the strategy's advantages
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        """TRL's, once, on the round the runner holds for this call; then the strategy's advantages and rows."""
        inputs = self.rounds.stream_inputs(inputs)  # rollout_stream: the rows of the groups handed over
        with self.rounds.scoring(inputs):
            with self.rounds.behaviour_correction():  # background rounds in-process: TRL's importance weight
                out = super()._generate_and_score_completions(inputs)
            return self.rounds.finish(out)

    # ---- loss ------------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        with self.rounds.behaviour_correction():
            if not self._custom_loss:
                return super()._compute_loss(model, inputs)
            return compute_policy_loss(self, model, inputs)
