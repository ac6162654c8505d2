"""`tool_format: chat`: tool calls through the model's own chat template (`<tool_call>` JSON, `tool` messages).

`ChatToolFormat(tokenizer)` learns everything it needs from the template itself, once, by rendering small
sentinel conversations (as TRL's `supports_tool_calling` and `_get_tool_suffix_ids` do):

- the tool-call markers: an assistant message with one sentinel call is rendered, the JSON object is found
  around the sentinel name, and the text before it (`<tool_call>`) and after it up to the end of the turn
  (`</tool_call>`) become the open / close markers. The close marker is the engine's stop string;
- the tool turn: `[user, assistant(tool_calls), tool(SENTINEL)]` is rendered with the generation prompt, and
  everything after the call's close marker is split at the sentinel into the template text before and after
  the result. For a Qwen template that is `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n` and
  `\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`: the end of the assistant turn, the tool turn and the
  next assistant header, exactly as the template renders them (so branches resume in the right template state).

Only that inserted text is tokenised: the template parts with special tokens recognised, the result with
`split_special_tokens=True` (a tool cannot end the row or open a turn). Sampled tokens are never re-tokenised.
A call is parsed from the sampled text between the last open and close marker: a JSON object with `name` and
`arguments` (an object, or a string holding one). Anything else is returned to the model as TRL's error text
`{'error': ...}`, not raised.

What this does not do: run tools (the engine's `ToolExecutor` does), or handle several calls in one turn
(generation stops at the first close marker, so every turn carries at most one call).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from appo_trl.rollout.text import neutralise_special_strings

_NAME = "tool_name_5f1c0e7a"
_KEY = "tool_key_9b2d4c1e"
_VAL = "tool_val_3e8a6f20"
_RESULT = "tool_result_7d4b2a9c"


@dataclasses.dataclass
class ParsedCall:
    """A tool call cut from sampled text: `name`, JSON `arguments`, or the `error` to send back instead."""

    name: str
    arguments: str | None
    error: str | None = None


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
        self.open, self.close = self._detect_markers()
        self._suffix_cache: dict[str, tuple[list[int], list[int]]] = {}
        self._special_ids = set(getattr(tokenizer, "all_special_ids", None) or [])

    @property
    def stop_strings(self) -> list[str]:
        return [self.close]

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

    def _detect_markers(self) -> tuple[str, str]:
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
        eos = self.tokenizer.eos_token or ""
        cut = tail.find(eos) if eos else -1
        after = (tail[:cut] if cut >= 0 else tail).split()
        open_marker = before[-1] if before else ""
        close_marker = after[0] if after else ""
        if not open_marker or not close_marker:
            raise ChatTemplateToolError(
                "tool_format=chat: the chat template renders tool calls without an opening and closing marker "
                f"around the JSON (found {open_marker!r} ... {close_marker!r}); the engine stops on the closing one"
            )
        return open_marker, close_marker

    def _template_parts(self, name: str) -> tuple[list[int], list[int]]:
        """Token ids of the template text before and after a tool result (cached per tool name)."""
        if name not in self._suffix_cache:
            if len(self._suffix_cache) >= 256:  # names come from sampled text: keep the cache bounded
                self._suffix_cache.clear()
            call = {"type": "function", "function": {"name": name, "arguments": {}}}
            messages = [
                {"role": "user", "content": "dummy"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": name, "content": _RESULT},
            ]
            text = self._render(messages, True)
            at = text.find(_RESULT)
            cut = text.rfind(self.close, 0, at)
            if at < 0 or cut < 0 or text.count(_RESULT) != 1:
                raise ChatTemplateToolError("tool_format=chat: the chat template drops `tool` messages")
            pre, post = text[cut + len(self.close) : at], text[at + len(_RESULT) :]
            enc = self.tokenizer
            self._suffix_cache[name] = (
                enc(pre, add_special_tokens=False)["input_ids"] if pre else [],
                enc(post, add_special_tokens=False)["input_ids"] if post else [],
            )
        return self._suffix_cache[name]

    # ------------------------------------------------------------------ runtime
    def parse(self, turn_text: str) -> ParsedCall:
        """The call between the last open marker and the last close marker of `turn_text`."""
        end = turn_text.rfind(self.close)
        start = turn_text.rfind(self.open, 0, end) if end >= 0 else -1
        if start < 0:
            return ParsedCall("unknown", None, f"no {self.open} before {self.close}")
        body = turn_text[start + len(self.open) : end].strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return ParsedCall("unknown", None, f"the tool call is not valid JSON: {exc}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ParsedCall("unknown", None, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
        args: Any = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                return ParsedCall(obj["name"], None, f"the arguments are not valid JSON: {exc}")
        if not isinstance(args, dict):
            return ParsedCall(obj["name"], None, "the arguments must be a JSON object")
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def result_ids(self, name: str, text: str, limit: int) -> list[int]:
        """Ids inserted after a call: end of the assistant turn, the tool turn holding `text`, next header."""
        pre, post = self._template_parts(name)

        def enc(s: str) -> list[int]:
            return self.tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"] if s else []

        body = enc(text)
        if self._special_ids.intersection(body):  # a tokenizer that ignores split_special_tokens
            body = enc(neutralise_special_strings(text, self.tokenizer))
        if len(pre) + len(body) + len(post) > limit:
            body = body[: max(limit - len(pre) - len(post), 0)]
        return pre + body + post

    def completion_messages(self, traj) -> list[dict]:
        """A trajectory as TRL's tool-loop completion: assistant (with `tool_calls`), `tool`, ..., assistant."""
        decode = self.tokenizer.decode
        messages, pos = [], 0
        for call in traj.tool_calls:
            text = decode(traj.completion_ids[pos : call.start], skip_special_tokens=True)
            cut = text.rfind(self.open)
            content = (text[:cut] if cut >= 0 else text).rstrip()
            try:
                arguments = json.loads(call.query)
            except (json.JSONDecodeError, TypeError):
                arguments = call.query
            messages.append({
                "role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": {"name": call.tag, "arguments": arguments}}],
            })  # fmt: skip
            messages.append({"role": "tool", "name": call.tag, "content": call.result})
            pos = call.end
        messages.append({"role": "assistant", "content": decode(traj.completion_ids[pos:], skip_special_tokens=True)})
        return messages
