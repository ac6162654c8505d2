"""The demo's task as your own agent (`agent: demo_agent:agent` in recipes/demo/agent.yaml).

One trajectory: the openai SDK against the trainer's endpoint, stopping the model at `</python>` or `</search>`;
the agent runs that call itself and sends the result back in a user turn (`<result>...</result>`), up to
`CALL_LIMIT` calls; its reward is the exact match of the last `\\boxed{}` answer with the row's `answer`.

Its tools: `python` evaluates `print(<integer arithmetic>)` (+, -, *, parentheses: what the demo's questions
need; anything else is an error result, nothing is executed), `search` is BM25 over the demo's encyclopedia
(`appo_trl.tools.search_server.BM25Index`, the index `appo serve-search` builds, loaded once per process) with the
top hit formatted as the search tool does (`Page 1: ...`). What it does not do: sandbox arbitrary code, or keep the
SFT traces' format: the endpoint closes the model's turn before the agent's next message, so each result arrives in
a new user turn, which the demo's cold start never saw (docs/benchmarks.md, "Features on the cold start").
"""

from __future__ import annotations

import ast
import operator
import os
import re
import threading

import openai

from appo_trl.evaluation.metrics import extract_prediction
from appo_trl.rewards.qa import exact_match
from appo_trl.tools.search import format_results

CORPUS = os.environ.get("DEMO_CORPUS", "outputs/demo/data/corpus.jsonl")  # `make cold-start` writes it
CALL_LIMIT = 3  # the demo recipes' tool_call_limit
STOPS = ["</python>", "</search>"]
_CALL = re.compile(r"<(python|search)>(.*?)(?:</\1>|$)", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_index, _lock = None, threading.Lock()


def arithmetic(code: str) -> str:
    """What `print(<expr>)` prints for integer +, -, * and parentheses; an error line for anything else."""
    try:
        tree = ast.parse(code.strip(), mode="eval").body
        if not (isinstance(tree, ast.Call) and getattr(tree.func, "id", "") == "print" and len(tree.args) == 1):
            return "Error: this agent runs print(<arithmetic>) only"
        return str(_value(tree.args[0]))
    except (SyntaxError, ValueError) as exc:
        return f"Error: {exc}"


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError(f"not integer arithmetic: {ast.dump(node)[:60]}")


def search(query: str) -> str:
    """The top BM25 hit for `query` in `CORPUS`, as the search tool shows it."""
    global _index
    from appo_trl.tools.search_server import BM25Index

    with _lock:
        if _index is None:
            _index = BM25Index(CORPUS)
        hits = _index.retrieve([query.strip()], 1)[0]
    return format_results([doc["contents"] for doc, _ in hits], max_results=1)


def agent(row: dict, base_url: str, model: str) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="-")
    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    text, calls = "", 0
    while True:
        reply = client.chat.completions.create(model=model, messages=messages, stop=STOPS).choices[0].message
        text = reply.content or ""
        messages.append({"role": "assistant", "content": text})
        call = _CALL.search(text)
        if call is None or calls == CALL_LIMIT:  # an answer, or no calls left
            break
        calls += 1
        tool, arg = call.groups()
        result = arithmetic(arg) if tool == "python" else search(arg)
        messages.append({"role": "user", "content": f"<result>\n{result}\n</result>"})
    return exact_match(extract_prediction(text), row["answer"])
