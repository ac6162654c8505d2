"""`tool_format: chat` token by token: the tiny Qwen-style template, a scripted policy and Python function tools.

The expected ids are built from the chat template itself: after `</tool_call>` the engine must insert exactly
the text the template renders between the call and the next assistant turn, tokenised on its own (template
parts with special tokens, the result without), and nothing sampled is ever re-tokenised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path

import pytest
import trl
from trl.chat_template_utils import get_training_chat_template

from appo_trl.rollout import RolloutConfig, RolloutEngine
from appo_trl.rollout.chat_format import ChatTemplateToolError, ChatToolFormat
from appo_trl.tools.registry import build_tools
from bench.fake_vllm import ScriptedPolicy


def lp(pos: int) -> float:
    return -(pos + 1) / 1000.0


def same(a, b) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


async def lookup(key: str) -> str:
    """Look a key up in the tiny table.

    Args:
        key: the key to look up.
    """
    await asyncio.sleep(0)
    if key not in {"x"}:
        raise KeyError(key)
    return "42"


@pytest.fixture
def tok(tiny_chat_tokenizer):
    return tiny_chat_tokenizer


@pytest.fixture
def enc(tok):
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def chat(tok):
    return ChatToolFormat(tok)


def call_text(name: str, args) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def by_responses(tok, turns):
    """Script: the k-th turn once the context holds k `</tool_response>` tokens (its rest when partly sampled)."""
    close = tok.convert_tokens_to_ids("</tool_response>")
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]

    def script(ctx, rng):
        turn = turns[min(ctx.count(close), len(turns) - 1)]
        starts = [i for i in range(len(ctx)) if ctx[i : i + len(header)] == header]
        done = ctx[starts[-1] + len(header) :] if starts else []  # already sampled in this assistant turn
        return turn[len(done) :] if done and turn[: len(done)] == done else turn

    return script


@pytest.fixture
def make_engine(tok, chat):
    engines = []

    def _make(script, funcs, **cfg):
        cfg.setdefault("max_completion_length", 400)
        cfg.setdefault("max_model_len", 2048)
        engine = RolloutEngine(ScriptedPolicy(tok, script), tok, RolloutConfig(**cfg),
                               build_tools(funcs, tool_format="chat"), chat=chat)  # fmt: skip
        engines.append(engine)
        return engine, engine.backend

    yield _make
    for e in engines:
        e.close()


def test_markers_and_tool_turn_come_from_the_template(chat, tok, enc):
    assert (chat.open, chat.close) == ("<tool_call>", "</tool_call>")
    assert chat.stop_strings == [] and chat.turn_end == "<|im_end|>"  # sample to the end of the turn, as TRL
    ids = chat.result_ids("multiply", "6", limit=10_000)
    assert (
        tok.decode(ids)
        == "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    pre, post = (
        enc("\n<|im_start|>user\n<tool_response>\n"),
        enc("\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    )
    assert ids == pre + enc("6") + post  # template parts and the result tokenised on their own
    assert ids.count(tok.eos_token_id) == 1  # the end of the tool turn (the assistant's own end is sampled)


def test_template_without_tool_calls_is_rejected(tiny_tokenizer):
    with pytest.raises(ChatTemplateToolError, match="drops assistant `tool_calls`"):
        ChatToolFormat(tiny_tokenizer)  # the ARPO tags template ignores tool_calls


@pytest.mark.parametrize("body, error", [
    ('{"name": "multiply", "arguments": {"a": 2, "b": }}', "not valid JSON"),
    ('{"arguments": {}}', '"name"'),
    ('{"name": "multiply", "arguments": "[1]"}', "must be a JSON object"),
])  # fmt: skip
def test_parse_errors(chat, body, error):
    call = chat.parse(f"think <tool_call>\n{body}\n</tool_call>")
    assert call.arguments is None and error in call.error


def test_parse_takes_the_last_call_and_string_arguments(chat):
    call = chat.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call> x <tool_call>'
                      '{"name": "multiply", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}</tool_call>')  # fmt: skip
    assert (call.name, json.loads(call.arguments), call.error) == ("multiply", {"a": 2, "b": 3}, None)


def test_one_call_then_answer_matches_the_rendered_conversation(make_engine, tok, enc):
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    prompt = tok.apply_chat_template(messages, tools=[multiply], add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    # the turns as TRL's Qwen3 training template renders them (TRL's GRPOTrainer(tools=...) renders with it)
    t0 = enc("<think>\nmultiply\n</think>\n\n" + call_text("multiply", {"a": 6, "b": 7})) + [tok.eos_token_id]
    t1 = enc("<think>\n\n</think>\n\nThe answer is \\boxed{42}.") + [tok.eos_token_id]
    engine, policy = make_engine(by_responses(tok, [t0 + enc(" never"), t1]), [multiply])
    [[traj]] = engine.run(engine.rollout([prompt], 1, seed=0))
    inserted = ChatToolFormat(tok).result_ids("multiply", "42", 10_000)
    assert traj.completion_ids == t0 + inserted + t1
    assert traj.loss_mask == [1] * len(t0) + [0] * len(inserted) + [1] * len(t1)
    P = len(prompt)
    assert same(traj.logprobs, [lp(P + i) if m else math.nan for i, m in enumerate(traj.loss_mask)])
    assert traj.finish_reason == "eos" and traj.num_calls == 1
    [rec] = traj.tool_calls
    assert (rec.tag, json.loads(rec.query), rec.result, rec.ok) == ("multiply", {"a": 6, "b": 7}, "42", True)
    assert (rec.start, rec.end) == (len(t0), len(t0) + len(inserted))
    # the row is exactly the conversation the template renders (the template state is right for the next turn)
    full = messages + [
        {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\n",
         "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}]},
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "assistant", "content": "The answer is \\boxed{42}."},
    ]  # fmt: skip
    training = get_training_chat_template(tok)
    rendered = tok.apply_chat_template(full, tools=[multiply], tokenize=False, chat_template=training)
    assert tok.decode(prompt + traj.completion_ids, skip_special_tokens=False) + "\n" == rendered
    assert [p.stop for _, p in policy.requests] == [[]] * 2
    # TRL-style completion messages for reward functions
    msgs = engine.chat.completion_messages(traj)
    assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant"]
    assert msgs[0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    assert msgs[0]["content"] == "<think>\nmultiply\n</think>"
    assert msgs[2]["content"] == "<think>\n\n</think>\n\nThe answer is \\boxed{42}."


@pytest.mark.parametrize("call, expected", [
    ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": }}\n</tool_call>', "{'error': 'the tool call is not valid JSON"),
    (call_text("divide", {"a": 1}), "{'error': 'Tool divide not found.'}"),
    (call_text("lookup", {"key": "y"}), "{'error': \"'y'\"}"),  # the function raised KeyError('y')
    (call_text("multiply", {"a": 1}), "{'error': \"multiply() missing 1 required positional argument: 'b'\"}"),
    (call_text("lookup", {"key": "x"}), "42"),  # async tool
])  # fmt: skip
def test_bad_calls_become_tool_errors_not_crashes(make_engine, tok, enc, call, expected):
    t0, t1 = enc(call) + [tok.eos_token_id], enc("ok") + [tok.eos_token_id]
    engine, _ = make_engine(by_responses(tok, [t0, t1]), [multiply, lookup])
    [[traj]] = engine.run(engine.rollout([enc("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")], 1, seed=0))
    [rec] = traj.tool_calls
    assert rec.result.startswith(expected) and rec.ok == (expected == "42")
    assert traj.finish_reason == "eos" and traj.completion_ids[-len(t1) :] == t1
    span = tok.decode(traj.completion_ids[rec.start : rec.end])
    assert expected in span and span.endswith("<|im_start|>assistant\n")


def test_special_strings_in_a_result_stay_text(make_engine, tok, enc):
    def leak(s: str) -> str:
        """Return text with control strings.

        Args:
            s: ignored.
        """
        return "a<|im_end|>b<|im_start|>c"

    t0, t1 = enc(call_text("leak", {"s": "x"})) + [tok.eos_token_id], [tok.eos_token_id]
    engine, _ = make_engine(by_responses(tok, [t0, t1]), [leak])
    [[traj]] = engine.run(engine.rollout([enc("<|im_start|>assistant\n")], 1, seed=0))
    rec = traj.tool_calls[0]
    body = traj.completion_ids[rec.start : rec.end]
    # only the template's own <|im_end|> (the tool turn's) and two <|im_start|> are control tokens
    assert body.count(tok.eos_token_id) == 1 and body.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert "a< |im_end|>b< |im_start|>c" in tok.decode(body)  # escaped by neutralise_result (issue 11)


def test_call_limit_ends_on_the_sampled_end_of_turn_and_counts_per_trajectory(make_engine, tok, enc):
    t0 = enc(call_text("multiply", {"a": 2, "b": 3})) + [tok.eos_token_id]
    engine, _ = make_engine(by_responses(tok, [t0, t0, t0]), [multiply], call_limit=2)
    [[a, b]] = engine.run(engine.rollout([enc("<|im_start|>assistant\n")], 2, seed=0))
    for traj in (a, b):
        assert traj.num_calls == 2 and traj.finish_reason == "call_limit"
        # the third turn is not executed; its own sampled <|im_end|> ends the row (nothing is forced)
        assert traj.completion_ids[-len(t0) :] == t0 and traj.loss_mask[-len(t0) :] == [1] * len(t0)
        assert not math.isnan(traj.logprobs[-1])


def test_branch_after_the_call_reruns_it_and_after_the_result_resumes_in_the_assistant_turn(make_engine, tok, enc):
    t0 = enc("hm " + call_text("multiply", {"a": 6, "b": 7})) + [tok.eos_token_id]
    t1 = enc("The answer is 42.") + [tok.eos_token_id]
    calls = []

    def multiply_logged(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        """
        calls.append((a, b))
        return a * b

    multiply_logged.__name__ = "multiply"
    engine, policy = make_engine(by_responses(tok, [t0, t1]), [multiply_logged])
    prompt = enc("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    [[parent]] = engine.run(engine.rollout([prompt], 1, seed=0))
    rec = parent.tool_calls[0]
    # right after the turn's sampled <|im_end|>: the call is re-run, the same template turn is inserted
    child = engine.run(engine.branch(parent, len(t0), seed=1))
    assert calls == [(6, 7), (6, 7)] and child.completion_ids == parent.completion_ids
    # inside the inserted tool turn: refused (only sampled tokens are branch points)
    with pytest.raises(ValueError, match="falls inside the result"):
        engine.run(engine.branch(parent, rec.start + 3, seed=1))
    # right after the result: the next request continues inside the new assistant turn
    n = len(policy.requests)
    child = engine.run(engine.branch(parent, rec.end + 2, seed=1))
    ctx = policy.requests[n][0]
    assert tok.decode(ctx).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\nThe answer")
    assert child.completion_ids == parent.completion_ids and child.loss_mask == parent.loss_mask


def test_hook_runs_after_each_tool_result_on_sampled_tokens(make_engine, tok, enc):
    t0 = enc(call_text("multiply", {"a": 2, "b": 3})) + [tok.eos_token_id]
    t1 = enc(" done") + [tok.eos_token_id]
    engine, _ = make_engine(by_responses(tok, [t0, t1]), [multiply], record_entropies=True, hook_mode="lookahead",
                            entropy_window=2)  # fmt: skip
    seen = []

    def hook(ctx):
        seen.append((ctx.position, ctx.trajectory.loss_mask[ctx.position - 1], ctx.lookahead_entropy))
        return 1

    groups = engine.run(engine.rollout([enc("<|im_start|>assistant\n")], 1, seed=0, hook=hook, group_size=2))
    [[root, fork]] = groups
    rec = root.tool_calls[0]
    assert seen[0][0] == rec.end and seen[0][1] == 0  # right after the inserted assistant header
    assert not math.isnan(seen[0][2])  # entropy of the look-ahead tokens, all sampled
    assert fork.origin == "fork" and fork.completion_ids[: rec.end] == root.completion_ids[: rec.end]
    assert fork.completion_ids == root.completion_ids  # the scripted policy continues the same way


TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "qwen3_instruct_2507"])
def test_real_qwen_templates_shipped_with_trl(tiny_chat_model_path, name):
    """The markers and the tool turn are learnt from the template text, not hard-coded for the tiny model."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model_path)
    tok.chat_template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    chat = ChatToolFormat(tok)
    assert (chat.open, chat.close) == ("<tool_call>", "</tool_call>")
    inserted = tok.decode(chat.result_ids("multiply", "42", 10_000))
    assert chat.turn_end == "<|im_end|>"
    assert inserted == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["qwen3_5_think", "gptoss"])
def test_templates_without_json_tool_calls_fail_at_construction(tiny_chat_model_path, name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model_path)
    tok.chat_template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    with pytest.raises(ChatTemplateToolError, match="JSON object with `name` and `arguments`"):
        ChatToolFormat(tok)


# ---------------------------------------------------------------------------------------------- several calls a turn
async def slow_echo(text: str) -> str:
    """Echo a text after a short wait (an async tool that finishes after the sync ones).

    Args:
        text: the text to echo.
    """
    await asyncio.sleep(0.05)
    return f"echo {text}"


MULTI_CALLS = [("slow_echo", {"text": "hi"}), ("multiply", {"a": 6, "b": 7}), ("multiply", {"a": 2, "b": 3})]
MULTI_RESULTS = ["echo hi", "42", "6"]
ANSWER = "<think>\n\n</think>\n\nDone: 42."  # Qwen3 templates render the last assistant turn with a think block


def qwen_tokenizer(path, name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    return tok


def multi_call_rollout(tok, k, **cfg):
    """A scripted policy that emits `k` calls in one assistant turn, then the answer once the results are back."""
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    messages = [{"role": "user", "content": "Echo hi, then 6 times 7 and 2 times 3."}]
    prompt = tok.apply_chat_template(messages, tools=[slow_echo, multiply], add_generation_prompt=True,
                                     return_dict=True)["input_ids"]  # fmt: skip
    calls = MULTI_CALLS[:k]
    t0 = enc("I will call the tools.\n" + "\n".join(call_text(n, a) for n, a in calls)) + [tok.eos_token_id]
    t1 = enc(ANSWER) + [tok.eos_token_id]
    cfg.setdefault("max_completion_length", 600)
    engine = RolloutEngine(ScriptedPolicy(tok, by_responses(tok, [t0, t1])), tok,
                           RolloutConfig(max_model_len=4096, **cfg),
                           build_tools([slow_echo, multiply], tool_format="chat"), chat=ChatToolFormat(tok))  # fmt: skip
    return engine, messages, prompt, t0, t1, calls


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "qwen3_instruct_2507"])
def test_several_calls_in_one_turn_match_the_rendered_conversation(tiny_chat_model_path, name, k):
    """k calls in one assistant turn: all run, one `tool` message each in call order, exact masks and logprobs,
    and prompt + completion is token for token the conversation the TRL-shipped template renders."""
    tok = qwen_tokenizer(tiny_chat_model_path, name)
    engine, messages, prompt, t0, t1, calls = multi_call_rollout(tok, k)
    try:
        [[traj]] = engine.run(engine.rollout([prompt], 1, seed=0))
        results = MULTI_RESULTS[:k]
        pieces = engine.chat.tool_turn_ids([n for n, _ in calls], results, 10_000)
        inserted = [i for p in pieces for i in p]
        assert traj.completion_ids == t0 + inserted + t1
        assert traj.loss_mask == [1] * len(t0) + [0] * len(inserted) + [1] * len(t1)
        P = len(prompt)
        assert same(traj.logprobs, [lp(P + i) if m else math.nan for i, m in enumerate(traj.loss_mask)])
        assert traj.finish_reason == "eos" and traj.num_calls == k
        assert [(r.tag, json.loads(r.query), r.result) for r in traj.tool_calls] == [
            (n, a, res) for (n, a), res in zip(calls, results)
        ]  # call order, although the async call finished last
        starts = [len(t0) + sum(map(len, pieces[:i])) for i in range(k)]
        assert [(r.start, r.end) for r in traj.tool_calls] == [(s, len(t0) + len(inserted)) for s in starts]
        full = messages + [
            {"role": "assistant", "content": "I will call the tools.",
             "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]},
            *({"role": "tool", "name": n, "content": res} for (n, _), res in zip(calls, results)),
            {"role": "assistant", "content": ANSWER},
        ]  # fmt: skip
        rendered = tok.apply_chat_template(full, tools=[slow_echo, multiply], tokenize=False)
        assert tok.decode(prompt + traj.completion_ids, skip_special_tokens=False) + "\n" == rendered
        msgs = engine.chat.completion_messages(traj)
        assert [m["role"] for m in msgs] == ["assistant"] + ["tool"] * k + ["assistant"]
        assert [c["function"]["name"] for c in msgs[0]["tool_calls"]] == [n for n, _ in calls]
        assert [m["content"] for m in msgs[1:-1]] == results and msgs[-1]["content"] == ANSWER
    finally:
        engine.close()


def test_branch_inside_a_multi_call_turn_resumes_in_the_assistant_turn(tiny_chat_model_path):
    tok = qwen_tokenizer(tiny_chat_model_path, "qwen3")
    engine, _, prompt, t0, t1, calls = multi_call_rollout(tok, 3)
    policy = engine.backend
    try:
        [[parent]] = engine.run(engine.rollout([prompt], 1, seed=0))
        first, second, third = parent.tool_calls
        # after the first sampled </tool_call>: the model is still in its assistant turn; the rest of the turn is
        # sampled again and then all three calls of the turn run
        close = tok.convert_tokens_to_ids("</tool_call>")
        p = t0.index(close) + 1
        n = len(policy.requests)
        child = engine.run(engine.branch(parent, p, seed=1))
        assert tok.decode(policy.requests[n][0]).endswith('"arguments": {"text": "hi"}}\n</tool_call>')
        assert child.completion_ids == parent.completion_ids and child.loss_mask == parent.loss_mask
        assert same(child.logprobs, parent.logprobs) and child.num_calls == 3
        assert [r.result for r in child.tool_calls] == MULTI_RESULTS
        # right after the turn's sampled end: the three calls are re-run, the same tool turn follows
        child = engine.run(engine.branch(parent, first.start, seed=1))
        assert child.completion_ids == parent.completion_ids and child.tool_calls == [
            dataclasses.replace(r, latency_s=c.latency_s) for r, c in zip(parent.tool_calls, child.tool_calls)
        ]
        # between two results of the turn: inside its tool turn, refused
        for pos in (second.start, third.start, third.start + 1):
            with pytest.raises(ValueError, match="falls inside the result"):
                engine.run(engine.branch(parent, pos, seed=1))
        # after the tool turn: a new assistant turn, the calls are carried over, none re-run
        child = engine.run(engine.branch(parent, first.end, seed=1))
        assert child.tool_calls[:3] == parent.tool_calls and child.completion_ids == parent.completion_ids
    finally:
        engine.close()


def test_each_call_of_a_turn_counts_against_the_limit(tiny_chat_model_path):
    """Limit 3, two calls a turn: the first turn runs (2 calls); the second would make 4, so none of it runs."""
    tok = qwen_tokenizer(tiny_chat_model_path, "qwen2_5")
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    t0 = enc(call_text("multiply", {"a": 6, "b": 7}) + "\n" + call_text("multiply", {"a": 2, "b": 3}))
    t0 += [tok.eos_token_id]
    engine = RolloutEngine(ScriptedPolicy(tok, by_responses(tok, [t0])), tok,
                           RolloutConfig(max_completion_length=600, max_model_len=4096, call_limit=3),
                           build_tools([multiply], tool_format="chat"), chat=ChatToolFormat(tok))  # fmt: skip
    try:
        [[traj]] = engine.run(
            engine.rollout([enc("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")], 1, seed=0)
        )
        assert traj.num_calls == 2 and traj.finish_reason == "call_limit"
        assert [r.result for r in traj.tool_calls] == ["42", "6"]
        assert traj.completion_ids[-len(t0) :] == t0 and traj.loss_mask[-len(t0) :] == [1] * len(t0)
        assert engine.metrics()["rollout/call_limit_hits"] == 1 and engine.metrics()["rollout/tool_calls"] == 2
    finally:
        engine.close()


def test_a_bad_call_among_good_ones_gets_its_own_error_in_place(make_engine, tok, enc):
    t0 = enc(call_text("multiply", {"a": 6, "b": 7}) + "\n" + call_text("divide", {"a": 1}) + "\n<tool_call>\n{x}\n"
             "</tool_call>\n" + call_text("multiply", {"a": 2, "b": 3})) + [tok.eos_token_id]  # fmt: skip
    t1 = enc("ok") + [tok.eos_token_id]
    engine, _ = make_engine(by_responses(tok, [t0, t1]), [multiply], call_limit=4)
    [[traj]] = engine.run(engine.rollout([enc("<|im_start|>assistant\n")], 1, seed=0))
    results = [r.result for r in traj.tool_calls]
    assert results[0] == "42" and results[3] == "6" and traj.num_calls == 4
    assert results[1] == "{'error': 'Tool divide not found.'}" and results[2].startswith("{'error': 'the tool call")
    assert [r.query for r in traj.tool_calls][1:3] == ['{"name": "divide", "arguments": {"a": 1}}', "{x}"]
    assert traj.finish_reason == "eos" and traj.completion_ids[-len(t1) :] == t1


def test_a_turn_ended_by_another_eos_gets_the_templates_end_of_turn(tiny_chat_model_path):
    """A base-model tokenizer (EOS `<|endoftext|>`, turns end with `<|im_end|>`): the calls still run, and the
    template's end of turn is inserted (mask 0) before the tool turn, so the next turn is in the right state."""
    tok = qwen_tokenizer(tiny_chat_model_path, "qwen2_5")
    tok.eos_token = "<|endoftext|>"
    chat = ChatToolFormat(tok)
    assert chat.turn_end == "<|im_end|>"
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    t0 = enc(call_text("multiply", {"a": 6, "b": 7}) + "\n" + call_text("multiply", {"a": 2, "b": 3}))
    t0 += [tok.eos_token_id]
    t1 = enc("ok") + [tok.eos_token_id]
    engine = RolloutEngine(ScriptedPolicy(tok, by_responses(tok, [t0, t1])), tok,
                           RolloutConfig(max_completion_length=600, max_model_len=4096),
                           build_tools([multiply], tool_format="chat"), chat=chat)  # fmt: skip
    try:
        [[traj]] = engine.run(
            engine.rollout([enc("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")], 1, seed=0)
        )
        pieces = chat.tool_turn_ids(["multiply"] * 2, ["42", "6"], 10_000)
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert traj.completion_ids == t0 + [im_end] + pieces[0] + pieces[1] + t1
        assert traj.loss_mask[len(t0) - 1 : len(t0) + 1] == [1, 0] and traj.num_calls == 2
    finally:
        engine.close()
