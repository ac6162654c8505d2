"""Request bodies at the agent endpoint's edges (issue 48): deep nesting, lone surrogates; each a 400 naming the
field, no traceback, and the connection stays usable for the next request."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("openai")

from tests.trainer.test_agent_requests import post, serve  # noqa: E402
from tests.trainer.test_agents import TOOLS  # noqa: E402

USER = {"role": "user", "content": "6 times 7?"}


def _call(arguments: str) -> str:
    """A request whose assistant turn carries one tool call with `arguments` (raw JSON text of the value)."""
    return ('{"model": "x", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "",'
            ' "tool_calls": [{"id": "c", "type": "function", "function": {"name": "multiply", "arguments": '
            + arguments + '}}]}, {"role": "tool", "tool_call_id": "c", "content": "1"}]}')  # fmt: skip


EDGES = [
    # (raw body, the error's start)
    ('{"model": "x", "messages": [{"role": "user", "content": ' + "[" * 5000 + "]" * 5000 + "}]}",
     "body: nested over 64 levels deep"),
    (_call('{"a": ' * 1200 + "1" + "}" * 1200), "body: nested over 64 levels deep"),
    (_call('{"a": ' * 100 + "1" + "}" * 100), "messages.1.tool_calls.0.function.arguments.a.a.a"),
    (_call(json.dumps('{"a": ' * 100 + "1" + "}" * 100)),
     "messages.1.tool_calls.0.function.arguments: the JSON text's a.a.a"),
    ('{"model": "x", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages.0.content: holds a lone surrogate ('\\ud800' at character 1)"),
    (_call('"{\\"a\\": \\"\\\\udfff\\"}"'), "messages.1.tool_calls.0.function.arguments: the JSON text's a: holds"),
    ('{"model": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages.0.content.0.text: holds a lone surrogate"),
    ('{"model": "x", "messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": '
     '{"name": "mul\\ud800", "parameters": {}}}]}', "tools.0.function.name: holds a lone surrogate"),
    ('{"model": "x", "messages": [{"role": "user", "content": "a", "\\ud800": 1}]}', "messages.0.<key>: holds"),
    # own attack: what pydantic's lax mode or Python's parser took or named wrongly
    ('{"model": "x", "messages": [{"role": "user", "content": "a"}], "max_tokens": true}',
     "max_tokens: must be an integer, not true"),
    ('{"model": "x", "messages": [{"role": "user", "content": "a"}], "stop": ""}', "stop: an empty stop string"),
    ('{"model": "x", "messages": [{"role": "user", "content": "a"}], "stop": ["x", ""]}', "stop: an empty stop"),
    ('{"model": "x", "messages": [{"role": "user", "content": "a"}], "max_tokens": ' + "9" * 5000 + "}",
     "the request body is not JSON (Exceeds the limit (4300 digits) for integer string conversion"),
]


def test_deep_nesting_and_lone_surrogates_get_a_400_naming_the_field(tiny_chat_tokenizer, capfd, caplog):
    with caplog.at_level("DEBUG"), serve(tiny_chat_tokenizer) as (endpoint, backend):
        base_url, session = endpoint.open_session()
        with httpx.Client(timeout=30) as client:  # one keep-alive connection for every request
            for body, expected in EDGES:
                reply = client.post(base_url + "/chat/completions", content=body)
                assert reply.status_code == 400, (body[:120], reply.text[:300])
                message = reply.json()["error"]["message"]
                assert message.startswith(expected), (expected, message)
                assert "\n" not in message and "TypeError" not in message
                # the same connection answers the next request
                ok = client.post(base_url + "/chat/completions", json={"model": "x", "messages": [USER],
                                                                       "tools": TOOLS})  # fmt: skip
                assert ok.status_code == 200, ok.text
        assert len(backend.prompts) == len(EDGES)  # only the good requests reached the sampler
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception in ASGI" not in out + err, err[-2000:]
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")]


def test_unicode_that_is_text_passes_the_walk():
    from appo_trl.rollout.text import MAX_DEPTH, body_problem

    assert body_problem({"messages": [{"content": "caf\u00e9 \U0001f600 \u4e2d"}], "k\u00e9y": [1, [2]]}) is None
    assert body_problem([[]] * 3) is None
    deep: list = []
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert body_problem(deep) == f"{'.'.join(['0'] * MAX_DEPTH)}: nested over {MAX_DEPTH} levels deep, more than "\
        "is taken"  # fmt: skip
    assert body_problem(deep[0]) is None  # MAX_DEPTH containers in all: taken


def test_a_huge_request_is_tokenised_off_the_loop_so_other_runs_are_answered(tiny_chat_tokenizer):
    """Run 0's huge request is held inside its tokenisation until run 1's small request has been answered: the
    endpoint's loop answers run 1 meanwhile. (Were it tokenised on the loop, run 1 would be answered only after the
    hold gave up, and `answered_during` would be False.)"""
    import threading

    with serve(tiny_chat_tokenizer, max_model_len=2048) as (endpoint, backend):
        renderer, encode = endpoint.renderer, endpoint.renderer.encode
        holding, released, answered_during = threading.Event(), threading.Event(), []

        def held_encode(text: str) -> list[int]:
            if len(text) > 100_000:
                holding.set()
                answered_during.append(released.wait(timeout=20))
            return encode(text)

        renderer.encode = held_encode
        big_url, big_session = endpoint.open_session()
        small_url, small_session = endpoint.open_session()
        replies: dict = {}
        big = threading.Thread(target=lambda: replies.setdefault("big", post(big_url, {
            "model": "x", "messages": [{"role": "user", "content": "word " * 200_000}]})))  # fmt: skip
        big.start()
        assert holding.wait(timeout=20)
        small = post(small_url, {"model": "x", "messages": [USER], "tools": TOOLS})
        released.set()
        big.join(timeout=60)
        assert small.status_code == 200 and small_session.chains
        assert answered_during == [True]
        assert replies["big"].status_code == 400 and "max_model_len is 2048" in replies["big"].json()["error"]["message"]
        assert big_session.chains == []


def test_an_empty_last_answer_is_no_turn_of_the_completion(tiny_chat_tokenizer):
    """The row's budget spent: later answers are empty; the conversation reward functions see has exactly the row's
    turns (assistant messages = `turn_ends` of its mask), so a per-turn function counting them is not refused."""
    from appo_trl.rollout.group_tree import turn_ends

    with serve(tiny_chat_tokenizer, max_tokens=40) as (endpoint, _):
        url, session = endpoint.open_session()
        messages = [USER]
        first = post(url, {"model": "x", "messages": messages, "tools": TOOLS}).json()["choices"][0]["message"]
        messages += [first, {"role": "user", "content": "more " * 100}]  # does not fit: the row ends
        second = post(url, {"model": "x", "messages": messages, "tools": TOOLS}).json()["choices"][0]
        assert second["finish_reason"] == "length" and second["message"]["content"] == ""
        messages += [second["message"], {"role": "user", "content": "and?"}]  # budget spent: empty again
        third = post(url, {"model": "x", "messages": messages, "tools": TOOLS}).json()["choices"][0]
        assert third["message"]["content"] == ""
        [row] = session.chains
        said = [m for m in session.completion_messages() if m["role"] == "assistant"]
        assert len(said) == len(turn_ends(row.loss_mask)) == 1
        assert len(session.answered) == 3  # every call is still an answered call (per-call rewards)
