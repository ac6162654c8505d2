"""Configuration dataclasses: `APPOScriptArguments` (data, rewards, tools) and `APPOConfig(GRPOConfig)`.

Every field is a recipe key (flat YAML) and a CLI flag (`--key value`), parsed by `appo_trl.configs.recipes`.
`APPOConfig` adds the rollout strategy (grpo / arpo / aepo / appo), the branching rules of each strategy, the
policy-loss mode and its parameters, and the tool-loop limits. This module holds the fields and their
validation only (invalid combinations fail in `__post_init__`); the behaviour lives in `appo_trl.trainer.trainer` and
the maths in `appo_trl.algorithms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from trl import GRPOConfig, ScriptArguments

from appo_trl.configs.reference import REFERENCE_PRESETS


@dataclass
class APPOScriptArguments(ScriptArguments):
    """Script arguments of `appo train`: where the data comes from and how completions are scored.

    Args:
        dataset_name: hub id, local parquet/jsonl file, or folder of such files.
        prompt_column: column holding the prompt (a string, or a list of chat messages).
        answer_column: column holding the gold answer(s), passed to reward functions as `answer`.
        reward_funcs: reward function names from `appo_trl.rewards` or dotted import paths.
        system_prompt: system message prepended to string prompts (a name from the prompt registry or text).
        skip_bad_rows: drop bad rows (malformed or non-UTF-8 JSON lines, null or empty prompts, prompts too long
            for the model), counted and logged per file, instead of stopping at the first one.
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
    skip_bad_rows: bool = field(
        default=False,
        metadata={
            "help": "Drop bad rows (malformed or non-UTF-8 JSON lines, null or empty prompts, prompts too long for "
            "the model), counted and logged per file; false (default): stop at the first one, naming file and row."
        },
    )


