"""`APPOTrainer(tools=[func])` as in TRL, on both tool formats and all four strategies.

The trainer builds its own engine from the config (tools, chat format, schemas in the prompt); only the sampler
is replaced by a scripted backend, so that calls, results, masks and branches happen for real: before a tool
result it emits one call, after it the answer and EOS. Tags: `<python> ... </python>`; chat: the tiny
Qwen-style template's `<tool_call>` JSON. Branching/credit/masking must be the same in both formats.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from datasets import Dataset

from appo_trl.config import APPOConfig
from appo_trl.rollout import Segment
from appo_trl.tools.base import ToolResult
from appo_trl.trainer.trainer import APPOTrainer
from tests.trainer.test_trainer import CPU, spy_loss

CALLS: list[tuple[int, int]] = []
MULTI = [(6, 7), (2, 3), (1, 5)]  # the arguments of the 1st, 2nd, 3rd call of a turn


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    CALLS.append((a, b))
    return a * b


class ScriptedBackend:
    """`calls` tool calls in one turn (chat; tags: one), then the answer; each token logprob -0.5 with a
    two-entry top-k (entropies for branching). Chat turns end with the sampled `<|im_end|>`, as a Qwen model's."""

    def __init__(self, tokenizer, fmt: str, calls: int = 1):
        self.tok, self.fmt, self.calls = tokenizer, fmt, calls
        marker = "</tool_response>" if fmt == "chat" else "<result>"
        self.after = tokenizer.convert_tokens_to_ids(marker)

    async def generate(self, prompt_ids, params):
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        if self.after in prompt_ids:
            ids, reason, stop = enc(" <answer> 42 </answer>") + [self.tok.eos_token_id], "eos", None
        elif self.fmt == "chat":
            calls = "\n".join(
                f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
                for a, b in MULTI[: self.calls]
            )
            ids, reason, stop = (
                enc("<think> six times seven </think>\n" + calls) + [self.tok.eos_token_id],
                "eos",
                None,
            )
        else:
            ids, reason, stop = (
                enc("<think> six times seven </think> <python> print(6*7) </python>"),
                "stop",
                "</python>",
            )
        ids = ids[: params.max_tokens]
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, reason, stop)


class ScriptedPython:
    name = tag = "python"

    async def call(self, text):
        CALLS.append((6, 7))
        return ToolResult(text="42")

    async def aclose(self):
        pass


class Reward:
    __name__ = "answer_reward"

    def __init__(self):
        self.seen = []

    def __call__(self, completions, answer, **kw):
        self.seen.append(completions)
        return [float("42" in json.dumps(c)) + 0.01 * i for i, c in enumerate(completions)]


def prompts(k=4):
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"what is 6 times 7 ({i})"}] for i in range(k)],
        "answer": ["42"] * k,
    })  # fmt: skip


STRATEGY = {
    "grpo": {},
    "arpo": dict(initial_rollouts=2, branch_probability=1.0, beam_size=2),
    "aepo": dict(initial_rollouts=2, branch_probability=0.0, beam_size=2),
    "appo": dict(initial_rollouts=2, min_remaining_tokens=2),
}


