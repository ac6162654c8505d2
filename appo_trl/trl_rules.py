"""TRL's own rules, copied where appo-trl must apply them to rows TRL did not build: one function per rule.

Floor 1 (it imports torch and TRL only), so the config's checks (`generate_every`) and the trainer read the same copy.

Each was read from `GRPOTrainer._generate_and_score_completions` of trl `TRL_VERSION`; when TRL moves, this is the
file to read again (its private attributes: `trainer/trl_seams.py`; as TRL's own code, these copies read two of them,
`_tokenizer` and `_multi_environment`, which `tests/trainer/test_trl_seams.py` lists). The rules: whether TRL runs its no-grad old-logp pass
(`runs_old_logp_pass`), the vLLM importance-sampling ratio (`importance_ratio`), the reference forward, or the
adapter-free / "ref" adapter one under PEFT (`reference_logps`), and truncated-completion masking
(`truncated_rows`), and the reward rule of rows every reward function left unscored (`scored_rewards`,
`unscorable_rows`, `zero_unscorable`), the environments' reset and observation rules (`reset_kwargs`,
`observed_prompt`, `environment_prompt_ids`), how often a generation batch starts (`generate_every`), its generation metrics (`log_generation`), and the layout of its scored batch (`extend_scored_batch`, which appends
rows handed over as plain data, such as an agent run's chain rows, padded as TRL pads each entry). Users: the round runner (`trainer/rounds.py`: the old-logp cache, the rewards a
strategy's own advantages read) and an agent's chain rows (`trainer/chain_rows.py`). What this does not do: decide when a
rule applies beyond TRL's own condition.

`TRL_COPIES` names, for each rule, the TRL function it was read from and the SHA-256 of that function's source in
`TRL_VERSION`; `tests/trainer/test_trl_rules.py` fails naming the copy when TRL's source moves.
"""

from __future__ import annotations

import math

import torch

TRL_VERSION = "1.16.0"  # the TRL these rules (and `trl_seams`' seams) were read from

_GRPO = "trl.trainer.grpo_trainer:GRPOTrainer"
_SCORE = f"{_GRPO}._generate_and_score_completions"
_SCORE_SHA = "1fa48922792dcd5c72da155cfe99db477771a7c61cde15519fe8c86d0cdc0b65"
# copy -> (the TRL function it was read from, "module:qualname", and the sha256 of its source in TRL_VERSION)
TRL_COPIES: dict[str, tuple[str, str]] = {
    "runs_old_logp_pass": (_SCORE, _SCORE_SHA),
    "importance_ratio": (_SCORE, _SCORE_SHA),
    "reference_logps": (_SCORE, _SCORE_SHA),
    "truncated_rows": (_SCORE, _SCORE_SHA),
    "unscorable_rows": (_SCORE, _SCORE_SHA),
    "scored_rewards": (_SCORE, _SCORE_SHA),
    "zero_unscorable": (_SCORE, _SCORE_SHA),
    "extend_scored_batch": (_SCORE, _SCORE_SHA),
    "reset_kwargs": (_SCORE, _SCORE_SHA),
    "observed_prompt": (_SCORE, _SCORE_SHA),
    "environment_prompt_ids": (
        f"{_GRPO}._tokenize_prompts",
        "d2d27f7c9bfda85f1c3225785fa2f09466c428803be6afa8a6c46290f7171a15",
    ),
    "log_generation": (f"{_GRPO}._generate", "2a27fdf8f5e6f3562508eec3efb9e9dade2e0bf810de5031cdfab429d0a048f2"),
    "generate_every": (f"{_GRPO}._prepare_inputs", "f824e7fb0714795697c9b4d574de1e139dd5f4404c2554e92cf1db7f60fa6c96"),
}


def generate_every(args) -> int:
    """TRL's `generate_every`: the training micro-steps one generation batch serves (`steps_per_generation x
    num_iterations` of `args`)."""
    return args.steps_per_generation * args.num_iterations


