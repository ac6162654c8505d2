"""A custom tool for the tiny chat-format recipes: `tools: [tools.calculator]` in `recipes/tiny/*_chat.yaml`.

Any typed function with a Google-style docstring is a tool (TRL's `tools=` convention): its schema comes from
the signature and docstring, and the model sees it through the chat template. `tools.calculator` resolves from
the recipe's folder, so this file needs no installation.
"""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression: {ast.unparse(node)}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with +, -, *, / and parentheses.

    Args:
        expression: the expression to evaluate, e.g. "12 * (3 + 4)".
    """
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
