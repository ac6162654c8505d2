"""`search_corpus`: the checks before `appo train` starts a search server for the run, and the tool config it gets.

`search_tool_config(script_args, training_args, url)` returns the run's `tool_config` with `search.url` pointed at
the started server. Before anything starts, `check_search_corpus` fails with one line when the setting cannot be
honoured: the corpus is not a file, the run has no `search` tool, the search backend is not `local`, or the recipe
also names a `search.url` (two servers for one tool: say which).
"""

from __future__ import annotations

import os
from typing import Any

from appo_trl.configs.errors import PreflightError
from appo_trl.configs.plan import parse_tool_config


def check_search_corpus(script_args, training_args) -> str | None:
    """The corpus path to serve, or None when `search_corpus` is unset; raises `PreflightError` (one line)."""
    corpus = getattr(script_args, "search_corpus", None)
    if not corpus:
        return None
    if not os.path.isfile(corpus):
        raise PreflightError(f"search_corpus {corpus!r} is not a file (a JSONL corpus: one {{'contents'}} or "
                             "{'title', 'text'} per line; the demo's: `appo demo --sft_only`)")  # fmt: skip
    if "search" not in (getattr(training_args, "tools", None) or []):
        raise PreflightError(f"search_corpus {corpus!r} is set but the run has no `search` tool; add `search` to "
                             "`tools` or leave search_corpus out")  # fmt: skip
    search = parse_tool_config(training_args.tool_config).get("search") or {}
    if search.get("backend", "local") != "local":
        raise PreflightError(f"search_corpus starts a local server, but tool_config.search.backend is "
                             f"{search['backend']!r}; set backend: local or leave search_corpus out")  # fmt: skip
    if search.get("url"):
        raise PreflightError(f"search_corpus starts a server for the run, and tool_config.search.url names another "
                             f"({search['url']}); leave one of them out")  # fmt: skip
    return corpus


def search_tool_config(training_args, url: str) -> dict[str, Any]:
    """`tool_config` with `search.url` set to the run's server."""
    config = parse_tool_config(training_args.tool_config)
    config["search"] = {**(config.get("search") or {}), "url": url}
    return config
