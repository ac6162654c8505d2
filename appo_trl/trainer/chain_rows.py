"""Forked rows of agent runs: a run's other chains joined to TRL's scored batch, each with its run's advantage.

An agent that rewrites its history leaves one run with several chains of exact ids (`AgentSession.chain_rows`). TRL
scores one row per run (`num_generations` per prompt: rewards and group statistics are over runs); `add_chain_rows`
then appends each kept run's fork rows to TRL's output dict: their exact ids, tool mask and sampler logprobs, the
run's advantage (token-level advantages: the run's value at its first token, since a fork precedes every branch
point of its run), and the per-token logps TRL computed for the batch (old, reference, vLLM's importance ratio)
from the same forwards. What it does not do: sample, score, or decide which runs reach the loss (the strategy's
`keep`).
"""

from __future__ import annotations

import torch

from appo_trl.trainer import trl_rules
from appo_trl.trainer.rows import left_pad, pad_rows

# per-row entries of TRL 1.16's `_generate_and_score_completions` output, with the value TRL pads them with
_PROMPT_KEYS = {"prompt_ids": None, "prompt_mask": 0}  # left-padded (None: the pad token)
_COMPLETION_KEYS = {"completion_ids": None, "completion_mask": 0, "tool_mask": 1, "sampling_per_token_logps": 0.0,
                    "old_per_token_logps": 0.0, "ref_per_token_logps": 0.0, "advantages": 0.0,
                    "importance_sampling_ratio": 1.0}  # fmt: skip


def add_chain_rows(trainer, out: dict, rows: list, keep: list[bool]) -> tuple[dict, list[bool]]:
    """`out` (TRL's batch of `rows`, one per run) with every run's fork rows appended, and `keep` extended (a fork
    row follows its run). Under several processes every rank runs the same forwards (a rank with fewer forks pads
    with its first row, then drops it), so no collective depends on local counts."""
    forks = [(i, f) for i, r in enumerate(rows) for f in r.chain_rows]
    needs_forward = "old_per_token_logps" in out or "ref_per_token_logps" in out
    most = len(forks)
    if needs_forward and trainer.accelerator.num_processes > 1:
        count = torch.tensor([len(forks)], device=trainer.accelerator.device)
        most = int(trainer.accelerator.gather(count).max().item())
    if most == 0:
        return out, list(keep)
    unknown = [k for k, v in out.items() if _per_row(v, len(rows)) and k not in _PROMPT_KEYS and k not in
               _COMPLETION_KEYS]  # fmt: skip
    if unknown:
        raise RuntimeError(f"forked agent rows cannot extend TRL's batch entries {unknown}")
    pad_id = trainer._tokenizer.pad_token_id
    runs = [i for i, _ in forks]
    trajs = [f for _, f in forks] + [rows[0]] * (most - len(forks))  # padding rows: forwards only
    prompt_ids, prompt_mask = left_pad([list(t.prompt_ids) for t in trajs], pad_id)
    completion_ids = pad_rows([list(t.completion_ids) for t in trajs], pad_id)
    completion_mask = pad_rows([[1] * len(t.completion_ids) for t in trajs], 0)
    tool_mask = pad_rows([[int(m) for m in t.loss_mask] for t in trajs], 1)
    if trainer.mask_truncated_completions:  # TRL's rule: a row that does not end in EOS / pad is masked out
        cut = trl_rules.truncated_rows(trainer, [t.completion_ids for t in trajs])
        completion_mask, tool_mask = completion_mask * ~cut, tool_mask * ~cut
    device = out["completion_ids"].device
    new = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
           "completion_mask": completion_mask, "tool_mask": tool_mask}  # fmt: skip
    new = {k: v.to(device) for k, v in new.items()}
    if "sampling_per_token_logps" in out:
        new["sampling_per_token_logps"] = pad_rows([[float(x) for x in t.logprobs] for t in trajs], 0.0).to(device)
    new.update(_forward_logps(trainer, out, new))
    if not forks:  # this rank only kept the other ranks' forwards company
        return out, list(keep)
    adv = out["advantages"]
    run_adv = adv[runs] if adv.dim() == 1 else adv[runs, :1].expand(-1, completion_ids.size(1))
    if adv.dim() == 2:
        run_adv = run_adv * completion_mask[: len(forks)].to(run_adv)
    new = {k: v[: len(forks)] for k, v in new.items()}
    new["advantages"] = run_adv
    merged = dict(out)
    for key in list(out):
        if key in new:
            merged[key] = _concat(out[key], new[key], key, pad_id)
    return merged, list(keep) + [keep[i] for i in runs]


def _forward_logps(trainer, out: dict, new: dict) -> dict:
    """The old / reference logps (and vLLM's importance ratio) of the fork rows, as TRL computes them for its rows."""
    from trl.models.utils import disable_gradient_checkpointing

    got = {}
    if "old_per_token_logps" not in out and "ref_per_token_logps" not in out:
        return got
    ids = torch.cat([new["prompt_ids"], new["completion_ids"]], dim=1)
    mask = torch.cat([new["prompt_mask"], new["completion_mask"]], dim=1)
    width = new["completion_ids"].size(1)
    args = trainer.args
    batch_size = args.per_device_train_batch_size if trainer.model.training else args.per_device_eval_batch_size

    def logps(model):
        return trainer._get_per_token_logps_and_entropies(model, ids, mask, width, batch_size=batch_size)[0]

    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, args.gradient_checkpointing_kwargs):
        if "old_per_token_logps" in out:
            got["old_per_token_logps"] = logps(trainer.model)
        if "ref_per_token_logps" in out:  # the ref model, or under PEFT the adapter-free / "ref" adapter forward
            got["ref_per_token_logps"] = trl_rules.reference_logps(trainer, logps)
    if "importance_sampling_ratio" in out:
        mask = new["completion_mask"] * new["tool_mask"]
        got["importance_sampling_ratio"] = trl_rules.importance_ratio(
            trainer, got["old_per_token_logps"], new["sampling_per_token_logps"], mask
        )
    return got


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


__all__ = ["add_chain_rows"]
