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


# fmt: off
MALFORMED = [  # (body, the field the 400 names)
    ({"model": "x", "messages": "hi"}, "messages: Input should be a valid list"),
    ({"model": "x", "messages": []}, "messages: List should have at least 1 item"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "",
                                                                    "tool_calls": "bad"}]},
     "messages.1.tool_calls: Input should be a valid list"),
    ({"model": "x", "messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages.0.tool_calls.0.function.name: Field required"),
    ({"model": "x", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content: only text parts are served"),
    ({"model": "x", "messages": [{"role": "robot", "content": "a"}]}, "messages.0.role: Input should be"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}], "n": "abc"}, "n: Input should be a valid integer"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}], "n": 2}, "n: n=2 is not served"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}], "temperature": "hot"},
     "temperature: Input should be a valid number"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
     "max_tokens: Input should be greater than or equal to 1"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}},
     "response_format: 'json_object' is not served"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     "tools.0.function: Field required"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}], "functions": [{"name": "f"}]},
     "functions: the legacy `functions` form is not served"),
    ({"model": "x", "messages": [{"role": "user", "content": "a"}], "logit_bias": {"5": 10}}, "logit_bias: is not"),
    ([1, 2], "body: Input should be a valid dictionary"),
    (b"{not json", "the request body is not JSON"),
    (b"\xff\xfe", "the request body is not JSON"),
]
# fmt: on


def test_malformed_requests_get_a_400_naming_the_field_and_no_traceback(tiny_chat_tokenizer, caplog, capfd):
    with caplog.at_level("DEBUG"), serve(tiny_chat_tokenizer) as (endpoint, backend):
        base_url, session = endpoint.open_session()
        for body, expected in MALFORMED:
            reply = post(base_url, body)
            assert reply.status_code == 400, (body, reply.text)
            assert reply.json()["error"]["message"].startswith(expected), (body, reply.json())
        # the openai SDK (it retries 5xx, not 400): one request, one clear error
        client = openai.OpenAI(base_url=base_url, api_key="-")
        with pytest.raises(openai.BadRequestError, match="temperature: Input should be a valid number"):
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], temperature="hot")
        client.close()
        # a secret with non-ASCII text, and an unknown one: 404
        wrong = base_url.replace(endpoint.secret, "s\u00e9cr\u00e8t\u2603")
        assert httpx.get(wrong.rsplit("/v1", 1)[0] + "/v1/models").status_code == 404
        assert backend.prompts == [] and session.chains == []
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception in ASGI" not in out + err
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")]


def test_settings_the_endpoint_does_not_follow_are_warned_once(tiny_chat_tokenizer, caplog):
    with caplog.at_level("WARNING", logger="appo_trl.rollout.agent_endpoint"), serve(tiny_chat_tokenizer) as (ep, _):
        for _ in range(2):
            body = {"model": "x", "messages": [{"role": "user", "content": "a"}], "seed": 3, "top_p": 0.5,
                    "frequency_penalty": 0.2, "user": "me", "parallel_tool_calls": True, "guided_json": {}}  # fmt: skip
            assert post(ep.open_session()[0], body).status_code == 200
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert any("top_p=0.5, frequency_penalty=0.2, seed=3" in line for line in lines)
    assert any("does not know and ignores: guided_json (" in line for line in lines)  # `user` and the like: quiet


def test_a_wildcard_host_hands_agents_a_reachable_url(tiny_chat_tokenizer):
    with serve(tiny_chat_tokenizer, host="0.0.0.0") as (endpoint, _):
        base_url, _ = endpoint.open_session()
        host = httpx.URL(base_url).host
        assert host not in ("0.0.0.0", "") and endpoint.url_host == host
        client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "6 times 7?"}])
        assert reply.choices[0].finish_reason == "tool_calls"
        client.close()


def test_a_client_gone_mid_body_leaves_no_traceback(tiny_chat_tokenizer, capfd):
    """An agent cancelled while sending its request (a timeout, Ctrl-C): the endpoint drops it without a traceback."""
    import socket
    import time

    with serve(tiny_chat_tokenizer) as (endpoint, backend):
        base_url, session = endpoint.open_session()
        path = base_url.split(f":{endpoint.port}", 1)[1] + "/chat/completions"
        with socket.create_connection(("127.0.0.1", endpoint.port)) as s:
            s.sendall(f'POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{"model'.encode())
            time.sleep(0.2)
        time.sleep(0.5)  # the server notices the disconnect
        assert post(base_url, {"model": "x", "messages": [{"role": "user", "content": "a"}]}).status_code == 200
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception in ASGI" not in out + err, err
