"""A scripted policy for TRL's agent examples: the next assistant turn is a function of the context's text only.

The same script drives TRL's `GRPOTrainer` (its `_generate_single_turn` patched) and `APPOTrainer` (its rollout
engine's backend), so per-step tool-call counts and failure rates can be compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable

from appo_trl.rollout import Segment

HEADER = "<|im_start|>assistant\n"


class ScriptedTurns:
    """`turn(context_text, n_results) -> str`: the assistant turn (ended with the end of turn by this class)."""

    def __init__(self, tokenizer, turn: Callable[[str, int], str]):
        self.tok, self.turn = tokenizer, turn
        self.result = tokenizer.convert_tokens_to_ids("</tool_response>")
        self.header = tokenizer.encode(HEADER, add_special_tokens=False)

    def ids(self, context_ids: list[int]) -> list[int]:
        text = self.tok.decode(context_ids)
        body = self.turn(text, context_ids.count(self.result))
        return self.tok.encode(body, add_special_tokens=False) + [self.tok.eos_token_id]

    def _tail(self, ids: list[int]) -> list[int]:
        h = len(self.header)
        starts = [i + h for i in range(len(ids) - h + 1) if ids[i : i + h] == self.header]
        return ids[starts[-1] :] if starts else []

    async def generate(self, prompt_ids, params):  # APPO's backend protocol
        tail = self._tail(list(prompt_ids))
        full = self.ids(list(prompt_ids))
        # continue a turn already started (ARPO's look-ahead); the prompt's own empty think block is not ours
        k = next(k for k in range(len(tail) + 1) if full[: len(tail) - k] == tail[k:])
        ids = full[len(tail) - k :]
        reason = "eos"
        if len(ids) > params.max_tokens:
            ids, reason = ids[: params.max_tokens], "length"
        tops = [{i: -0.5, (i + 1) % len(self.tok): -1.0} for i in ids] if params.logprobs else None
        return Segment(ids, [-0.5] * len(ids), tops, reason, None)

    def trl_single_turn(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """A stand-in for `GRPOTrainer._generate_single_turn`: one scripted completion per prompt."""
        return [self.ids(list(p)) for p in prompt_ids], None


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
