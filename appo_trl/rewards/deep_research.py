"""ARPO's training reward, reproduced exactly (ARPO paper, hierarchical reward; identical in AEPO and APPO).

score = −1 if the format is invalid or no boxed answer can be extracted; otherwise Acc = max-over-golds token-F1
of the normalised boxed answer, plus 0.1 when Acc > 0 and the response contains both `</search>` and `</python>`.
Range {−1} ∪ [0, 1.1]. Option `math_verify_for_math=True` (not in the reference): rows with `ability == "math"`
use Acc = 1.0/0.0 from `math_equal` instead of F1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from appo_trl.rewards.extract import answer_block, last_boxed, strip_boxed
from appo_trl.rewards.qa import f1_score

_TOOL_TAG = re.compile(r"</?(?:search|python|result)>")
TOOL_BONUS = 0.1


def validate_format(text: str) -> tuple[bool, str]:
    """Check the TIR format of a response (ARPO paper, hierarchical reward; docs/fidelity.md); returns (ok, reason).

    Rules: count(`<think>`) == count(`</think>`) ≥ 1; exactly one `<answer>` and one `</answer>`, opening first;
    every `<search>` (resp. `<python>`) is followed by the tool-tag sequence `</search>`, `<result>`, `</result>`;
    the answer content contains `\\boxed{` and `}`.
    """
    opens, closes = text.count("<think>"), text.count("</think>")
    if opens != closes or opens < 1:
        return False, f"think tags: {opens} open, {closes} close"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False, "need exactly one <answer> and one </answer>"
    if text.index("<answer>") > text.index("</answer>"):
        return False, "</answer> before <answer>"
    tags = _TOOL_TAG.findall(text)
    for i, tag in enumerate(tags):
        if tag in ("<search>", "<python>"):
            want = [tag.replace("<", "</"), "<result>", "</result>"]
            if tags[i + 1 : i + 4] != want:
                return False, f"{tag} not followed by {' '.join(want)}"
    block = answer_block(text) or ""
    if "\\boxed{" not in block or "}" not in block:
        return False, "no \\boxed{} in the answer"
    return True, "ok"


def extract_boxed_answer(text: str) -> str | None:
    """The stripped last boxed expression of the first `<answer>` block, or None (ARPO's reward)."""
    block = answer_block(text)
    if block is None:
        return None
    return strip_boxed(last_boxed(block))


def compute_score(
    response: str,
    golds: str | Sequence[str],
    ability: str | None = None,
    math_verify_for_math: bool = False,
) -> float:
    """ARPO's `deep_research.compute_score` (ARPO paper, hierarchical reward; docs/fidelity.md): −1 | F1 | F1 + 0.1.

    `response` is the decoded completion only (no prompt). Example: a valid response answering `\\boxed{Paris}`
    for gold "Paris" with both a search and a python call scores 1.1; without tool calls 1.0; wrong answer 0.
    """
    ok, _ = validate_format(response)
    if not ok:
        return -1.0
    pred = extract_boxed_answer(response)
    if pred is None:
        return -1.0
    gold_list = [golds] if isinstance(golds, str) else [str(g) for g in golds]
    if math_verify_for_math and ability == "math":
        from appo_trl.rewards.math import math_equal

        acc = 1.0 if any(math_equal(pred, g) for g in gold_list) else 0.0
    else:
        acc = f1_score(pred, gold_list)
    if acc > 0 and "</search>" in response and "</python>" in response:
        return acc + TOOL_BONUS
    return acc
