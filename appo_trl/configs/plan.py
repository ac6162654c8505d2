"""The start-up plan: what a run resolves once, before the model loads, and then hands on explicitly.

`StartupPlan.resolve` checks that the reward functions find their gold-answer column, resolves the tool specs
(built-in names, functions, dotted paths looked up in the tool directories: the recipe's folder, then the
working directory), parses `tool_config` and builds the tools, each exactly once. `appo train` resolves it in
preflight (`appo_trl.configs.preflight.plan_startup`) and passes it to `APPOTrainer(tools=plan)`; an
`APPOTrainer` given TRL's `tools=` list (or nothing) resolves its own in `__init__`. The first rollout engine
takes the built tools (`take_tools`); an engine built after that one closed gets fresh ones.

What this does not do: run each tool's own `check()` (a preflight check) or load the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from appo_trl.configs.errors import PreflightError

# built-in rewards that do not compare against a gold answer
GOLD_FREE_REWARDS = frozenset({"format"})
GOLD_COLUMNS = ("answer", "ground_truth", "solution")


def check_reward_columns(reward_names, dataset, answer_column: str = "answer") -> None:
    """Every built-in reward (by name or function) that scores against gold answers finds one of `GOLD_COLUMNS`
    in `dataset`; custom rewards are not checked (their needs are unknown)."""
    from appo_trl.rewards import REWARD_FUNCS

    if dataset is None or not hasattr(dataset, "column_names"):
        return  # e.g. an IterableDataset without known columns: nothing to check
    columns = list(dataset.column_names or [])
    if any(c in columns for c in GOLD_COLUMNS):
        return
    by_func = {id(fn): name for name, fn in REWARD_FUNCS.items()}
    names = [n if isinstance(n, str) else by_func.get(id(n)) for n in reward_names]
    needing = [n for n in names if n in REWARD_FUNCS and n not in GOLD_FREE_REWARDS]
    if needing:
        raise PreflightError(
            f"reward {needing[0]!r} needs gold answers, but the dataset has no answer column {answer_column!r} "
            f"(columns: {columns}); set answer_column to the column holding the answers, or use a reward that "
            f"needs none ({', '.join(sorted(GOLD_FREE_REWARDS))})."
        )


def parse_tool_config(raw) -> dict[str, Any]:
    """`tool_config` as a mapping keyed by tool name: a YAML mapping, a JSON string, or None (empty)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise PreflightError(f"tool_config is not valid JSON: {exc}") from exc
    if raw is not None and not isinstance(raw, dict):
        raise PreflightError(f"tool_config must be a mapping keyed by tool name, got {type(raw).__name__}.")
    return dict(raw or {})


@dataclasses.dataclass
class StartupPlan:
    """The tools of a run, resolved and built once (see the module head).

    Attributes:
        tool_specs: built-in names (kept as strings) and resolved callables, in the configured order.
        tool_format: `tags` (ARPO) or `chat` (the chat template), `tool_format` or the default for the specs.
        tool_dirs: folders searched first for dotted tool paths, before the working directory.
        tool_config: the parsed `tool_config` (per-tool parameters).
        tools: the built tools (name -> tool), None when there are none or an engine has taken them.
        environment_timeouts: `tool_config` deadlines (seconds) of names that are not standalone tools: with
            `environment_factory`, environment methods (checked against them once the environments exist).
    """

    tool_specs: list = dataclasses.field(default_factory=list)
    tool_format: str = "tags"
    tool_dirs: tuple[str, ...] = ()
    tool_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    tools: dict[str, Any] | None = None
    environment_timeouts: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def resolve(cls, args, tools=None, tool_dirs: Sequence[str | os.PathLike] = (), *, reward_funcs=(),
                dataset=None, answer_column: str = "answer", environments: bool = False) -> StartupPlan:  # fmt: skip
        """Check the reward columns, then resolve and build the tools of `tools` (TRL's `tools=`) or `args.tools`.

        Raises a `ValueError` naming the problem: tools given both ways, an unknown or unimportable tool, a bad
        `tool_config`, a `tool_config` without tools, a gold-answer reward without an answer column. With
        `environments` (an `environment_factory`), `tool_config` entries that name no standalone tool are
        environment methods' deadlines (`{method: {timeout: s}}`, `environment_timeouts`).
        """
        from appo_trl.tools.callables import resolve_callables
        from appo_trl.tools.registry import build_tools, default_tool_format

        check_reward_columns(reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs], dataset,
                             answer_column)  # fmt: skip
        if tools is not None and not isinstance(tools, (list, tuple)):
            tools = [tools]
        if tools and getattr(args, "tools", None):
            raise ValueError(
                "APPOTrainer: pass tools either as APPOTrainer(tools=...) or APPOConfig(tools=...), not both."
            )
        specs = list(tools or getattr(args, "tools", None) or [])
        dirs = tuple(str(d) for d in tool_dirs if d)
        tool_format = getattr(args, "tool_format", None) or default_tool_format(specs)
        raw_config = getattr(args, "tool_config", None)
        plan = cls(resolve_callables(specs, dirs), tool_format, dirs, parse_tool_config(raw_config))
        if environments:
            from appo_trl.tools.registry import function_timeout

            named = {s if isinstance(s, str) else getattr(s, "__name__", "") for s in plan.tool_specs}
            rest = {k: v for k, v in plan.tool_config.items() if k not in named}
            plan.tool_config = {k: v for k, v in plan.tool_config.items() if k in named}
            plan.environment_timeouts = {k: t for k, v in rest.items() if (t := function_timeout(k, v)) is not None}
        if plan.tool_specs:
            plan.tools = build_tools(plan.tool_specs, plan.tool_config, tool_format, dirs)
        elif raw_config and not environments:
            raise ValueError(f"APPOConfig: tool_config is set ({raw_config}) but no tools are configured.")
        return plan

    def build_tools(self) -> dict[str, Any]:
        """A fresh set of the planned tools (an empty mapping when there are none)."""
        from appo_trl.tools.registry import build_tools

        if not self.tool_specs:
            return {}
        return build_tools(self.tool_specs, self.tool_config, self.tool_format, self.tool_dirs)

    def take_tools(self) -> dict[str, Any]:
        """The built tools for the first rollout engine; each later call builds a fresh set (`build_tools`)."""
        tools, self.tools = self.tools, None
        return tools if tools is not None else self.build_tools()

    def close(self) -> None:
        """Close the built tools no engine has taken (their sandboxes, search sessions)."""
        tools, self.tools = self.tools or {}, None
        for tool in tools.values():
            aclose = getattr(tool, "aclose", None)
            if aclose is not None:
                asyncio.run(aclose())
