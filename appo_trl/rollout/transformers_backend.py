"""`TransformersBackend`: in-process sampling with the policy model itself (CPU, tests, small runs).

Concurrent `generate` calls are queued and served in batches: a worker takes up to `max_batch_size` waiting
requests, left-pads them, and runs one token-by-token decode loop with a KV cache in the backend's own decode
thread (so the event loop, and with it the tools, keeps running; not the loop's default executor, which a tool
may fill: a tool that never returns cannot stop sampling). Each row has its own seeded `torch.Generator`, its own
`max_tokens` and stop strings, and stops at the model's EOS ids. Logprobs are "processed" like vLLM's
(`--logprobs-mode processed_logprobs`): the log-softmax after temperature, top-k and top-p, read at the
sampled id; top logprobs come from the same distribution.

With an `accelerator`, the model is unwrapped for generation with TRL's `unwrap_model_for_generation` once
per batch. Under multi-process ZeRO-3 or FSDP2 every forward is a collective and ranks run different numbers
of batches, so a trainer gathers the full weights once per round on every rank and hands the gathered module
to `backend.unwrapped_for_rollout(model)` around the whole `engine.run` (`APPOTrainer` does, through
`appo_trl.trainer.sharded`). This backend is not meant to be fast; use `VLLMServerBackend` at scale.

With a `gate` (`appo_trl.rollout.decode_gate.DecodeGate`, `rollout_stream` on the sampler copy), each decode step
runs inside the gate, every token is stamped with the policy version of the step that sampled it
(`Segment.version_runs`), and the weights may be swapped between two steps: the sequences continue over their KV
cache (`keep`) or recompute their prefix under the new weights (`abort`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import time

import torch

from appo_trl.rollout.decode_gate import DecodeGate
from appo_trl.rollout.text import PieceDecoder, StopMatcher
from appo_trl.rollout.types import SamplingParams, Segment
from appo_trl.sampling import add_version_run


def _process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities after temperature, top-k and top-p (masked entries are -inf). `logits`: (V,)."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop = cum - sorted_lp.exp() >= top_p  # keep the smallest set whose mass reaches top_p
        logp = logp.clone()
        logp[order[drop]] = float("-inf")
        logp = torch.log_softmax(logp, dim=-1)
    return logp


class _Request:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, future: asyncio.Future):
        self.prompt_ids, self.params, self.future = prompt_ids, params, future


class TransformersBackend:
    """Backend running the given causal LM in-process.

    Args:
        model: a transformers causal LM (the policy; may be wrapped by accelerate/DeepSpeed).
        tokenizer: its tokenizer (stop strings are matched on decoded pieces; EOS ids come from it).
        accelerator: when given, the model is unwrapped with `trl.models.utils.unwrap_model_for_generation`.
        max_batch_size: most requests decoded together.
        eos_token_ids: ids that end a sequence (default: the model's generation config, else the tokenizer's).
        gate: a `DecodeGate`: decode steps the weights can be swapped between, tokens stamped with their versions.
    """

    def __init__(self, model, tokenizer, *, accelerator=None, max_batch_size: int = 16,
                 eos_token_ids: list[int] | None = None, gate: DecodeGate | None = None):  # fmt: skip
        self.model, self.gate = model, gate
        self.tokenizer = tokenizer
        self.accelerator = accelerator
        self.max_batch_size = max_batch_size
        if eos_token_ids is None:
            gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = gen_eos if gen_eos is not None else tokenizer.eos_token_id
            eos_token_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.eos_token_ids = set(int(e) for e in eos_token_ids if e is not None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_token_ids))
        self.decoder = PieceDecoder(tokenizer)
        self._queues: dict[int, asyncio.Queue] = {}
        self._workers: dict[int, asyncio.Task] = {}
        self._decoder_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.num_batches = 0

    def _decode_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The backend's own decode thread (one batch decodes at a time; created again after `aclose`)."""
        if self._decoder_thread is None:
            self._decoder_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="appo-sampler")
        return self._decoder_thread

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Segment:
        loop = asyncio.get_running_loop()
        key = id(loop)
        if key not in self._queues or self._workers[key].done():
            self._queues[key] = asyncio.Queue()
            self._workers[key] = loop.create_task(self._worker(self._queues[key]))
        fut = loop.create_future()
        start = time.perf_counter()
        await self._queues[key].put(_Request(list(prompt_ids), params, fut))
        seg = await fut
        seg.latency_s = time.perf_counter() - start
        return seg

    async def aclose(self) -> None:
        """Stop the batching worker of the running event loop (requests still queued get cancelled)."""
        key = id(asyncio.get_running_loop())
        worker = self._workers.pop(key, None)
        queue = self._queues.pop(key, None)
        if worker is not None:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        while queue is not None and not queue.empty():
            req = queue.get_nowait()
            if not req.future.done():
                req.future.cancel()
        if not self._workers and self._decoder_thread is not None:  # no loop uses it any more
            self._decoder_thread.shutdown(wait=False)
            self._decoder_thread = None

    async def _worker(self, queue: asyncio.Queue) -> None:
        while True:
            batch = [await queue.get()]
            await asyncio.sleep(0)  # let requests issued in the same tick join the batch
            while len(batch) < self.max_batch_size and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                loop = asyncio.get_running_loop()
                segments = await loop.run_in_executor(self._decode_executor(), self._decode_batch, batch)
            except Exception as exc:  # noqa: BLE001 - hand the error to every waiting caller
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
                continue
            for req, seg in zip(batch, segments):
                if not req.future.done():
                    req.future.set_result(seg)

    @contextlib.contextmanager
    def unwrapped_for_rollout(self, model=None):
        """Sample with one unwrapped model for a whole rollout instead of unwrapping once per batch.

        `model`: a module whose full weights the caller already gathered (on every rank, at the same point);
        without it, `self.model` is unwrapped once here. Under ZeRO-3 / FSDP2 with several processes the
        per-batch unwrap is a collective and ranks run different numbers of batches: hold the gathered model.
        """
        with contextlib.nullcontext(model) if model is not None else self._unwrapped() as model:
            self._held = model
            try:
                yield model
            finally:
                self._held = None

    def _unwrapped(self):
        if getattr(self, "_held", None) is not None:
            return contextlib.nullcontext(self._held)
        if self.accelerator is None:
            return contextlib.nullcontext(self.model)
        from trl.models.utils import unwrap_model_for_generation

        return unwrap_model_for_generation(self.model, self.accelerator)

    @torch.no_grad()
    def _decode_batch(self, batch: list[_Request]) -> list[Segment]:
        self.num_batches += 1
        with self._unwrapped() as model:
            was_training = model.training
            model.eval()
            try:
                return self._decode(model, batch)
            finally:
                model.train(was_training)

    def _decode(self, model, batch: list[_Request]) -> list[Segment]:
        device = next(model.parameters()).device
        n = len(batch)
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        gens = []
        for r in batch:
            g = torch.Generator(device="cpu")
            g.manual_seed(r.params.seed if r.params.seed is not None else torch.seed())
            gens.append(g)
        matchers = [StopMatcher(r.params.stop) for r in batch]
        out_ids: list[list[int]] = [[] for _ in batch]
        out_lp: list[list[float]] = [[] for _ in batch]
        out_top: list[list[dict[int, float]]] = [[] for _ in batch]
        finish: list[tuple[str, str | None] | None] = [None] * n
        runs: list[list[tuple[int, int]]] = [[] for _ in batch]  # versions (with a gate)
        past, step_ids, attn = None, ids, mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        gate, seen = self.gate, self.gate.swaps if self.gate is not None else 0
        for _ in range(max(r.params.max_tokens for r in batch)):
            with gate.step() if gate is not None else contextlib.nullcontext(None) as version:
                if past is not None and gate is not None and gate.recompute_since(seen):  # abort: new weights' KV
                    past, step_ids = None, ids
                    positions = (attn.cumsum(-1) - 1).clamp(min=0)
                seen = gate.swaps if gate is not None else 0
                out = model(input_ids=step_ids, attention_mask=attn, position_ids=positions, past_key_values=past,
                            use_cache=True)  # fmt: skip
            past = out.past_key_values
            logits = out.logits[:, -1, :].cpu()
            next_ids = torch.full((n,), self.pad_id, dtype=torch.long)
            for i, r in enumerate(batch):
                if finish[i] is not None:
                    continue
                p = r.params
                logp = _process_logits(logits[i], p.temperature, p.top_k, p.top_p)
                if p.temperature > 0:
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gens[i]))
                else:
                    tok = int(torch.argmax(logp))
                next_ids[i] = tok
                out_ids[i].append(tok)
                if version is not None:
                    add_version_run(runs[i], version, 1)
                out_lp[i].append(float(logp[tok]))
                if p.logprobs > 0:  # two lists, not one 0-d tensor per entry (the host work of each decoded token)
                    vals, idx = torch.topk(logp, min(p.logprobs, logp.numel()))
                    top = {t: v for t, v in zip(idx.tolist(), vals.tolist()) if math.isfinite(v)}
                    top.setdefault(tok, out_lp[i][-1])
                    out_top[i].append(top)
                if tok in self.eos_token_ids:
                    finish[i] = ("eos", None)
                elif (stop := matchers[i].push(self.decoder.piece(tok))) is not None:
                    finish[i] = ("stop", stop)
                elif len(out_ids[i]) >= p.max_tokens:
                    finish[i] = ("length", None)
            if all(f is not None for f in finish):
                break
            step_ids = next_ids.view(n, 1).to(device)
            ids = torch.cat([ids, step_ids], dim=1)  # every sequence so far (an `abort` swap recomputes it)
            attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
        return [
            Segment(out_ids[i], out_lp[i], out_top[i] if r.params.logprobs > 0 else None,
                    *(finish[i] or ("length", None)), version_runs=runs[i])  # fmt: skip
            for i, r in enumerate(batch)
        ]
