"""LLM judge over any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, OpenAI, ...).

The prompt is ARPO's (`prompts.yaml: judge`): the judge sees the question, the gold answers and the
prediction and answers "Correct" or "Incorrect". As in ARPO, a prediction that already matches a gold
exactly (EM or math equivalence) is correct without a call, and the content of a `<judgment>` tag is used
when present. Unlike ARPO, a reply that says neither "correct" nor "incorrect", an HTTP error or a timeout
is retried (exponential backoff) and, after the last attempt, recorded as a judge *error* for that sample
(`correct: None`), counted in the report, and retried on the next resumed run; it never crashes the run.

The API key comes from the environment variable named by `api_key_env` and is only ever put in the
request header: it is not stored in configs, reports or logs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import httpx

JUDGMENT_TAG = re.compile(r"<judgment>(.*?)</judgment>", re.DOTALL | re.IGNORECASE)
NEGATIVE = ("incorrect", "not correct", "wrong")


@dataclasses.dataclass
class JudgeConfig:
    """Where the judge runs and how it is called.

    Args:
        base_url: OpenAI-compatible API root, e.g. `http://127.0.0.1:8001/v1`. Empty disables the judge.
        model: the judge model name sent to the server (named in every report).
        api_key_env: environment variable holding the API key (optional for local servers).
        max_retries: attempts after the first one, for HTTP errors, timeouts and unparseable replies.
        timeout_s: per-request timeout, seconds.
        backoff_s: first retry delay; doubles with every retry.
        concurrency: requests in flight at once.
        max_tokens: reply budget (a thinking judge needs more).
        temperature: sampling temperature of the judge (0 for reproducible verdicts).
    """

    base_url: str = ""
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    max_retries: int = 3
    timeout_s: float = 60.0
    backoff_s: float = 1.0
    concurrency: int = 16
    max_tokens: int = 512
    temperature: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.base_url and self.model)

    def public(self) -> dict[str, Any]:
        """The config as reported (the key's variable name, never its value)."""
        return dataclasses.asdict(self)


def parse_verdict(reply: str) -> bool | None:
    """True for "Correct", False for "Incorrect"/"wrong"/"not correct", None when it says neither."""
    match = JUDGMENT_TAG.search(reply)
    text = (match.group(1) if match else reply).strip().lower()
    if any(word in text for word in NEGATIVE):
        return False
    if "correct" in text:
        return True
    return None


class JudgeError(RuntimeError):
    """One failed judge attempt (HTTP status, malformed body or unparseable verdict)."""


class LLMJudge:
    """Calls the judge for many (question, golds, prediction) items concurrently, with retries.

    Args:
        config: the `JudgeConfig`.
        prompt: template with `{question}`, `{labeled_answer}`, `{pred_answer}` (ARPO's by default).
        transport: an `httpx.AsyncBaseTransport` for tests (`httpx.MockTransport`); None uses the network.
    """

    def __init__(
        self, config: JudgeConfig, prompt: str | None = None, transport: httpx.AsyncBaseTransport | None = None
    ):
        if not config.enabled:
            raise ValueError("LLMJudge needs `base_url` and `model`.")
        from appo_trl.evaluation.benchmarks import judge_prompt

        self.config = config
        self.prompt = prompt or judge_prompt()
        self.transport = transport

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.config.api_key_env, "") if self.config.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _attempt(self, client: httpx.AsyncClient, content: str) -> tuple[bool, str]:
        body = {
            "model": self.config.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
        }
        response = await client.post("/chat/completions", json=body)
        if response.status_code != 200:
            raise JudgeError(f"HTTP {response.status_code}")
        try:
            reply = response.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeError(f"malformed response body ({type(e).__name__})") from None
        verdict = parse_verdict(reply)
        if verdict is None:
            raise JudgeError(f"unparseable verdict: {reply[:80]!r}")
        return verdict, reply

    async def _judge_one(self, client, sem, question: str, golds: Sequence[str], prediction: str) -> dict[str, Any]:
        content = self.prompt.format(question=question, labeled_answer=" / ".join(golds), pred_answer=prediction)
        error = ""
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            try:
                async with sem:
                    verdict, reply = await self._attempt(client, content)
                return {"correct": verdict, "reply": reply, "attempts": attempt + 1, "error": None}
            except (JudgeError, httpx.HTTPError) as e:
                error = f"{type(e).__name__}: {e}" if not isinstance(e, JudgeError) else str(e)
        return {"correct": None, "reply": None, "attempts": self.config.max_retries + 1, "error": error}

    async def ajudge(self, items: Sequence[tuple[str, Sequence[str], str]], progress=None) -> list[dict[str, Any]]:
        """Verdicts for `(question, golds, prediction)` items, in order; `progress()` is called per item."""
        sem = asyncio.Semaphore(max(1, self.config.concurrency))
        async with httpx.AsyncClient(
            base_url=self.config.base_url.rstrip("/"),
            headers=self._headers(),
            timeout=self.config.timeout_s,
            transport=self.transport,
        ) as client:

            async def one(item):
                out = await self._judge_one(client, sem, *item)
                if progress is not None:
                    progress()
                return out

            return await asyncio.gather(*(one(item) for item in items))

    def judge(self, items: Sequence[tuple[str, Sequence[str], str]], progress=None) -> list[dict[str, Any]]:
        """Synchronous `ajudge`."""
        return asyncio.run(self.ajudge(items, progress))
