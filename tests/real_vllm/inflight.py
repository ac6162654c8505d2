"""Helpers of the in-flight update tests: the trainer's reference logprobs of a completion sampled across an update
(keep mode: the old weights' KV cache under the new weights), `Background` (a streamed request in a thread) and
`Ballast` (other requests decoding meanwhile, so a pause lands while the measured one is still generating)."""

from __future__ import annotations

import threading
import time

import httpx
import torch

from tests.rollout.pausable_vllm import Background  # noqa: F401  (the tests import it from here)

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


class Ballast:
    """`k` streamed completions decoding beside the measured request, closed (so aborted by the server) on exit.

    The tiny model decodes faster than the API server streams its tokens out: alone, a 1,500-token request can be
    finished in the engine while its client has read 157 tokens, so a `/pause` sent at the 40th token often came
    after the end (CI run of aec7a82: both modes, three attempts each). Eight other sequences in each decode step
    slow the engine down, so the pause lands mid-generation. Entering waits until each has streamed a token."""

    def __init__(self, url: str, model: str, k: int = 8, max_tokens: int = 1900, timeout_s: float = 120.0):
        self.url, self.model, self.k, self.max_tokens, self.timeout_s = url, model, k, max_tokens, timeout_s
        self.stop, self.started = threading.Event(), threading.Semaphore(0)
        self.errors: list[BaseException] = []

    def _one(self, i: int) -> None:
        body = {"model": self.model, "prompt": f"ballast {i}: " + "hello " * 20, "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 1.0, "stream": True, "seed": i}  # fmt: skip
        told = False
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=self.timeout_s) as resp:
                resp.raise_for_status()
                for _ in resp.iter_lines():
                    if not told:
                        told = True
                        self.started.release()
                    if self.stop.is_set():
                        return  # the connection closes: the server aborts the request
        except BaseException as exc:  # told by __enter__ (a ballast that never started)
            self.errors.append(exc)
        finally:
            if not told:
                self.started.release()

    def __enter__(self) -> Ballast:
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(self.k)]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + self.timeout_s
        for _ in self.threads:
            if not self.started.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"the ballast requests did not start within {self.timeout_s:g} s")
        if self.errors:
            raise AssertionError(f"a ballast request failed: {self.errors[0]!r}")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout_s)