@pytest.mark.parametrize("fmt", ["tags", "chat"])
@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
def test_each_strategy_on_both_formats(tmp_path, fmt, strategy, tiny_tokenizer, tiny_model_path,
                                       tiny_chat_tokenizer, tiny_chat_model_path):  # fmt: skip
    tok, path = (tiny_chat_tokenizer, tiny_chat_model_path) if fmt == "chat" else (tiny_tokenizer, tiny_model_path)
    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy=strategy, num_generations=4,
                      per_device_train_batch_size=4, max_steps=1, max_completion_length=120, tool_format=fmt,
                      **STRATEGY[strategy])  # fmt: skip
    reward = Reward()
    trainer = APPOTrainer(model=path, reward_funcs=[reward], args=args, train_dataset=prompts(),
                          processing_class=tok, tools=[multiply] if fmt == "chat" else ["python"])  # fmt: skip
    engine = trainer.rollout_engine
    engine.backend = ScriptedBackend(tok, fmt)
    if fmt == "tags":
        engine.executor.tools["python"] = ScriptedPython()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    seen = spy_loss(trainer)
    CALLS.clear()
    trainer.train()
    # every root called the tool once; branches copy the call from their prefix or re-run it
    assert CALLS and set(CALLS) == {(6, 7)}
    [completions] = reward.seen
    assert len(completions) == 4
    if fmt == "chat":  # TRL's tool-loop completion shape, with the tool result as a `tool` message
        assert all([m["role"] for m in c] == ["assistant", "tool", "assistant"] for c in completions)
        assert completions[0][0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 6, "b": 7}}
        assert completions[0][1]["content"] == "42"
    rows = sum(s["completion_ids"].size(0) for s in seen)
    assert rows == (2 if strategy == "appo" else 4)  # APPO: branch rows leave the batch
    close = tok.convert_tokens_to_ids("</tool_call>" if fmt == "chat" else "</python>")
    for inputs in seen:
        # the schemas are rendered into the prompt in chat format (TRL's `tools=`)
        prompt_text = tok.decode(inputs["prompt_ids"][0])
        assert ('"name": "multiply"' in prompt_text) == (fmt == "chat")
        for row in range(inputs["completion_ids"].size(0)):
            ids = inputs["completion_ids"][row]
            end = (ids == close).nonzero()[0, 0]  # the sampled call ends here; the template/result follows
            if fmt == "chat":  # the turn's own end (<|im_end|>) is sampled, then the tool turn is inserted
                assert ids[end + 1] == tok.eos_token_id and inputs["tool_mask"][row, end + 1] == 1
                end += 1
            assert inputs["tool_mask"][row, end] == 1 and inputs["tool_mask"][row, end + 1] == 0
    logged = {k: v for e in trainer.state.log_history for k, v in e.items()}
    if strategy in ("arpo", "aepo"):
        assert logged["branch/points_per_prompt"] > 0  # forks after the tool result
    if strategy == "appo":
        assert logged["branch/points_per_prompt"] == 2
    # Parameters move, unless every group's rows are identical: then the zero-mean advantages give an exactly
    # zero policy gradient, which the tree forward (one shared forward for identical rows) computes as such, where
    # row-wise float noise still moved Adam.
    if any(len({tuple(r.tolist()) for r in s["completion_ids"]}) > 1 for s in seen):
        assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


def test_bad_tools_fail_at_construction_naming_the_tool(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer):
    def undocumented(x: int) -> int:
        return x

    def untyped(x):
        """Echo.

        Args:
            x: anything.
        """
        return x

    args = APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=4)
    cases = [
        ([undocumented], "tool 'undocumented' has no docstring"),
        ([untyped], "untyped"),
        (["pyhton"], "unknown tool 'pyhton'"),
        (["no_such_module.func"], "tool 'no_such_module.func': cannot import module"),
        ([multiply, multiply], "two tools are named 'multiply'"),
    ]
    for tools, message in cases:
        with pytest.raises(ValueError, match=message):
            APPOTrainer(model=tiny_chat_model_path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                        processing_class=tiny_chat_tokenizer, tools=tools)  # fmt: skip
    with pytest.raises(ValueError, match="not both"):
        APPOTrainer(model=tiny_chat_model_path, reward_funcs=[Reward()], train_dataset=prompts(),
                    args=APPOConfig(output_dir=str(tmp_path), **CPU, tools=["python"]), tools=[multiply])  # fmt: skip


def test_tags_template_cannot_run_chat_tools(tmp_path, tiny_model_path, tiny_tokenizer):
    args = APPOConfig(output_dir=str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="cannot render a tool-calling conversation"):
        APPOTrainer(model=tiny_model_path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                    processing_class=tiny_tokenizer, tools=[multiply])  # fmt: skip
    args = APPOConfig(output_dir=str(tmp_path), **CPU, tool_format="tags")
    with pytest.raises(ValueError, match="need tool_format=chat"):
        APPOTrainer(model=tiny_model_path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                    processing_class=tiny_tokenizer, tools=[multiply])  # fmt: skip


def test_warns_when_no_rollout_called_a_tool(tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, caplog):
    class NoCalls:
        async def generate(self, prompt_ids, params):
            return Segment([5, 6, tiny_chat_tokenizer.eos_token_id], [-0.5] * 3, None, "eos", None)

    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy="arpo", initial_rollouts=2,
                      num_generations=4, per_device_train_batch_size=4, max_steps=1, max_completion_length=16)  # fmt: skip
    trainer = APPOTrainer(model=tiny_chat_model_path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                          processing_class=tiny_chat_tokenizer, tools=[multiply])  # fmt: skip
    trainer.rollout_engine.backend = NoCalls()
    with caplog.at_level(logging.WARNING, logger="appo_trl.trainer.trainer"):
        trainer.train()
    [msg] = [r.getMessage() for r in caplog.records if "No rollout called a tool" in r.getMessage()]
    assert "(multiply) in 1 round(s)" in msg and "ARPO branches only after tool results: no branching happened" in msg


