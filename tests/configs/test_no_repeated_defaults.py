"""`configs/` reads APPOConfig's settings from the config, never `getattr(args, field, <APPOConfig's default>)`:
such a copy of a default drifts silently when the config's default changes (issue 46)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "appo_trl" / "configs"
# (file, field): where the object is not always an APPOConfig, so the field may be absent
ALLOWED = {
    ("plan.py", "tool_config"): "APPOTrainer(args=GRPOConfig(...)) and `appo eval`'s namespace have no tool fields",
    ("plan.py", "tool_format"): "as tool_config",
    ("preflight.py", "use_cpu"): "check_launch_engine asks every parsed dataclass of a recipe, not the config only",
}


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def repeated_defaults(source: str, defaults: dict) -> list[tuple[int, str]]:
    """(line, field) of each `getattr(x, "field", d)` in `source` where `d` is the literal default of `field`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and len(node.args) == 3):
            continue
        field = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
        if field not in defaults:
            continue
        try:
            value = ast.literal_eval(node.args[2])
        except ValueError:
            continue
        if value == defaults[field]:
            out.append((node.lineno, field))
    return out


def test_configs_never_repeat_a_default_of_appo_config():
    from appo_trl.config import APPOConfig

    defaults = {f.name: _default(f) for f in dataclasses.fields(APPOConfig)}
    problems = [
        f"appo_trl/configs/{path.name}:{line}: getattr(..., {field!r}, {defaults[field]!r}) repeats APPOConfig's "
        f"default; read `args.{field}`"
        for path in sorted(CONFIGS.glob("*.py"))
        for line, field in repeated_defaults(path.read_text(), defaults)
        if (path.name, field) not in ALLOWED
    ]
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_repeated_default():
    defaults = {"vllm_sync_adapter": "auto", "agent": None}
    src = 'a = getattr(args, "vllm_sync_adapter", "auto")\nb = getattr(args, "agent", 1)\nc = args.agent\n'
    assert repeated_defaults(src, defaults) == [(1, "vllm_sync_adapter")]
