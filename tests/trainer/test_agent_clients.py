"""Real agent clients trained through the endpoint: the OpenAI Agents SDK, smolagents and a `verifiers` environment
(grpo and appo).

Same scripted sampler as `test_agents.py`; smolagents gets one that ends with its `final_answer` tool.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from appo_trl.rollout import Segment  # noqa: E402
from tests.trainer.test_agents import ScriptedBackend, make_trainer  # noqa: E402


def calculator(base_url, model):
    """The OpenAI Agents SDK module, an async client at `base_url`, and an `Agent` with a `function_tool` on it."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    client = openai.AsyncOpenAI(base_url=base_url, api_key="-")
    llm = agents.OpenAIChatCompletionsModel(model=model, openai_client=client)
    return agents, client, agents.Agent(name="calculator", instructions="Use the tool.", model=llm, tools=[multiply])


async def agents_sdk_agent(row, base_url, model):
    """The OpenAI Agents SDK: an `Agent` with a `function_tool`, on a chat-completions model at `base_url`."""
    agents, client, agent = calculator(base_url, model)
    result = await agents.Runner.run(agent, row["prompt"][0]["content"])
    await client.close()
    return float("42" in str(result.final_output))


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
def test_openai_agents_sdk_trains_two_steps(tmp_path, strategy, tiny_chat_tokenizer, tiny_chat_model_path):
    pytest.importorskip("agents")
    extra = dict(initial_rollouts=1, min_remaining_tokens=2) if strategy == "appo" else {}
    trainer, backend = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, agents_sdk_agent, strategy,
                                    **extra)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert all(h["agent/errors"] == 0 and h["agent/restarts"] == 0 for h in logs)  # the SDK's history is extended
    assert all(h["reward"] == 0.5 for h in logs)  # per group one 42 and one 41
    if strategy == "appo":
        assert all(h["agent/branches"] == 2 and h["agent/replay_divergence"] == 0 for h in logs)


class SmolScripted(ScriptedBackend):
    """For smolagents' ToolCallingAgent: `multiply`, then after its observation the `final_answer` tool."""

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        last_user = self.tok.decode(prompt_ids).split("<|im_start|>user")[-1]
        call = ('{"name": "final_answer", "arguments": {"answer": "42"}}' if "Observation" in last_user
                else '{"name": "multiply", "arguments": {"a": 6, "b": 7}}')  # fmt: skip
        ids = self.tok.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False)
        ids = (ids + [self.tok.eos_token_id])[: params.max_tokens]
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, "eos" if len(ids) < params.max_tokens else "length")


def smolagents_agent(row, base_url, model):
    """smolagents: `ToolCallingAgent` with `OpenAIServerModel` (it rewrites its history: every step forks)."""
    smolagents = pytest.importorskip("smolagents")

    @smolagents.tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        """
        return a * b

    llm = smolagents.OpenAIServerModel(model_id=model, api_base=base_url, api_key="-")
    agent = smolagents.ToolCallingAgent(tools=[multiply], model=llm, max_steps=3, verbosity_level=0)
    return float(str(agent.run(row["prompt"][0]["content"])) == "42")


@pytest.fixture(scope="module")
def long_chat_model(tmp_path_factory):
    """The tiny chat model with 8k positions: smolagents' system prompt alone is about 2.6k tokens."""
    from transformers import AutoTokenizer

    from appo_trl.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-chat-8k"), chat_template="tools",
                            max_position_embeddings=8192)  # fmt: skip
    return path, AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
def test_smolagents_trains_two_steps_with_forked_rows(tmp_path, strategy, long_chat_model):
    pytest.importorskip("smolagents")
    path, tok = long_chat_model
    extra = dict(initial_rollouts=1, min_remaining_tokens=2) if strategy == "appo" else {}
    trainer, _ = make_trainer(tmp_path, path, tok, smolagents_agent, strategy, **extra)
    backend = trainer.rollout_engine.backend = SmolScripted(tok)
    batches, strat = [], trainer.rounds.strategy
    real = strat.generate
    strat.generate = lambda *a, **k: batches.append(real(*a, **k)) or batches[-1]
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "reward" in h]
    # each run forks once (smolagents sends its tool call back as text); its row is the last chain, exact
    assert all(h["agent/errors"] == 0 and h["agent/restarts"] >= 2 and h["reward"] == 1.0 for h in logs)
    for row in batches[-1].rows:
        row.check()
        sampled = [i for i, m in zip(row.completion_ids, row.loss_mask) if m == 1]
        assert sampled == row.completion_ids[: len(sampled)]  # the final_answer call, as sampled
        assert row.prompt_ids in backend.prompts  # the fork's prompt: the template's rendering, as sampled on
    if strategy == "appo":
        assert all(h["agent/branches"] == 2 and h["agent/replay_divergence"] == 0 for h in logs)


def verifiers_env():
    """A `verifiers` `ToolEnv` on a small local dataset with a rubric. Built once, on the main thread: verifiers'
    environments install SIGINT/SIGTERM handlers when constructed (the test puts the previous ones back)."""
    import signal

    vf = pytest.importorskip("verifiers")
    from datasets import Dataset

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        """
        return a * b

    def correct(completion, answer, **kw) -> float:
        return float(answer in str(completion[-1].get("content") or ""))

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    data = Dataset.from_dict({"question": ["what is 6 times 7"], "answer": ["42"]})
    env = vf.ToolEnv(dataset=data, tools=[multiply], rubric=vf.Rubric(funcs=[correct]), max_turns=3)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)

    async def verifiers_agent(row, base_url, model):
        """The environment's rollout through its OpenAI chat-completions client at `base_url`; its rubric's reward."""
        client = vf.OpenAIChatCompletionsClient(openai.AsyncOpenAI(base_url=base_url, api_key="-"))
        rollout = {"prompt": list(row["prompt"]), "example_id": 0, "answer": row["answer"]}
        out = await env.run_rollout(rollout, client, model, sampling_args={})
        assert out.get("error") is None, out.get("error")
        return float(out["reward"])

    return verifiers_agent


@pytest.mark.parametrize("strategy", ["grpo", "appo"])
def test_verifiers_environment_trains_two_steps(tmp_path, strategy, tiny_chat_tokenizer, tiny_chat_model_path):
    agent = verifiers_env()
    extra = dict(initial_rollouts=1, min_remaining_tokens=2) if strategy == "appo" else {}
    trainer, backend = make_trainer(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, agent, strategy, **extra)
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert all(h["agent/errors"] == 0 for h in logs), logs
    assert all(h["reward"] == 0.5 for h in logs)  # per group one 42 and one 41
    if strategy == "appo":
        assert all(h["agent/branches"] == 2 and h["agent/replay_divergence"] == 0 for h in logs)
