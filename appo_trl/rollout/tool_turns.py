"""The tool step of the rollout loop: a trajectory stopped on a call gets its results as tokens (mask 0).

`ToolTurns` is the part of `RolloutEngine` (`appo_trl.rollout.engine`, a mixin) that runs calls: ARPO's tags
(`_call_tool`: one call, its result spliced into `result_template`) and the chat template (`_chat_turn`: every
call of the closed assistant turn, standalone tools concurrently, environment methods one at a time in call
order, one tool turn of results), the call and turn limits, and the per-tool metrics. It uses the engine's
tokenizer, config, executor, chat format, environments, metrics and `_budget`.

What it does not do: sample, fork or branch (`appo_trl.rollout.engine`).
"""

from __future__ import annotations

import asyncio

from appo_trl.rollout.text import extract_call, neutralise_result, neutralise_special_strings, plain_text
from appo_trl.rollout.types import ToolCallRecord, Trajectory
from appo_trl.tools.base import ToolResult
from appo_trl.tools.callables import trl_error_text


class ToolTurns:
    """Runs the tool calls a trajectory stopped on and appends their results (see the module head)."""

    def _result_ids(self, text: str) -> list[int]:
        """Token ids of the result block (tag format): no BOS, special-token strings in `text` stay plain text."""

        def enc(s: str) -> list[int]:
            return self.tokenizer(plain_text(s), add_special_tokens=False, split_special_tokens=True)["input_ids"] \
                if s else []  # fmt: skip

        ids = enc(self._tmpl_pre + text + self._tmpl_post)
        if self._special_ids.intersection(ids):  # a tokenizer that ignores split_special_tokens
            text = neutralise_special_strings(text, self.tokenizer)
            ids = enc(self._tmpl_pre + text + self._tmpl_post)
        limit = self.config.max_result_tokens
        if len(ids) > limit:
            pre, post = enc(self._tmpl_pre), enc(self._tmpl_post)
            ids = pre + enc(text)[: max(limit - len(pre) - len(post), 0)] + post
        return ids

    def _turn_text(self, traj: Trajectory) -> str:
        """Decoded completion since the end of the last tool result (where the current call must be)."""
        start = traj.tool_calls[-1].end if traj.tool_calls else 0
        return self.tokenizer.decode(traj.completion_ids[start:], skip_special_tokens=False)

    async def _call_tool(self, traj: Trajectory, tag: str) -> bool:
        """Handle a tool stop tag (chat: a closed turn with calls) at the end of `traj`; False when it finished."""
        if self.chat is not None:
            return await self._chat_turn(traj)
        if self._over_limit(traj, 1):
            traj.append([self.eos_id], 0)
            return False
        query = extract_call(self._turn_text(traj), tag)
        if not query:
            traj.finish_reason = "empty_call"
            self._m["empty_calls"] += 1
            return False
        result = await self.executor.execute(tag, query)
        result.text = neutralise_result(result.text, getattr(self.executor, "tools", ()), self.tokenizer)
        ids = self._result_ids(result.text)
        room = self._budget(traj)
        start = len(traj.completion_ids)
        traj.append(ids[: max(room, 0)], 0)
        traj.num_calls += 1
        traj.tool_calls.append(ToolCallRecord(tag, query, result.text, bool(result.ok), float(result.latency_s),
                                              start, len(traj.completion_ids)))  # fmt: skip
        self._count_call(tag, result)
        if len(ids) >= room:
            traj.finish_reason = "length"
            self._m["length_hits"] += 1
            return False
        return True

    def _over_limit(self, traj: Trajectory, calls: int) -> bool:
        """True (and `traj` finished `call_limit`) when one more turn of `calls` calls would pass `call_limit` or
        `turn_limit` (None: no limit). The turns done are the distinct ends of the records: a turn's calls share
        one."""
        limit, turns = self.config.call_limit, self.config.turn_limit
        over = (limit is not None and traj.num_calls + calls > limit) or (
            turns is not None and len({c.end for c in traj.tool_calls}) >= turns
        )
        if over:
            traj.finish_reason = "call_limit"
            self._m["call_limit_hits"] += 1
        return over

    def _count_call(self, tag: str, result: ToolResult) -> None:
        stats = self._tool_m[tag]
        stats["calls"] += 1
        stats["failures"] += not result.ok
        stats["time_s"] += result.latency_s
        self._m["tool_calls"] += 1
        self._m["tool_failures"] += not result.ok
        self._m["tool_time_s"] += result.latency_s

    async def _chat_turn(self, traj: Trajectory) -> bool:
        """Run every call of the closed assistant turn ending `traj` and append its tool turn; False when finished.

        The calls run concurrently (those to the trajectory's environment one at a time, in call order:
        `_run_calls`) and their results are appended in call order. Each record spans its own
        template part and result; the calls of one turn share `end`, the end of the tool turn (sampling resumes
        there). A turn that would take the calls past `call_limit`, or the turns past `turn_limit`, runs none: the
        trajectory ends `call_limit`.
        """
        turn = self._turn_text(traj)
        calls = self.chat.parse_calls(turn)
        if self._over_limit(traj, len(calls)):
            return False
        results = await self._run_calls(traj, calls)
        tools = getattr(self.executor, "tools", ())
        for r in results:
            r.text = neutralise_result(r.text, tools, self.tokenizer)
        closed = turn.rstrip().endswith(self.chat.turn_end)  # else another EOS ended it: the template's end is added
        pieces = self.chat.tool_turn_ids([c.name for c in calls], [r.text for r in results],
                                         self.config.max_result_tokens, closed)  # fmt: skip
        ids = [i for piece in pieces for i in piece]
        room = self._budget(traj)
        start = len(traj.completion_ids)
        traj.append(ids[: max(room, 0)], 0)
        end = len(traj.completion_ids)
        for call, result, piece in zip(calls, results, pieces):
            query = call.arguments if call.error is None and result.error != "bad_call" else call.raw
            traj.tool_calls.append(ToolCallRecord(call.name, query, result.text, bool(result.ok),
                                                  float(result.latency_s), min(start, end), end))  # fmt: skip
            start += len(piece)
            self._count_call(call.name, result)
        traj.num_calls += len(calls)
        if len(ids) >= room:
            traj.finish_reason = "length"
            self._m["length_hits"] += 1
            return False
        return True

    async def _run_calls(self, traj: Trajectory, calls: list) -> list[ToolResult]:
        """Run the parsed calls of one turn; results in call order.

        Standalone tools run concurrently (as TRL's async tools). Calls to the trajectory's environment run one at
        a time in call order, since they may mutate its state (TRL runs sync tools that way), and each is noted
        with its record index (`len(traj.tool_calls)` + its position in the turn: the records are appended after
        all calls ran), which also snapshots the instance after that call for branches.
        """
        results: list[ToolResult | None] = [None] * len(calls)
        env = self.environments_now()
        env_tools = [env.tool(traj, c.name) if env is not None and c.error is None else None for c in calls]
        base = len(traj.tool_calls)

        async def environment_calls() -> None:
            for i, (call, tool) in enumerate(zip(calls, env_tools)):
                if tool is not None:
                    results[i] = await self.executor.execute(call.name, call.arguments, tool=tool)
                    env.record(traj, base + i, call.name, call.arguments, results[i].text)

        async def standalone(i: int, call) -> None:
            results[i] = await self._chat_call(call)

        await asyncio.gather(
            environment_calls(), *(standalone(i, c) for i, c in enumerate(calls) if env_tools[i] is None)
        )
        return results

    async def _chat_call(self, call) -> ToolResult:
        """Run one parsed chat-format call to a standalone tool; a bad call or an unknown tool becomes TRL's error text."""
        if call.error is None and call.name not in self.executor.tools:
            call.error = f"Tool {call.name} not found."  # TRL's message
        if call.error is not None:
            return ToolResult(trl_error_text(call.error), ok=False, error="bad_call")
        return await self.executor.execute(call.name, call.arguments)