@pytest.mark.parametrize("limit,calls", [(0, 1), (2, 3)])
def test_calls_refused_by_the_limit_are_named_not_called_missing(
    tmp_path, tiny_chat_model_path, tiny_chat_tokenizer, caplog, limit, calls
):
    tok = tiny_chat_tokenizer
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

    class RefusedCalls:
        async def generate(self, prompt_ids, params):
            ids = tok.encode("\n".join([call] * calls), add_special_tokens=False) + [tok.eos_token_id]
            return Segment(ids[: params.max_tokens], [-0.5] * len(ids[: params.max_tokens]), None, "eos", None)

    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy="arpo", initial_rollouts=2,
                      num_generations=4, per_device_train_batch_size=4, max_steps=1, max_completion_length=96,
                      tool_call_limit=limit)  # fmt: skip
    trainer = APPOTrainer(model=tiny_chat_model_path, reward_funcs=[Reward()], args=args, train_dataset=prompts(),
                          processing_class=tok, tools=[multiply])  # fmt: skip
    trainer.rollout_engine.backend = RefusedCalls()
    with caplog.at_level(logging.WARNING, logger="appo_trl.trainer.trainer"):
        trainer.train()
    text = [r.getMessage() for r in caplog.records]
    assert not any("No rollout called a tool" in m for m in text)
    [msg] = [m for m in text if "the limits refused the calls" in m]
    assert f"tool_call_limit={limit}" in msg and "4 rollout(s) called tools" in msg


def test_config_tool_fields(tmp_path):
    base = dict(output_dir=str(tmp_path), **CPU)
    cfg = APPOConfig(**base, max_tool_calling_iterations=5)  # TRL's turn limit, checked beside the call limit
    assert (cfg.tool_call_limit, cfg.max_tool_calling_iterations) == (3, 5)
    assert APPOConfig(**base, tools="python").tools == ["python"]  # `tools: python` in YAML
    assert APPOConfig(**base, tools=[multiply]).to_dict()["tools"] == [f"{multiply.__module__}.multiply"]
    with pytest.raises(ValueError, match="tool_format='json'"):
        APPOConfig(**base, tool_format="json")


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
def test_several_calls_per_turn_on_each_strategy(tmp_path, strategy, k, tiny_chat_tokenizer, tiny_chat_model_path):
    """A policy emitting k calls in one turn: every call runs and counts, the rewards see TRL's message shape
    (one assistant message with k tool_calls, k tool messages in call order), and only sampled tokens train."""
    from appo_trl.rollout.chat_format import ChatToolFormat

    tok = tiny_chat_tokenizer
    args = APPOConfig(output_dir=str(tmp_path), **CPU, rollout_strategy=strategy, num_generations=4,
                      per_device_train_batch_size=4, max_steps=1, max_completion_length=200, tool_call_limit=k,
                      **STRATEGY[strategy])  # fmt: skip
    reward = Reward()
    trainer = APPOTrainer(model=tiny_chat_model_path, reward_funcs=[reward], args=args, train_dataset=prompts(),
                          processing_class=tok, tools=[multiply])  # fmt: skip
    trainer.rollout_engine.backend = ScriptedBackend(tok, "chat", calls=k)
    seen = spy_loss(trainer)
    CALLS.clear()
    trainer.train()
    assert set(CALLS) == set(MULTI[:k]) and len(CALLS) % k == 0
    [completions] = reward.seen
    results = [str(a * b) for a, b in MULTI[:k]]
    for c in completions:
        assert [m["role"] for m in c] == ["assistant"] + ["tool"] * k + ["assistant"]
        assert [t["function"]["arguments"] for t in c[0]["tool_calls"]] == [{"a": a, "b": b} for a, b in MULTI[:k]]
        assert [m["content"] for m in c[1:-1]] == results
    inserted = sum(map(len, ChatToolFormat(tok).tool_turn_ids(["multiply"] * k, results, 10_000)))
    for inputs in seen:
        for row in range(inputs["completion_ids"].size(0)):
            n = int(inputs["completion_mask"][row].sum())
            zeros = int((inputs["completion_mask"][row] * (1 - inputs["tool_mask"][row])).sum())
            assert zeros == inserted  # exactly the tool turn is masked, nothing sampled
            assert n > inserted
    logged = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert logged["tools/call_frequency"] == k
