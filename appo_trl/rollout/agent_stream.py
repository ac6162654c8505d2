"""A finished `chat.completion` answer as OpenAI's server-sent-event stream of `chat.completion.chunk` objects.

The agent endpoint samples the whole turn first (the row is what the sampler produced, token for token) and then
sends the answer as a stream: the role, the text, each tool call (its index, id and name, then its arguments),
the `finish_reason`, the usage chunk when the request set `stream_options.include_usage`, and `data: [DONE]`. A
client that assembles the deltas gets the message the non-streamed request returns.
What it does not do: sample, or keep a connection open while the model writes (`appo_trl.rollout.agent_endpoint`).
"""

from __future__ import annotations

import json
from typing import Any


def stream_chunks(answer: dict[str, Any], include_usage: bool = False) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects that stream `answer` (a `chat.completion` of one choice)."""
    [choice] = answer["choices"]
    message = choice["message"]
    head = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}  # fmt: skip

    def chunk(delta: dict, finish: str | None = None, logprobs: Any = None) -> dict:
        out = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        return {**out, "usage": None} if include_usage else out

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content") or choice.get("logprobs"):
        chunks.append(chunk({"content": message.get("content") or ""}, logprobs=choice.get("logprobs")))
    for j, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        start = {"index": j, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
        chunks.append(chunk({"tool_calls": [start]}))
        chunks.append(chunk({"tool_calls": [{"index": j, "function": {"arguments": fn["arguments"]}}]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


def sse_events(answer: dict[str, Any], include_usage: bool = False) -> list[str]:
    """`stream_chunks` as server-sent events (`data: {...}`), ended by `data: [DONE]`."""
    return [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in stream_chunks(answer, include_usage)] + [
        "data: [DONE]\n\n"
    ]


__all__ = ["sse_events", "stream_chunks"]
