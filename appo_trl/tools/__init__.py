"""Floor 1: the agent's tools (python sandbox, search) and their executor. Imports nothing else from `appo_trl`."""

from appo_trl.tools.base import Tool, ToolResult
from appo_trl.tools.executor import ToolExecutor
from appo_trl.tools.python_sandbox import PythonSandbox, PythonTool, PythonToolConfig
from appo_trl.tools.registry import TOOL_REGISTRY, build_tools, make_config
from appo_trl.tools.search import SEARCH_BACKENDS, SearchTool, SearchToolConfig, format_results
from appo_trl.tools.search_cache import JsonReplayCache, SearchCache, normalize_query

__all__ = [
    "SEARCH_BACKENDS",
    "TOOL_REGISTRY",
    "JsonReplayCache",
    "PythonSandbox",
    "PythonTool",
    "PythonToolConfig",
    "SearchCache",
    "SearchTool",
    "SearchToolConfig",
    "Tool",
    "ToolExecutor",
    "ToolResult",
    "build_tools",
    "format_results",
    "make_config",
    "normalize_query",
]
