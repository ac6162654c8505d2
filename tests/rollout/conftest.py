"""Rollout test helpers: scripted tools and policies, and `bench/` importable for the fake vLLM server."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from appo_trl.tools.base import ToolResult  # noqa: E402


class ScriptedTool:
    """A tool whose output is `respond(query)` (sync or async); records every query."""

    def __init__(self, tag: str, respond, ok: bool = True):
        self.name = self.tag = tag
        self.respond, self.ok = respond, ok
        self.queries: list[str] = []

    async def call(self, text: str) -> ToolResult:
        self.queries.append(text)
        out = self.respond(text)
        if asyncio.iscoroutine(out):
            out = await out
        return ToolResult(out, ok=self.ok, latency_s=0.001)

    async def aclose(self) -> None:
        pass


@pytest.fixture
def enc(tiny_tokenizer):
    def _enc(text: str) -> list[int]:
        return tiny_tokenizer(text, add_special_tokens=False)["input_ids"]

    return _enc


@pytest.fixture
def result_ids(tiny_tokenizer):
    """Ids of the ARPO result block around `text`, as the engine must inject them."""

    def _ids(text: str) -> list[int]:
        return tiny_tokenizer(f" <result>\n{text}\n</result>", add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]

    return _ids


def generate_once(backend, prompt, params):
    """One `backend.generate` call in a fresh event loop, closing the backend's client afterwards."""

    async def go():
        try:
            return await backend.generate(prompt, params)
        finally:
            await backend.aclose()

    return asyncio.run(go())
