"""Python functions as tools (TRL's `tools=`): schemas, checks at construction, dotted paths, run-time errors."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from appo_trl.configs.recipes import parse_recipe
from appo_trl.tools.callables import FunctionTool, ToolSpecError, resolve_callables
from appo_trl.tools.registry import build_tools, default_tool_format


def add(a: int, b: int = 1) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


def test_schema_is_transformers_get_json_schema():
    from transformers.utils import get_json_schema

    tool = FunctionTool(add)
    assert tool.name == tool.tag == "add" and tool.schema == get_json_schema(add)
    assert tool.schema["function"]["parameters"]["required"] == ["a"]


def test_sync_tools_run_off_the_event_loop_and_errors_are_trl_text():
    seen = []

    def where(x: str) -> str:
        """Report the thread.

        Args:
            x: echoed.
        """
        seen.append(threading.current_thread() is threading.main_thread())
        return x

    async def go():
        ok = await FunctionTool(where).call(json.dumps({"x": "hi"}))
        bad_json = await FunctionTool(add).call("{a: 1")
        bad_args = await FunctionTool(add).call(json.dumps({"c": 1}))
        return ok, bad_json, bad_args

    ok, bad_json, bad_args = asyncio.run(go())
    assert (ok.text, ok.ok, seen) == ("hi", True, [False])
    assert not bad_json.ok and bad_json.text.startswith("{'error': 'arguments are not valid JSON")
    assert not bad_args.ok and bad_args.text == str({"error": "add() got an unexpected keyword argument 'c'"})


def test_dotted_paths_resolve_from_the_given_folder_then_the_cwd(tmp_path, monkeypatch):
    recipe_dir, cwd = tmp_path / "recipe", tmp_path / "cwd"
    recipe_dir.mkdir(), cwd.mkdir()
    body = 'def {n}(q: str) -> str:\n    """Look up.\n\n    Args:\n        q: the query.\n    """\n    return q\n'
    (recipe_dir / "mytools.py").write_text(body.format(n="near"))
    (cwd / "othertools.py").write_text(body.format(n="far"))
    monkeypatch.chdir(cwd)
    near, far = resolve_callables(["mytools.near", "othertools:far"], [str(recipe_dir)])
    assert (near.__name__, far.__name__) == ("near", "far")
    with pytest.raises(ToolSpecError, match="cannot import module 'mytools'"):
        resolve_callables(["mytools.near"])  # not in the cwd
    with pytest.raises(ToolSpecError, match="has no attribute 'nea'. Did you mean 'near'"):
        resolve_callables(["mytools.nea"], [str(recipe_dir)])


def test_recipe_folder_is_where_tools_resolve(tmp_path, monkeypatch):
    from appo_trl.stages.train import dataclass_types

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "x.yaml").write_text("tools: [tools.calculator]\noutput_dir: o\nuse_cpu: true\nbf16: false\n")
    parsed = parse_recipe(dataclass_types(), ["--config", str(tmp_path / "r" / "x.yaml")])
    assert parsed.folder == str((tmp_path / "r").resolve())
    assert parse_recipe(dataclass_types(), ["--output_dir", "o", "--use_cpu", "true"]).folder is None


def test_formats_and_builtin_wrappers():
    assert default_tool_format(["python"]) == "tags" and default_tool_format(["python", add]) == "chat"
    tools = build_tools(["python", add], tool_format="chat")
    assert set(tools) == {"python", "add"}
    assert tools["python"].schema["function"]["parameters"]["required"] == ["code"]
    with pytest.raises(ToolSpecError, match="need tool_format=chat"):
        build_tools([add], tool_format="tags")


def test_preflight_builds_chat_recipe_tools_from_the_recipe_folder(tmp_path, monkeypatch):
    """`appo train` checks tools before the model loads: a chat recipe's dotted tool must pass that check."""
    from appo_trl.configs import preflight
    from appo_trl.configs.recipes import REPO_ROOT
    from appo_trl.stages.train import dataclass_types

    monkeypatch.chdir(tmp_path)  # not the repository: `tools.calculator` must come from the recipe's folder
    recipe = str(REPO_ROOT / "recipes" / "tiny" / "appo_chat.yaml")
    parsed = parse_recipe(dataclass_types(), ["--config", recipe, "--output_dir", str(tmp_path / "o")])
    _, training_args, _ = parsed
    preflight.check_tools(training_args, [parsed.folder])
    training_args.tools = ["tools.no_such_tool"]
    with pytest.raises(preflight.PreflightError, match="has no attribute 'no_such_tool'"):
        preflight.check_tools(training_args, [parsed.folder])
