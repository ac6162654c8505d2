"""The trainer's reference logprobs of a completion sampled across a weight update, by transformers' own forward:
a plain forward of one set of weights, or (keep mode) the old weights' KV cache of the prefix under the new weights.
Read by the in-process gate's tests (`test_decode_gate.py`) and the real vLLM-CPU ones (`tests/real_vllm/inflight.py`)."""

from __future__ import annotations

import torch

TOL = 1e-4  # float32 on both sides


def logps_from(logits: torch.Tensor, ids: list[int]) -> list[float]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [lp[i, t].item() for i, t in enumerate(ids)]


@torch.no_grad()
def plain_logps(model, prompt: list[int], ids: list[int]) -> list[float]:
    """Logprob of each of `ids` after `prompt`, one forward (temperature 1)."""
    logits = model(torch.tensor([prompt + ids])).logits[0]
    return logps_from(logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)], ids)


@torch.no_grad()
def kept_cache_logps(old, new, prompt: list[int], ids: list[int], boundary: int) -> list[float]:
    """Logprobs of `ids[boundary:]` sampled after a keep-mode update at `boundary` tokens: the KV cache of
    `prompt + ids[:boundary - 1]` was built by the `old` weights (the last token sampled before the pause is fed
    after it), the rest by the `new` weights over that cache (transformers' `past_key_values`)."""
    assert boundary >= 1
    seq = prompt + ids
    cut = len(prompt) + boundary - 1
    past = old(torch.tensor([seq[:cut]]), use_cache=True).past_key_values
    logits = new(torch.tensor([seq[cut : len(seq) - 1]]), past_key_values=past, use_cache=True).logits[0]
    return logps_from(logits, ids[boundary:])


def worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)
