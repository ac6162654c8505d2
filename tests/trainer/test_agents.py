"""`APPOTrainer(agent=...)`: the user's own `openai` SDK loop trained through the OpenAI-compatible endpoint.

The sampler is a scripted backend (the random tiny model rarely writes a valid tool call): before a tool result it
writes two parallel `<tool_call>`s, after one the answer and EOS; every token logprob -0.5. The agent is a plain
`openai.OpenAI` loop that runs the calls itself.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import threading

import pytest
from datasets import Dataset

openai = pytest.importorskip("openai")

from appo_trl.config import APPOConfig  # noqa: E402
from appo_trl.rollout import Segment  # noqa: E402
from appo_trl.trainer.trainer import APPOTrainer  # noqa: E402
from tests.trainer.test_trainer import CPU, spy_loss  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]  # fmt: skip


class ScriptedBackend:
    """Two parallel calls, then (after a tool response) the answer; records every prompt it was given."""

    def __init__(self, tokenizer):
        self.tok, self.prompts, self.answers = tokenizer, [], {}
        self.after = tokenizer.convert_tokens_to_ids("</tool_response>")
        self.calls_text = (
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>\n'
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        )

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        if self.after in prompt_ids:  # per prompt, answers alternate 42 / 41: every group has both
            key = "(0)" in self.tok.decode(prompt_ids)
            self.answers[key] = self.answers.get(key, -1) + 1
            ids = enc("<answer> 42 </answer>" if self.answers[key] % 2 == 0 else "<answer> 41 </answer>")
        else:
            ids = enc(self.calls_text)
        ids = (ids + [self.tok.eos_token_id])[: params.max_tokens]
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, "eos" if len(ids) < params.max_tokens else "length")


def sdk_agent(row, base_url, model):
    """A hand-written `openai` SDK tool loop (parallel calls answered in order); reward: the answer is 42."""
    client = openai.OpenAI(base_url=base_url, api_key="-")
    messages = list(row["prompt"])
    for _ in range(4):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0.3)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] * args["b"])})
    client.close()
    return float("42" in (msg.content or ""))


def train_until_ctrl_c(trainer) -> None:
    """`trainer.train()`, which must end in KeyboardInterrupt. A shell without job control starts background jobs with
    SIGINT ignored (`bash .ci/run &`), so Ctrl-C's handler is installed for the run."""
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        signal.signal(signal.SIGINT, sigint)


def prompts(k=2):
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"what is 6 times 7 ({i})"}] for i in range(k)],
        "answer": ["42"] * k,
    })  # fmt: skip


