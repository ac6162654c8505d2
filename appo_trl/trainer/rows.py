"""Small tensor helpers shared by the trainer modules (padding ragged rows, selecting rows of TRL's batch dict)."""

from __future__ import annotations

import torch


def pad_rows(rows: list[list], value: float | int, length: int | None = None) -> torch.Tensor:
    """Right-pad ragged rows into one (R, T) tensor (float if `value` or any element is a float)."""
    length = max((len(r) for r in rows), default=0) if length is None else length
    is_float = isinstance(value, float) or any(isinstance(x, float) for r in rows for x in r[:1])
    out = torch.full((len(rows), length), value, dtype=torch.float32 if is_float else torch.long)
    for i, r in enumerate(rows):
        r = r[:length]
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=out.dtype)
    return out


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
