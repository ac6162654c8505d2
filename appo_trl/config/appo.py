"""`APPOConfig(GRPOConfig)`: the fields of appo-trl's training config and what only the config can check.

Every field is a recipe key (flat YAML) and a CLI flag (`--key value`), parsed by `appo_trl.configs.recipes`;
enum-like fields are `Literal`s (argparse lists their choices) and each field names its `--help` group. The
strategy's own defaults and checks live beside it (`appo_trl.strategies`, `RolloutStrategy.validate`);
the other checks are `appo_trl.config.checks`; behaviour is `appo_trl.trainer.trainer`, maths `algorithms`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trl import GRPOConfig

from appo_trl.config import checks
from appo_trl.config.agent import AGENT_HELP
from appo_trl.config.credit import check_credit, credit_field
from appo_trl.config.lora import SYNC_ADAPTER_HELP, check_sync_adapter
from appo_trl.config.script import _loss, _rollout, _strategy, _vllm
from appo_trl.config.stream import StreamFields
from appo_trl.strategies import strategy_class

# fields that were removed, with the one line that names their replacement (Python, recipe and command line)
REMOVED_FIELDS = {
    "exclude_whitespace_punct": "exclude_whitespace_punct was removed; use branch_token_filter "
    "(`none` is exclude_whitespace_punct: false).",
    "entropy_balanced_clipping": "entropy_balanced_clipping was removed; use loss_mode "
    "(`entropy_balanced` is entropy_balanced_clipping: true).",
}


@dataclass
class APPOConfig(StreamFields, GRPOConfig):  # GRPOConfig's fields first: APPOConfig("out") is output_dir
    """`GRPOConfig` plus the agentic-RL settings of appo-trl.

    `num_generations` is the final group size n (rows per prompt that reach the reward functions). Strategies:
    `grpo` samples n rollouts per prompt through the tool loop; `arpo` starts `initial_rollouts` and branches
    after tool results with probability clip(τ + β·ΔH); `aepo` adds a dynamic initial budget, a consecutive-branch
    penalty and entropy-balanced clipping / advantage; `appo` starts `initial_rollouts`, scores every token with
    BS_t = Z(H)·Z(FV) after one trainer forward, branches at the top n − initial points, credits branch outcomes to
    the source trajectory's prefix and optimises the initial rollouts only (ARPO, AEPO and APPO papers; every
    place where our defaults differ from the released code is listed in docs/fidelity.md).

    `reference: <algorithm>` sets every switch to the released implementation's behaviour (`REFERENCE_PRESETS`):
    a switch set explicitly to neither its default nor the preset's value is an error; one at its default follows.
    """

    reference: Literal["arpo", "aepo", "appo", "tree_grpo"] | None = field(
        default=None,
        metadata=_strategy(
            "`arpo`, `aepo`, `appo` or `tree_grpo`: reproduce that algorithm's released implementation (sets the "
            "strategy and every fidelity switch, see docs/fidelity.md); unset = our defaults.",
        ),
    )

    tools: list[str] = field(
        default_factory=list,
        metadata=_rollout(
            "Tools the agent may call: built-in `python`, `search`, or (tool_format=chat) Python functions / dotted "
            "import paths such as `tools.lookup` (resolved from the recipe's folder, then the working directory). "
            "Schemas come from signatures and docstrings, as in TRL's `GRPOTrainer(tools=...)`.",
        ),
    )
    tool_format: Literal["tags", "chat"] | None = field(
        default=None,
        metadata=_rollout(
            "`tags` (ARPO: <python>...</python>, results in <result>) or `chat` (the model's chat template: tool "
            "schemas in the prompt, <tool_call> JSON, results as `tool` messages). Default: chat when any tool is "
            "a Python function or dotted path, else tags.",
        ),
    )
    tool_config: dict | str | None = field(
        default=None, metadata=_rollout("Per-tool parameters as a mapping (YAML) or JSON string, keyed by tool name.")
    )
    tool_call_limit: int | None = field(
        default=3,
        metadata=_rollout(
            "Tool calls allowed per trajectory across all tools (a branch inherits its parent's count); null = no "
            "limit. At the limit the trajectory ends. Each call of a multi-call chat turn counts, and a turn that "
            "would pass the limit runs none of its calls. TRL's `max_tool_calling_iterations` counts turns, as in "
            "TRL, and is checked too; a config appo-trl builds from a GRPOConfig (or for no `args`) has no call "
            "limit, as TRL. Released values: 3 reasoning, 6 deep search.",
        ),
    )
    dump_rollouts: int = field(
        default=0,
        metadata=_rollout(
            "Groups per training step written to `output_dir/rollouts/step_<N>.jsonl` (main process; 0 = off). "
            "`appo rollouts OUTPUT_DIR` shows them as branch trees: fork points, rewards, tool calls.",
        ),
    )
    max_nan_reward_steps: int = field(
        default=0,
        metadata=_rollout(
            "Training rounds in a row in which every reward function returns None/NaN for every completion before "
            "the run stops with an error naming the functions (such rounds train nothing; each one logs a "
            "warning); 0 (default) = never stop, as TRL, which warns and trains on.",
        ),
    )
    rollout_concurrency: int = field(default=64, metadata=_rollout("Most sampler requests in flight per rank."))
    # --- your own agent through the OpenAI-compatible endpoint (appo_trl.trainer.agents) ------------------------
    agent: str | None = field(default=None, metadata=AGENT_HELP["agent"])
    agent_errors: Literal["zero", "raise"] = field(default="zero", metadata=AGENT_HELP["agent_errors"])
    agent_timeout_s: float = field(default=600.0, metadata=AGENT_HELP["agent_timeout_s"])
    max_failed_agent_rounds: int = field(default=3, metadata=AGENT_HELP["max_failed_agent_rounds"])
    agent_host: str = field(default="127.0.0.1", metadata=AGENT_HELP["agent_host"])
    agent_port: int = field(default=0, metadata=AGENT_HELP["agent_port"])
    # --- vLLM weight sync (server mode) ---------------------------------------------------------------------
    vllm_weight_sync: Literal["auto", "nccl", "disk"] = field(
        default="auto",
        metadata=_vllm(
            "How weights reach the vLLM server once per round: `nccl` (TRL's weight-transfer engine, CUDA only), "
            "`disk` (safetensors + POST /collective_rpc reload_weights + /reset_prefix_cache; the server needs "
            "VLLM_SERVER_DEV_MODE=1 and must read the folder), or `auto` (disk when the trainer or the server "
            "runs on CPU, else nccl). See appo_trl.vllm.weight_sync.",
        ),
    )
    vllm_server_wait_s: float = field(
        default=300.0,
        metadata=_vllm(
            "Server mode: seconds to wait for a vLLM server that stopped answering (connection refused) to come back "
            "(GET /health) before the run fails. When it is back, the weights are synced again and the round is "
            "re-run (disk sync; with nccl a restart is an error). 0 = fail when the request retries are spent.",
        ),
    )
    vllm_request_timeout_s: float = field(
        default=600.0,
        metadata=_vllm(
            "Server mode: seconds one completion request may wait for its answer (httpx read timeout). A request "
            "that times out is retried (3 retries), then the run fails naming this setting, so a server that "
            "accepted a request and went silent costs at most 4x this. A long generation must fit in it.",
        ),
    )
    vllm_sync_adapter: Literal["auto", "always", "never"] = field(default="auto", metadata=SYNC_ADAPTER_HELP)
    vllm_weight_sync_dir: str | None = field(
        default=None,
        metadata=_vllm("disk sync: folder the server reads the weights from (default: a temporary folder)."),
    )
    # --- overlap of generation and training (appo_trl.trainer.async_rounds) ------------------------------------
    max_staleness: int = field(
        default=0,
        metadata=_rollout(
            "TRL's name. 0 (default): synchronous, each round is sampled on the weights it trains. k >= 1: the next "
            "round generates in the background while the current one trains; a row is trained at most k optimizer "
            "steps after the weights that sampled it (older rounds are dropped, `rollout/stale_rows_dropped`), with "
            "decoupled PPO's correction (TRL's vllm_importance_sampling_*). See appo_trl.trainer.async_rounds.",
        ),
    )
    weight_sync_steps: int = field(
        default=1,
        metadata=_rollout(
            "TRL's name. With max_staleness >= 1: sync the sampler (vLLM server or the in-process sampler copy) "
            "every this many optimizer steps, and whenever the staleness bound needs it (<= max_staleness).",
        ),
    )
    async_fv_policy: Literal["proximal", "sampler"] = field(
        default="proximal",
        metadata=_rollout(
            "APPO with max_staleness >= 1: the weights of the branch-selection forward. `proximal`: the weights of "
            "the round's hand-over, which its loss takes the ratio against (it waits for the optimizer steps of the "
            "round training meanwhile), so FutureValue also measures the policy lag; `sampler`: the in-process "
            "sampler copy, FutureValue as synchronously.",
        ),
    )
    # --- several vLLM replicas (vllm_server_base_url lists them) ---------------------------------------------
    vllm_router_policy: Literal["consistent_hash", "round_robin", "cache_aware", "power_of_two", "random"] = field(
        default="consistent_hash",
        metadata=_vllm(
            "When `vllm_server_base_url` lists several replicas, appo starts vLLM's router (`appo-trl[router]`) "
            "in front of them with this `--policy`. `consistent_hash` keeps every request of one tree (sent with "
            "its `X-Session-ID`) on one replica, where its prefix is cached; `round_robin` is the cache-blind "
            "baseline. See appo_trl.vllm.router.",
        ),
    )
    vllm_router_port: int | None = field(
        default=None, metadata=_vllm("Port of the router appo starts (default: a free port on 127.0.0.1).")
    )
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata=_vllm(
            "colocate mode: dtype of the in-process vLLM engine. `auto` is TRL's (vLLM's choice: a float32 "
            "checkpoint runs in bfloat16); `float32`, `bfloat16` or `float16` force it (float32 makes the "
            "sampler's logprobs match a float32 trainer's).",
        ),
    )
    # --- strategy -------------------------------------------------------------------------------------------
    rollout_strategy: str = field(
        default="grpo",
        metadata=_strategy(
            "Rollout strategy: `grpo` (no branching), `arpo`, `aepo` or `appo`, or any class registered with "
            "`appo_trl.strategies.register_strategy`.",
        ),
    )
    initial_rollouts: int | None = field(
        default=None,
        metadata=_strategy(
            "Rollouts started from the bare prompt (N); the other n − N rows are branches. Defaults to "
            "`num_generations` for grpo and `num_generations // 2` for the branching strategies.",
        ),
    )
    # --- ARPO ------------------------------------------------------------------------------------------------
    beam_size: int = field(
        default=2,
        metadata=_strategy("ARPO/AEPO: each branch source may spawn up to `beam_size − 1` copies per tool round."),
    )
    branch_probability: float = field(
        default=0.5,
        metadata=_strategy(
            "ARPO/AEPO threshold τ: ARPO branches with P = clip(τ + β·ΔH, 0, 1); AEPO (reference form) with "
            "P = clip(1 − τ/f + β·ΔH, 0, 1), f the consecutive-branch factor (equal at τ = 0.5, f = 1).",
        ),
    )
    entropy_weight: float = field(
        default=0.2, metadata=_strategy("ARPO/AEPO: entropy weight β in P = clip(τ + β·ΔH, 0, 1).")
    )
    empty_segment_entropy: Literal["nan", "zero"] = field(
        default="nan",
        metadata=_strategy(
            "ARPO/AEPO: entropy of an empty segment (a tool call right after a result). `nan` (ours): unknown, "
            "ΔH = 0. `zero` (released code): H = 0, so ΔH = −H_root. Example: H_root = 1, τ 0.5, β 0.2 → P 0.5 vs 0.3.",
        ),
    )
    advantage_std_eps: float = field(
        default=1e-4,
        metadata=_strategy(
            "ε in the group advantage (r − mean)/(std + ε) of grpo/arpo/aepo: 1e-4 is TRL's, the released code uses "
            "1e-6 (needs scale_rewards=group). Example: rewards [1, 0], std 0.7071 → A₀ 0.70700 vs 0.70711.",
        ),
    )
    entropy_tokens: int = field(
        default=20,
        metadata=_strategy("Tokens after a tool result (or at the root) whose entropy forms H (ARPO window)."),
    )
    entropy_topk: int = field(
        default=10,
        metadata=_strategy("Top-k sampler logprobs per token used for the truncated entropy (vLLM `logprobs`)."),
    )
    arpo_entropy_timing: Literal["lookahead", "faithful"] = field(
        default="lookahead",
        metadata=_strategy(
            "`lookahead`: ΔH from the k tokens generated after the current tool result (paper intent). "
            "`faithful`: the reference's one-round lag (ΔH from the segment before the call).",
        ),
    )
    # --- AEPO ------------------------------------------------------------------------------------------------
    dynamic_rollouts: bool = field(
        default=False,
        metadata=_strategy("AEPO: per-prompt initial budget N_p = clamp(int(n·σ(0.5·(H_root − H_tool))) + 1, 1, n)."),
    )
    dynamic_rollouts_source: Literal["reuse", "probe"] = field(
        default="reuse",
        metadata=_strategy(
            "AEPO dynamic budget statistics: `probe` runs a discarded probe rollout per prompt (reference); "
            "`reuse` takes H_root / H_tool from the first initial rollout (no extra rollout).",
        ),
    )
    branch_penalty: float = field(
        default=0.05,
        metadata=_strategy(
            "AEPO: consecutive-branch penalty; P is multiplied by max(0, 1 − penalty·l) after l rounds in a row "
            "that created branches. 0 disables it.",
        ),
    )
    aepo_penalty_scope: Literal["lineage", "prompt"] = field(
        default="lineage",
        metadata=_strategy(
            "AEPO: what the consecutive-branch count l follows. `lineage` (ours): fork points of the trajectory's "
            "own lineage in a row that forked. `prompt` (released code): rounds in a row in which the prompt created "
            "a trajectory (fork or refill), not reset by rounds in which nothing in the batch was created. Example: "
            "a prompt forks in round 1, nobody in round 2 → round-3 P = 1 − 0.5/0.95 = 0.474 (prompt) vs 0.5.",
        ),
    )
    entropy_balanced_advantage: bool | None = field(
        default=None,
        metadata=_strategy(
            "AEPO: entropy-aware advantage A·clamp(1 + a·z(H_t), 0, 2), actually applied. Default: on for aepo "
            "(the released code sets it but silently skips it because entropy_coeff = 0; `reference: aepo` is off).",
        ),
    )
    entropy_advantage_clamp: bool = field(
        default=True,
        metadata=_strategy(
            "AEPO: clamp the entropy-aware factor 1 + a·z to [0, 2] (ours); False = released code (z < −1/a flips "
            "the advantage's sign). Example: a = 0.2, z = −6 → factor 0 vs −0.2.",
        ),
    )
    entropy_advantage_weight: float = field(
        default=0.2, metadata=_strategy("AEPO: weight a of the entropy-aware advantage.")
    )
    # --- APPO ------------------------------------------------------------------------------------------------
    fv_gamma: float = field(
        default=2 ** (-1 / 64),
        metadata=_strategy(
            "APPO: discount γ_fv of the future value FV_t = clip(exp(Σ γ^(k−t)·(ℓ^train_k − ℓ^sampler_k)), "
            "0.8, 1.2). Default matches the future-KL horizon 2^(−1/64); the reference uses 1.0.",
        ),
    )
    max_branches_per_rollout: str | None = field(
        default="auto",
        metadata=_strategy(
            "APPO: cap of branch points per initial rollout: `auto` (ours) = ⌈(n − N)/N⌉ + 1, an integer, or null = "
            "no cap (released code). Exceeded only as a fallback to keep the group at exactly n.",
        ),
    )
    min_remaining_tokens: int = field(
        default=64,
        metadata=_strategy("APPO: a branch point needs at least this many completion tokens after it."),
    )
    branch_token_filter: Literal["whitespace_punct", "whitespace", "none"] = field(
        default="whitespace_punct",
        metadata=_strategy(
            "APPO: tokens that are never branch points. `whitespace_punct` (ours): whitespace- or punctuation-only "
            "and special tokens; `whitespace` (released code): whitespace-only, so `,` and EOS may be picked; `none`.",
        ),
    )
    branch_allow_last_token: bool = field(
        default=False,
        metadata=_strategy(
            "APPO: True lets a row's last sampled token (usually the EOS) be a branch point (released code); False "
            "(ours) excludes it: a branch after the EOS only re-samples padding.",
        ),
    )
    branch_zscore_scope: Literal["candidates", "loss_mask"] = field(
        default="candidates",
        metadata=_strategy(
            "APPO: tokens over which Z(H) and Z(FV) are taken per rollout: `candidates` (ours, the tokens that can "
            "be picked) or `loss_mask` (released code: every sampled token, filtered ones included). Example: H = "
            "[0, 1, 5] with the 5 on a filtered token → Z(H) of the middle token +1.0 (candidates) vs −0.46.",
        ),
    )
    fv_degeneracy_guard: bool = field(
        default=True,
        metadata=_strategy(
            "APPO: a rollout whose FV is constant (std < 1e-4, the on-policy case) gets Z(FV) := 1 so BS = Z(H) "
            "(ours); False = released code, where BS ≈ 0 and float noise / token order picks the points.",
        ),
    )
    resample_selected_token: bool = field(
        default=False,
        metadata=_strategy(
            "APPO: False keeps token t in the branch prefix (reference); True re-samples it (prefix = response[:t]).",
        ),
    )
    reward_scale_discount: float = field(
        default=0.9,
        metadata=_strategy(
            "APPO: δ of the saliency-decayed scale m_i[t] = mean_b(1 + (BS_b/max BS)·δ^(s_b−t)) applied to the "
            "initial trajectory's advantage.",
        ),
    )
    advantage_mode: Literal["dual_group", "group"] = field(
        default="dual_group",
        metadata=_strategy(
            "APPO advantages: `dual_group` (initial and branch groups z-scored separately, branch credit on the "
            "source's prefix) or `group` (TRL's single group over all n rows).",
        ),
    )
    advantage_estimator: Literal["group", "tree", "tree_grpo"] = credit_field("advantage_estimator", "group")
    tree_credit_global_weight: float = credit_field("tree_credit_global_weight", 1.0)
    tree_credit_local_weight: float = credit_field("tree_credit_local_weight", 1.0)
    tree_credit_scale: Literal["sqrt_rows", "none"] = credit_field("tree_credit_scale", "sqrt_rows")
    tree_credit_form: Literal["paper", "treerl_released"] = credit_field("tree_credit_form", "paper")
    tree_grpo_combine: Literal["sum", "nested"] = credit_field("tree_grpo_combine", "sum")
    tree_credit_branch_rows: bool | None = credit_field("tree_credit_branch_rows", None)
    m_scaling: Literal["advantage", "reward_noop"] = field(
        default="advantage",
        metadata=_strategy(
            "APPO: where δ-scaling applies: `advantage` (effective) or `reward_noop` (reference: on the terminal "
            "reward, where the group z-score cancels it).",
        ),
    )
    branch_entropy_source: Literal["sampler_topk", "trainer"] = field(
        default="sampler_topk",
        metadata=_strategy(
            "APPO branch-score entropy: `sampler_topk` (top-k sampler logprobs, reference) or `trainer` "
            "(exact entropy from the trainer forward).",
        ),
    )
    # --- loss ------------------------------------------------------------------------------------------------
    loss_mode: Literal["clip", "dual_clip", "future_kl", "entropy_balanced"] | None = field(
        default=None,
        metadata=_loss(
            "Policy loss: `clip` (TRL's own loss), `dual_clip`, `future_kl` or `entropy_balanced`. Default: "
            "the strategy's (`default_loss_mode`): future_kl for appo, entropy_balanced for aepo, else clip.",
        ),
    )
    clip_ratio_c: float = field(default=3.0, metadata=_loss("Dual-clip bound c for negative advantages (> 1)."))
    future_kl_decay_rate: float = field(
        default=64.0, metadata=_loss("future_kl: half-life in tokens; γ_L = 2^(−1/decay_rate).")
    )
    future_kl_clip_ratio: float = field(
        default=0.2,
        metadata=_loss(
            "future_kl: clip ε_f of the future importance weight (also the FV clip of APPO's branch score). 0 is "
            "the released code's 'no clip' (weight ≤ 10) and is accepted only with `reference: appo`.",
        ),
    )
    future_kl_normalizer: Literal["loss_type", "kept_tokens"] = field(
        default="loss_type",
        metadata=_loss(
            "future_kl: denominator when the safety rule drops sequences. `loss_type` (ours): TRL's normaliser, "
            "dropped tokens still counted; `kept_tokens` (released code, needs loss_type=bnpo): token mean over the "
            "kept rows of the micro-batch. Example: one of two 3-token rows dropped, kept loss −6 → −1.0 vs −2.0.",
        ),
    )
    kl_clamp: float | None = field(
        default=None,
        metadata=_loss(
            "Clamp of the per-token k3 KL estimate to [−c, c] (only with beta ≠ 0): null (ours, TRL) or 10 "
            "(released verl code). Example: logπ − logπ_ref = 3 → k3 = e³ − 4 = 16.09, clamped 10.",
        ),
    )
    future_kl_weight: float = field(default=1.0, metadata=_loss("future_kl: weight b in Ã = A·(1 + b·f)."))
    future_kl_clip_high_only: bool = field(
        default=True, metadata=_loss("future_kl: clip the future weight to [1, 1+ε_f] instead of [1−ε_f, 1+ε_f].")
    )
    future_kl_safety_threshold: float = field(
        default=6.0,
        metadata=_loss("future_kl: for A < 0 and ratio above this, the future weight is capped to [0.8, 1]."),
    )
    tree_forward: bool = field(
        default=True,
        metadata=_loss(
            "Train on the tree: every trainer forward (loss, TRL's old-logp pass, the reference pass, APPO's "
            "branch scoring) folds its rows into prefix tries and sends each shared token through the model once "
            "(TRL's `packing: tree` of AsyncGRPO, here for every strategy). Exact: same logps, entropies, loss and "
            "gradients as the row-by-row forward (float32 on CPU, 1e-5). Micro-batches then hold whole groups. "
            "On a GPU the attention uses PyTorch's varlen FlashAttention (bf16/fp16), else flash_attn's varlen "
            "kernel, else FlexAttention, else the per-segment SDPA path (also the CPU path), each skipped with one "
            "log line; `bench/gpu.py` measures them and `tests/trainer/test_tree_gpu.py` checks their exactness.",
        ),
    )
    tree_token_budget: int = field(
        default=16384,
        metadata=_loss(
            "tree_forward: most unique tokens in one trie (one forward); it bounds activation memory as "
            "`per_device_train_batch_size` rows do row-wise. A row longer than the budget is forwarded alone. "
            "Each trie forwards the shared prompt once, so a group split over several tries forwards it once per "
            "trie: at the paper recipes' shapes (prompt 1,536 tokens, n = 16, completions up to 4,096) the default "
            "holds only 3 full-length rows, so the prompt is forwarded about 6 times per group. To forward it once "
            "per group, size the budget to prompt + n x (max_completion_length + 1) (67,087 there; fewer tokens "
            "than the row-wise micro-batch of the same n rows, 90,112) if activation memory allows, with "
            "`per_device_train_batch_size` a multiple of n.",
        ),
    )

    REMOVED_FIELDS = REMOVED_FIELDS  # read by `appo_trl.configs.recipes` for recipe keys and flags

    def __new__(cls, *args, **kwargs):
        for name in REMOVED_FIELDS.keys() & kwargs.keys():
            checks.fail(REMOVED_FIELDS[name])
        return super().__new__(cls)

    def __post_init__(self):
        checks.check_choices(self, APPOConfig)
        checks.apply_reference(self)
        checks.follow_hardware(self)
        super().__post_init__()
        self._validate_appo()

    def to_dict(self):
        """`TrainingArguments.to_dict` with Python tool functions written as their dotted names (for logging)."""
        from appo_trl.tools.callables import tool_label

        out = super().to_dict()
        if out.get("tools"):
            out["tools"] = [tool_label(t) for t in out["tools"]]
        return out

    @property
    def strategy_class(self):
        """The registered `RolloutStrategy` subclass of `rollout_strategy` (its facts: `appo_trl.strategies`)."""
        return strategy_class(self.rollout_strategy)

    @property
    def branch_rows_per_prompt(self) -> int:
        """n − N: rows per prompt produced by branching (0 for grpo)."""
        return self.num_generations - self.initial_rollouts

    @property
    def drops_branch_rows(self) -> bool:
        """True when branch rows leave the batch before the loss (appo with a branch, unless tree credit keeps them)."""
        kept = self.tree_credit_branch_rows
        return self.strategy_class.drops_branch_rows and self.branch_rows_per_prompt > 0 and not kept

    def _validate_appo(self):
        """The strategy's part first (defaults such as initial_rollouts and loss_mode), then the config's own."""
        self.strategy_class.validate(self)
        check_credit(self, self.strategy_class)  # advantage_estimator=tree and its options
        checks.check_ranges(self)
        checks.resolve_branch_cap(self)
        checks.check_loss(self)
        if isinstance(self.tools, str) or callable(self.tools):  # `tools: python` in YAML, `tools=func` in Python
            self.tools = [self.tools]
        checks.check_replicas(self)
        checks.check_vllm(self)
        check_sync_adapter(self, checks.fail)
        checks.check_batching(self)
        checks.check_async(self)
