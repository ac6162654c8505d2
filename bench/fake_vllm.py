"""A loopback stand-in for `vllm serve` (vLLM 0.31's OpenAI server) for tests and benchmarks. Not package code.

`FakeVLLMServer(policy, ...)` runs FastAPI + uvicorn in a thread on 127.0.0.1 and answers, in the JSON shape
vLLM 0.31 uses for the fields we read:

- `GET /health`, `GET /v1/models` (with `max_model_len`), `POST /reset_prefix_cache` (`{"success": true}`),
  `GET /server_info` (`device_config.device`, `lora_config`) and `POST /collective_rpc` (recorded in `rpc_calls`,
  not run); with `max_lora_rank`, vLLM's runtime LoRA endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`);
- `POST /v1/completions` with token-id prompts, `n`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
  `logprobs`, `stop`, `include_stop_str_in_output`, `return_token_ids`, `return_tokens_as_token_ids`:
  `choices[i] = {index, text, logprobs: {text_offset, token_logprobs, tokens: ["token_id:<id>"],
  top_logprobs: [{"token_id:<id>": lp}]}, finish_reason: "stop"|"length", stop_reason: str|null,
  prompt_logprobs, prompt_token_ids, token_ids}` plus `usage`. EOS gives `finish_reason="stop"` with
  `stop_reason=null`; a stop string gives its text as `stop_reason`; the token that completes a stop string
  is kept whole in `token_ids`.

The policy is any `Backend` (`generate(prompt_ids, SamplingParams) -> Segment`): `ScriptedPolicy` below, or
`appo_trl.rollout.TransformersBackend` around the tiny model. Knobs: `decode_step_s` (time per decode step of
one sequence), `max_num_seqs` (at most K sequences decoding at once, the rest queued, as continuous batching
on a busy GPU; None = unlimited), `extra_delay_s` (slow server), `fail_next` (answer the next N completion
requests with HTTP 500), `abort_next` (answer the next N with `finish_reason: "abort"` and half the tokens, as
a real server does on `POST /pause` or shutdown), `reject_next` (answer the next N with HTTP 400 and a vLLM
error body), `fail_rpc_next` (answer the next N `POST /collective_rpc` with HTTP 500), `stop()` (server down),
`kill()` (a crash: every open connection is cut, in-flight requests get no answer), `restart(down_s)` (down for
`down_s` seconds, then up again on the same port: a new "process", events get a `"restart"` marker) and
`restart_at` (the completion request with this 0-based index answers HTTP 503 and triggers
`restart(restart_down_s)` in the background, as a server dying mid-round). `sessions` records each completion
request's `X-Session-ID` header (None without one); `start()` reuses `port` when it is set (a replica
restarting at its URL).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load_file

from appo_trl.rollout.text import PieceDecoder, StopMatcher
from appo_trl.sampling import SamplingParams, Segment


class ScriptedPolicy:
    """A deterministic "model": `script(context_ids, rng) -> ids` says what it would emit next.

    The emitted ids are cut like a real sampler: at the first EOS, at the token that completes a stop string,
    or at `max_tokens`. The logprob of the token at absolute position `pos` (prompt included) is
    `-(pos + 1) / 1000`, so a test can tell from a logprob alone which position it was sampled at. With
    `logprobs=k`, the top logprobs hold the sampled token and `k` other ids with lower logprobs.

    Args:
        tokenizer: decodes pieces for stop matching.
        script: `(context_ids, rng) -> list[int]`; `rng` is `random.Random(seed)` of the request.
        delay: optional `(context_ids) -> seconds`, awaited before answering (scripted slowness).
    """

    def __init__(self, tokenizer, script: Callable[[list[int], random.Random], list[int]],
                 delay: Callable[[list[int]], float] | None = None):  # fmt: skip
        self.tokenizer, self.script, self.delay = tokenizer, script, delay
        self.decoder = PieceDecoder(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.requests: list[tuple[list[int], SamplingParams]] = []

    @staticmethod
    def logprob_at(pos: int) -> float:
        return -(pos + 1) / 1000.0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Segment:
        self.requests.append((list(prompt_ids), params))
        if self.delay is not None:
            await asyncio.sleep(self.delay(prompt_ids))
        emitted = self.script(list(prompt_ids), random.Random(params.seed))
        matcher = StopMatcher(params.stop)
        ids, reason, stop = [], "length", None
        for tok in emitted[: params.max_tokens]:
            ids.append(tok)
            if tok == self.eos_id:
                reason = "eos"
                break
            if (stop := matcher.push(self.decoder.piece(tok))) is not None:
                reason = "stop"
                break
        if reason == "length" and len(ids) < params.max_tokens:
            raise RuntimeError("script ran out of tokens before EOS, a stop string or max_tokens")
        base = len(prompt_ids)
        lps = [self.logprob_at(base + i) for i in range(len(ids))]
        top = None
        if params.logprobs > 0:
            top = [
                {**{(t + j) % 50 + 3: lp - j for j in range(1, params.logprobs + 1)}, t: lp} for t, lp in zip(ids, lps)
            ]
        return Segment(ids, lps, top, reason, stop)


class FakeVLLMServer:
    """vLLM-0.31-compatible `/v1/completions` on 127.0.0.1 in a background thread (use as a context manager).

    Args:
        policy: a `Backend` producing the segments.
        tokenizer: renders `text` fields (optional; empty text without it).
        model_name: the id served by `/v1/models`.
        decode_step_s: seconds per decode step of one sequence (a segment of L tokens takes L steps).
        max_num_seqs: sequences decoding at once (None: unlimited); further requests queue.
        extra_delay_s: added to every completion request (a slow server).
        fail_next: the next N completion requests answer HTTP 500.
        abort_next: the next N completion requests are aborted (HTTP 200, `finish_reason: "abort"`).
        reject_next: the next N completion requests answer HTTP 400 with `reject_message`.
        max_model_len: reported by `/v1/models`.
        device: reported by `/server_info` as `device_config.device`.
        restart_at: index of the completion request that makes the server restart (None: never).
        restart_down_s: how long that restart keeps the port closed.
        max_lora_rank: LoRA on (`--enable-lora --max-lora-rank R` with runtime updating): `/server_info` reports
            `lora_config`, `POST /v1/load_lora_adapter` / `unload_lora_adapter` keep `adapters` (name -> the
            adapter's tensors, read at load), and a completion naming an unknown model answers 404. None: off
            (`lora_config` None, the LoRA endpoints 404), as a server started without it.
    """

    def __init__(self, policy, tokenizer=None, *, model_name: str = "fake-model", decode_step_s: float = 0.0,
                 max_num_seqs: int | None = None, extra_delay_s: float = 0.0, fail_next: int = 0,
                 abort_next: int = 0, reject_next: int = 0, reject_message: str = "injected rejection",
                 max_model_len: int = 32768, device: str = "cpu", restart_at: int | None = None,
                 restart_down_s: float = 1.0, max_lora_rank: int | None = None):  # fmt: skip
        self.max_lora_rank, self.adapters = max_lora_rank, {}
        self.policy, self.tokenizer, self.model_name = policy, tokenizer, model_name
        self.abort_next, self.reject_next, self.reject_message = abort_next, reject_next, reject_message
        self.max_model_len, self.device = max_model_len, device
        self.restart_at, self.restart_down_s = restart_at, restart_down_s
        self.restarter: threading.Thread | None = None
        self.rpc_calls: list[dict[str, Any]] = []
        self.rpc_in_flight: list[int] = []
        self.sessions: list[str | None] = []
        self.fail_rpc_next = 0
        self.events: list[str] = []
        self._pieces = PieceDecoder(tokenizer) if tokenizer is not None else None
        self.decode_step_s, self.max_num_seqs = decode_step_s, max_num_seqs
        self.extra_delay_s, self.fail_next = extra_delay_s, fail_next
        self.bodies: list[dict[str, Any]] = []
        self.num_resets = 0
        self.max_running = 0
        self._running = 0
        self._active, self._busy_since, self._busy_s = 0, 0.0, 0.0  # requests being served (`busy_s`)
        self._sem: asyncio.Semaphore | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.app = self._build_app()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _identity_routes(self, app: FastAPI) -> None:
        """`GET /health` and `GET /v1/models` (with `max_model_len`), the routes every fake server answers."""

        @app.get("/health")
        async def health():
            return JSONResponse({})

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "vllm",
                                                "max_model_len": self.max_model_len}]}  # fmt: skip

    def _lora_routes(self, app: FastAPI) -> None:
        """vLLM's runtime LoRA endpoints (`max_lora_rank` set): `load_inplace` replaces a loaded name's tensors."""

        def lora_error(message: str, status: int):
            return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await request.json()
            name, path = body["lora_name"], body["lora_path"]
            if self.max_lora_rank is None:
                return lora_error("Not Found", 404)
            if name in self.adapters and not body.get("load_inplace"):
                return lora_error(f"The lora adapter '{name}' has already been loaded.", 400)
            try:
                with open(os.path.join(path, "adapter_config.json")) as f:
                    rank = json.load(f)["r"]
                tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
            except (OSError, KeyError, ValueError) as exc:
                return lora_error(f"cannot load the adapter at {path}: {exc}", 400)
            if rank > self.max_lora_rank:
                return lora_error(f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.", 400)
            inplace = name in self.adapters
            self.adapters[name] = tensors
            self.events.append(f"{'load_inplace' if inplace else 'load'}:{name}")
            self._adapter_loaded(name)
            return Response(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            name = (await request.json())["lora_name"]
            if self.max_lora_rank is None or self.adapters.pop(name, None) is None:
                return lora_error(f"The lora adapter '{name}' cannot be found.", 404)
            self.events.append(f"unload:{name}")
            return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    def _adapter_loaded(self, name: str) -> None:
        """Called after every adapter load (a subclass's hook)."""

    def _unknown_model(self, body: dict):
        """The 404 vLLM answers a completion naming a model it does not serve, or None."""
        if body.get("model", self.model_name) not in (self.model_name, *self.adapters):
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                           "code": 404}}, status_code=404)  # fmt: skip
        return None

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        self._identity_routes(app)

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            self.num_resets += 1
            self.events.append("reset_prefix_cache")
            return JSONResponse({"success": True})

        @app.get("/server_info")
        async def server_info():
            return {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs",
                                                     "max_model_len": self.max_model_len},
                                    "device_config": {"device": self.device},
                                    "lora_config": None if self.max_lora_rank is None else
                                    {"max_lora_rank": self.max_lora_rank, "max_loras": 2}}}  # fmt: skip

        self._lora_routes(app)

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request):
            body = await request.json()
            if self.fail_rpc_next > 0:
                self.fail_rpc_next -= 1
                return JSONResponse({"error": {"message": "injected rpc failure", "code": 500}}, status_code=500)
            self.rpc_calls.append(body)
            self.rpc_in_flight.append(self._active)  # completion requests being served when the rpc landed
            self.events.append(f"rpc:{body.get('method')}")
            return JSONResponse({"results": [None]})

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            if self.restart_at is not None and len(self.bodies) == self.restart_at:
                self.restart_at = None
                self.bodies.append(body)
                self.events.append("dying")
                self.restarter = threading.Thread(target=self.restart, args=(self.restart_down_s,), daemon=True)
                self.restarter.start()
                return JSONResponse({"error": {"message": "server shutting down", "code": 503}}, status_code=503)
            if (unknown := self._unknown_model(body)) is not None:
                return unknown
            self.bodies.append(body)
            self.sessions.append(request.headers.get("x-session-id"))
            self.events.append("completion")
            if self.fail_next > 0:
                self.fail_next -= 1
                return JSONResponse({"error": {"message": "injected failure", "code": 500}}, status_code=500)
            if self.reject_next > 0:
                self.reject_next -= 1
                error = {"message": self.reject_message, "type": "BadRequestError", "param": None, "code": 400}
                return JSONResponse({"error": error}, status_code=400)
            if self.extra_delay_s:
                await asyncio.sleep(self.extra_delay_s)
            out = await self._complete(body)
            if self.abort_next > 0:
                self.abort_next -= 1
                for choice in out["choices"]:
                    half = len(choice["token_ids"] or []) // 2
                    choice.update(
                        finish_reason="abort", stop_reason=None, token_ids=(choice["token_ids"] or [])[:half]
                    )
                    if choice["logprobs"]:
                        choice["logprobs"] = {k: v[:half] for k, v in choice["logprobs"].items()}
            # json.dumps directly: FastAPI's jsonable_encoder would dominate the cost of large answers
            return Response(json.dumps(out), media_type="application/json")

        return app

    async def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompts = body["prompt"]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        n, want = int(body.get("n", 1)), body.get("logprobs")
        choices, completion_tokens = [], 0
        for prompt in prompts:
            for j in range(n):
                seed = body.get("seed")
                params = SamplingParams(
                    max_tokens=int(body.get("max_tokens") or 16), temperature=float(body.get("temperature", 1.0)),
                    top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", -1) or -1),
                    seed=None if seed is None else int(seed) + j, stop=list(body.get("stop") or []),
                    logprobs=int(want or 0),
                )  # fmt: skip
                seg = await self._decode(list(prompt), params)
                completion_tokens += len(seg.token_ids)
                choices.append(self._choice(len(choices), list(prompt), seg, want, body))
        n_prompt = sum(len(p) for p in prompts)
        return {
            "id": f"cmpl-{random.getrandbits(64):016x}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model", self.model_name), "choices": choices, "service_tier": None,
            "system_fingerprint": None,
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt + completion_tokens,
                      "completion_tokens": completion_tokens, "prompt_tokens_details": None},
            "kv_transfer_params": None,
        }  # fmt: skip

    def busy_s(self) -> float:
        """Seconds so far with at least one completion request being served (for server idle fractions)."""
        return self._busy_s + (time.perf_counter() - self._busy_since if self._active else 0.0)

    async def _decode(self, prompt: list[int], params: SamplingParams) -> Segment:
        if self._active == 0:
            self._busy_since = time.perf_counter()
        self._active += 1
        try:
            return await self._decode_timed(prompt, params)
        finally:
            self._active -= 1
            if self._active == 0:
                self._busy_s += time.perf_counter() - self._busy_since

    async def _decode_timed(self, prompt: list[int], params: SamplingParams) -> Segment:
        if self._sem is None and self.max_num_seqs:
            self._sem = asyncio.Semaphore(self.max_num_seqs)
        seg = await self.policy.generate(prompt, params)
        if self.decode_step_s:
            if self._sem is not None:
                async with self._sem:
                    await self._hold(len(seg.token_ids))
            else:
                await self._hold(len(seg.token_ids))
        return seg

    async def _hold(self, steps: int) -> None:
        self._running += 1
        self.max_running = max(self.max_running, self._running)
        try:
            await asyncio.sleep(steps * self.decode_step_s)
        finally:
            self._running -= 1

    def _choice(self, index: int, prompt: list[int], seg: Segment, want, body) -> dict[str, Any]:
        pieces = [self._pieces.piece(t) for t in seg.token_ids] if self._pieces is not None else []
        text = "".join(pieces)
        if seg.stop_str and not body.get("include_stop_str_in_output", False):
            text = text[: text.find(seg.stop_str)]
        elif seg.stop_str:
            text = text[: text.find(seg.stop_str) + len(seg.stop_str)]
        logprobs = None
        if want is not None:
            offsets, pos = [], 0
            for piece in pieces or [""] * len(seg.token_ids):
                offsets.append(pos)
                pos += len(piece)
            tops = seg.top_logprobs or [{t: lp} for t, lp in zip(seg.token_ids, seg.logprobs)]
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": list(seg.logprobs),
                "tokens": [f"token_id:{t}" for t in seg.token_ids],
                "top_logprobs": [{f"token_id:{k}": v for k, v in d.items()} for d in tops],
            }
        return {
            "index": index, "text": text, "logprobs": logprobs,
            "finish_reason": "length" if seg.finish_reason == "length" else "stop",
            "stop_reason": seg.stop_str if seg.finish_reason == "stop" else None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
            "token_ids": list(seg.token_ids) if body.get("return_token_ids") else None,
        }  # fmt: skip

    def start(self) -> FakeVLLMServer:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port or 0, log_level="error", access_log=False,
                                lifespan="off", timeout_keep_alive=30)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._loop = asyncio.new_event_loop()

        def run():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._server.serve())

        self._thread = threading.Thread(target=run, name="fake-vllm", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("fake vLLM server failed to start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def kill(self) -> None:
        """A crash: stop listening and cut every open connection at once (no answer to in-flight requests)."""
        server = self._server
        if server is None:
            return

        def abort():  # as the kernel does for a dead process: no more accepts, every connection reset
            for listener in server.servers:
                listener.close()
            for conn in list(server.server_state.connections):
                if conn.transport is not None:
                    conn.transport.abort()
            server.should_exit = server.force_exit = True

        self._loop.call_soon_threadsafe(abort)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            raise RuntimeError("fake vLLM server did not stop within 10 s of kill()")
        # A dead process's sockets all close with it. This server lives in the test's process, so a connection the
        # loop accepted after `abort` ran stays open with nobody to answer it, and a client (the router) waits on
        # it until its own timeout. Abort every transport the stopped loop still holds (asyncio's fd -> transport
        # map) and run the loop once so their sockets close.
        for transport in list(getattr(self._loop, "_transports", {}).values()):
            if transport is not None and not transport.is_closing():
                transport.abort()
        self._loop.call_soon(self._loop.stop)
        self._loop.run_forever()
        self._server = None

    def bodies_per_sync(self) -> list[list[dict[str, Any]]]:
        """The completion bodies split at each `reload_weights` call: `[before the 1st, after the 1st, ...]`.
        A restart can leave retries of a dead round's requests after it, so a round is not a fixed slice."""
        out: list[list[dict[str, Any]]] = [[]]
        bodies = iter(self.bodies)
        for event in self.events:
            if event == "rpc:reload_weights":
                out.append([])
            elif event in ("completion", "dying"):
                out[-1].append(next(bodies))
        return out

    def restart(self, down_s: float = 1.0) -> None:
        """Stop (connections refused), wait `down_s`, start again on the same port; blocking."""
        self.stop()
        self._sem = None  # asyncio objects of the old server's loop
        self.events.append("restart")
        time.sleep(down_s)
        self.start()

    def __enter__(self) -> FakeVLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
