"""Configuration dataclasses: `APPOScriptArguments` (data, rewards, tools) and `APPOConfig(GRPOConfig)`.

Every field is a recipe key (flat YAML) and a CLI flag (`--key value`), parsed by `appo_trl.recipes`.
`APPOConfig` adds the rollout strategy (grpo / arpo / aepo / appo), the branching rules of each strategy, the
policy-loss mode and its parameters, and the tool-loop limits. This module holds the fields and their
validation only (invalid combinations fail in `__post_init__`); the behaviour lives in `appo_trl.trainer` and
the maths in `appo_trl.algorithms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig, ScriptArguments


@dataclass
class APPOScriptArguments(ScriptArguments):
    """Script arguments of `appo train`: where the data comes from and how completions are scored.

    Args:
        dataset_name: hub id, local parquet/jsonl file, or folder of such files.
        prompt_column: column holding the prompt (a string, or a list of chat messages).
        answer_column: column holding the gold answer(s), passed to reward functions as `answer`.
        reward_funcs: reward function names from `appo_trl.rewards` or dotted import paths.
        system_prompt: system message prepended to string prompts (a name from the prompt registry or text).
    """

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub id, local parquet/jsonl file, or a folder of such files."}
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column with the prompt (text or messages)."})
    answer_column: str = field(default="answer", metadata={"help": "Column with the gold answer(s)."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["arpo_deep_research"],
        metadata={"help": "Reward function names (see `appo_trl.rewards.REWARD_FUNCS`) or dotted import paths."},
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System prompt name (prompt registry) or literal text."}
    )


ROLLOUT_STRATEGIES = ("grpo", "arpo", "aepo", "appo")
LOSS_MODES = ("clip", "dual_clip", "future_kl", "entropy_balanced")
# Loss normalisers the custom (non-TRL) loss modes reproduce exactly (spec/trl-internals.md §6.2 step 10).
CUSTOM_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
DEFAULT_LOSS_MODE = {"grpo": "clip", "arpo": "clip", "aepo": "clip", "appo": "future_kl"}


def _h(text: str) -> dict:
    return {"help": text}


@dataclass
class APPOConfig(GRPOConfig):
    """`GRPOConfig` plus the agentic-RL settings of appo-trl.

    `num_generations` is the final group size n (rows per prompt that reach the reward functions). Strategies:
    `grpo` samples n rollouts per prompt through the tool loop; `arpo` starts `initial_rollouts` and branches
    after tool results with probability clip(τ + β·ΔH); `aepo` adds a dynamic initial budget, a consecutive-branch
    penalty and entropy-balanced clipping / advantage; `appo` starts `initial_rollouts`, scores every token with
    BS_t = Z(H)·Z(FV) after one trainer forward, branches at the top n − initial points, credits branch outcomes to
    the source trajectory's prefix and optimises the initial rollouts only (spec/algorithms.md §2, §4, §5.5).
    """

    tools: list[str] = field(default_factory=list, metadata=_h("Tools the agent may call, e.g. `python search`."))
    tool_config: dict | str | None = field(
        default=None, metadata=_h("Per-tool parameters as a mapping (YAML) or JSON string, keyed by tool name.")
    )
    tool_call_limit: int = field(
        default=3,
        metadata=_h(
            "Tool calls allowed per trajectory across all tools (a branch inherits its parent's count). "
            "At the limit the trajectory ends. Released values: 3 reasoning, 6 deep search."
        ),
    )
    dump_rollouts: int = field(
        default=0,
        metadata=_h(
            "Groups per training step written to `output_dir/rollouts/step_<N>.jsonl` (main process; 0 = off). "
            "`appo rollouts OUTPUT_DIR` shows them as branch trees: fork points, rewards, tool calls."
        ),
    )
    rollout_concurrency: int = field(
        default=64, metadata=_h("Maximum sampler requests in flight per rank (async tool loop).")
    )
    # --- strategy -------------------------------------------------------------------------------------------
    rollout_strategy: str = field(
        default="grpo", metadata=_h("Rollout strategy: `grpo` (no branching), `arpo`, `aepo` or `appo`.")
    )
    initial_rollouts: int | None = field(
        default=None,
        metadata=_h(
            "Rollouts started from the bare prompt (N); the other n − N rows are branches. Defaults to "
            "`num_generations` for grpo and `num_generations // 2` for the branching strategies."
        ),
    )
    # --- ARPO ------------------------------------------------------------------------------------------------
    beam_size: int = field(
        default=2, metadata=_h("ARPO/AEPO: each branch source may spawn up to `beam_size − 1` copies per tool round.")
    )
    branch_probability: float = field(
        default=0.5,
        metadata=_h(
            "ARPO/AEPO threshold τ: ARPO branches with P = clip(τ + β·ΔH, 0, 1); AEPO (reference form) with "
            "P = clip(1 − τ/f + β·ΔH, 0, 1), f the consecutive-branch factor (equal at τ = 0.5, f = 1)."
        ),
    )
    entropy_weight: float = field(default=0.2, metadata=_h("ARPO/AEPO: entropy weight β in P = clip(τ + β·ΔH, 0, 1)."))
    entropy_tokens: int = field(
        default=20, metadata=_h("Tokens after a tool result (or at the root) whose entropy forms H (ARPO window).")
    )
    entropy_topk: int = field(
        default=10, metadata=_h("Top-k sampler logprobs per token used for the truncated entropy (vLLM `logprobs`).")
    )
    arpo_entropy_timing: str = field(
        default="lookahead",
        metadata=_h(
            "`lookahead`: ΔH from the k tokens generated after the current tool result (paper intent). "
            "`faithful`: the reference's one-round lag (ΔH from the segment before the call)."
        ),
    )
    # --- AEPO ------------------------------------------------------------------------------------------------
    dynamic_rollouts: bool = field(
        default=False,
        metadata=_h("AEPO: per-prompt initial budget N_p = clamp(int(n·σ(0.5·(H_root − H_tool))) + 1, 1, n)."),
    )
    dynamic_rollouts_source: str = field(
        default="reuse",
        metadata=_h(
            "AEPO dynamic budget statistics: `probe` runs a discarded probe rollout per prompt (reference); "
            "`reuse` takes H_root / H_tool from the first initial rollout (no extra rollout)."
        ),
    )
    initial_entropy_tokens: int = field(
        default=50, metadata=_h("AEPO: max tokens of the root-entropy probe generation.")
    )
    branch_penalty: float = field(
        default=0.05,
        metadata=_h(
            "AEPO: consecutive-branch penalty; P is multiplied by max(0, 1 − penalty·l) after l rounds in a row "
            "that created branches. 0 disables it."
        ),
    )
    entropy_balanced_clipping: bool = field(
        default=False,
        metadata=_h(
            "AEPO: entropy-balanced clipping (the clipped upper branch keeps its gradient through "
            "(1+ε_h)·ρ/sg(ρ)); selects `loss_mode: entropy_balanced`."
        ),
    )
    entropy_balanced_advantage: bool = field(
        default=False,
        metadata=_h(
            "AEPO: entropy-aware advantage A·clamp(1 + a·z(H_t), 0, 2), actually applied (the reference "
            "silently skips it when entropy_coeff = 0)."
        ),
    )
    entropy_advantage_weight: float = field(default=0.2, metadata=_h("AEPO: weight a of the entropy-aware advantage."))
    # --- APPO ------------------------------------------------------------------------------------------------
    fv_gamma: float = field(
        default=2 ** (-1 / 64),
        metadata=_h(
            "APPO: discount γ_fv of the future value FV_t = clip(exp(Σ γ^(k−t)·(ℓ^train_k − ℓ^sampler_k)), "
            "0.8, 1.2). Default matches the future-KL horizon 2^(−1/64); the reference uses 1.0."
        ),
    )
    max_branches_per_rollout: int | None = field(
        default=None,
        metadata=_h(
            "APPO: cap of branch points per initial rollout; default ⌈(n − N)/N⌉ + 1. Exceeded only as a "
            "fallback to keep the group at exactly n."
        ),
    )
    min_remaining_tokens: int = field(
        default=64, metadata=_h("APPO: a branch point needs at least this many completion tokens after it.")
    )
    exclude_whitespace_punct: bool = field(
        default=True,
        metadata=_h("APPO: whitespace- or punctuation-only tokens (and the final EOS) are never branch points."),
    )
    resample_selected_token: bool = field(
        default=False,
        metadata=_h(
            "APPO: False keeps token t in the branch prefix (reference); True re-samples it (prefix = response[:t])."
        ),
    )
    reward_scale_discount: float = field(
        default=0.9,
        metadata=_h(
            "APPO: δ of the saliency-decayed scale m_i[t] = mean_b(1 + (BS_b/max BS)·δ^(s_b−t)) applied to the "
            "initial trajectory's advantage."
        ),
    )
    advantage_mode: str = field(
        default="dual_group",
        metadata=_h(
            "APPO advantages: `dual_group` (initial and branch groups z-scored separately, branch credit on the "
            "source's prefix) or `group` (TRL's single group over all n rows)."
        ),
    )
    m_scaling: str = field(
        default="advantage",
        metadata=_h(
            "APPO: where δ-scaling applies: `advantage` (effective) or `reward_noop` (reference: on the terminal "
            "reward, where the group z-score cancels it)."
        ),
    )
    branch_entropy_source: str = field(
        default="sampler_topk",
        metadata=_h(
            "APPO branch-score entropy: `sampler_topk` (top-k sampler logprobs, reference) or `trainer` "
            "(exact entropy from the trainer forward)."
        ),
    )
    # --- loss ------------------------------------------------------------------------------------------------
    loss_mode: str | None = field(
        default=None,
        metadata=_h(
            "Policy loss: `clip` (TRL's own loss), `dual_clip`, `future_kl` or `entropy_balanced`. Default: "
            "future_kl for appo, entropy_balanced for aepo with entropy_balanced_clipping, else clip."
        ),
    )
    clip_ratio_c: float = field(default=3.0, metadata=_h("Dual-clip bound c for negative advantages (> 1)."))
    future_kl_decay_rate: float = field(
        default=64.0, metadata=_h("future_kl: half-life in tokens; γ_L = 2^(−1/decay_rate).")
    )
    future_kl_clip_ratio: float = field(
        default=0.2, metadata=_h("future_kl: clip ε_f of the future importance weight.")
    )
    future_kl_weight: float = field(default=1.0, metadata=_h("future_kl: weight b in Ã = A·(1 + b·f)."))
    future_kl_clip_high_only: bool = field(
        default=True, metadata=_h("future_kl: clip the future weight to [1, 1+ε_f] instead of [1−ε_f, 1+ε_f].")
    )
    future_kl_safety_threshold: float = field(
        default=6.0, metadata=_h("future_kl: for A < 0 and ratio above this, the future weight is capped to [0.8, 1].")
    )

    def __post_init__(self):
        super().__post_init__()
        self._validate_appo()
        self._warn_no_effect()

    @property
    def branch_rows_per_prompt(self) -> int:
        """n − N: rows per prompt produced by branching (0 for grpo)."""
        return self.num_generations - self.initial_rollouts

    @property
    def drops_branch_rows(self) -> bool:
        """True when branch rows leave the batch before the loss (appo with at least one branch)."""
        return self.rollout_strategy == "appo" and self.branch_rows_per_prompt > 0

    def _fail(self, msg: str):
        raise ValueError(f"APPOConfig: {msg}")

    def _validate_appo(self):  # noqa: C901 - a flat list of independent checks
        n = self.num_generations
        if self.rollout_strategy not in ROLLOUT_STRATEGIES:
            self._fail(f"rollout_strategy={self.rollout_strategy!r}; choose one of {ROLLOUT_STRATEGIES}.")
        if self.initial_rollouts is None:
            self.initial_rollouts = n if self.rollout_strategy == "grpo" else max(1, n // 2)
        if not 1 <= self.initial_rollouts <= n:
            self._fail(f"initial_rollouts={self.initial_rollouts} must be in [1, num_generations={n}].")
        if self.rollout_strategy == "grpo" and self.initial_rollouts != n:
            self._fail("rollout_strategy=grpo does not branch: initial_rollouts must equal num_generations.")
        if self.loss_mode is None:
            self.loss_mode = DEFAULT_LOSS_MODE[self.rollout_strategy]
            if self.rollout_strategy == "aepo" and self.entropy_balanced_clipping:
                self.loss_mode = "entropy_balanced"
        if self.loss_mode not in LOSS_MODES:
            self._fail(f"loss_mode={self.loss_mode!r}; choose one of {LOSS_MODES}.")
        if self.entropy_balanced_clipping and self.loss_mode != "entropy_balanced":
            self._fail(f"entropy_balanced_clipping=True needs loss_mode=entropy_balanced (got {self.loss_mode!r}).")
        if self.rollout_strategy != "aepo":
            for flag in ("dynamic_rollouts", "entropy_balanced_clipping", "entropy_balanced_advantage"):
                if getattr(self, flag):
                    self._fail(f"{flag}=True is an AEPO option; set rollout_strategy=aepo.")
        choices = {
            "arpo_entropy_timing": ("lookahead", "faithful"),
            "dynamic_rollouts_source": ("reuse", "probe"),
            "advantage_mode": ("dual_group", "group"),
            "m_scaling": ("advantage", "reward_noop"),
            "branch_entropy_source": ("sampler_topk", "trainer"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                self._fail(f"{name}={getattr(self, name)!r}; choose one of {allowed}.")
        if self.beam_size < 1:
            self._fail(f"beam_size={self.beam_size} must be >= 1.")
        if self.dump_rollouts < 0:
            self._fail(f"dump_rollouts={self.dump_rollouts} must be >= 0 (groups written per step).")
        for name in ("branch_probability", "reward_scale_discount", "future_kl_clip_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                self._fail(f"{name}={getattr(self, name)} must be in [0, 1].")
        if not 0.0 < self.fv_gamma <= 1.0:
            self._fail(f"fv_gamma={self.fv_gamma} must be in (0, 1].")
        if self.clip_ratio_c <= 1.0:
            self._fail(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound).")
        if self.future_kl_decay_rate <= 0:
            self._fail(f"future_kl_decay_rate={self.future_kl_decay_rate} must be > 0.")
        if (
            self.tool_call_limit < 0
            or self.entropy_tokens < 1
            or self.entropy_topk < 1
            or self.min_remaining_tokens < 0
        ):
            self._fail("tool_call_limit, min_remaining_tokens must be >= 0 and entropy_tokens, entropy_topk >= 1.")
        if self.max_branches_per_rollout is None:
            self.max_branches_per_rollout = math.ceil(self.branch_rows_per_prompt / self.initial_rollouts) + 1
        if self.loss_mode != "clip":
            if self.loss_type not in CUSTOM_LOSS_TYPES:
                self._fail(
                    f"loss_mode={self.loss_mode} supports loss_type in {CUSTOM_LOSS_TYPES} (got {self.loss_type!r})."
                )
            if self.top_entropy_quantile < 1.0:
                self._fail(
                    f"loss_mode={self.loss_mode} does not support top_entropy_quantile < 1; use loss_mode=clip."
                )
        if self.use_vllm and self.vllm_mode != "server":
            self._fail(
                "the tool loop samples through vLLM's HTTP server only: set vllm_mode=server "
                "(colocate mode is not supported by appo-trl's rollout engine)."
            )
        self._validate_batching()

    def _validate_batching(self):
        """Groups stay on one rank, and the rows left after dropping branches still split into micro-batches.

        TRL's `_prepare_inputs` shuffles the per-rank generation batch (`per_device_train_batch_size ×
        steps_per_generation` rows) and splits it into `steps_per_generation` equal slices. APPO removes the
        n − N branch rows of each group before that split, so the rank keeps G·N rows (G = groups per rank) and
        each micro-step trains on G·N / steps_per_generation rows: G·N must be a multiple of steps_per_generation.
        """
        n, spg = self.num_generations, self.steps_per_generation
        rows = self.per_device_train_batch_size * spg
        if rows % n != 0:
            self._fail(
                f"per_device_train_batch_size × steps_per_generation = {rows} must be a multiple of "
                f"num_generations = {n}, so that every group is sampled, branched and scored on one rank."
            )
        if self.drops_branch_rows and (rows // n * self.initial_rollouts) % spg != 0:
            self._fail(
                f"after removing branch rows each rank keeps {rows // n} groups × {self.initial_rollouts} "
                f"initial rollouts = {rows // n * self.initial_rollouts} rows, which must split evenly into "
                f"steps_per_generation = {spg} micro-batches; raise per_device_train_batch_size or change "
                "initial_rollouts."
            )

    def _warn_no_effect(self):
        """Settings that are valid but make a strategy do nothing useful: warned once, the run goes on."""
        import warnings

        if (
            self.rollout_strategy == "appo"
            and self.branch_rows_per_prompt > 0
            and self.min_remaining_tokens >= self.max_completion_length
        ):
            warnings.warn(
                f"APPOConfig: min_remaining_tokens={self.min_remaining_tokens} >= max_completion_length="
                f"{self.max_completion_length}: no token can be a branch point, so every one of the "
                f"{self.branch_rows_per_prompt} branches per prompt is a fallback (`branch/fallback_frac` = 1). "
                "Lower min_remaining_tokens (e.g. to max_completion_length // 4).",
                UserWarning,
                stacklevel=4,  # the line that built the config (past __init__ and __post_init__)
            )
