"""`tool_format: chat`: tool calls through the model's own chat template (`<tool_call>` JSON, `tool` messages).

`ChatToolFormat(tokenizer)` learns everything it needs from the template itself, once, by rendering small
sentinel conversations (as TRL's `supports_tool_calling` and `_get_tool_suffix_ids` do):

- the tool-call markers: an assistant message with one sentinel call is rendered, the JSON object is found
  around the sentinel name, and the text before it (`<tool_call>`) and after it (`</tool_call>`) become the
  open / close markers; the text after the close marker up to the tokenizer's EOS (else its first word) is the
  end of the assistant turn (`<|im_end|>` for Qwen templates);
- the tool turn of k calls: `[user, assistant(k tool_calls), tool(S1), ..., tool(Sk)]` is rendered with the
  generation prompt, and everything after the assistant turn's end is split at the sentinels into k + 1
  template parts. For a Qwen template and two calls that is `\n<|im_start|>user\n<tool_response>\n`, S1,
  `\n</tool_response>\n<tool_response>\n`, S2, `\n</tool_response><|im_end|>\n<|im_start|>assistant\n`: the
  tool turn and the next assistant header exactly as the template renders them (so branches resume in the
  right template state). Cached per tuple of tool names.

Like TRL's tool loop, generation runs to the end of the assistant turn (EOS), not to the first close marker, so
a turn may carry several calls (`stop_strings` is empty). `parse_calls` cuts every `open ... close` pair of the
turn, in order: a JSON object with `name` and `arguments` (an object, or a string holding one). Anything else is
returned to the model as TRL's error text `{'error': ...}`, not raised. The results are appended in call order
(TRL appends the results of sync tools before those of async ones; here the order is always the call order).

Only inserted text is tokenised: the template parts with special tokens recognised, each result with
`split_special_tokens=True` (a tool cannot end the row or open a turn). Sampled tokens are never re-tokenised.

What this does not do: run tools (the engine's `ToolExecutor` does, all calls of a turn concurrently), or
handle templates that write calls in another syntax (Qwen3.5's XML, gpt-oss: refused at construction).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from appo_trl.rollout.text import body_problem, neutralise_special_strings, plain_text

_NAME = "tool_name_5f1c0e7a"
_KEY = "tool_key_9b2d4c1e"
_VAL = "tool_val_3e8a6f20"
_RESULT = "tool_result_7d4b2a9c"
_CACHE_SIZE = 256  # tool-name tuples come from sampled text: keep the cache bounded


@dataclasses.dataclass
class ParsedCall:
    """A tool call cut from sampled text: `name`, JSON `arguments`, or the `error` to send back instead."""

    name: str
    arguments: str | None
    error: str | None = None
    raw: str = ""  # the text between the markers, stripped (the query recorded for a bad call)


def _special_strings(tokenizer) -> set[str]:
    """The tokenizer's special-token strings: EOS, `all_special_tokens` and every added token marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {tokenizer.eos_token, *(getattr(tokenizer, "all_special_tokens", None) or [])}
    found.update(t.content for t in added.values() if getattr(t, "special", False))
    return {t for t in found if t}


class ChatTemplateToolError(ValueError):
    """The chat template cannot be used for tool calling (raised at construction)."""


