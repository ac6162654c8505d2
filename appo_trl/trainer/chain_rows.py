"""Chain rows of agent runs: a run's other chains joined to TRL's scored batch, each with its run's advantage.

An agent that rewrites its history leaves one run with several chains of exact ids (`AgentSession.chain_rows`). TRL
scores one row per run (`num_generations` per prompt: rewards and group statistics are over runs); `add_chain_rows`
then hands each kept run's chain rows over as plain data (`trl_rules.extend_scored_batch` extends TRL's output dict
with them): their exact ids, tool mask and sampler logprobs, the run's advantage (token-level advantages: the run's
value at its first token, since an earlier chain precedes every branch point of its run), and the per-token logps
TRL computes for its rows (old, reference, vLLM's importance ratio) from the same forwards. What it does not do:
sample, score, or decide which runs reach the loss (the strategy's `keep`).

Under several processes a rank short of chain rows pads its forwards with `padding_rows` (pad tokens, in no mask),
never with a real row, and drops them before `trl_rules.extend_scored_batch`.
"""

from __future__ import annotations

import torch

from appo_trl import trl_rules
from appo_trl.algorithms.rows import pad_rows
from appo_trl.trainer import trl_seams
from appo_trl.trainer.rows import left_pad


def add_chain_rows(trainer, out: dict, rows: list, keep: list[bool]) -> tuple[dict, list[bool]]:
    """`out` (TRL's batch of `rows`, one per run) with every run's chain rows appended, and `keep` extended (a chain
    row follows its run). Under several processes every rank runs the same forwards: a rank with fewer chain rows
    adds `padding_rows` to its forwards and drops them after, so no collective depends on local counts."""
    chains = [(i, f) for i, r in enumerate(rows) for f in r.chain_rows]
    needs_forward = "old_per_token_logps" in out or "ref_per_token_logps" in out
    most = len(chains)
    if needs_forward and trainer.accelerator.num_processes > 1:
        count = torch.tensor([len(chains)], device=trainer.accelerator.device)
        most = int(trainer.accelerator.gather(count).max().item())
    if most == 0:
        return out, list(keep)
    trl_rules.check_extendable(out, len(rows))
    pad_id = trl_seams.tokenizer(trainer).pad_token_id
    runs = [i for i, _ in chains]
    real, padding = _row_lists([f for _, f in chains]), padding_rows(most - len(chains), pad_id)
    lists = {k: real[k] + padding[k] for k in real}
    prompt_ids, prompt_mask = left_pad(lists["prompt_ids"], pad_id)
    completion_ids = pad_rows(lists["completion_ids"], pad_id)
    completion_mask = pad_rows(lists["completion_mask"], 0)
    tool_mask = pad_rows(lists["tool_mask"], 1)
    if trainer.mask_truncated_completions:  # TRL's rule: a row that does not end in EOS / pad is masked out
        cut = trl_rules.truncated_rows(trainer, lists["completion_ids"])
        completion_mask, tool_mask = completion_mask * ~cut, tool_mask * ~cut
    device = out["completion_ids"].device
    new = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
           "completion_mask": completion_mask, "tool_mask": tool_mask}  # fmt: skip
    new = {k: v.to(device) for k, v in new.items()}
    if "sampling_per_token_logps" in out:
        new["sampling_per_token_logps"] = pad_rows(lists["sampling_per_token_logps"], 0.0).to(device)
    new.update(_forward_logps(trainer, out, new))
    if not chains:  # this rank only kept the other ranks' forwards company
        return out, list(keep)
    adv = out["advantages"]
    run_adv = adv[runs] if adv.dim() == 1 else adv[runs, :1].expand(-1, completion_ids.size(1))
    if adv.dim() == 2:
        run_adv = run_adv * completion_mask[: len(chains)].to(run_adv)
    new = {k: v[: len(chains)] for k, v in new.items()}  # the padding rows end here
    new["advantages"] = run_adv
    return trl_rules.extend_scored_batch(out, new, pad_id), list(keep) + [keep[i] for i in runs]


def padding_rows(k: int, pad_id: int) -> dict[str, list[list]]:
    """`k` rows that only keep other ranks' forwards company, per entry of `_row_lists`: a one-token prompt and a
    one-token completion, both the pad token, completion and tool mask 0 and sampler logprob 0.0 (no loss could
    count them); the prompt token stays attended (a row with no attended token can turn attention to NaN). A chain
    row has a prompt and a sampled token, so a padding row never widens the forwards."""
    return {"prompt_ids": [[pad_id]] * k, "completion_ids": [[pad_id]] * k, "completion_mask": [[0]] * k,
            "tool_mask": [[0]] * k, "sampling_per_token_logps": [[0.0]] * k}  # fmt: skip


def _row_lists(trajs: list) -> dict[str, list[list]]:
    """The ragged per-row lists of chain rows `trajs`, before padding: ids, masks and sampler logprobs."""
    return {"prompt_ids": [list(t.prompt_ids) for t in trajs], "completion_ids": [list(t.completion_ids) for t in trajs],
            "completion_mask": [[1] * len(t.completion_ids) for t in trajs],
            "tool_mask": [[int(m) for m in t.loss_mask] for t in trajs],
            "sampling_per_token_logps": [[float(x) for x in t.logprobs] for t in trajs]}  # fmt: skip


def _forward_logps(trainer, out: dict, new: dict) -> dict:
    """The old / reference logps (and vLLM's importance ratio) of the chain rows, as TRL computes them for its rows."""
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
        return trl_seams.per_token_logps_and_entropies(trainer, model, ids, mask, width, batch_size=batch_size)[0]

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


__all__ = ["add_chain_rows", "padding_rows"]
