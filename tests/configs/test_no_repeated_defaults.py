"""The package reads APPOConfig's settings from the config, never `getattr(args, field, <APPOConfig's default>)`:
such a copy of a default drifts silently when the config's default changes (issue 46). Every module of
`appo_trl/` is scanned; `config/` itself (which declares the defaults) included."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "appo_trl"
# (path under appo_trl/, field): where the object is not always an APPOConfig, so the field may be absent
ALLOWED = {
    ("configs/plan.py", "tool_config"): "APPOTrainer(args=GRPOConfig(...)) and `appo eval`'s namespace have no tools",
    ("configs/plan.py", "tool_format"): "as tool_config",
    ("configs/preflight.py", "use_cpu"): "check_launch_engine asks every parsed dataclass of a recipe, not the config",
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


def test_the_package_never_repeats_a_default_of_appo_config():
    from appo_trl.config import APPOConfig

    defaults = {f.name: _default(f) for f in dataclasses.fields(APPOConfig)}
    paths = sorted(PACKAGE.rglob("*.py"))
    assert len(paths) > 100 and any(p.parent.name == "stages" for p in paths)  # the whole package, not one folder
    problems = [
        f"appo_trl/{rel}:{line}: getattr(..., {field!r}, {defaults[field]!r}) repeats APPOConfig's default; "
        f"read `args.{field}`"
        for path in paths
        for rel in [path.relative_to(PACKAGE).as_posix()]
        for line, field in repeated_defaults(path.read_text(), defaults)
        if (rel, field) not in ALLOWED
    ]
    assert not problems, "\n".join(problems)


def test_every_allowed_exception_still_exists():
    """An ALLOWED entry whose getattr has gone is removed, so the list never excuses a future copy."""
    from appo_trl.config import APPOConfig

    defaults = {f.name: _default(f) for f in dataclasses.fields(APPOConfig)}
    files = {rel for rel, _ in ALLOWED}
    found = {(rel, field) for rel in files for _, field in repeated_defaults((PACKAGE / rel).read_text(), defaults)}
    assert set(ALLOWED) <= found, sorted(set(ALLOWED) - found)


def test_the_check_catches_a_repeated_default():
    defaults = {"vllm_sync_adapter": "auto", "agent": None}
    src = 'a = getattr(args, "vllm_sync_adapter", "auto")\nb = getattr(args, "agent", 1)\nc = args.agent\n'
    assert repeated_defaults(src, defaults) == [(1, "vllm_sync_adapter")]
