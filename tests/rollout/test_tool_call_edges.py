"""The model's own tool calls and the tools' results at their edges (issue 48, own attack): a call nested too deep,
an integer of 5,000 digits, a lone surrogate escape in a name or an argument are answered as malformed calls (TRL's
error text back to the model), never raised out of the round; a result holding a lone surrogate is tokenised with
U+FFFD in its place instead of the tokenizer's TypeError."""

from __future__ import annotations

import pytest

from appo_trl.rollout.chat_format import ChatToolFormat
from appo_trl.rollout.text import plain_text

DEEP = '{"name": "multiply", "arguments": ' + '{"a": ' * 3000 + "1" + "}" * 3000 + "}"
CALLS = [
    (f"<tool_call>{DEEP}</tool_call>", "the tool call nests too deep to parse"),
    ('<tool_call>{"name": "multiply", "arguments": "' + '{\\"a\\": ' * 3000 + "1" + "}" * 3000 + '"}</tool_call>',
     "the arguments nest too deep to parse"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
     "the tool call is not valid JSON: Exceeds the limit (4300 digits)"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": "\\ud800", "b": 2}}</tool_call>',
     "the tool call cannot be used: arguments.a: holds a lone surrogate"),
    ('<tool_call>{"name": "mul\\udfff", "arguments": {}}</tool_call>', "the tool call cannot be used: name: holds"),
    ('<tool_call>{"name": "multiply", "arguments": "{\\"a\\": \\"\\\\ud800\\"}"}</tool_call>',
     "the arguments cannot be used: a: holds a lone surrogate"),
]


@pytest.mark.parametrize("text, expected", CALLS, ids=range(len(CALLS)))
def test_a_call_that_cannot_be_used_is_a_malformed_call_not_an_exception(text, expected, tiny_chat_tokenizer):
    [call] = ChatToolFormat(tiny_chat_tokenizer).parse_calls(text)
    assert call.error is not None and call.error.startswith(expected), call.error
    assert call.error.isascii()  # the error text goes back to the model: it must tokenise


def test_a_result_with_a_lone_surrogate_is_tokenised(tiny_chat_tokenizer, tiny_tokenizer):
    from appo_trl.rollout import RolloutEngine

    engine = RolloutEngine(None, tiny_tokenizer)  # the tag format's result block
    assert "a\ufffdb" in tiny_tokenizer.decode(engine._result_ids("a\ud800b"))
    engine.close()
    fmt = ChatToolFormat(tiny_chat_tokenizer)
    ids = fmt.result_ids("multiply", "a\ud800b", 100)
    assert "a\ufffdb" in tiny_chat_tokenizer.decode(ids)
    assert plain_text("caf\u00e9") == "caf\u00e9" and plain_text("x\udc80") == "x\ufffd"