def make_trainer(tmp_path, path, tok, agent, strategy="grpo", reward_funcs=None, num_prompts=2, **extra):
    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy=strategy, max_completion_length=96,
                      **{"max_steps": 2, "initial_rollouts": 2, "num_generations": 2,
                         "per_device_train_batch_size": 4, **extra})  # fmt: skip
    trainer = APPOTrainer(model=path, reward_funcs=reward_funcs, args=args, train_dataset=prompts(num_prompts),
                          processing_class=tok, agent=agent)  # fmt: skip
    backend = ScriptedBackend(tok)
    trainer.rollout_engine.backend = backend
    return trainer, backend


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
def test_openai_sdk_agent_trains_two_steps(tmp_path, strategy, tiny_chat_tokenizer, tiny_chat_model_path):
    tok = tiny_chat_tokenizer
    trainer, backend = make_trainer(tmp_path, tiny_chat_model_path, tok, sdk_agent, strategy)
    seen = spy_loss(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert len(seen) >= 2 and trainer.state.global_step == 2
    assert any(not (a == b.detach()).all() for a, b in zip(before, trainer.model.parameters()))  # it learned
    open_id, resp = tok.convert_tokens_to_ids("<tool_call>"), tok.convert_tokens_to_ids("<tool_response>")
    for inputs in seen:
        for ids, mask in zip(inputs["completion_ids"], inputs["tool_mask"]):
            ids, mask = ids.tolist(), mask.tolist()
            assert ids.count(open_id) == 2 and ids.count(resp) == 2  # both parallel calls, both results
            # sampled tokens (the calls, the answer) are trained; the tool turn rendered by the template is not
            assert all(m == 0 for i, m in zip(ids, mask) if i == resp)
            assert all(m == 1 for i, m in zip(ids, mask) if i == open_id)
    # every second request extends the first: its prompt is the recorded ids (prompt + sampled turn) + tool turn
    after = tok.convert_tokens_to_ids("</tool_response>")
    firsts = [p for p in backend.prompts if after not in p]
    turn = tok.encode(backend.calls_text, add_special_tokens=False) + [tok.eos_token_id]
    seconds = [p for p in backend.prompts if after in p]
    assert len(seconds) == len(firsts) == 8  # 2 steps x 4 runs
    assert all(any(p[: len(f)] == f and p[len(f) : len(f) + len(turn)] == turn for f in firsts) for p in seconds)
    logs = [h for h in trainer.state.log_history if "rewards/agent_reward/mean" in h]
    assert logs and all(h["rewards/agent_reward/mean"] == 0.5 for h in logs)
    assert all(h.get("agent/errors", 0) == 0 and h.get("agent/restarts", 0) == 0 for h in logs)
    assert all(h["tools/calls"] == 8 and h["tools/call_frequency"] == 2 for h in logs)  # the calls the model made
    assert trainer.rounds.path.agents.endpoint is None  # closed after train()


def test_endpoint_rows_are_exact_and_forks_start_new_rows(tiny_chat_tokenizer):
    """Direct: the endpoint, a session, an extension and a fork (the agent drops its history)."""
    from appo_trl.rollout.agent_endpoint import AgentEndpoint
    from appo_trl.rollout.agent_session import ChatRenderer
    from appo_trl.rollout.chat_format import ChatToolFormat
    from appo_trl.rollout.types import SamplingParams

    tok = tiny_chat_tokenizer
    backend = ScriptedBackend(tok)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    renderer = ChatRenderer(tok, tool_format=ChatToolFormat(tok))
    endpoint = AgentEndpoint(lambda c: asyncio.run_coroutine_threadsafe(c, loop), backend.generate, renderer,
                             SamplingParams(max_tokens=200), 4096, model_name="tiny").start()  # fmt: skip
    try:
        base_url, session = endpoint.open_session(seed=1)
        assert base_url.endswith("/v1") and endpoint.secret in base_url
        client = openai.OpenAI(base_url=base_url, api_key="-")
        assert [m.id for m in client.models.list()] == ["tiny"]
        messages = [{"role": "user", "content": "6 times 7?"}]
        first = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, logprobs=True)
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 2
        assert json.loads(msg.tool_calls[1].function.arguments) == {"a": 2, "b": 3}
        assert first.usage.completion_tokens == len(first.choices[0].logprobs.content)
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42"},
                     {"role": "tool", "tool_call_id": msg.tool_calls[1].id, "content": "6"}]  # fmt: skip
        second = client.chat.completions.create(model="x", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content.strip() == "<answer> 42 </answer>"
        [row] = session.chains
        row.check()
        assert (
            backend.prompts[1] == row.prompt_ids + row.completion_ids[: len(backend.prompts[1]) - len(row.prompt_ids)]
        )
        sampled = [i for i, m in zip(row.completion_ids, row.loss_mask) if m == 1]
        assert sum(len(s) for s in [sampled]) == first.usage.completion_tokens + second.usage.completion_tokens
        assert all(math.isnan(lp) for lp, m in zip(row.logprobs, row.loss_mask) if m == 0)
        assert all(lp == -0.5 for lp, m in zip(row.logprobs, row.loss_mask) if m == 1)
        # a compacted history is not an extension: a second row (fork) on the template's rendering
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "6 times 7? (again)"}])
        assert len(session.chains) == 2 and session.row.origin == "restart"
        assert session.row.prompt_ids == renderer.prompt_ids([{"role": "user", "content": "6 times 7? (again)"}], None)
        # a wrong secret, and an ended run
        bad = base_url.replace(endpoint.secret, "x" * len(endpoint.secret))
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=bad, api_key="-", max_retries=0).models.list()
        endpoint.end_session(base_url)
        with pytest.raises(openai.APIStatusError) as err:
            openai.OpenAI(base_url=base_url, api_key="-", max_retries=0).chat.completions.create(
                model="x", messages=messages)  # fmt: skip
        assert err.value.status_code == 410
        client.close()
    finally:
        endpoint.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def test_tool_choice_none_is_text_required_warns_and_others_are_refused(tiny_chat_tokenizer, caplog):
    from appo_trl.rollout.agent_endpoint import AgentEndpoint
    from appo_trl.rollout.agent_session import ChatRenderer
    from appo_trl.rollout.chat_format import ChatToolFormat
    from appo_trl.rollout.types import SamplingParams

    tok = tiny_chat_tokenizer
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    endpoint = AgentEndpoint(lambda c: asyncio.run_coroutine_threadsafe(c, loop), ScriptedBackend(tok).generate,
                             ChatRenderer(tok, tool_format=ChatToolFormat(tok)), SamplingParams(max_tokens=200),
                             4096).start()  # fmt: skip
    try:

        def ask(choice):
            client = openai.OpenAI(base_url=endpoint.open_session()[0], api_key="-", max_retries=0)
            messages = [{"role": "user", "content": "6 times 7?"}]
            return client.chat.completions.create(model="x", messages=messages, tools=TOOLS, tool_choice=choice)

        none = ask("none").choices[0]
        assert none.finish_reason == "stop" and not none.message.tool_calls and "multiply" in none.message.content
        with caplog.at_level("WARNING", logger="appo_trl.rollout.agent_endpoint"):
            named = {"type": "function", "function": {"name": "multiply"}}
            for choice in ("required", named, "auto"):
                assert len(ask(choice).choices[0].message.tool_calls) == 2  # sampled unconstrained, parsed
        assert sum("tool_choice" in r.getMessage() for r in caplog.records) == 1  # once per endpoint
        with pytest.raises(openai.BadRequestError, match="tool_choice='always'"):
            ask("always")
    finally:
        endpoint.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