def log_generation(trainer, mode: str, metrics, tokens: torch.Tensor, lengths: torch.Tensor,
                   truncated: torch.Tensor) -> None:  # fmt: skip
    """TRL's generation metrics under its keys: `num_tokens` (the round's gathered prompt + completion `tokens` added in
    training), the completions' mean / min / max `lengths` (gathered, one per row), the share `truncated`, and the
    lengths of the completions that ended (0 when none did)."""
    if mode == "train":
        trainer.state.num_input_tokens_seen += tokens.item()
    metrics["num_tokens"] = [trainer.state.num_input_tokens_seen]
    metrics["completions/mean_length"].append(lengths.float().mean().item())
    metrics["completions/min_length"].append(lengths.float().min().item())
    metrics["completions/max_length"].append(lengths.float().max().item())
    metrics["completions/clipped_ratio"].append(truncated.float().mean().item())
    ended = lengths[~truncated].float()
    ended = ended if ended.numel() else torch.zeros(1, device=lengths.device)
    metrics["completions/mean_terminated_length"].append(ended.mean().item())
    metrics["completions/min_terminated_length"].append(ended.min().item())
    metrics["completions/max_terminated_length"].append(ended.max().item())


def reset_kwargs(trainer, row: dict) -> dict:
    """What TRL passes to an environment's `reset()` for dataset `row` (no `environment` key with several)."""
    return {k: v for k, v in row.items() if k != "environment"} if trainer._multi_environment else row


def observed_prompt(row: dict, observation) -> list[dict]:
    """The prompt TRL samples `row` on when `reset()` returned `observation`: appended to the last message."""
    prompt = row.get("prompt", [{"role": "user", "content": ""}])  # TRL's default when the environment owns the data
    if observation is not None:
        content = prompt[-1]["content"]
        if isinstance(observation, list) and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if isinstance(observation, str) and isinstance(content, list):
            observation = [{"type": "text", "text": observation}]
        prompt = prompt[:-1] + [{**prompt[-1], "content": content + observation}]
    return prompt


def environment_prompt_ids(trainer, prompt: list[dict], tools: list | None) -> list[int]:
    """The ids of `prompt` rendered with an environment's `tools` as TRL's `_tokenize_prompts` renders them."""
    out = trainer.processing_class.apply_chat_template(
        conversation=[prompt], tools=tools or None, chat_template=trainer.chat_template, add_generation_prompt=True,
        tokenize=True, return_dict=True, **trainer.chat_template_kwargs,
    )  # fmt: skip
    return list(out["input_ids"][0])


# per-row entries of TRL's `_generate_and_score_completions` output, with the value TRL pads them with
_PROMPT_KEYS = {"prompt_ids": None, "prompt_mask": 0}  # left-padded (None: the pad token)
_COMPLETION_KEYS = {"completion_ids": None, "completion_mask": 0, "tool_mask": 1, "sampling_per_token_logps": 0.0,
                    "old_per_token_logps": 0.0, "ref_per_token_logps": 0.0, "advantages": 0.0,
                    "importance_sampling_ratio": 1.0}  # fmt: skip


def check_extendable(out: dict, num_rows: int) -> None:
    """RuntimeError naming the per-row entries of TRL's scored batch `out` whose layout `extend_scored_batch` does
    not know (a TRL that added one: read `_generate_and_score_completions` again)."""
    unknown = [k for k, v in out.items() if _per_row(v, num_rows) and k not in _PROMPT_KEYS and k not in
               _COMPLETION_KEYS]  # fmt: skip
    if unknown:
        raise RuntimeError(f"rows cannot extend TRL's scored batch entries {unknown} (trl {TRL_VERSION}'s layout)")


def extend_scored_batch(out: dict, new: dict, pad_id: int) -> dict:
    """TRL's scored batch `out` with the rows of `new` (the same per-row entries, as tensors) appended: prompts
    left-padded, completions right-padded to the wider of the two, as TRL pads them; other entries kept."""
    merged = dict(out)
    for key in out:
        if key in new:
            merged[key] = _concat(out[key], new[key], key, pad_id)
    return merged


def _per_row(value, num_rows: int) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == num_rows) or (
        isinstance(value, list) and len(value) == num_rows
    )