class ChatToolFormat:
    """Tool-call markers, call parsing and exact tool-turn token ids of one tokenizer's chat template.

    Args:
        tokenizer: the policy's tokenizer; its chat template must render assistant `tool_calls` and `tool` messages.
        chat_template: a template overriding the tokenizer's (as TRL's `chat_template`), else None.
        chat_template_kwargs: extra template variables (`enable_thinking`, ...), as in `GRPOConfig`.
    """

    def __init__(self, tokenizer, chat_template: str | None = None, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.kwargs = dict(chat_template_kwargs or {})
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ChatTemplateToolError("tool_format=chat needs a tokenizer with a chat template")
        self.open, self.close, self.turn_end = self._detect_markers()
        self._parts_cache: dict[tuple[str, ...], list[list[int]]] = {}
        self._special_ids = set(getattr(tokenizer, "all_special_ids", None) or [])
        self.turn_end_ids = tokenizer(self.turn_end, add_special_tokens=False)["input_ids"]

    @property
    def stop_strings(self) -> list[str]:
        """None: generation runs to the end of the assistant turn (EOS), which may hold several calls."""
        return []

    # ------------------------------------------------------------------ template probing
    def _render(self, messages, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.kwargs,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - jinja raises many types; all mean "cannot render tool calls"
            raise ChatTemplateToolError(
                f"tool_format=chat: the chat template cannot render a tool-calling conversation "
                f"({type(exc).__name__}: {exc})"
            ) from None

    def _detect_markers(self) -> tuple[str, str, str]:
        call = {"type": "function", "function": {"name": _NAME, "arguments": {_KEY: _VAL}}}
        user = [{"role": "user", "content": "hi"}]
        head = self._render(user, True)
        full = self._render(user + [{"role": "assistant", "content": "", "tool_calls": [call]}], False)
        where = full.find(_NAME, len(head) if full.startswith(head) else 0)
        if where < 0 or _KEY not in full or _VAL not in full:
            raise ChatTemplateToolError(
                "tool_format=chat: the chat template drops assistant `tool_calls` (it cannot express a tool call)"
            )
        start = full.rfind("{", 0, where)
        try:
            obj, end = json.JSONDecoder().raw_decode(full, start)
        except (ValueError, TypeError):
            obj, end = None, -1
        if not isinstance(obj, dict) or obj.get("name") != _NAME:
            raise ChatTemplateToolError(
                "tool_format=chat: the chat template does not render tool calls as a JSON object with `name` and "
                "`arguments` (supported: Qwen/Hermes-style `<tool_call>{...}</tool_call>`)"
            )
        # the last word before the JSON and the first after it (a `<think></think>` header is left out)
        before = full[len(head) if full.startswith(head) else 0 : start].split()
        tail = full[end:]
        # the close marker ends at the first special token (`<|im_end|>`), whichever the tokenizer's EOS is
        specials = [t for t in _special_strings(self.tokenizer) if len(t) > 1]
        cut = min((i for i in (tail.find(t) for t in specials) if i >= 0), default=-1)
        after = (tail[:cut] if cut >= 0 else tail).split()
        open_marker = before[-1] if before else ""
        close_marker = after[0] if after else ""
        if not open_marker or not close_marker:
            raise ChatTemplateToolError(
                "tool_format=chat: the chat template renders tool calls without an opening and closing marker "
                f"around the JSON (found {open_marker!r} ... {close_marker!r}); the engine cuts calls between them"
            )
        # the end of the assistant turn: the special token right after the close marker, else the next word
        rest = tail[tail.find(close_marker) + len(close_marker) :].lstrip()
        turn_end = next((t for t in sorted(specials, key=len, reverse=True) if rest.startswith(t)), None)
        turn_end = turn_end or (rest.split() or [""])[0]
        if not turn_end:
            raise ChatTemplateToolError(
                "tool_format=chat: the chat template does not end the assistant turn after a tool call"
            )
        return open_marker, close_marker, turn_end

    def _template_parts(self, names: tuple[str, ...]) -> list[list[int]]:
        """Token ids of the k + 1 template parts around k tool results, after the assistant turn's end."""
        if names not in self._parts_cache:
            if len(self._parts_cache) >= _CACHE_SIZE:
                self._parts_cache.clear()
            calls = [{"type": "function", "function": {"name": n, "arguments": {}}} for n in names]
            sentinels = [f"{_RESULT}_{i}_x" for i in range(len(names))]
            messages = [
                {"role": "user", "content": "dummy"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                *({"role": "tool", "name": n, "content": r} for n, r in zip(names, sentinels)),
            ]
            text = self._render(messages, True)
            at = [text.find(r) for r in sentinels]
            cut = text.rfind(self.close, 0, at[0]) if at[0] >= 0 else -1
            end = text.find(self.turn_end, cut) if cut >= 0 else -1
            if min(at) < 0 or at != sorted(at) or end < 0 or end > at[0] or any(text.count(r) != 1 for r in sentinels):
                raise ChatTemplateToolError(
                    f"tool_format=chat: the chat template drops or reorders `tool` messages ({len(names)} calls)"
                )
            bounds = [end + len(self.turn_end), *at, len(text)]
            lens = [0] + [len(r) for r in sentinels]
            parts = [text[bounds[i] + lens[i] : bounds[i + 1]] for i in range(len(names) + 1)]
            enc = self.tokenizer
            self._parts_cache[names] = [enc(t, add_special_tokens=False)["input_ids"] if t else [] for t in parts]
        return self._parts_cache[names]

    # ------------------------------------------------------------------ runtime
    def parse(self, turn_text: str) -> ParsedCall:
        """The call between the last open marker and the last close marker of `turn_text`."""
        end = turn_text.rfind(self.close)
        start = turn_text.rfind(self.open, 0, end) if end >= 0 else -1
        if start < 0:
            # the markers are named without their brackets: tool results are escaped, so `<` would read `&lt;`
            opener, closer = (m.strip("<>/") or m for m in (self.open, self.close))
            what = f"no opening {opener} marker before the closing {closer} marker"
            return ParsedCall("unknown", None, what, turn_text[:end].strip())
        body = turn_text[start + len(self.open) : end].strip()
        try:
            obj = json.loads(body)
        except RecursionError:  # the model's own text: answered as a malformed call, never raised out of the round
            return ParsedCall("unknown", None, "the tool call nests too deep to parse", body)
        except ValueError as exc:  # JSONDecodeError; an integer of over 4300 digits
            return ParsedCall("unknown", None, f"the tool call is not valid JSON: {str(exc).splitlines()[0]}", body)
        problem = body_problem(obj)
        if problem is not None:  # too deep to render, or a lone surrogate escape no tokenizer takes
            return ParsedCall("unknown", None, f"the tool call cannot be used: {problem}", body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ParsedCall(
                "unknown", None, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}', body
            )
        args: Any = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except RecursionError:
                return ParsedCall(obj["name"], None, "the arguments nest too deep to parse", body)
            except ValueError as exc:
                return ParsedCall(obj["name"], None, f"the arguments are not valid JSON: {str(exc).splitlines()[0]}",
                                  body)  # fmt: skip
            problem = body_problem(args)
            if problem is not None:
                return ParsedCall(obj["name"], None, f"the arguments cannot be used: {problem}", body)
        if not isinstance(args, dict):
            return ParsedCall(obj["name"], None, "the arguments must be a JSON object", body)
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False), None, body)

    def parse_calls(self, turn_text: str) -> list[ParsedCall]:
        """Every call of an assistant turn, in order: one per close marker (text after the last one is not a call)."""
        calls, pos = [], 0
        while (end := turn_text.find(self.close, pos)) >= 0:
            calls.append(self.parse(turn_text[pos : end + len(self.close)]))
            pos = end + len(self.close)
        return calls

    def has_calls(self, turn_text: str) -> bool:
        return self.close in turn_text

    def tool_turn_ids(self, names: list[str], texts: list[str], limit: int, closed: bool = True) -> list[list[int]]:
        """Ids inserted after an assistant turn with k calls, cut into k pieces (one per call, in call order).

        Piece i is the template text before result i plus the result (`limit` tokens at most, the template
        included); the last piece also holds the text after the last result and the next assistant header.
        `closed=False` (the turn ended on another EOS than the template's end of turn) puts the end of turn first.
        """
        parts = self._template_parts(tuple(names))

        def enc(s: str) -> list[int]:
            return self.tokenizer(plain_text(s), add_special_tokens=False, split_special_tokens=True)["input_ids"] \
                if s else []  # fmt: skip

        pieces = []
        for i, text in enumerate(texts):
            body = enc(text)
            if self._special_ids.intersection(body):  # a tokenizer that ignores split_special_tokens
                body = enc(neutralise_special_strings(text, self.tokenizer))
            tail = parts[-1] if i == len(texts) - 1 else []
            body = body[: max(limit - len(parts[i]) - len(tail), 0)]
            pieces.append(parts[i] + body + tail)
        if not closed and pieces:
            pieces[0] = list(self.turn_end_ids) + pieces[0]
        return pieces

    def result_ids(self, name: str, text: str, limit: int) -> list[int]:
        """Ids inserted after a turn with one call: the tool turn holding `text` and the next assistant header."""
        return self.tool_turn_ids([name], [text], limit)[0]

    def completion_messages(self, traj) -> list[dict]:
        """A trajectory as TRL's tool-loop completion: assistant (with `tool_calls`), `tool`, ..., assistant.

        Calls of one assistant turn share their record's `end` (the end of their tool turn): one assistant
        message carries them all, followed by one `tool` message per call, in call order. The turn's text is
        parsed again as TRL's `parse_response` does: a turn with a malformed call is a plain-text assistant message
        (so every `tool_calls` entry a reward reads has dict `arguments`); its error `tool` messages follow it."""
        decode = self.tokenizer.decode
        turns: dict[int, list] = {}
        for call in traj.tool_calls:
            turns.setdefault(call.end, []).append(call)
        messages, pos = [], 0
        for end, calls in turns.items():
            text = decode(traj.completion_ids[pos : calls[0].start], skip_special_tokens=True)
            parsed = self.parse_calls(text)
            if len(parsed) != len(calls) or any(p.error is not None for p in parsed):
                # TRL's parse_response: a turn with a malformed call is plain text (no `tool_calls`)
                messages.append({"role": "assistant", "content": text.removesuffix(self.turn_end).rstrip()})
            else:
                cut = text.find(self.open)
                content = (text[:cut] if cut >= 0 else text).rstrip()
                tool_calls = [
                    {"type": "function", "function": {"name": p.name, "arguments": json.loads(p.arguments)}}
                    for p in parsed
                ]
                messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
            messages.extend({"role": "tool", "name": call.tag, "content": call.result} for call in calls)
            pos = end
        messages.append({"role": "assistant", "content": decode(traj.completion_ids[pos:], skip_special_tokens=True)})
        return messages
