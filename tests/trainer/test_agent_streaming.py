"""`stream: true` through the agent endpoint: OpenAI's server-sent-event chunks, and agents that stream trained.

The scripted sampler of `test_agents.py` (two parallel tool calls, then the answer). Checked directly: the message
an `openai` client assembles from the chunks equals the non-streamed answer for the same seed (tool calls, ids and
arguments included), the usage chunk comes with `stream_options.include_usage`, and the rows the two runs record are
the same ids. Trained (grpo and appo, 2 steps, 4 runs per prompt): an `openai` SDK loop with `stream=True` and the
OpenAI Agents SDK's `Runner.run_streamed`.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.trainer.test_agent_clients import calculator  # noqa: E402
from tests.trainer.test_agents import TOOLS, ScriptedBackend, make_trainer  # noqa: E402


def assemble(stream) -> tuple[dict, str, dict | None]:
    """A streamed answer as the non-streamed message (role, content, tool calls), its finish_reason and usage."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})  # fmt: skip
                call["id"] = d.id or call["id"]
                call["function"]["name"] += (d.function.name or "") if d.function else ""
                call["function"]["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, usage


def test_streamed_answer_equals_the_plain_one_and_rows_are_the_same(tiny_chat_tokenizer):
    from appo_trl.rollout.agent_endpoint import AgentEndpoint
    from appo_trl.rollout.agent_session import ChatRenderer
    from appo_trl.rollout.chat_format import ChatToolFormat
    from appo_trl.rollout.types import SamplingParams

    tok = tiny_chat_tokenizer
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    backend = ScriptedBackend(tok)
    endpoint = AgentEndpoint(lambda c: asyncio.run_coroutine_threadsafe(c, loop), backend.generate,
                             ChatRenderer(tok, tool_format=ChatToolFormat(tok)), SamplingParams(max_tokens=200),
                             4096, model_name="tiny").start()  # fmt: skip
    try:
        runs = []
        for stream in (False, True):
            backend.answers = {}  # the same script for both runs (it alternates its answers)
            base_url, session = endpoint.open_session(seed=3)
            client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
            messages, answers = [{"role": "user", "content": "6 times 7?"}], []
            for _ in range(2):
                kw = dict(model="x", messages=messages, tools=TOOLS, logprobs=True)
                if stream:
                    message, finish, usage = assemble(client.chat.completions.create(
                        **kw, stream=True, stream_options={"include_usage": True}))  # fmt: skip
                else:
                    reply = client.chat.completions.create(**kw)
                    message = reply.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"})
                    finish, usage = reply.choices[0].finish_reason, reply.usage
                answers.append((message, finish, usage.model_dump(exclude_none=True)))
                messages = messages + [message]
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": "42"}
                             for c in message.get("tool_calls", ())]  # fmt: skip
            runs.append((answers, session))
            client.close()
        (plain, plain_session), (streamed, streamed_session) = runs
        assert plain[0][1] == "tool_calls" and len(plain[0][0]["tool_calls"]) == 2
        assert json.loads(plain[0][0]["tool_calls"][1]["function"]["arguments"]) == {"a": 2, "b": 3}
        assert plain[1][1] == "stop" and "42" in plain[1][0]["content"]
        assert streamed == plain  # messages (tool call ids included), finish reasons and usage
        [a], [b] = plain_session.chains, streamed_session.chains
        assert (a.prompt_ids, a.completion_ids, a.loss_mask, a.logprobs) == (
            b.prompt_ids, b.completion_ids, b.loss_mask, b.logprobs)  # fmt: skip
        # without stream_options no usage chunk; the raw events end with [DONE]
        body = {"model": "x", "messages": [{"role": "user", "content": "6 times 7?"}], "stream": True}
        raw = httpx.post(endpoint.open_session()[0] + "/chat/completions", json=body)
        assert raw.headers["content-type"].startswith("text/event-stream")
        events = [e for e in raw.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and "usage" not in chunks[-1]
    finally:
        endpoint.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def streaming_sdk_agent(row, base_url, model):
    """The hand-written `openai` SDK tool loop of `test_agents.sdk_agent`, every request with `stream=True`."""
    client = openai.OpenAI(base_url=base_url, api_key="-")
    messages = list(row["prompt"])
    for _ in range(4):
        stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True})  # fmt: skip
        message, _, usage = assemble(stream)
        assert usage is not None
        messages.append(message)
        if "tool_calls" not in message:
            break
        for call in message["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] * args["b"])})
    client.close()
    return float("42" in message["content"])


async def agents_sdk_streamed_agent(row, base_url, model):
    """The OpenAI Agents SDK with `Runner.run_streamed` (it streams every chat-completions call)."""
    agents, client, agent = calculator(base_url, model)
    result = agents.Runner.run_streamed(agent, row["prompt"][0]["content"])
    kinds = [event.type async for event in result.stream_events()]
    await client.close()
    assert "raw_response_event" in kinds  # it did stream
    return float("42" in str(result.final_output))


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
@pytest.mark.parametrize("agent", [streaming_sdk_agent, agents_sdk_streamed_agent], ids=["openai", "agents_sdk"])
def test_streaming_agents_train_two_steps(tmp_path, strategy, agent, tiny_chat_tokenizer, tiny_chat_model_path):
    if agent is agents_sdk_streamed_agent:
        pytest.importorskip("agents")
    extra = dict(initial_rollouts=2, min_remaining_tokens=2) if strategy == "appo" else dict(initial_rollouts=4)
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, agent, strategy,
                              num_generations=4, **extra)  # fmt: skip
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not (a == b.detach()).all() for a, b in zip(before, trainer.model.parameters()))  # it learned
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2 and all(h["agent/errors"] == 0 and h["agent/restarts"] == 0 for h in logs)
    assert all(h["reward"] == 0.5 for h in logs)  # per group two 42s and two 41s: every run streamed to its end
    if strategy == "appo":
        assert all(h["agent/branches"] >= 2 and h["agent/replay_divergence"] == 0 for h in logs)
