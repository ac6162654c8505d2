"""Bad data rows, found at start-up (before the model loads) and reported in one line naming the file and the row.

- `scan_json_file(path, skip)`: a `.jsonl` / `.json` data file read line by line as `datasets` would: a line that
  is not UTF-8 or not valid JSON is reported as `FILE, line N: ...` (1-based, as an editor shows it), instead of
  `datasets`' 60-line traceback. With `skip`, the good lines are copied to a temporary file that is loaded instead.
- `prompt_problem(prompt)`: why a prompt cannot be trained on: `null`, empty or whitespace only (a string, or
  messages whose non-system contents are all empty), or not text / messages.
- `prompt_lengths(prompts, tokenizer)`: prompt lengths in tokens, rendered as TRL renders a conversational
  prompt (the tokenizer's chat template with the generation prompt), the tokenizer only, no model.
- `find_bad_prompts(source, prompts, render, tokenizer, (limit, what))`: both checks over one source's prompts.
- `BadRows`: the bad rows of one source; `resolve(...)` raises `DataError` naming the first one (and how many
  more), or, where the user chose to skip (`skip_bad_rows: true`), logs how many rows were dropped and why.

Rows are numbered from 0 as `datasets` and pandas number them (JSON syntax errors give the file's line number).
What this does not count in a prompt's length: the tool schemas a `tool_format: chat` template adds to every
prompt (a fixed overhead; the rollout engine still refuses a prompt that does not fit, naming its length).
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Sequence
from typing import Any

from appo_trl.configs.errors import DataError

logger = logging.getLogger(__name__)

SKIP_HINT = "fix the data, or set skip_bad_rows: true to drop such rows"


class BadRows:
    """Bad rows of one source: `add(row, reason)`, then `resolve(skip)`."""

    def __init__(self, source: str, unit: str = "row"):
        self.source, self.unit = source, unit
        self.rows: list[tuple[int, str]] = []

    def add(self, row: int, reason: str) -> None:
        self.rows.append((row, reason))

    def __bool__(self) -> bool:
        return bool(self.rows)

    def drop_from(self, ds):
        """`ds` (a `datasets.Dataset`) without the bad rows; `DataError` when none is left."""
        if not self.rows:
            return ds
        dropped = {r for r, _ in self.rows}
        if len(dropped) >= len(ds):
            raise DataError(f"{self.source}: every {self.unit} is bad ({self.rows[0][1]}, ...); nothing is left.")
        return ds.select([i for i in range(len(ds)) if i not in dropped])

    def resolve(self, skip: bool) -> None:
        """Raise `DataError` for the first bad row, or log the skipped ones (`skip`); nothing when all are good."""
        if not self.rows:
            return
        row, reason = self.rows[0]
        if not skip:
            more = f" ({len(self.rows) - 1} more bad {self.unit}s)" if len(self.rows) > 1 else ""
            raise DataError(f"{self.source}, {self.unit} {row}: {reason}{more}; {SKIP_HINT}.")
        kinds = collections.Counter(r.split(" (")[0].split(":")[0] for _, r in self.rows)
        listed = ", ".join(str(r) for r, _ in self.rows[:10]) + (", ..." if len(self.rows) > 10 else "")
        logger.warning(
            "skip_bad_rows: skipped %d bad %s(s) of %s (%s): %s %s",
            len(self.rows),
            self.unit,
            self.source,
            ", ".join(f"{n} {k}" for k, n in kinds.items()),
            self.unit + "s",
            listed,
        )


def scan_json_file(path: str, skip: bool = False) -> str:
    """Check a JSON / JSON-lines data file; returns the path to load (a filtered copy when lines were skipped)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        whole = raw.decode("utf-8")
    except UnicodeDecodeError:
        whole = None
    if whole is not None and whole.lstrip().startswith("["):  # one JSON document (an array of records)
        try:
            json.loads(whole)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}, line {exc.lineno}: malformed JSON ({exc.msg}, column {exc.colno}).") from None
        return path
    bad, good = BadRows(path, unit="line"), []
    for number, line in enumerate(raw.splitlines(keepends=True), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.add(number, f"not UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1})")
            continue
        if text.strip():
            try:
                record = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                bad.add(number, f"malformed JSON ({exc.msg}, column {exc.colno})")
                continue
            if not isinstance(record, dict):
                bad.add(number, f"a JSON {type(record).__name__}, not an object (one record per line)")
                continue
        good.append(line)
    if not bad:
        return path
    bad.resolve(skip)
    from appo_trl.tools.scratch import scratch_path

    filtered = scratch_path("rows", suffix=".jsonl")  # removed at exit; a killed run's at the next start
    with open(filtered, "wb") as fh:
        fh.writelines(line if line.endswith(b"\n") else line + b"\n" for line in good)
    return filtered


def _content_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Sequence):  # content blocks: [{"type": "text", "text": ...}]
        return " ".join(str(b.get("text") or "") if isinstance(b, dict) else str(b) for b in content)
    return None


def prompt_problem(prompt: Any) -> str | None:
    """Why `prompt` cannot be trained on, or None when it can."""
    if prompt is None:
        return "the prompt is null"
    if isinstance(prompt, str):
        return None if prompt.strip() else "the prompt is empty or whitespace only"
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        return f"the prompt is a {type(prompt).__name__}, not text or a list of chat messages"
    texts = []
    for m in prompt:
        if not isinstance(m, dict) or "role" not in m:
            return "the prompt is a list, but not of chat messages {role, content}"
        text = _content_text(m.get("content"))
        if text is None:
            return f"a {m['role']!r} message has content of type {type(m.get('content')).__name__}"
        if m["role"] != "system":
            texts.append(text)
    return None if any(t.strip() for t in texts) else "the prompt is empty or whitespace only (no message text)"


def prompt_lengths(prompts: Sequence[list[dict]], tokenizer, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token counts of conversational prompts as the trainer renders them (chat template + generation prompt)."""
    if not prompts:
        return []
    kwargs = dict(chat_template_kwargs or {})
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **kwargs) for p in prompts]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def find_bad_prompts(source: str, prompts: Sequence[Any], render, tokenizer=None,
                     max_prompt_tokens: tuple[int, str] | None = None) -> BadRows:  # fmt: skip
    """The bad prompts of one source: `prompt_problem`, then (given a tokenizer and `(limit, what sets it)`) a
    rendered prompt of `limit` tokens or more (`render(prompt)` gives its chat messages)."""
    bad = BadRows(source)
    for i, prompt in enumerate(prompts):
        if (problem := prompt_problem(prompt)) is not None:
            bad.add(i, problem)
    if tokenizer is not None and max_prompt_tokens is not None and getattr(tokenizer, "chat_template", None):
        limit, what = max_prompt_tokens
        skip = {r for r, _ in bad.rows}
        rows = [i for i in range(len(prompts)) if i not in skip]
        for i, n in zip(rows, prompt_lengths([render(prompts[i]) for i in rows], tokenizer)):
            if n >= limit:
                bad.add(i, f"the prompt is too long ({n} tokens with the chat template; {what} = {limit})")
        bad.rows.sort()
    return bad
