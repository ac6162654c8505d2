"""SFT on chat-format tool traces (TRL's tool-calling shape): tool calls rendered, tool turns never trained."""

from __future__ import annotations

import json

import pytest

from appo_trl.configs.recipes import REPO_ROOT
from appo_trl.data import load_sft_dataset
from appo_trl.stages.sft import tokenize_conversation

DATA = str(REPO_ROOT / "recipes" / "tiny" / "data" / "sft_chat.jsonl")


def trained_text(tok, out) -> str:
    return tok.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])


@pytest.fixture(scope="module")
def row():
    return load_sft_dataset(DATA)[0]


def test_loader_keeps_tool_calls_names_and_the_tools_column(row):
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    call = json.loads(row["messages"][2]["tool_calls"])[0]["function"]
    assert call["name"] == "calculator" and row["messages"][3]["name"] == "calculator"
    assert json.loads(row["tools"])[0]["function"]["name"] == "calculator"


@pytest.mark.parametrize("assistant_only_loss", [True, False])
def test_tool_turns_are_masked_and_calls_are_trained(row, tiny_chat_tokenizer, assistant_only_loss):
    tok = tiny_chat_tokenizer
    out = tokenize_conversation(row["messages"], tok, tools=row["tools"], assistant_only_loss=assistant_only_loss)
    text = tok.decode(out["input_ids"])
    result = row["messages"][3]["content"]
    assert "<tools>" in text and '"name": "calculator"' in text  # the schema is rendered as in RL prompts
    assert f"<tool_response>\n{result}\n</tool_response>" in text
    trained = trained_text(tok, out)
    call = json.loads(json.loads(row["messages"][2]["tool_calls"])[0]["function"]["arguments"])["expression"]
    assert f'"expression": "{call}"' in trained and "\\boxed{" in trained  # the call and the answer are learnt
    assert f"<tool_response>\n{result}\n" not in trained  # the tool's output never is


def test_result_equal_to_text_of_the_call_masks_the_tool_turn_not_the_call(tiny_chat_tokenizer):
    tok = tiny_chat_tokenizer
    calls = json.dumps(
        [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "5 * 1"}}}]
    )
    messages = [
        {"role": "user", "content": "What is 5 * 1?"},
        {"role": "assistant", "content": "", "tool_calls": calls, "name": None},
        {"role": "tool", "content": "5", "name": "calculator", "tool_calls": None},
        {"role": "assistant", "content": "\\boxed{5}"},
    ]
    out = tokenize_conversation(messages, tok, assistant_only_loss=False)
    trained = trained_text(tok, out)
    assert '"expression": "5 * 1"' in trained and "<tool_response>\n\n</tool_response>" in trained
