"""Helpers of the real-server stage (constants of the server the conftest starts, requests, references)."""

from __future__ import annotations

import asyncio
import time

import httpx
import torch

from appo_trl.rollout.transformers_backend import _process_logits
from appo_trl.vllm.server import VLLMServerBackend

MAX_MODEL_LEN = 2048
MAX_LOGPROBS = 20


def run(coro_fn, *backends):
    async def go():
        try:
            return await coro_fn()
        finally:
            for b in backends:
                await b.aclose()

    return asyncio.run(go())


def generate(server, prompt, params, **kw):
    backend = VLLMServerBackend(server.url, **kw)
    return run(lambda: backend.generate(prompt, params), backend)


def forward_logps(model, prompt, ids, temperature=1.0, top_k=-1, top_p=1.0):
    """Logprob of each sampled id under the processed distribution, from one transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0]
    return [
        _process_logits(logits[len(prompt) - 1 + i], temperature, top_k, top_p)[t].item() for i, t in enumerate(ids)
    ]


def metric(server, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter over the series whose labels include `labels`, from `GET /metrics`."""
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line.split("}")[0] for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(server, name: str, *, timeout_s: float, every_s: float, stop=lambda: False) -> float:
    """Poll `metric(server, name)` until it is at least 1, `stop()` is true or `timeout_s` has passed, and return
    its last value."""
    deadline = time.monotonic() + timeout_s
    while (value := metric(server, name)) < 1 and not stop() and time.monotonic() < deadline:
        time.sleep(every_s)
    return value
