"""`tool_format: chat` token by token: the tiny Qwen-style template, a scripted policy and Python function tools.

The expected ids are built from the chat template itself: after `</tool_call>` the engine must insert exactly
the text the template renders between the call and the next assistant turn, tokenised on its own (template
parts with special tokens, the result without), and nothing sampled is ever re-tokenised.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import trl

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
    assert chat.stop_strings == ["</tool_call>"]
    ids = chat.result_ids("multiply", "6", limit=10_000)
    assert (
        tok.decode(ids)
        == "<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    pre, post = (
        enc("<|im_end|>\n<|im_start|>user\n<tool_response>\n"),
        enc("\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    )
    assert ids == pre + enc("6") + post  # template parts and the result tokenised on their own
    assert ids.count(tok.eos_token_id) == 2  # end of the assistant turn and of the tool turn: template tokens


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
    t0 = enc("<think>multiply</think>\n" + call_text("multiply", {"a": 6, "b": 7}))
    t1 = enc("The answer is \\boxed{42}.") + [tok.eos_token_id]
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
        {"role": "assistant", "content": "<think>multiply</think>",
         "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}]},
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "assistant", "content": "The answer is \\boxed{42}."},
    ]  # fmt: skip
    rendered = tok.apply_chat_template(full, tools=[multiply], tokenize=False)
    assert tok.decode(prompt + traj.completion_ids, skip_special_tokens=False) + "\n" == rendered
    assert [p.stop for _, p in policy.requests] == [["</tool_call>"]] * 2
    # TRL-style completion messages for reward functions
    msgs = engine.chat.completion_messages(traj)
    assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant"]
    assert msgs[0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    assert msgs[0]["content"] == "<think>multiply</think>" and msgs[2]["content"] == "The answer is \\boxed{42}."


@pytest.mark.parametrize("call, expected", [
    ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": }}\n</tool_call>', "{'error': 'the tool call is not valid JSON"),
    (call_text("divide", {"a": 1}), "{'error': 'Tool divide not found.'}"),
    (call_text("lookup", {"key": "y"}), "{'error': \"'y'\"}"),  # the function raised KeyError('y')
    (call_text("multiply", {"a": 1}), "{'error': \"multiply() missing 1 required positional argument: 'b'\"}"),
    (call_text("lookup", {"key": "x"}), "42"),  # async tool
])  # fmt: skip
def test_bad_calls_become_tool_errors_not_crashes(make_engine, tok, enc, call, expected):
    t0, t1 = enc(call), enc("ok") + [tok.eos_token_id]
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

    t0, t1 = enc(call_text("leak", {"s": "x"})), [tok.eos_token_id]
    engine, _ = make_engine(by_responses(tok, [t0, t1]), [leak])
    [[traj]] = engine.run(engine.rollout([enc("<|im_start|>assistant\n")], 1, seed=0))
    rec = traj.tool_calls[0]
    body = traj.completion_ids[rec.start : rec.end]
    # only the template's own two <|im_end|> and one <|im_start|> are control tokens
    assert body.count(tok.eos_token_id) == 2 and body.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert "a< |im_end|>b< |im_start|>c" in tok.decode(body)  # escaped by neutralise_result (issue 11)


def test_call_limit_appends_eos_and_counts_per_trajectory(make_engine, tok, enc):
    t0 = enc(call_text("multiply", {"a": 2, "b": 3}))
    engine, _ = make_engine(by_responses(tok, [t0, t0, t0]), [multiply], call_limit=2)
    [[a, b]] = engine.run(engine.rollout([enc("<|im_start|>assistant\n")], 2, seed=0))
    for traj in (a, b):
        assert traj.num_calls == 2 and traj.finish_reason == "call_limit"
        assert traj.completion_ids[-1] == tok.eos_token_id and traj.loss_mask[-1] == 0
        assert math.isnan(traj.logprobs[-1])


def test_branch_after_the_call_reruns_it_and_after_the_result_resumes_in_the_assistant_turn(make_engine, tok, enc):
    t0 = enc("hm " + call_text("multiply", {"a": 6, "b": 7}))
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
    # right after </tool_call>: the call is re-run, the same template turn is inserted
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
    t0 = enc(call_text("multiply", {"a": 2, "b": 3}))
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
    assert fork.meta["origin"] == "fork" and fork.completion_ids[: rec.end] == root.completion_ids[: rec.end]
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
    assert (
        inserted
        == "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name", ["qwen3_5_think", "gptoss"])
def test_templates_without_json_tool_calls_fail_at_construction(tiny_chat_model_path, name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model_path)
    tok.chat_template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    with pytest.raises(ChatTemplateToolError, match="JSON object with `name` and `arguments`"):
        ChatToolFormat(tok)