class Conversation:
    """A TRL-signature reward function that records what it was given."""

    __name__ = "conversation_reward"

    def __init__(self):
        self.seen = []

    def __call__(self, prompts, completions, answer, **kw):
        self.seen.append((prompts, completions, answer))
        return [0.5 + 0.1 * i for i in range(len(completions))]


async def async_agent(row, base_url, model):
    """An `async def` agent on `openai.AsyncOpenAI`; returns None: the reward functions score it."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="-")
    messages = list(row["prompt"])
    reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    msg = reply.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in msg.tool_calls]
    await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    await client.close()
    return None


def test_async_agent_returning_none_is_scored_by_reward_funcs(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    reward = Conversation()
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, async_agent,
                              reward_funcs=[reward], max_steps=1)  # fmt: skip
    trainer.train()
    [(prompts, completions, answer)] = reward.seen
    assert answer == ["42"] * 4 and prompts[0] == [{"role": "user", "content": "what is 6 times 7 (0)"}]
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "tool", "assistant"]
    assert completions[0][0]["tool_calls"][0]["function"]["name"] == "multiply"
    assert {c[-1]["content"].strip() for c in completions} == {"<answer> 42 </answer>", "<answer> 41 </answer>"}
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["rewards/agent_reward/mean"] is None  # no run returned a number (TRL: all None)
    assert log["rewards/conversation_reward/mean"] == pytest.approx(0.65) == log["reward"]


def test_agent_reward_wins_over_reward_funcs(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    reward = Conversation()
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, sdk_agent,
                              reward_funcs=[reward], max_steps=1)  # fmt: skip
    trainer.train()
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["reward"] == 0.5  # the agent's 1.0 and 0.0, not plus the reward function's 0.5..0.8


def failing_agent(row, base_url, model):
    openai.OpenAI(base_url=base_url, api_key="-").chat.completions.create(model=model, messages=row["prompt"])
    raise ValueError("the sandbox broke\nsecond line")


def test_agent_that_raises_gets_zero_reward_or_stops_the_run(tmp_path, caplog, tiny_chat_tokenizer,
                                                              tiny_chat_model_path):  # fmt: skip
    trainer, _ = make_trainer(tmp_path / "a", tiny_chat_model_path, tiny_chat_tokenizer, failing_agent, max_steps=1)
    with caplog.at_level("WARNING"):
        trainer.train()
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["reward"] == 0.0 and log["agent/errors"] == 4.0
    warned = [r.message for r in caplog.records if "the sandbox broke; its trajectory gets reward 0" in r.message]
    assert len(warned) == 1 and "second line" not in warned[0] and "failing_agent" in warned[0]
    from appo_trl.trainer.agents import AgentError

    trainer, _ = make_trainer(tmp_path / "b", tiny_chat_model_path, tiny_chat_tokenizer, failing_agent, max_steps=1,
                              agent_errors="raise")  # fmt: skip
    with pytest.raises(AgentError, match="'failing_agent' failed: ValueError: the sandbox broke"):
        trainer.train()
    assert not [t for t in threading.enumerate() if t.name.startswith(("appo-agent", "appo-agents"))]


async def slow_agent(row, base_url, model):
    await asyncio.sleep(30)


def silent_agent(row, base_url, model):
    return 1.0


def test_timeouts_and_an_agent_without_requests(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    trainer, _ = make_trainer(tmp_path / "a", tiny_chat_model_path, tiny_chat_tokenizer, slow_agent, max_steps=1,
                              agent_timeout_s=0.2)  # fmt: skip
    trainer.train()
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["agent/timeouts"] == 4.0 and log["reward"] == 0.0
    trainer, _ = make_trainer(tmp_path / "b", tiny_chat_model_path, tiny_chat_tokenizer, silent_agent, max_steps=1)
    from appo_trl.trainer.agents import AgentError

    with pytest.raises(AgentError, match="agent 'silent_agent' returned without sending a single request"):
        trainer.train()


def test_recipe_agent_is_found_beside_the_recipe_and_close_frees_the_port(tmp_path, tiny_chat_tokenizer,
                                                                          tiny_chat_model_path):  # fmt: skip
    (tmp_path / "my_agent.py").write_text(
        "import openai\n\ndef agent(row, base_url, model):\n"
        "    client = openai.OpenAI(base_url=base_url, api_key='-')\n"
        "    client.chat.completions.create(model=model, messages=row['prompt'])\n"
        "    return 0.25\n"
    )
    args = APPOConfig(output_dir=str(tmp_path / "out"), **CPU, num_generations=2, per_device_train_batch_size=4,
                      max_steps=1, max_completion_length=32, agent="my_agent:agent")  # fmt: skip
    from appo_trl.configs.plan import StartupPlan

    plan = StartupPlan.resolve(args, None, [str(tmp_path)])  # as `appo train` passes the recipe's folder
    trainer = APPOTrainer(model=tiny_chat_model_path, args=args, train_dataset=prompts(),
                          processing_class=tiny_chat_tokenizer, tools=plan)  # fmt: skip
    assert trainer.agent.__name__ == "agent"
    trainer.rollout_engine.backend = ScriptedBackend(tiny_chat_tokenizer)
    ports = []
    real_start = trainer.rounds.path.agents._start

    def start():
        real_start()
        ports.append(trainer.rounds.path.agents.endpoint.port)

    trainer.rounds.path.agents._start = start
    trainer.train()
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["reward"] == 0.25
    import socket

    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", ports[0]), timeout=2):
        pass
    assert not [t for t in threading.enumerate() if t.name.startswith(("appo-agent", "appo-agents"))]
    bad = APPOConfig(output_dir=str(tmp_path / "o2"), **CPU, agent="nope:x")
    with pytest.raises(ValueError, match="agent: .*cannot import module 'nope'"):
        APPOTrainer(
            model=tiny_chat_model_path, args=bad, train_dataset=prompts(), processing_class=tiny_chat_tokenizer
        )


CANCELLED = []


async def stuck_agent(row, base_url, model):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="-")
    await client.chat.completions.create(model=model, messages=row["prompt"])
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        CANCELLED.append(base_url)
        raise


def test_ctrl_c_stops_agents_and_endpoint(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    import os
    import socket

    before = set(threading.enumerate())  # threads other tests left behind are not this run's
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, stuck_agent, max_steps=1)
    agents = trainer.rounds.path.agents
    real_start, ports = agents._start, []

    def start():
        real_start()
        ports.append(agents.endpoint.port)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while every agent waits

    agents._start = start
    CANCELLED.clear()
    train_until_ctrl_c(trainer)
    assert len(CANCELLED) == 4 and agents.endpoint is None
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", ports[0]), timeout=2):
        pass
    left = [t for t in set(threading.enumerate()) - before if t.name.startswith(("appo-agent", "appo-rollout-loop"))]
    assert not left


def test_appo_branches_agent_runs_by_replay(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    """APPO: 1 initial run per prompt, 1 branch; the branch re-runs the deterministic agent, its calls before the
    branch call are answered from the record (0 divergence), and its row shares the parent's tokens up to the point."""
    tok = tiny_chat_tokenizer
    trainer, backend = make_trainer(tmp_path, tiny_chat_model_path, tok, sdk_agent, "appo", max_steps=1,
                                    initial_rollouts=1, min_remaining_tokens=2)  # fmt: skip
    batches, strategy = [], trainer.rounds.strategy
    real = strategy.generate
    strategy.generate = lambda *a, **k: batches.append(real(*a, **k)) or batches[-1]
    seen = spy_loss(trainer)
    trainer.train()
    [batch] = batches
    rows = {r.uid: r for r in batch.rows}
    for parent, branch in batch.groups:
        assert branch.parent == parent.uid and branch.origin == "branch" and rows[branch.parent] is parent
        p = branch.branch_pos
        assert branch.prompt_ids == parent.prompt_ids
        assert branch.completion_ids[:p] == parent.completion_ids[:p] and branch.loss_mask[:p] == parent.loss_mask[:p]
        branch.check()
        # the branch call was sampled on the parent's prompt + completion up to the branch point, exactly
        assert parent.prompt_ids + parent.completion_ids[:p] in backend.prompts
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["agent/branches"] == 2.0 and log["agent/replay_divergence"] == 0.0
    assert sum(s["completion_ids"].size(0) for s in seen) == 2  # APPO: branch rows leave the batch