def _concat(old: torch.Tensor, new: torch.Tensor, key: str, pad_id: int) -> torch.Tensor:
    """Rows of `old` then `new`, both padded to the wider one as TRL pads `key` (prompts left, completions right)."""
    if old.dim() == 1 or old.size(1) == new.size(1):  # (B,) or (B, 1): advantages, sequence-level ratios
        return torch.cat([old, new.to(old)], dim=0)
    value = _PROMPT_KEYS.get(key, _COMPLETION_KEYS.get(key))
    value = pad_id if value is None else value
    width = max(old.size(1), new.size(1))
    left = key in _PROMPT_KEYS

    def widen(x):
        pad = x.new_full((x.size(0), width - x.size(1)), value)
        return torch.cat([pad, x] if left else [x, pad], dim=1)

    return torch.cat([widen(old), widen(new.to(old))], dim=0)


def unscorable_rows(rewards_per_func: torch.Tensor) -> torch.Tensor:
    """TRL's unscorable rows: (N,) bool, True where every reward function returned None (NaN in `rewards_per_func`)."""
    return torch.isnan(rewards_per_func).all(dim=1)


def scored_rewards(trainer, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """TRL's reward of each row under `multi_objective_aggregation: sum_then_normalize`: the weighted `nansum` over the
    functions, NaN for an unscorable row, so no baseline counts it (a strategy's own advantages skip NaN rows)."""
    weights = trainer.reward_weights.to(rewards_per_func.device).unsqueeze(0)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards[unscorable_rows(rewards_per_func)] = math.nan
    return rewards


def zero_unscorable(advantages: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """TRL's last step of the advantages: an unscorable row (reward NaN) carries no signal, its advantage is 0 (a
    (B,) or (B, T) tensor; every token of the row)."""
    out = torch.nan_to_num(advantages, nan=0.0)
    out[torch.isnan(rewards).to(out.device)] = 0.0
    return out


def runs_old_logp_pass(trainer) -> bool:
    """Whether TRL computes `old_per_token_logps` with its no-grad forward: when a generation batch is trained over
    gradient-accumulation steps it does not align with, or with vLLM's importance-sampling correction."""
    misaligned = trainer.args.gradient_accumulation_steps % generate_every(trainer.args) != 0
    return misaligned or bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def importance_ratio(trainer, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (`vllm_importance_sampling_mode`: token or sequence, truncate or mask)
    of rows with old logps `old`, sampler logps `sampling` and loss mask `mask` (completion mask x tool mask)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    mode = trainer.vllm_importance_sampling_mode
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff)
    lo, hi = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo, hi = -float("inf") if lo is None else lo, float("inf") if hi is None else hi
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def reference_logps(trainer, logps):
    """TRL's reference per-token logps: `logps(model)` on its `ref_model`, or, under PEFT (no `ref_model`), on the
    policy with its adapter off, or with the "ref" adapter where the model has one. Call it without gradients."""
    from trl.trainer.utils import use_adapter

    if trainer.ref_model is not None:
        return logps(trainer.ref_model)
    model = trainer.accelerator.unwrap_model(trainer.model)
    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
        return logps(trainer.model)


def truncated_rows(trainer, completions: list[list[int]]) -> torch.Tensor:
    """TRL's `mask_truncated_completions` rule: a (R, 1) bool column, True for a completion that does not end in an
    EOS or the pad token (its row leaves the loss: multiply its masks by `~column`)."""
    ends = [*trainer.eos_token_ids, trainer._tokenizer.pad_token_id]
    return torch.tensor([c[-1] not in ends for c in completions]).unsqueeze(1)


__all__ = ["TRL_COPIES", "TRL_VERSION", "check_extendable", "environment_prompt_ids", "extend_scored_batch",
           "generate_every", "importance_ratio", "log_generation", "observed_prompt", "reference_logps",
           "reset_kwargs", "runs_old_logp_pass", "scored_rewards", "truncated_rows", "unscorable_rows",
           "zero_unscorable"]  # fmt: skip
