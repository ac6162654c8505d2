"""Floor 2: reward functions and answer metrics (ARPO paper, hierarchical reward; docs/fidelity.md).

Registry: `REWARD_FUNCS[name]` and `get_reward_func(name_or_dotted_path)`. Every reward function has TRL's
signature `fn(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]`; completions are strings
or chat-message lists; golds come in kwarg `answer` (aliases `ground_truth`, `solution`), `ability` optional.

Names:
- `arpo_deep_research`: ARPO's training reward (−1 format failure | token-F1 | F1 + 0.1 with both tools).
- `arpo_deep_research_mathverify`: the same, math equivalence (1/0) for rows with `ability == "math"`.
- `math_verify`: 1/0 math equivalence of the extracted answer.  `qa_f1`, `qa_em`: F1 / EM of the extracted answer.
- `format`: 0 if the TIR format is valid with a boxed answer, else −1.

Public helpers (modules):
- `qa.normalize_answer(s) -> str`; `qa.exact_match(pred, golds) -> float`; `qa.f1_score(pred, golds) -> float`;
  `qa.cover_exact_match(pred, golds) -> float` (= `qa.sub_exact_match`); golds: str or list[str].
- `math.math_equal(prediction, gold, timeout=5.0) -> bool` (thread-safe, no signals).
- `extract.extract_answer(text) -> str | None`; `extract.answer_block(text) -> str | None`;
  `extract.last_boxed(text) -> str | None`; `extract.strip_boxed(expr) -> str | None`.
- `deep_research.validate_format(text) -> (bool, reason)`; `deep_research.compute_score(response, golds,
  ability=None, math_verify_for_math=False) -> float`; `deep_research.extract_boxed_answer(text) -> str | None`.
- `funcs.completion_text(completion) -> str`.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

from appo_trl.rewards.funcs import (
    arpo_deep_research,
    arpo_deep_research_mathverify,
    format_reward,
    math_verify,
    qa_em,
    qa_f1,
)

REWARD_FUNCS: dict[str, Callable] = {
    "arpo_deep_research": arpo_deep_research,
    "arpo_deep_research_mathverify": arpo_deep_research_mathverify,
    "math_verify": math_verify,
    "qa_f1": qa_f1,
    "qa_em": qa_em,
    "format": format_reward,
}


def get_reward_func(name: str) -> Callable:
    """A reward function by registry name, or by dotted import path (`pkg.module.fn` or `pkg.module:fn`).

    Raises ValueError for an unknown name (listing the valid names and close matches) or a path that does not
    import to a callable.
    """
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if "." in name or ":" in name:
        module, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot import reward function {name!r}: {err}") from err
        if not callable(fn):
            raise ValueError(f"{name!r} is not callable")
        return fn
    close = difflib.get_close_matches(name, REWARD_FUNCS, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown reward function {name!r}; valid names: {', '.join(sorted(REWARD_FUNCS))}.{hint}")


__all__ = ["REWARD_FUNCS", "get_reward_func"]