ROLLOUT_STRATEGIES = ("grpo", "arpo", "aepo", "appo")
LOSS_MODES = ("clip", "dual_clip", "future_kl", "entropy_balanced")
# Loss normalisers the custom (non-TRL) loss modes reproduce exactly (TRL `GRPOTrainer._compute_loss`).
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
    the source trajectory's prefix and optimises the initial rollouts only (ARPO, AEPO and APPO papers; every
    place where our defaults differ from the released code is listed in docs/fidelity.md).

    `reference: arpo | aepo | appo` sets every switch of that algorithm to the released implementation's
    behaviour (`REFERENCE_PRESETS`); a switch set explicitly to a value other than its default and other than
    the preset's value is an error; one left at (or set to) its default takes the preset's value.
    """

    reference: str | None = field(
        default=None,
        metadata=_h(
            "`arpo`, `aepo` or `appo`: reproduce that algorithm's released implementation (sets the strategy and "
            "every fidelity switch, see docs/fidelity.md); unset = our defaults."
        ),
    )

    tools: list[str] = field(
        default_factory=list,
        metadata=_h(
            "Tools the agent may call: built-in `python`, `search`, or (tool_format=chat) Python functions / dotted "
            "import paths such as `tools.lookup` (resolved from the recipe's folder, then the working directory). "
            "Schemas come from signatures and docstrings, as in TRL's `GRPOTrainer(tools=...)`."
        ),
    )
    tool_format: str | None = field(
        default=None,
        metadata=_h(
            "`tags` (ARPO: <python>...</python>, results in <result>) or `chat` (the model's chat template: tool "
            "schemas in the prompt, <tool_call> JSON, results as `tool` messages). Default: chat when any tool is "
            "a Python function or dotted path, else tags."
        ),
    )
    tool_config: dict | str | None = field(
        default=None, metadata=_h("Per-tool parameters as a mapping (YAML) or JSON string, keyed by tool name.")
    )
    tool_call_limit: int | None = field(
        default=3,
        metadata=_h(
            "Tool calls allowed per trajectory across all tools (a branch inherits its parent's count); null = no "
            "limit. At the limit the trajectory ends. Each call of a multi-call chat turn counts, and a turn that "
            "would pass the limit runs none of its calls. TRL's `max_tool_calling_iterations` counts turns, as in "
            "TRL, and is checked too; a config appo-trl builds from a GRPOConfig (or for no `args`) has no call "
            "limit, as TRL. Released values: 3 reasoning, 6 deep search."
        ),
    )
    dump_rollouts: int = field(
        default=0,
        metadata=_h(
            "Groups per training step written to `output_dir/rollouts/step_<N>.jsonl` (main process; 0 = off). "
            "`appo rollouts OUTPUT_DIR` shows them as branch trees: fork points, rewards, tool calls."
        ),
    )
    max_nan_reward_steps: int = field(
        default=3,
        metadata=_h(
            "Training rounds in a row in which every reward function returns None/NaN for every completion before "
            "the run stops with an error naming the functions (such rounds train nothing); 0 = never stop."
        ),
    )
    rollout_concurrency: int = field(
        default=64, metadata=_h("Maximum sampler requests in flight per rank (async tool loop).")
    )
    # --- vLLM weight sync (server mode) ---------------------------------------------------------------------
    vllm_weight_sync: str = field(
        default="auto",
        metadata=_h(
            "How weights reach the vLLM server once per round: `nccl` (TRL's weight-transfer engine, CUDA only), "
            "`disk` (safetensors + POST /collective_rpc reload_weights + /reset_prefix_cache; the server needs "
            "VLLM_SERVER_DEV_MODE=1 and must read the folder), or `auto` (disk when the trainer or the server "
            "runs on CPU, else nccl). See appo_trl.vllm.weight_sync."
        ),
    )
    vllm_server_wait_s: float = field(
        default=300.0,
        metadata=_h(
            "Server mode: seconds to wait for a vLLM server that stopped answering (connection refused) to come back "
            "(GET /health) before the run fails. When it is back, the weights are synced again and the round is "
            "re-run (disk sync; with nccl a restart is an error). 0 = fail when the request retries are spent."
        ),
    )
    vllm_request_timeout_s: float = field(
        default=600.0,
        metadata=_h(
            "Server mode: seconds one completion request may wait for its answer (httpx read timeout). A request "
            "that times out is retried (3 retries), then the run fails naming this setting, so a server that "
            "accepted a request and went silent costs at most 4x this. A long generation must fit in it."
        ),
    )
    vllm_weight_sync_dir: str | None = field(
        default=None,
        metadata=_h("disk sync: folder the server reads the weights from (default: a temporary folder)."),
    )
    # --- overlap of generation and training (appo_trl.trainer.async_rounds) ------------------------------------
    max_staleness: int = field(
        default=0,
        metadata=_h(
            "TRL's name. 0 (default): synchronous, each round is sampled on the weights it trains. k >= 1: the next "
            "round generates in the background while the current one trains; a row is trained at most k optimizer "
            "steps after the weights that sampled it (older rounds are dropped, `rollout/stale_rows_dropped`), with "
            "decoupled PPO's correction (TRL's vllm_importance_sampling_* settings). See "
            "appo_trl.trainer.async_rounds."
        ),
    )
    weight_sync_steps: int = field(
        default=1,
        metadata=_h(
            "TRL's name. With max_staleness >= 1: sync the sampler (vLLM server or the in-process sampler copy) "
            "every this many optimizer steps, and whenever the staleness bound needs it (<= max_staleness)."
        ),
    )
    async_fv_policy: str = field(
        default="proximal",
        metadata=_h(
            "APPO with max_staleness >= 1: the weights of the branch-selection forward. `proximal`: the weights of "
            "the round's hand-over, which its loss takes the ratio against (it waits for the optimizer steps of the "
            "round training meanwhile), so FutureValue also measures the policy lag; `sampler`: the in-process "
            "sampler copy, FutureValue as synchronously."
        ),
    )
    # --- several vLLM replicas (vllm_server_base_url lists them) ---------------------------------------------
    vllm_router_policy: str = field(
        default="consistent_hash",
        metadata=_h(
            "When `vllm_server_base_url` lists several replicas, appo starts vLLM's router (`appo-trl[router]`) "
            "in front of them with this `--policy`. `consistent_hash` keeps every request of one tree (sent with "
            "its `X-Session-ID`) on one replica, where its prefix is cached; `round_robin` is the cache-blind "
            "baseline. See appo_trl.vllm.router."
        ),
    )
    vllm_router_port: int | None = field(
        default=None, metadata=_h("Port of the router appo starts (default: a free port on 127.0.0.1).")
    )
    vllm_dtype: str = field(
        default="auto",
        metadata=_h(
            "colocate mode: dtype of the in-process vLLM engine. `auto` is TRL's (vLLM's choice: a float32 "
            "checkpoint runs in bfloat16); `float32`, `bfloat16` or `float16` force it (float32 makes the "
            "sampler's logprobs match a float32 trainer's)."
        ),
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
    empty_segment_entropy: str = field(
        default="nan",
        metadata=_h(
            "ARPO/AEPO: entropy of an empty segment (a tool call right after a result). `nan` (ours): unknown, "
            "ΔH = 0. `zero` (released code): H = 0, so ΔH = −H_root. Example: H_root = 1, τ 0.5, β 0.2 → P 0.5 vs 0.3."
        ),
    )
    advantage_std_eps: float = field(
        default=1e-4,
        metadata=_h(
            "ε in the group advantage (r − mean)/(std + ε) of grpo/arpo/aepo: 1e-4 is TRL's, the released code uses "
            "1e-6 (needs scale_rewards=group). Example: rewards [1, 0], std 0.7071 → A₀ 0.70700 vs 0.70711."
        ),
    )
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
    branch_penalty: float = field(
        default=0.05,
        metadata=_h(
            "AEPO: consecutive-branch penalty; P is multiplied by max(0, 1 − penalty·l) after l rounds in a row "
            "that created branches. 0 disables it."
        ),
    )
    aepo_penalty_scope: str = field(
        default="lineage",
        metadata=_h(
            "AEPO: what the consecutive-branch count l follows. `lineage` (ours): fork points of the trajectory's "
            "own lineage in a row that forked. `prompt` (released code): rounds in a row in which the prompt created "
            "a trajectory (fork or refill), not reset by rounds in which nothing in the batch was created. Example: "
            "a prompt forks in round 1, nobody in round 2 → round-3 P = 1 − 0.5/0.95 = 0.474 (prompt) vs 0.5."
        ),
    )
    entropy_balanced_clipping: bool | None = field(
        default=None,
        metadata=_h(
            "AEPO: entropy-balanced clipping (the clipped upper branch keeps its gradient through "
            "(1+ε_h)·ρ/sg(ρ)); selects `loss_mode: entropy_balanced`. Default: on for aepo, off otherwise."
        ),
    )
    entropy_balanced_advantage: bool | None = field(
        default=None,
        metadata=_h(
            "AEPO: entropy-aware advantage A·clamp(1 + a·z(H_t), 0, 2), actually applied. Default: on for aepo "
            "(the released code sets it but silently skips it because entropy_coeff = 0; `reference: aepo` is off)."
        ),
    )
    entropy_advantage_clamp: bool = field(
        default=True,
        metadata=_h(
            "AEPO: clamp the entropy-aware factor 1 + a·z to [0, 2] (ours); False = released code (z < −1/a flips "
            "the advantage's sign). Example: a = 0.2, z = −6 → factor 0 vs −0.2."
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
    max_branches_per_rollout: str | None = field(
        default="auto",
        metadata=_h(
            "APPO: cap of branch points per initial rollout: `auto` (ours) = ⌈(n − N)/N⌉ + 1, an integer, or null = "
            "no cap (released code). Exceeded only as a fallback to keep the group at exactly n."
        ),
    )
    min_remaining_tokens: int = field(
        default=64, metadata=_h("APPO: a branch point needs at least this many completion tokens after it.")
    )
    exclude_whitespace_punct: bool = field(
        default=True,
        metadata=_h("APPO: False disables the token filter of `branch_token_filter` (every token may be a point)."),
    )
    branch_token_filter: str = field(
        default="whitespace_punct",
        metadata=_h(
            "APPO: tokens that are never branch points. `whitespace_punct` (ours): whitespace- or punctuation-only "
            "and special tokens; `whitespace` (released code): whitespace-only, so `,` and the EOS may be picked; "
            "`none`."
        ),
    )
    branch_allow_last_token: bool = field(
        default=False,
        metadata=_h(
            "APPO: True lets a row's last sampled token (usually the EOS) be a branch point (released code); False "
            "(ours) excludes it: a branch after the EOS only re-samples padding."
        ),
    )
    branch_zscore_scope: str = field(
        default="candidates",
        metadata=_h(
            "APPO: tokens over which Z(H) and Z(FV) are taken per rollout: `candidates` (ours, the tokens that can "
            "be picked) or `loss_mask` (released code: every sampled token, filtered ones included). Example: H = "
            "[0, 1, 5] with the 5 on a filtered token → Z(H) of the middle token +1.0 (candidates) vs −0.46."
        ),
    )
    fv_degeneracy_guard: bool = field(
        default=True,
        metadata=_h(
            "APPO: a rollout whose FV is constant (std < 1e-4, the on-policy case) gets Z(FV) := 1 so BS = Z(H) "
            "(ours); False = released code, where BS ≈ 0 and float noise / token order picks the points."
        ),
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
        default=0.2,
        metadata=_h(
            "future_kl: clip ε_f of the future importance weight (also the FV clip of APPO's branch score). 0 is "
            "the released code's 'no clip' (weight ≤ 10) and is accepted only with `reference: appo`."
        ),
    )
    future_kl_normalizer: str = field(
        default="loss_type",
        metadata=_h(
            "future_kl: denominator when the safety rule drops sequences. `loss_type` (ours): TRL's normaliser, "
            "dropped tokens still counted; `kept_tokens` (released code, needs loss_type=bnpo): token mean over the "
            "kept rows of the micro-batch. Example: one of two 3-token rows dropped, kept loss −6 → −1.0 vs −2.0."
        ),
    )
    kl_clamp: float | None = field(
        default=None,
        metadata=_h(
            "Clamp of the per-token k3 KL estimate to [−c, c] (only with beta ≠ 0): null (ours, TRL) or 10 "
            "(released verl code). Example: logπ − logπ_ref = 3 → k3 = e³ − 4 = 16.09, clamped 10."
        ),
    )
    future_kl_weight: float = field(default=1.0, metadata=_h("future_kl: weight b in Ã = A·(1 + b·f)."))
    future_kl_clip_high_only: bool = field(
        default=True, metadata=_h("future_kl: clip the future weight to [1, 1+ε_f] instead of [1−ε_f, 1+ε_f].")
    )
    future_kl_safety_threshold: float = field(
        default=6.0, metadata=_h("future_kl: for A < 0 and ratio above this, the future weight is capped to [0.8, 1].")
    )
    tree_forward: bool = field(
        default=True,
        metadata=_h(
            "Train on the tree: every trainer forward (loss, TRL's old-logp pass, the reference pass, APPO's "
            "branch scoring) folds its rows into prefix tries and sends each shared token through the model once "
            "(TRL's `packing: tree` of AsyncGRPO, here for every strategy). Exact: same logps, entropies, loss and "
            "gradients as the row-by-row forward (float32 on CPU, 1e-5). Micro-batches then hold whole groups. "
            "On a GPU the attention uses flash_attn's varlen kernel, else FlexAttention, else the CPU path; these "
            "GPU kernels and bf16 exactness have not been run on a GPU yet (no GPU has been lent to this project "
            "so far): only the FlexAttention forward is tested, on CPU."
        ),
    )
    tree_token_budget: int = field(
        default=16384,
        metadata=_h(
            "tree_forward: most unique tokens in one trie (one forward); it bounds activation memory as "
            "`per_device_train_batch_size` rows do row-wise. A row longer than the budget is forwarded alone. "
            "Each trie forwards the shared prompt once, so a group split over several tries forwards it once per "
            "trie: at the paper recipes' shapes (prompt 1,536 tokens, n = 16, completions up to 4,096) the default "
            "holds only 3 full-length rows, so the prompt is forwarded about 6 times per group. To forward it once "
            "per group, size the budget to prompt + n x (max_completion_length + 1) (67,087 there; fewer tokens "
            "than the row-wise micro-batch of the same n rows, 90,112) if activation memory allows, with "
            "`per_device_train_batch_size` a multiple of n."
        ),
    )

    def __post_init__(self):
        self._apply_reference()
        super().__post_init__()
        self._validate_appo()
        self._warn_no_effect()

    def to_dict(self):
        """`TrainingArguments.to_dict` with Python tool functions written as their dotted names (for logging)."""
        from appo_trl.tools.callables import tool_label

        out = super().to_dict()
        if out.get("tools"):
            out["tools"] = [tool_label(t) for t in out["tools"]]
        return out

    def _apply_reference(self):
        """Set every switch of `REFERENCE_PRESETS[reference]`; refuse an explicit conflicting value."""
        if self.reference is None:
            return
        if self.reference not in REFERENCE_PRESETS:
            self._fail(f"reference={self.reference!r}; choose one of {tuple(REFERENCE_PRESETS)}.")
        defaults = {f.name: f.default for f in fields(self)}
        for name, value in REFERENCE_PRESETS[self.reference].items():
            current = getattr(self, name)
            if current == value:
                continue
            if current != defaults[name]:
                self._fail(
                    f"reference={self.reference} sets {name}={value!r} (the released code's behaviour), but the "
                    f"config sets {name}={current!r}; remove one of them."
                )
            setattr(self, name, value)

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
        if self.tree_forward and self.tree_token_budget < 1:
            self._fail(f"tree_token_budget={self.tree_token_budget} must be >= 1 (unique tokens per forward).")
        if self.rollout_strategy not in ROLLOUT_STRATEGIES:
            self._fail(f"rollout_strategy={self.rollout_strategy!r}; choose one of {ROLLOUT_STRATEGIES}.")
        if self.initial_rollouts is None:
            self.initial_rollouts = n if self.rollout_strategy == "grpo" else max(1, n // 2)
        if not 1 <= self.initial_rollouts <= n:
            self._fail(f"initial_rollouts={self.initial_rollouts} must be in [1, num_generations={n}].")
        if self.rollout_strategy == "grpo" and self.initial_rollouts != n:
            self._fail("rollout_strategy=grpo does not branch: initial_rollouts must equal num_generations.")
        is_aepo = self.rollout_strategy == "aepo"
        if self.entropy_balanced_clipping is None:  # `rollout_strategy: aepo` alone is AEPO
            self.entropy_balanced_clipping = is_aepo and self.loss_mode in (None, "entropy_balanced")
        if self.entropy_balanced_advantage is None:
            self.entropy_balanced_advantage = is_aepo
        if self.loss_mode is None:
            self.loss_mode = DEFAULT_LOSS_MODE[self.rollout_strategy]
            if is_aepo and self.entropy_balanced_clipping:
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
            "empty_segment_entropy": ("nan", "zero"),
            "aepo_penalty_scope": ("lineage", "prompt"),
            "branch_token_filter": ("whitespace_punct", "whitespace", "none"),
            "branch_zscore_scope": ("candidates", "loss_mask"),
            "future_kl_normalizer": ("loss_type", "kept_tokens"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                self._fail(f"{name}={getattr(self, name)!r}; choose one of {allowed}.")
        if self.beam_size < 1:
            self._fail(f"beam_size={self.beam_size} must be >= 1.")
        if self.vllm_server_wait_s < 0:
            self._fail(f"vllm_server_wait_s={self.vllm_server_wait_s} must be >= 0 (0 = do not wait).")
        if not self.vllm_request_timeout_s > 0:
            self._fail(f"vllm_request_timeout_s={self.vllm_request_timeout_s} must be > 0 (seconds per request).")
        if self.max_nan_reward_steps < 0:
            self._fail(f"max_nan_reward_steps={self.max_nan_reward_steps} must be >= 0 (0 = never stop).")
        if self.dump_rollouts < 0:
            self._fail(f"dump_rollouts={self.dump_rollouts} must be >= 0 (groups written per step).")
        for name in ("branch_probability", "reward_scale_discount", "future_kl_clip_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                self._fail(f"{name}={getattr(self, name)} must be in [0, 1].")
        if self.future_kl_clip_ratio == 0.0 and self.reference != "appo":
            self._fail(
                "future_kl_clip_ratio=0 means 'no clip' (weight clamped to ≤ 10) in the released APPO code; set "
                "reference: appo to use that meaning, or a ratio in (0, 1]."
            )
        if self.future_kl_normalizer == "kept_tokens" and (self.loss_mode != "future_kl" or self.loss_type != "bnpo"):
            self._fail(
                "future_kl_normalizer=kept_tokens is verl's token mean over the kept rows of a micro-batch: it needs "
                f"loss_mode=future_kl and loss_type=bnpo (got {self.loss_mode!r}, {self.loss_type!r})."
            )
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            self._fail(f"kl_clamp={self.kl_clamp} must be > 0 (or null for no clamp).")
        if not self.advantage_std_eps > 0:
            self._fail(f"advantage_std_eps={self.advantage_std_eps} must be > 0.")
        if self.advantage_std_eps != 1e-4 and self.scale_rewards not in ("group", True):
            self._fail(f"advantage_std_eps needs scale_rewards=group (got {self.scale_rewards!r}).")
        if not 0.0 < self.fv_gamma <= 1.0:
            self._fail(f"fv_gamma={self.fv_gamma} must be in (0, 1].")
        if self.clip_ratio_c <= 1.0:
            self._fail(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound).")
        if self.future_kl_decay_rate <= 0:
            self._fail(f"future_kl_decay_rate={self.future_kl_decay_rate} must be > 0.")
        if (
            (self.tool_call_limit is not None and self.tool_call_limit < 0)
            or (self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0)
            or self.entropy_tokens < 1
            or self.entropy_topk < 1
            or self.min_remaining_tokens < 0
        ):
            self._fail(
                "tool_call_limit, max_tool_calling_iterations, min_remaining_tokens must be >= 0 (the limits: or "
                "null) and entropy_tokens, entropy_topk >= 1."
            )
        self._resolve_branch_cap()
        if self.loss_mode != "clip" or (self.kl_clamp is not None and self.beta != 0.0):
            if self.loss_type not in CUSTOM_LOSS_TYPES:
                self._fail(
                    f"loss_mode={self.loss_mode} supports loss_type in {CUSTOM_LOSS_TYPES} (got {self.loss_type!r})."
                )
            if self.top_entropy_quantile < 1.0:
                self._fail(
                    f"loss_mode={self.loss_mode} does not support top_entropy_quantile < 1; use loss_mode=clip."
                )
        if self.tool_format not in (None, "tags", "chat"):
            self._fail(f"tool_format={self.tool_format!r}; choose one of ('tags', 'chat').")
        if isinstance(self.tools, str) or callable(self.tools):  # `tools: python` in YAML, `tools=func` in Python
            self.tools = [self.tools]
        if self.vllm_weight_sync not in ("auto", "nccl", "disk"):
            self._fail(f"vllm_weight_sync must be auto, nccl or disk (got {self.vllm_weight_sync!r}).")
        self._validate_replicas()
        if self.vllm_dtype not in ("auto", "float32", "bfloat16", "float16"):
            self._fail(f"vllm_dtype={self.vllm_dtype!r}; choose auto, float32, bfloat16 or float16.")
        if self.vllm_dtype != "auto" and not (self.use_vllm and self.vllm_mode == "colocate"):
            self._fail("vllm_dtype applies to vllm_mode=colocate only (a server takes --dtype at launch).")
        if self.use_vllm and self.vllm_mode not in ("server", "colocate"):
            self._fail(f"vllm_mode={self.vllm_mode!r}; choose server (vllm serve) or colocate (in-process vLLM).")
        if self.use_vllm and self.vllm_mode == "colocate" and self.vllm_tensor_parallel_size > 1:
            self._fail(
                f"vllm_mode=colocate with vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} is not supported "
                "(each rank's tool loop sends its own requests, a tensor-parallel group must send the same ones); "
                f"use vllm_mode=server (`vllm serve MODEL --tensor-parallel-size {self.vllm_tensor_parallel_size}`)."
            )
        self._validate_batching()
        self._validate_async()

    def _validate_async(self):
        """`max_staleness` / `weight_sync_steps`: settings the background rounds can honour (see async_rounds)."""
        k, w = self.max_staleness, self.weight_sync_steps
        if k < 0 or w < 1:
            self._fail(f"max_staleness={k} must be >= 0 and weight_sync_steps={w} >= 1.")
        if self.async_fv_policy not in ("proximal", "sampler"):
            self._fail(f"async_fv_policy={self.async_fv_policy!r}; choose one of ('proximal', 'sampler').")
        if k == 0:
            if w != 1:
                self._fail(f"weight_sync_steps={w} needs max_staleness >= 1 (a synchronous run syncs every round).")
            return
        if w > k:
            self._fail(f"weight_sync_steps={w} > max_staleness={k}: rows would be older than the bound allows.")
        every, ga = self.steps_per_generation * self.num_iterations, self.gradient_accumulation_steps
        if every % ga != 0 or 2 * (every // ga) - 1 > k:
            self._fail(
                f"max_staleness={k} with steps_per_generation × num_iterations = {every} and "
                f"gradient_accumulation_steps = {ga}: a round must span a whole number m of optimizer steps with "
                "2m − 1 <= max_staleness (its last rows train m − 1 steps after its first)."
            )
        if self.use_vllm and self.vllm_mode == "colocate":
            self._fail(
                f"max_staleness={k} with vllm_mode=colocate: the in-process vLLM engine would be synced (and put to "
                "sleep) while a background round generates on it; use vllm_mode=server, or max_staleness: 0."
            )
        if self.async_fv_policy == "sampler" and self.use_vllm:
            self._fail("async_fv_policy=sampler scores with the in-process sampler copy; with use_vllm use proximal.")
        if not self.vllm_importance_sampling_correction:
            self._fail(
                "max_staleness >= 1 trains on rows sampled by older weights: it needs the behaviour-policy "
                "correction, vllm_importance_sampling_correction=True (TRL's default)."
            )

    def _validate_replicas(self):
        """`vllm_server_base_url`: one URL or several (a list, or one string split at commas); the router policy."""
        from appo_trl.vllm.replicas import parse_server_urls
        from appo_trl.vllm.router import POLICIES, RouterError, router_executable

        try:
            urls = parse_server_urls(self.vllm_server_base_url)
        except ValueError as exc:
            self._fail(str(exc))
        if urls:
            self.vllm_server_base_url = ",".join(urls)  # TRL's field is a str: a list is kept comma-joined
        if self.vllm_router_policy not in POLICIES:
            self._fail(f"vllm_router_policy={self.vllm_router_policy!r}; choose one of {POLICIES}.")
        if self.use_vllm and len(urls) > 1:
            try:
                router_executable()
            except RouterError as exc:
                self._fail(str(exc))

    def _resolve_branch_cap(self):
        """`auto` → ⌈(n − N)/N⌉ + 1; null / "none" → no cap (None); an integer (or its string) → that cap (≥ 1)."""
        cap = self.max_branches_per_rollout
        if isinstance(cap, str) and cap.strip().lower() in ("none", "null"):
            cap = None
        if cap == "auto":
            cap = math.ceil(self.branch_rows_per_prompt / self.initial_rollouts) + 1
        elif cap is not None:
            try:
                cap = int(cap)
            except (TypeError, ValueError):
                self._fail(f"max_branches_per_rollout={cap!r}; use auto, a positive integer or null (no cap).")
            if cap < 1:
                self._fail(f"max_branches_per_rollout={cap} must be >= 1 (null = no cap).")
        self.max_branches_per_rollout = cap

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
