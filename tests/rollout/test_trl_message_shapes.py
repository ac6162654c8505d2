"""Completion messages as TRL's `parse_response` shapes them (issue 34, item 1).

A turn whose call JSON is malformed is plain assistant text in TRL (no `tool_calls`), so a TRL-written reward
always reads dict `arguments`; the error `tool` message the engine answered with follows that turn. An unknown
tool parses fine: a normal `tool_calls` entry with dict arguments and TRL's error text as the result. The shapes
are written by hand; the last test writes them to parquet as TRL's `log_completions` does.
"""

from __future__ import annotations

import pandas as pd
import pytest

from appo_trl.rollout import RolloutConfig, RolloutEngine
from appo_trl.rollout.chat_format import ChatToolFormat
from appo_trl.tools.registry import build_tools
from bench.fake_vllm import ScriptedPolicy


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


PROMPT = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
BAD = '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": }}\n</tool_call>'
GOOD = '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "divide", "arguments": {"a": 1}}\n</tool_call>'


def rollout(tok, turns: list[str]):
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    close = tok.convert_tokens_to_ids("</tool_response>")
    scripted = [enc(t) + [tok.eos_token_id] for t in turns]
    header = enc("<|im_start|>assistant\n")

    def script(ctx, rng):
        turn = scripted[min(ctx.count(close), len(scripted) - 1)]
        last = max(i for i in range(len(ctx) - len(header) + 1) if ctx[i : i + len(header)] == header)
        return turn[len(ctx) - last - len(header) :]

    chat = ChatToolFormat(tok)
    cfg = RolloutConfig(max_completion_length=400, max_model_len=2048)
    engine = RolloutEngine(
        ScriptedPolicy(tok, script), tok, cfg, build_tools([multiply], tool_format="chat"), chat=chat
    )
    try:
        [[traj]] = engine.run(engine.rollout([enc(PROMPT)], 1, seed=0))
    finally:
        engine.close()
    return chat.completion_messages(traj)


@pytest.mark.parametrize("turn", [BAD, "thinking " + GOOD + "\n" + BAD])
def test_a_malformed_call_makes_the_turn_plain_text(tiny_chat_tokenizer, turn):
    msgs = rollout(tiny_chat_tokenizer, [turn, "*yes*"])
    assert msgs[0] == {"role": "assistant", "content": turn}  # all of the turn, markers included, as TRL decodes it
    assert [m["role"] for m in msgs[1:-1]] == ["tool"] * turn.count("</tool_call>")
    assert msgs[-1] == {"role": "assistant", "content": "*yes*"}


def test_valid_and_unknown_calls_keep_dict_arguments(tiny_chat_tokenizer):
    msgs = rollout(tiny_chat_tokenizer, ["I call. " + GOOD + UNKNOWN, "*no*"])
    assert msgs[0] == {
        "role": "assistant",
        "content": "I call.",
        "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}},
            {"type": "function", "function": {"name": "divide", "arguments": {"a": 1}}},
        ],
    }
    assert msgs[1] == {"role": "tool", "name": "multiply", "content": "6"}
    assert msgs[2] == {"role": "tool", "name": "divide", "content": "{'error': 'Tool divide not found.'}"}


def test_mixed_rows_write_to_parquet_as_log_completions_does(tiny_chat_tokenizer, tmp_path):
    rows = [rollout(tiny_chat_tokenizer, [t, "done"]) for t in (BAD, GOOD, UNKNOWN)]
    for row in rows:  # grpo_agent.py's query_reward reads this without a type check
        for turn in row:
            for call in turn.get("tool_calls") or []:
                assert isinstance(call["function"]["arguments"], dict)
    df = pd.DataFrame({"step": [1] * 3, "prompt": [[{"role": "user", "content": "q"}]] * 3, "completion": rows})
    df.to_parquet(tmp_path / "completions_00001.parquet")
    back = pd.read_parquet(tmp_path / "completions_00001.parquet")
    assert back["completion"][1][0]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}


def test_error_text_for_a_stray_close_marker_reads_without_html_escapes(tiny_chat_tokenizer):
    """The engine's own error text names the markers without brackets, so escaping leaves it readable."""
    msgs = rollout(tiny_chat_tokenizer, ["oops </tool_call>", "done"])
    assert msgs[0] == {"role": "assistant", "content": "oops </tool_call>"}
    assert msgs[1]["content"] == "{'error': 'no opening tool_call marker before the closing tool_call marker'}"
    assert "&lt;" not in msgs[1]["content"]
