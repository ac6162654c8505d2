"""One trajectory of a user's agent: its OpenAI chat requests turned into exact-token rows.

`AgentSession.complete(request)` answers one `/v1/chat/completions` request body. The prompt it samples on is
built from ids, never from the model's text:

- **extension**: the request's messages start with the previous request's messages plus the assistant message the
  session returned (compared as messages: role, text, tool calls by name and arguments; call ids ignored), with the
  same tools. The prompt is the chain's recorded ids (prompt + every token so far) plus the new messages rendered
  by the chat template after the end of the assistant turn (mask 0, logprob NaN).
- **restart**: anything else (the agent dropped, edited or compacted its history, or changed its tools). A new chain
  starts on the template's rendering of the whole request; the earlier chains stay in `chains`, and each one that
  holds a sampled answer is a training row of the run too (`chain_rows`).

- **replay** (a branch of a recorded run, `Replay`): each call before the branch call is answered with the parent's
  recorded answer while the ids it would sample on equal the parent's; the branch call answers the parent's tokens up
  to the branch point plus a continuation sampled on exactly that prefix; a mismatch ends the replay (`diverged`).

Each chain is one `Trajectory` (prompt, completion, mask, logprobs: the row invariants of the rollout layer); `row`
is the run's row (the last chain; a branch's: the chain of its branch call), `chain_rows` its other sampled chains. Tool
calls in the sampled text are parsed with the template's tool-call format (`ChatToolFormat`) and returned as
`message.tool_calls`. Sampling settings are the caller's (`SamplingParams` from the trainer), never the request's.

Budget: a chain holds at most `params.max_tokens` (`max_completion_length`) completion tokens, its sampled answers
and the rendered messages between them together, and fits `max_model_len`. A request's `max_tokens` (or
`max_completion_tokens`) caps that turn only: its answer is at most that many tokens (`finish_reason: length`), the
next turn closes it with the template's turn end and samples on; it never ends the chain. Once the chain's budget is
spent, later turns are answered empty (`length`). A request longer than `max_model_len` is refused
(`RequestTooLong`). Messages of over `OFF_LOOP_CHARS` characters are rendered and tokenised on a worker thread
(the tokenizer releases the GIL), so one run's huge request costs that run alone, never the endpoint's other runs.
What it does not do: serve HTTP (`appo_trl.rollout.agent_endpoint`), run agents or score (the trainer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from appo_trl.rollout.text import topk_entropy
from appo_trl.rollout.types import Origin, SamplingParams, Segment, Trajectory
from appo_trl.sampling import add_version_run

_SENTINEL = "assistant_sentinel_4c9e1b7d"
OFF_LOOP_CHARS = 4096  # about 4 ms of tokenising: longer messages are tokenised off the endpoint's event loop


def _text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return raw


def normalise(message: dict) -> tuple:
    """What decides whether two messages are the same turn: role, stripped text, tool calls (name, arguments)."""
    calls = tuple(
        (c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")),
                                                        sort_keys=True))
        for c in message.get("tool_calls") or ()
    )  # fmt: skip
    return (message.get("role"), _text(message.get("content")).strip(), calls)


def template_message(message: dict) -> dict:
    """A request message as chat templates expect it: text content, tool-call arguments as objects."""
    out = {k: v for k, v in message.items() if v is not None and k in ("role", "content", "name", "tool_call_id")}
    out["content"] = _text(message.get("content"))
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c["function"]["name"],
                                              "arguments": _arguments(c["function"].get("arguments"))}}
            for c in message["tool_calls"]
        ]  # fmt: skip
    return out


class ChatRenderer:
    """The policy's chat template as ids: a whole request, or the messages that follow an assistant turn.

    Args:
        tokenizer: the policy's tokenizer.
        chat_template, chat_template_kwargs: as in `GRPOConfig` (None: the tokenizer's template).
        tool_format: a `ChatToolFormat` (tool-call markers, the end of an assistant turn), or None when the
            template cannot express tool calls (then no `tool_calls` are ever returned).
    """

    def __init__(self, tokenizer, chat_template=None, chat_template_kwargs=None, tool_format=None):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.kwargs = dict(chat_template_kwargs or {})
        self.tool_format = tool_format
        self.turn_end = tool_format.turn_end if tool_format is not None else tokenizer.eos_token
        self.turn_end_ids = self.encode(self.turn_end)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def render(self, messages: list[dict], tools: list | None) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                [template_message(m) for m in messages], tools=tools or None, chat_template=self.chat_template,
                tokenize=False, add_generation_prompt=True, **self.kwargs,
            )  # fmt: skip
        except TemplateError as exc:  # the template refuses these messages (say, a role it does not know)
            raise ValueError(f"the model's chat template cannot render these messages: {exc}") from None

    def prompt_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        return self.encode(self.render(messages, tools))

    def delta_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        """Ids the template puts after an assistant turn's end for `messages`, up to the next assistant header."""
        head = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(head + messages, tools)
        at = text.find(_SENTINEL)
        end = text.find(self.turn_end, at) if at >= 0 else -1
        if end < 0:
            raise ValueError("the chat template does not end an assistant turn where the session expects it")
        return self.encode(text[end + len(self.turn_end) :])


class AgentSession:
    """The chains (rows) of one agent run, and the answer to each of its requests.

    Args:
        renderer: the `ChatRenderer` of the policy.
        sample: `async (prompt_ids, SamplingParams) -> Segment`, the backend call (the endpoint bounds concurrency).
        params: the trainer's sampling settings; `max_tokens` is the row budget (`max_completion_length`).
        max_model_len: the sampler's context length (prompt + completion).
        seed: this run's seed; request k of the session samples with a seed derived from it.
        group: the prompt index of the run in its round (kept on every chain).
    """

    def __init__(self, renderer: ChatRenderer, sample: Callable[[list[int], SamplingParams], Awaitable[Segment]],
                 params: SamplingParams, max_model_len: int, seed: int = 0, group: int = 0):  # fmt: skip
        self.renderer, self._sample, self.params = renderer, sample, params
        self.max_model_len, self.seed, self.group = max_model_len, seed, group
        self.chains: list[Trajectory] = []
        self.requests = 0
        self.refusals: list[str] = []  # every request the endpoint refused (4xx), as `HTTP <code>: <message>`
        self.closed = False
        self._history: list[tuple] = []  # normalised messages of the current chain, the last answer included
        self._tools_key: str | None = None
        self._first: int = 0  # messages of the chain's first request (its prompt)
        self._full = False  # the current chain's budget is spent: later extensions are answered empty (length)
        self._messages: list[dict] = []  # the current chain's conversation (for reward functions)
        self.calls: list[dict] = []  # every answered request: the ids it sampled on, its answer, where it went
        self.answered: list[tuple[int, int]] = []  # every answer, empty ones too: (its chain, last sampled token)
        self.replay: Replay | None = None
        self.replayed, self.diverged = 0, False
        self.branch_chain: int | None = None  # a branch: the chain that holds its branch call
        self._lock: asyncio.Lock | None = None

    @property
    def row(self) -> Trajectory | None:
        """The run's row: its last chain, or a branch's chain of the branch call (None: the agent made no request)."""
        if self.branch_chain is not None:
            return self.chains[self.branch_chain]
        return self.chains[-1] if self.chains else None

    def chain_rows(self) -> list[Trajectory]:
        """The run's other rows: each chain besides `row` that holds a sampled answer, in order. A branch's chains
        made only of replayed answers are copies of its parent's chains (the parent's rows already), so not rows."""
        sampled = {call["chain"] for call in self.calls if call["ids"] and not call["replayed"]}
        row = self.row
        return [chain for i, chain in enumerate(self.chains) if i in sampled and chain is not row]

    def completion_messages(self) -> list[dict]:
        """The last chain's conversation after its prompt: assistant, tool/user, ..., assistant (TRL's shape). Only
        answers with tokens in the row are in it, so its assistant messages are the row's turns (`turn_ends`)."""
        return [dict(m) for m in self._messages[self._first :]]

    async def complete(self, request: dict) -> dict:
        """The OpenAI `chat.completion` object answering `request`; the chain records the sampled ids. Requests of one
        run are answered one at a time, in arrival order (an agent's concurrent calls see each other's answers)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._complete(request)

    async def _complete(self, request: dict) -> dict:
        if self.closed:
            raise RuntimeError("this agent run has ended (timed out or the round is over)")
        messages = list(request.get("messages") or [])
        if not messages:
            raise ValueError("`messages` must be a non-empty list")
        tools = request.get("tools") or None
        check_tool_choice(request.get("tool_choice"))
        tools_key = json.dumps(tools, sort_keys=True)
        norm = [normalise(m) for m in messages]
        chain = self.chains[-1] if self.chains else None
        extends = (chain is not None and tools_key == self._tools_key and len(norm) > len(self._history)
                   and norm[: len(self._history)] == self._history)  # fmt: skip
        if extends:
            new = messages[len(self._history) :]
            if self._full:  # the row's budget is spent (a turn's own max_tokens only ends that turn)
                self._history = list(norm)
                return self._answer([], "length", request, chain)
            delta = await _ids(self.renderer.delta_ids, new, tools)
            end = self.renderer.turn_end_ids
            if chain.completion_ids and chain.completion_ids[-len(end) :] != end:
                delta = list(end) + delta  # the turn was cut (length): closed as the template closes it
            self._check_length(len(chain.prompt_ids) + len(chain.completion_ids) + len(delta))
            self._history = list(norm)
            if len(delta) > self._budget(chain):  # the new messages do not fit: the row ends here
                chain.finish_reason, self._full = "length", True
                return self._answer([], "length", request, chain)
            chain.append(delta, 0)
            self._messages.extend(dict(m) for m in new)
        else:
            prompt = await _ids(self.renderer.prompt_ids, messages, tools)
            self._check_length(len(prompt))
            chain = Trajectory(prompt_ids=prompt, group=self.group,
                               entropies=[] if self.params.logprobs else None)  # fmt: skip
            chain.origin, chain.chain = (Origin.ROOT if not self.chains else Origin.RESTART), len(self.chains)
            self.chains.append(chain)
            self._full = False
            self._tools_key, self._first, self._messages = tools_key, len(messages), [dict(m) for m in messages]
            self._history = list(norm)
        return await self._generate(chain, request)

    def _check_length(self, n: int) -> None:
        """A prompt of `n` tokens leaves room to sample within `max_model_len`, or the request is refused (400)."""
        if n >= self.max_model_len:
            raise RequestTooLong(
                f"this request is {n} tokens long (the conversation as the chat template renders it); the model's "
                f"max_model_len is {self.max_model_len} (prompt and answer together): shorten the conversation"
            )

    def _budget(self, chain: Trajectory) -> int:
        c = len(chain.completion_ids)
        return min(self.params.max_tokens - c, self.max_model_len - len(chain.prompt_ids) - c)

    def _recorded(self, k: int, prompt: list[int]) -> dict | None:
        """The parent's call k when this (replayed) request asks exactly what it asked; a mismatch ends the replay."""
        replay = self.replay
        if replay is None or k > replay.branch_call:
            return None
        if replay.calls[k]["prompt"] != prompt:
            self.replay, self.diverged = None, True
            return None
        self.replayed += 1
        return replay.calls[k]

    async def _generate(self, chain: Trajectory, request: dict) -> dict:
        room = self._budget(chain)
        if room < 1:
            chain.finish_reason, self._full = "length", True
            return self._answer([], "length", request, chain)
        asked = request.get("max_completion_tokens") or request.get("max_tokens")
        full, k = chain.prompt_ids + chain.completion_ids, self.requests
        rec = self._recorded(k, full)
        if rec is not None and k < self.replay.branch_call:  # before the branch call: the recorded answer
            self.requests += 1
            seg = Segment(list(rec["ids"]), list(rec["logprobs"]), None, rec["finish"], version_runs=list(rec["runs"]))
            return self._record(chain, full, seg, request, rec["entropies"], replayed=True)
        cut = self.replay.cut if rec is not None else 0
        prefix, prefix_lps = (rec["ids"][:cut], rec["logprobs"][:cut]) if rec is not None else ([], [])
        prefix_runs = first_runs(rec["runs"], cut) if rec is not None else []
        prefix_ents = rec["entropies"][:cut] if rec is not None and rec["entropies"] is not None else None
        if rec is not None:  # the branch call: the parent's tokens up to the branch point, then a fresh continuation
            self.replay, self.branch_chain = None, len(self.chains) - 1
            room, asked = room - len(prefix), (int(asked) - len(prefix) if asked else None)
            if room < 1 or (asked is not None and asked < 1):
                self.requests += 1
                seg = Segment(list(prefix), list(prefix_lps), None, "length", version_runs=prefix_runs)
                return self._record(chain, full, seg, request, prefix_ents)
        stop = request.get("stop") or []
        params = SamplingParams(
            max_tokens=max(min(room, int(asked)) if asked else room, 1), temperature=self.params.temperature,
            top_p=self.params.top_p, top_k=self.params.top_k, seed=_seed(self.seed, self.requests),
            logprobs=self.params.logprobs,
            stop=[stop] if isinstance(stop, str) else list(stop), session_id=self.params.session_id,
        )  # fmt: skip
        self.requests += 1
        start = time.perf_counter()
        seg = await self._sample(full + list(prefix), params)
        chain.generation_s += time.perf_counter() - start
        if len(seg.token_ids) > params.max_tokens:
            raise RuntimeError(f"backend returned {len(seg.token_ids)} tokens for max_tokens={params.max_tokens}")
        ents = [topk_entropy(t) for t in seg.top_logprobs] if seg.top_logprobs is not None else None
        if prefix:
            if ents is not None:
                ents = (prefix_ents or [math.nan] * len(prefix)) + ents
            runs = list(prefix_runs)
            for version, n in seg.version_runs:
                add_version_run(runs, version, n)
            seg = Segment(list(prefix) + list(seg.token_ids), list(prefix_lps) + list(seg.logprobs), None,
                          seg.finish_reason, version_runs=runs if seg.version_runs else [])  # fmt: skip
        return self._record(chain, full, seg, request, ents)

    def _record(self, chain: Trajectory, prompt: list[int], seg: Segment, request: dict,
                entropies: list[float] | None = None, replayed: bool = False) -> dict:  # fmt: skip
        """Note the answered call (for replays) and append its ids to the chain (mask 1, their logprobs and, from a
        streamed sampler, their policy versions)."""
        if chain.entropies is not None and entropies is None:
            entropies = [math.nan] * len(seg.token_ids)
        self.calls.append({"prompt": prompt, "ids": list(seg.token_ids), "logprobs": list(seg.logprobs),
                           "entropies": entropies, "finish": seg.finish_reason, "chain": len(self.chains) - 1,
                           "start": len(chain.completion_ids), "replayed": replayed,
                           "runs": list(seg.version_runs)})  # fmt: skip
        versions = [v for v, n in seg.version_runs for _ in range(n)] if seg.version_runs else None
        chain.append(list(seg.token_ids), 1, list(seg.logprobs), entropies if chain.entropies is not None else None,
                     versions=versions)  # fmt: skip
        chain.finish_reason = seg.finish_reason
        self._full = self._budget(chain) < 1
        return self._answer(list(seg.token_ids), seg.finish_reason, request, chain, seg.logprobs)

    def branch_call(self, position: int, resample: bool = True) -> Replay:
        """How a branch of this run at `position` of its row (`row`, one chain) replays it: the call whose answer holds
        `position`, and how many of that answer's tokens the branch keeps (`resample`: the token at `position` is
        sampled anew). The calls before it, in this chain and in earlier chains, are answered as recorded."""
        at = next((i for i, chain in enumerate(self.chains) if chain is self.row), None)
        for k, call in enumerate(self.calls):
            if call["chain"] == at and call["start"] <= position < call["start"] + len(call["ids"]):
                return Replay(self.calls, k, position - call["start"] + (0 if resample else 1))
        raise ValueError(f"position {position} is not in a sampled answer of this run's row")

    def _answer(self, ids: list[int], reason: str, request: dict, chain: Trajectory,
                logprobs: list[float] | None = None) -> dict:  # fmt: skip
        mask = chain.loss_mask  # an empty answer (budget spent): the chain's last sampled token before it
        self.answered.append((chain.chain, next((t for t in range(len(mask) - 1, -1, -1) if mask[t]), -1)))
        tok, fmt = self.renderer.tokenizer, self.renderer.tool_format
        text = tok.decode(ids, skip_special_tokens=True)
        calls = []
        if fmt is not None and ids and request.get("tool_choice") != "none":
            raw = tok.decode(ids, skip_special_tokens=False)
            if fmt.has_calls(raw):
                calls = [c for c in fmt.parse_calls(raw) if c.error is None]
                cut = text.find(fmt.open)
                text = (text[:cut] if cut >= 0 else text).rstrip() if calls else text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [
                {"id": _call_id(self.requests, j, ids), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for j, c in enumerate(calls)
            ]  # fmt: skip
            chain.num_calls += len(calls)
        finish = "tool_calls" if calls else ("length" if reason == "length" else "stop")
        self._history.append(normalise(message))
        if ids:  # an empty answer (the budget spent) holds no token of the row: no turn of it (`group_tree.turn_ends`)
            self._messages.append(message)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if request.get("logprobs") and logprobs is not None:
            choice["logprobs"] = {"content": [
                {"token": tok.decode([i]), "logprob": (lp if math.isfinite(lp) else -9999.0), "bytes": None,
                 "top_logprobs": []}
                for i, lp in zip(ids, logprobs)
            ]}  # fmt: skip
        prompt_tokens = len(chain.prompt_ids) + len(chain.completion_ids) - len(ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": request.get("model") or "policy", "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                      "total_tokens": prompt_tokens + len(ids)},
        }  # fmt: skip


class RequestTooLong(ValueError):
    """A request whose prompt leaves no room to sample within the model's `max_model_len` (nothing is recorded)."""


def check_tool_choice(choice: Any) -> None:
    """`tool_choice` is `auto`, `none` (the answer is text: no calls are parsed), `required` or a named function
    (both sampled unconstrained: the policy's own choice is what trains; the endpoint warns once); else an error."""
    named = (
        isinstance(choice, dict) and choice.get("type") == "function" and (choice.get("function") or {}).get("name")
    )
    if choice is not None and choice not in ("auto", "none", "required") and not named:
        raise ValueError(f"tool_choice={choice!r}; choose 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip


@dataclasses.dataclass
class Replay:
    """A branch's replay of its parent's run: `calls` (the parent's `AgentSession.calls`) are answered as recorded
    before `branch_call`; that call answers the first `cut` tokens of its recorded answer, then samples."""

    calls: list[dict]
    branch_call: int
    cut: int


async def _ids(render: Callable[[list[dict], list | None], list[int]], messages: list[dict],
               tools: list | None) -> list[int]:  # fmt: skip
    """`render(messages, tools)`: inline for short messages (a thread hop costs more than they do), on a worker thread
    once their text is over `OFF_LOOP_CHARS`, so the event loop keeps answering the other runs meanwhile."""
    size = sum(len(_text(m.get("content"))) + sum(len(str((c.get("function") or {}).get("arguments") or ""))
                                                  for c in m.get("tool_calls") or ()) for m in messages)  # fmt: skip
    if size <= OFF_LOOP_CHARS:
        return render(messages, tools)
    return await asyncio.to_thread(render, messages, tools)


def _call_id(k: int, j: int, ids: list[int]) -> str:
    """A tool call's id from the request count, its index and the answer's ids: a replayed answer gets the recorded
    ids, so an agent that writes call ids into its history asks a replay exactly what it asked its parent."""
    return "call_" + hashlib.blake2b(repr((k, j, tuple(ids))).encode(), digest_size=6).hexdigest()


def _seed(base: int, k: int) -> int:
    return hash((base, k)) % (2**31)


def first_runs(runs: list[tuple[int, int]], k: int) -> list[tuple[int, int]]:
    """The version runs of the first `k` tokens of a completion whose runs are `runs` (empty when none recorded)."""
    out: list[tuple[int, int]] = []
    for version, n in runs:
        add_version_run(out, version, min(n, k - sum(m for _, m in out)))
    return out


__all__ = ["AgentSession", "ChatRenderer", "Replay", "RequestTooLong", "normalise", "template_message"]
