"""Answer extraction from tool-integrated-reasoning completions (ARPO's reward).

The training reward takes the first `<answer>…</answer>` block, then the last `\\boxed{…}` inside it (brace
matched; the `\\boxed ` and `\\fbox{…}` forms are handled too) and strips the wrapper. These helpers are pure
string functions with no third-party dependency, shared by the rewards and the evaluation metrics.

Rewards read only the model's own text: every `<result>…</result>` span (tool output spliced into the
trajectory; an unterminated one runs to the end of the text) is removed before looking for an answer, so a tool
that prints `<answer>\\boxed{7}</answer>` cannot answer for the model (tool results are also escaped when they
are spliced in, `appo_trl.rollout.text.neutralise_result`).
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_RESULT = re.compile(r"<result>.*?(?:</result>|\Z)", re.DOTALL)


def model_text(text: str) -> str:
    """`text` without its tool-result spans: what the model itself wrote."""
    return _RESULT.sub(" ", text or "") if "<result>" in (text or "") else (text or "")


def answer_block(text: str) -> str | None:
    """Content of the first `<answer>(.*?)</answer>` block of the model's own text (tool results ignored;
    ARPO's reward), or `None` when there is none."""
    m = _ANSWER.search(model_text(text))
    return m.group(1) if m else None


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{…}` / `\\boxed …` / `\\fbox{…}` expression of `text`, wrapper included, or `None`.

    Braces are matched by depth counting, so `\\boxed{\\frac{1}{2}}` is returned whole. The `\\boxed x` form
    (a space instead of a brace) ends at the next `$` or end of text (ARPO's reward).

    Example: `last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}")` → `"\\boxed{\\frac{1}{2}}"`.
    """
    if not text:
        return None
    idx = text.rfind("\\boxed")
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    if text.startswith("\\boxed ", idx):
        rest = text[idx + len("\\boxed ") :]
        return "\\boxed " + rest.split("$")[0].strip()
    depth, start = 0, None
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
            start = i if start is None else start
        elif text[i] == "}":
            depth -= 1
            if depth == 0 and start is not None:
                return text[idx : i + 1]
            if depth < 0:
                return None
    return None


def strip_boxed(expr: str | None) -> str | None:
    """Remove the `\\boxed{…}` / `\\boxed ` / `\\fbox{…}` wrapper of `last_boxed`'s result; `None` when malformed."""
    if expr is None:
        return None
    if expr.startswith("\\boxed "):
        return expr[len("\\boxed ") :].strip()
    for head in ("\\boxed{", "\\fbox{"):
        if expr.startswith(head) and expr.endswith("}"):
            return expr[len(head) : -1]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or `None`.

    Order: the last boxed expression inside the first `<answer>` block (stripped); else the whole stripped answer
    block; else the last boxed expression anywhere in the text. The reward (`deep_research`) is stricter and uses
    `answer_block` + `last_boxed` directly (a missing box there scores −1, ARPO paper, hierarchical reward).
    """
    block = answer_block(text or "")
    if block is not None:
        inner = strip_boxed(last_boxed(block))
        return inner.strip() if inner is not None else block.strip()
    inner = strip_boxed(last_boxed(model_text(text)))
    return inner.strip() if inner is not None else None
