"""Requests the agent endpoint refuses or bounds: over-long conversations, huge bodies, a turn's own `max_tokens`.

The scripted sampler of `test_agents.py` behind a real endpoint (no trainer); `backend.prompts` shows whether
anything reached the sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.trainer.test_agents import TOOLS, ScriptedBackend  # noqa: E402


@contextlib.contextmanager
def serve(tok, max_tokens=200, max_model_len=4096, backend=None, **kw):
    """A started `AgentEndpoint` on the scripted sampler: (endpoint, backend)."""
    from appo_trl.rollout.agent_endpoint import AgentEndpoint
    from appo_trl.rollout.agent_session import ChatRenderer
    from appo_trl.rollout.chat_format import ChatToolFormat
    from appo_trl.rollout.types import SamplingParams

    backend = backend or ScriptedBackend(tok)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    endpoint = AgentEndpoint(lambda c: asyncio.run_coroutine_threadsafe(c, loop), backend.generate,
                             ChatRenderer(tok, tool_format=ChatToolFormat(tok)), SamplingParams(max_tokens=max_tokens),
                             max_model_len, **kw).start()  # fmt: skip
    try:
        yield endpoint, backend
    finally:
        endpoint.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def post(base_url: str, body) -> httpx.Response:
    kw = {"content": body} if isinstance(body, (bytes, str)) else {"json": body}
    return httpx.post(base_url + "/chat/completions", timeout=30, **kw)


def test_over_long_requests_are_refused_before_sampling(tiny_chat_tokenizer):
    tok = tiny_chat_tokenizer
    with serve(tok, max_model_len=2048) as (endpoint, backend):
        base_url, session = endpoint.open_session()
        long = {"role": "user", "content": "word " * 3000}  # about 12 KB, over 2048 tokens
        reply = post(base_url, {"model": "x", "messages": [long]})
        assert reply.status_code == 400
        n = len(endpoint.renderer.prompt_ids([long], None))
        message = reply.json()["error"]["message"]
        assert "max_model_len is 2048" in message and f"{n} tokens" in message, message
        assert backend.prompts == [] and session.chains == []  # nothing sampled, nothing recorded
        # an extension that pushes the conversation past max_model_len: refused too, the row kept as it was
        messages = [{"role": "user", "content": "6 times 7?"}]
        first = post(base_url, {"model": "x", "messages": messages, "tools": TOOLS}).json()["choices"][0]["message"]
        [row] = session.chains
        kept = list(row.completion_ids)
        messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "1 " * 2100},
                     {"role": "tool", "tool_call_id": first["tool_calls"][1]["id"], "content": "6"}]  # fmt: skip
        reply = post(base_url, {"model": "x", "messages": messages, "tools": TOOLS})
        assert reply.status_code == 400 and "max_model_len is 2048" in reply.json()["error"]["message"]
        assert len(backend.prompts) == 1 and row.completion_ids == kept
        # the row's own budget (max_completion_length) spent by a tool result is a truncation, not an error
        with serve(tok, max_tokens=40) as (small, _):
            url, sess = small.open_session()
            messages = [{"role": "user", "content": "6 times 7?"}]
            first = post(url, {"model": "x", "messages": messages, "tools": TOOLS}).json()["choices"][0]
            messages += [first["message"], {"role": "user", "content": "more " * 100}]
            reply = post(url, {"model": "x", "messages": messages, "tools": TOOLS}).json()["choices"][0]
            assert reply["finish_reason"] == "length" and reply["message"]["content"] == ""
            assert len(sess.chains) == 1 and sess.chains[0].finish_reason == "length"


def test_a_huge_body_is_refused_before_it_is_read_whole(tiny_chat_tokenizer):
    tok = tiny_chat_tokenizer
    with serve(tok, max_model_len=2048) as (endpoint, backend):
        assert endpoint.max_body_bytes == 2**20
        base_url, session = endpoint.open_session()
        huge = {"model": "x", "messages": [{"role": "user", "content": "x" * 5_000_000}]}
        reply = post(base_url, huge)
        assert reply.status_code == 413, reply.text
        assert f"over {2**20} bytes" in reply.json()["error"]["message"]
        # a chunked body (no content-length) is cut off as it arrives
        chunks = (b"x" * 65536 for _ in range(80))
        reply = httpx.post(base_url + "/chat/completions", content=chunks, timeout=30)
        assert reply.status_code == 413
        assert backend.prompts == [] and session.chains == []


def test_max_tokens_caps_its_turn_only(tiny_chat_tokenizer):
    """A turn capped at 2 tokens ends that turn; the next turn samples on (the row's budget is not spent)."""
    tok = tiny_chat_tokenizer
    with serve(tok, max_tokens=200) as (endpoint, backend):
        base_url, session = endpoint.open_session()
        client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
        messages = [{"role": "user", "content": "6 times 7?"}]
        first = client.chat.completions.create(model="x", messages=messages, max_tokens=2)
        assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 2
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        second = client.chat.completions.create(model="x", messages=messages, max_completion_tokens=60)
        assert second.choices[0].finish_reason == "tool_calls" and second.usage.completion_tokens > 2
        [row] = session.chains
        row.check()
        sampled = [m for m in row.loss_mask if m == 1]
        assert len(sampled) == 2 + second.usage.completion_tokens
        # the cut turn is closed with the template's turn end (not sampled) before the user turn
        end = endpoint.renderer.turn_end_ids
        assert row.completion_ids[2 : 2 + len(end)] == end and row.loss_mask[2] == 0
        assert len(backend.prompts) == 2 and backend.prompts[1] == row.prompt_ids + row.completion_ids[
            : len(backend.prompts[1]) - len(row.prompt_ids)]  # fmt: skip
        client.close()
