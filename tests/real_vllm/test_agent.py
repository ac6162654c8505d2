"""Your own agent through the real vLLM-CPU server: a hand-written `openai` SDK loop (its first request streamed),
2 grpo steps.

The agent is named in a recipe (`agent: sdk_agent:agent`, a file beside it) and `appo train` serves it the
OpenAI-compatible endpoint in front of the server. The model is the tiny chat model (Qwen-style `<tool_call>`
template; its vocabulary differs from the session server's tiny model), so the test runs on its own server
(`vllm_chat_server`, stopped at the end of the module). Asserted: both steps trained, every agent call answered
(no agent errors), and TRL's `sampling/sampling_logp_difference` below 1e-4: the rows the endpoint recorded
are the server's exact tokens and logprobs, re-scored by the trainer after every weight sync.
"""

from __future__ import annotations

import json

from test_train_eval import appo

AGENT = """
import json

import openai

TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def streamed(client, **kw):
    # the message assembled from the endpoint's server-sent-event chunks (the usage chunk must come last)
    content, calls, usage = "", {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                                  "function": {"name": d.function.name, "arguments": ""}})
                call["function"]["arguments"] += d.function.arguments or ""
    assert usage is not None and usage.completion_tokens > 0, usage
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def agent(row, base_url, model):
    client = openai.OpenAI(base_url=base_url, api_key="-")
    messages = list(row["prompt"])
    for turn in range(3):
        if turn == 0:  # the first request streams, the others do not: one run, one chain either way
            msg = streamed(client, model=model, messages=messages, tools=TOOLS)
        else:
            msg = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            msg = msg.choices[0].message.model_dump(exclude_none=True)
        messages.append(msg)
        if not msg.get("tool_calls"):
            break
        for call in msg["tool_calls"]:
            try:
                args = json.loads(call["function"]["arguments"])
                result = str(int(args["a"]) * int(args["b"]))
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    client.close()
    return float(row["answer"] in (msg.get("content") or ""))
"""


def test_openai_sdk_agent_trains_two_grpo_steps_through_the_server(vllm_chat_server, tmp_path):
    (tmp_path / "sdk_agent.py").write_text(AGENT)
    rows = [{"prompt": f"What is {a} times {b}?", "answer": str(a * b)} for a, b in [(6, 7), (3, 4)]]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "agent.yaml").write_text(
        f"model_name_or_path: {vllm_chat_server.model}\ndtype: float32\ndataset_name: {tmp_path / 'data.jsonl'}\n"
        "agent: sdk_agent:agent\nrollout_strategy: grpo\nmax_steps: 2\nper_device_train_batch_size: 4\n"
        "num_generations: 2\nmax_completion_length: 48\nlearning_rate: 1.0e-3\nbeta: 0.0\nuse_cpu: true\n"
        "bf16: false\ngradient_checkpointing: false\nreport_to: none\nsave_strategy: steps\nsave_steps: 2\n"
        "logging_steps: 1\n"
    )
    out = tmp_path / "run"
    appo(
        "train", "--config", str(tmp_path / "agent.yaml"), "--output_dir", str(out),
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", vllm_chat_server.url,
    )  # fmt: skip
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "agent/requests" in e]
    assert len(logs) == 2, state["log_history"]
    assert all(e["agent/requests"] >= 4 and e["agent/errors"] == 0 for e in logs), logs  # the streamed ones too
    assert all(e["agent/restarts"] == 0 for e in logs), logs  # a streamed answer sent back extends its chain
    assert all(e["sampling/sampling_logp_difference/max"] < 1e-4 for e in logs), logs