def nondeterministic_agent(row, base_url, model):
    """Its first message differs on every run: a branch's replay diverges at once and samples fresh."""
    import uuid

    client = openai.OpenAI(base_url=base_url, api_key="-")
    messages = [{"role": "user", "content": row["prompt"][0]["content"] + uuid.uuid4().hex[:6]}]
    client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    client.close()
    return 0.5


def test_replay_divergence_is_counted(tmp_path, tiny_chat_tokenizer, tiny_chat_model_path):
    trainer, _ = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, nondeterministic_agent, "appo",
                              max_steps=1, initial_rollouts=1, min_remaining_tokens=2)  # fmt: skip
    trainer.train()
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["agent/branches"] == 2.0 and log["agent/replay_divergence"] == 2.0 and log["agent/replayed_calls"] == 0


def test_what_an_agent_cannot_run_with_is_refused_before_the_model_loads(tmp_path):
    base = dict(output_dir=str(tmp_path), **CPU, num_generations=2, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="'sdk_agent': the agent runs its own loop and tools; tools cannot be set"):
        APPOTrainer(model="missing", args=APPOConfig(**base), train_dataset=prompts(), agent=sdk_agent, tools=[len])
    with pytest.raises(ValueError, match="either as APPOTrainer\\(agent=...\\) or APPOConfig\\(agent=...\\)"):
        APPOTrainer(model="missing", args=APPOConfig(**base, agent="m:a"), train_dataset=prompts(), agent=sdk_agent)
