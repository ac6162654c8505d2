"""Entropy estimators from sampler top-k logprobs (ARPO paper, entropy-based adaptive rollout; docs/fidelity.md).

vLLM returns, per generated token, the logprobs of its top-k tokens (k = 10) plus the sampled token. The truncated
entropy H_t = −Σ_{v ∈ top-k ∪ {sampled}} p_v·log p_v is a lower bound of the full-vocabulary entropy, clamped ≥ 0.
ARPO's segment entropy sums it over the first 20 tokens of a segment and divides by ln|V|.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def _lp(v: Any) -> float:
    """A logprob from a float or an object with `.logprob` (vLLM `Logprob`)."""
    return float(getattr(v, "logprob", v))


def topk_entropy(top_logprobs: torch.Tensor | Sequence[Mapping[Any, Any] | Sequence[float] | None]) -> torch.Tensor:
    """Per-token truncated entropy H_t = max(0, −Σ_v exp(ℓ_v)·ℓ_v) over the given logprobs (ARPO paper).

    `top_logprobs` is a (T, k) tensor of logprobs (−inf entries contribute 0), or a length-T list whose items are
    dicts {token: logprob or vLLM Logprob} (top-k ∪ sampled, as vLLM returns them), plain lists of logprobs, or
    None (no data → NaN). Returns a float32 (T,) tensor.
    Example: two tokens at p = 0.5 each → −2·0.5·ln 0.5 = ln 2 ≈ 0.6931.
    """
    if isinstance(top_logprobs, torch.Tensor):
        lp = top_logprobs.float()
        terms = torch.where(torch.isfinite(lp), -lp.exp() * lp, torch.zeros_like(lp))
        return terms.sum(-1).clamp(min=0.0)
    out = []
    for item in top_logprobs:
        if item is None:
            out.append(float("nan"))
            continue
        vals = item.values() if isinstance(item, Mapping) else item
        h = 0.0
        for v in vals:
            x = _lp(v)
            if math.isfinite(x):
                h -= math.exp(x) * x
        out.append(max(h, 0.0))
    return torch.tensor(out, dtype=torch.float32)


def segment_entropy(
    token_entropies: torch.Tensor | Sequence[float],
    window: int = 20,
    reduce: str = "sum",
    vocab_size: int | None = None,
    empty: float = float("nan"),
) -> float:
    """ARPO's segment entropy: reduce the first `window` token entropies, divided by ln|V| if `vocab_size` (ARPO paper).

    H_seg = (1/ln|V|)·Σ_{j < min(window, len)} H_j with `reduce="sum"` (reference), or the mean with `"mean"`.
    NaN entries are ignored; an empty segment gives `empty`: NaN by default (the caller then treats ΔH as 0),
    0.0 in the released ARPO/AEPO code (ΔH = 0 − H_root). Example: [1, 2, 3], window 2, sum → 3; with |V| = e² → 1.5.
    """
    h = torch.as_tensor(token_entropies, dtype=torch.float64).reshape(-1)[:window]
    h = h[~torch.isnan(h)]
    if h.numel() == 0:
        return float(empty)
    if reduce == "sum":
        val = float(h.sum())
    elif reduce == "mean":
        val = float(h.mean())
    else:
        raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")
    if vocab_size is not None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        val /= math.log(vocab_size)
    return val
