"""Small tensor helpers shared by the trainer modules (padding ragged id rows as TRL pads prompts, left; selecting
and splitting rows of TRL's batch dict). Right-padding ragged rows is `appo_trl.algorithms.rows.pad_rows`."""

from __future__ import annotations

import torch


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ragged id rows as TRL pads prompts: (ids, attention mask), both (R, T) long tensors."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids.view(len(rows), width), mask.view(len(rows), width)


def select_rows(batch: dict, index: torch.Tensor, num_rows: int) -> dict:
    """Keep rows `index` of every per-row entry of TRL's generation-batch dict (dim 0 == num_rows).

    0-dim tensors and entries that are not per-row (e.g. `num_items_in_batch`) are returned unchanged.
    """
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == num_rows:
            out[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, list) and len(value) == num_rows:
            out[key] = [value[i] for i in index.tolist()]
        else:
            out[key] = value
    return out


def split_rows(batch: dict, num_chunks: int) -> list[dict]:
    """TRL's `split_tensor_dict` without dropping rows: when the row count is not a multiple of `num_chunks` (an
    agent's chain rows), the first chunks hold one row more. 0-dim tensors and `None` go to every chunk."""
    rows = len(next(v for v in batch.values() if v is not None and not (isinstance(v, torch.Tensor) and v.ndim == 0)))
    size, extra = divmod(rows, num_chunks)
    chunks, start = [], 0
    for i in range(num_chunks):
        end = start + size + (i < extra)
        chunks.append({k: v if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0) else v[start:end]
                       for k, v in batch.items()})  # fmt: skip
        start = end
    return chunks


def group_permutation(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """A random row order that keeps the rows of one prompt together: groups shuffled, rows in a group in order.

    A group is every row with the same prompt tokens. With the tree forward a micro-batch should hold whole groups,
    so that their shared prompt is forwarded once (TRL's `shuffle_sequence_dict` shuffles single rows). A group
    still straddles two micro-batches when the micro-batch size is not a multiple of the group size.
    """
    keys: dict[tuple, list[int]] = {}
    for i, (ids, mask) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
        keys.setdefault(tuple(t for t, m in zip(ids, mask) if m), []).append(i)
    groups = list(keys.values())
    return torch.tensor([i for g in torch.randperm(len(groups)).tolist() for i in groups[g]], dtype=torch.long)


def permute_rows(batch: dict, permutation: torch.Tensor) -> dict:
    """TRL's `shuffle_sequence_dict` with a given permutation (0-dim tensors and `None` unchanged)."""

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[permutation.to(v.device)]
        return [v[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}
