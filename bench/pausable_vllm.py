"""A scripted vLLM server with vLLM 0.31's in-flight update routes (the pause/resume tests, bench/inflight.py).

`POST /v1/completions` with `stream: true` sends one token per `step_s` as server-sent events (vLLM's chunk
shape: `token_ids`, `logprobs`, `text`, `finish_reason`, stop strings matched in the request's own text). The
token at absolute position `p` is `100 + p % 50` (its text `TEXT[p % 10]`), so a
re-fed request continues the same sequence; its logprob is `-(1 + weights) / 10`, where `weights` counts the
`reload_weights` calls (and, with `max_lora_rank`, adapter loads: `load_inplace` included) the server has taken
when the token is generated: a token's logprob names its version.
`/pause?mode=keep` freezes every request between two tokens, `abort` ends them (`finish_reason: "abort"`, their
partial tokens already sent; one aborted before its first token sends no chunk, only `[DONE]`, as vLLM 0.31's
completion stream drops an empty first chunk), `wait` lets them finish; new requests wait for `/resume` in every mode. Faults:
`abort_first_after` (the first request is aborted after that many tokens), `pause_delay_s` (a pause that hangs),
`resume_fails` (the next N `/resume` answer 500), `decodes_while_paused` (a broken keep mode), `ahead` (the
engine done at once, its stream behind), `no_pause_routes` (an
older vLLM or no dev mode: the routes 404); `kill()` (from `FakeVLLMServer`) is a replica that dies. `/server_info`
and `/reset_prefix_cache` (500 under a `keep` pause with requests frozen, as vLLM) serve the trainer's disk route.
`ServerProcess` runs one in a process of its own, as a vLLM server runs (`bench/inflight.py --server-process`).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.fake_vllm import FakeVLLMServer

TEXT = "abcdefghij"  # the text of the token at absolute position p is TEXT[p % 10]


class PausableVLLM(FakeVLLMServer):
    def __init__(self, *, step_s: float = 0.005, pause_delay_s: float = 0.0, resume_fails: int = 0,
                 no_pause_routes: bool = False, abort_first_after: int | None = None,
                 decodes_while_paused: bool = False, ahead: bool = False,
                 max_lora_rank: int | None = None):  # fmt: skip
        self.step_s, self.pause_delay_s, self.resume_fails = step_s, pause_delay_s, resume_fails
        self.no_pause_routes, self.abort_first_after = no_pause_routes, abort_first_after
        self.decodes_while_paused, self.ahead = decodes_while_paused, ahead
        self.weights = 0
        self.state = "running"  # "keep" (PAUSED_ALL), "new" (PAUSED_NEW: abort and wait)
        self.running: dict[int, dict] = {}  # request number -> {"aborted": bool}
        self.prompts: list[list[int]] = []
        self.salts: list[str | None] = []
        self.calls: list[str] = []
        self.clear_cache: bool | None = None  # of the last /pause
        super().__init__(None, max_model_len=4096, max_lora_rank=max_lora_rank)

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        self._identity_routes(app)
        self._lora_routes(app)

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request):
            if (await request.json())["method"] == "reload_weights":
                self.weights += 1
            return JSONResponse({"results": [None]})

        @app.get("/server_info")
        async def server_info():  # what the trainer's disk route reads at start-up
            return {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs",
                                                     "max_model_len": self.max_model_len},
                                    "device_config": {"device": self.device},
                                    "lora_config": None if self.max_lora_rank is None else
                                    {"max_lora_rank": self.max_lora_rank, "max_loras": 1}}}  # fmt: skip

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():  # as vLLM: frozen requests hold blocks, so a reset under a keep pause fails
            self.calls.append("reset_prefix_cache")
            if self.state == "keep" and self.running:
                return JSONResponse({"error": "running requests hold blocks"}, status_code=500)
            return JSONResponse({"success": True})

        @app.post("/pause")
        async def pause(mode: str = "abort", clear_cache: bool = True):
            if self.no_pause_routes:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            self.calls.append(f"pause:{mode}")
            self.clear_cache = clear_cache
            await asyncio.sleep(self.pause_delay_s)
            self.state = "keep" if mode == "keep" else "new"
            if mode == "abort":
                for entry in self.running.values():
                    entry["aborted"] = True
            while mode == "wait" and self.running:
                await asyncio.sleep(0.001)
            return JSONResponse({"status": "paused"})

        @app.post("/resume")
        async def resume():
            self.calls.append("resume")
            if self.resume_fails > 0:
                self.resume_fails -= 1
                return JSONResponse({"error": "Failed to resume generation: injected"}, status_code=500)
            self.state = "running"
            return JSONResponse({"status": "resumed"})

        @app.get("/is_paused")
        async def is_paused():
            if self.no_pause_routes:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"is_paused": self.state != "running"})

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            if (unknown := self._unknown_model(body)) is not None:
                return unknown
            self.bodies.append(body)
            self.prompts.append(list(body["prompt"][0]))
            self.salts.append(body.get("cache_salt"))
            # numbered here, not when the stream starts: two requests whose streams start late must not share a number
            return StreamingResponse(self._stream(body, len(self.bodies)), media_type="text/event-stream")

        return app

    def _adapter_loaded(self, name: str) -> None:
        self.weights += 1

    def _chunk(self, ids: list[int], logprobs: list[float], finish: str | None, text: str = "", stop=None) -> str:
        lp = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs, "top_logprobs": None}
        choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": lp, "finish_reason": finish,
                  "stop_reason": stop}  # fmt: skip
        return f"data: {json.dumps({'choices': [choice]})}\n\n"

    async def _stream(self, body: dict, n: int):
        prompt_len, max_tokens = len(body["prompt"][0]), int(body["max_tokens"])
        while self.state != "running":  # queued until /resume
            await asyncio.sleep(0.001)
        self.running[n] = entry = {"aborted": False}
        try:
            text = ""  # this request's own output: vLLM matches stop strings there only
            if self.ahead:  # the engine finished at once; the stream delivers behind it, whatever the pause does
                logprob = -(1 + self.weights) / 10
                for i in range(max_tokens):
                    await asyncio.sleep(self.step_s)
                    piece = TEXT[(prompt_len + i) % len(TEXT)]
                    finish = "length" if i == max_tokens - 1 else None
                    yield self._chunk([100 + (prompt_len + i) % 50], [logprob], finish, piece)
                yield "data: [DONE]\n\n"
                return
            for i in range(max_tokens):
                await asyncio.sleep(self.step_s)
                while self.state == "keep" and not self.decodes_while_paused:  # frozen between two decode steps
                    await asyncio.sleep(0.001)
                if entry["aborted"] or (n == 1 and i == self.abort_first_after):
                    if i:  # as vLLM: a request aborted before its first token ends with no chunk, only [DONE]
                        yield self._chunk([], [], "abort")
                    break
                piece = TEXT[(prompt_len + i) % len(TEXT)]
                text += piece
                stop = next((s for s in body.get("stop") or [] if s in text), None)
                finish = "stop" if stop else "length" if i == max_tokens - 1 else None
                yield self._chunk([100 + (prompt_len + i) % 50], [-(1 + self.weights) / 10], finish, piece, stop)
                if stop:
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.running.pop(n, None)


def _serve(kwargs: dict, port, running, decoding, stop, parent: int) -> None:
    """A `ServerProcess`'s child: the server, and what it is doing copied to shared memory every millisecond,
    until told to stop or its parent is gone (killed: nothing else would end it)."""
    with PausableVLLM(**kwargs) as server:
        port.value = server.port
        while not stop.wait(0.001) and os.getppid() == parent:
            running.value, decoding.value = len(server.running), server.state == "running"


class ServerProcess:
    """A `PausableVLLM` in a process of its own (spawned), so that its event loop shares no interpreter with the
    client, as a vLLM server's does not. `url`; `running` (the requests it holds) and `state` ("running" or
    "paused") are read from shared memory, at most a millisecond old. A context manager; `__exit__` stops the
    process, and kills it after 10 s."""

    def __init__(self, **kwargs):
        ctx = multiprocessing.get_context("spawn")
        self._port, self._running, self._decoding = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Value("b", True)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_serve, args=(kwargs, self._port, self._running, self._decoding, self._stop, os.getpid()),
                                 name="scripted-vllm", daemon=True)  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port.value}"

    @property
    def running(self) -> int:
        return self._running.value

    @property
    def state(self) -> str:
        return "running" if self._decoding.value else "paused"

    def __enter__(self) -> ServerProcess:
        self._proc.start()
        deadline = time.monotonic() + 60
        while not self._port.value:
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the scripted server's process did not start (exit code {self._proc.exitcode})")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
