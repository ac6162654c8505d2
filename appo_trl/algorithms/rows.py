"""Ragged rows (one list per trajectory: ids, masks, logprobs, entropies) right-padded into one tensor, as the
strategies and the trainer hand them to the maths here."""

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
