"""Token-level text helpers shared by the backends and the engine: stop-string matching on sampled pieces,
truncated top-k entropy, tool-call extraction and neutralising special-token strings in tool output.

Stop strings are matched on decoded text, the way vLLM does it: a segment ends with the token whose text
completes the stop string, and that token is kept whole even when it carries text after the stop string
(`"</python>\\n"` as one token). Nothing here re-tokenises sampled text.
"""

from __future__ import annotations

import math


class PieceDecoder:
    """Decodes token ids to text incrementally, with a per-id cache (byte-level BPE pieces are context-free).

    Incomplete UTF-8 pieces decode to U+FFFD on their own; for stop matching on ASCII tags that is harmless.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class StopMatcher:
    """Feeds sampled token texts one by one and reports the first stop string completed.

    `push(text)` returns the stop string that the text just completed (the earliest-ending occurrence in
    the running text), or None. Only a tail as long as the longest stop string is kept.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._keep = max((len(s) for s in self.stops), default=0)
        self._tail = ""

    def push(self, text: str) -> str | None:
        if not self.stops:
            return None
        window = self._tail + text
        best, best_end = None, None
        for stop in self.stops:
            # an occurrence must end inside the new text, otherwise an earlier push would have reported it
            idx = window.find(stop, max(0, len(self._tail) - len(stop) + 1))
            if idx >= 0 and (best_end is None or idx + len(stop) < best_end):
                best, best_end = stop, idx + len(stop)
        self._tail = window[-self._keep :] if self._keep else ""
        return best


def topk_entropy(top: dict[int, float] | None) -> float:
    """Truncated entropy `-sum p log p` over the given logprobs (top-k plus the sampled token), in nats."""
    if not top:
        return math.nan
    h = 0.0
    for lp in top.values():
        if lp is not None and math.isfinite(lp):
            h -= math.exp(lp) * lp
    return max(h, 0.0)


def window_entropy(entropies: list[float], window: int, reduce: str = "sum", norm: float = 1.0) -> float:
    """Reduce the first `window` known per-token entropies (NaN skipped); NaN when none is known."""
    vals = [e for e in entropies[:window] if not math.isnan(e)]
    if not vals:
        return math.nan
    total = sum(vals) if reduce == "sum" else sum(vals) / len(vals)
    return total / norm


def extract_call(text: str, tag: str) -> str | None:
    """The content of the last `<tag>...</tag>` in `text`, stripped; None when there is no complete pair."""
    close = f"</{tag}>"
    end = text.rfind(close)
    if end < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return None
    return text[start + len(tag) + 2 : end].strip()


def neutralise_special_strings(text: str, tokenizer) -> str:
    """Break every special-token string (`<|im_end|>`, `<|endoftext|>`, ...) in tool output with a space after
    its first character, so that no tokenizer can turn it into a control token, whatever its options."""
    specials = getattr(tokenizer, "all_special_tokens", None) or []
    for tok in sorted(set(specials), key=len, reverse=True):
        if len(tok) > 1 and tok in text:
            text = text.replace(tok, tok[0] + " " + tok[1:])
    return text
