"""The package's floors (docs/architecture.md): a module imports only its own subpackage and the floors below.

Every `import` in every module of `appo_trl` counts, also the ones inside functions (the lazy imports that keep
`appo --help` fast are still dependencies). A new subpackage or top-level module must be given a floor here,
and the top level holds only `__init__.py`, `data.py`, `tiny.py`, `sampling.py`, `trl_rules.py` and the subpackages.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "appo_trl"

# unit (a subpackage or a top-level module) -> floor; docs/architecture.md draws the same picture
FLOORS = {
    "tools": 1,
    "tiny": 1,
    "sampling": 1,
    "rollout": 2,
    "vllm": 2,
    "algorithms": 2,
    "tree": 2,
    "rewards": 2,
    "configs": 3,
    "data": 4,
    "reporting": 5,
    "evaluation": 5,
    "strategies": 6,
    "config": 7,
    "trainer": 8,
    "stages": 9,
    "synthetic": 10,
    "cli": 11,
    "trl_rules": 1,
}
TOP_LEVEL_FILES = {"__init__.py", "data.py", "tiny.py", "sampling.py", "trl_rules.py", "py.typed"}


def _unit(module: str) -> str | None:
    """`appo_trl.trainer.loss` -> `trainer`; `appo_trl` itself -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "appo_trl" and len(parts) > 1 else None


def _lazy_targets() -> dict[str, str]:
    """`appo_trl.__init__`'s lazy public names (`APPOTrainer` -> its module), read from its `_LAZY` dict."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every `appo_trl` import in `source`, the module being `module`."""
    out = []
    lazy = _lazy_targets()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "appo_trl"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                pkg = module.split(".")[: -node.level]
                base = ".".join(pkg + ([base] if base else []))
            if base.split(".")[0] != "appo_trl":
                continue
            for alias in node.names:
                if base == "appo_trl":  # `from appo_trl import rewards`, a lazy public name, or `__version__`
                    name = alias.name
                    is_module = (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()
                    out.append((node.lineno, lazy.get(name, f"appo_trl.{name}" if is_module else "appo_trl")))
                else:
                    out.append((node.lineno, base))
    return out


def layer_violations(sources: dict[str, str]) -> list[str]:
    """One line per import that reaches a floor at or above the importer's (outside its own unit).

    `sources` maps a dotted module name (`appo_trl.tools.search`) to its source text.
    """
    problems = []
    for module, source in sorted(sources.items()):
        unit = _unit(module)
        if unit is None:  # appo_trl/__init__.py: lazy names only
            continue
        if unit not in FLOORS:
            problems.append(f"{module}: `{unit}` has no floor in tests/test_layers.py (and docs/architecture.md)")
            continue
        for line, target in imported_modules(source, module):
            other = _unit(target)
            if other is None or other == unit:
                continue
            if other not in FLOORS:
                problems.append(f"{module}:{line} imports {target}, which has no floor")
            elif FLOORS[other] >= FLOORS[unit]:
                problems.append(
                    f"{module}:{line} imports {target}: floor {FLOORS[unit]} ({unit}) may not import "
                    f"floor {FLOORS[other]} ({other})"
                )
    return problems


def _package_sources() -> dict[str, str]:
    sources = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        sources[".".join(parts)] = path.read_text()
    return sources


def test_no_lower_floor_imports_a_higher_one():
    problems = layer_violations(_package_sources())
    assert not problems, "layer violations:\n" + "\n".join(problems)


def test_top_level_holds_only_data_tiny_and_the_subpackages():
    extra = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if p.is_file() and p.name not in TOP_LEVEL_FILES and p.suffix in {".py", ".pyc"}
    )
    assert extra == [], f"modules at the top of appo_trl/: {extra}; give each a subpackage"
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages <= set(FLOORS), f"subpackages without a floor: {sorted(subpackages - set(FLOORS))}"


def test_every_subpackage_docstring_names_its_floor():
    for name, floor in FLOORS.items():
        init = PACKAGE / name / "__init__.py"
        if not init.is_file():
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc.startswith(f"Floor {floor}"), f"appo_trl/{name}/__init__.py docstring must start 'Floor {floor}'"


def test_architecture_page_names_every_subpackage():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [name for name in FLOORS if not re.search(rf"(?<![\w/]){name}(/|\.py)", page)]
    assert not missing, f"docs/architecture.md does not name {missing}"


@pytest.mark.parametrize(
    "module, source, bad",
    [
        ("appo_trl.tools.search", "def f():\n    from appo_trl.trainer import trainer\n", True),
        ("appo_trl.rollout.engine", "import appo_trl.configs.recipes\n", True),
        ("appo_trl.reporting.hub", "from appo_trl import APPOTrainer\n", True),  # a lazy public name
        ("appo_trl.trainer.loss", "from .. import stages\n", True),  # relative
        ("appo_trl.evaluation.runner", "from appo_trl.reporting import console\n", True),  # same floor, sibling
        ("appo_trl.rollout.engine", "from appo_trl.vllm import VLLMServerBackend\n", True),  # same floor, sibling
        ("appo_trl.vllm.server", "from appo_trl.rollout.types import Segment\n", True),
        ("appo_trl.vllm.server", "from appo_trl.sampling import Segment\n", False),  # the contract, floor 1
        ("appo_trl.trainer.loss", "from appo_trl.algorithms import losses\nfrom . import rows\n", False),
        ("appo_trl.cli.demo", "from appo_trl.synthetic import task\n", False),
    ],
)
def test_the_check_catches_a_forbidden_import(module, source, bad):
    assert bool(layer_violations({module: source})) is bad


def import_edges(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the `appo_trl` modules it imports (lazy ones included); `from pkg import mod` names `pkg.mod`."""
    edges: dict[str, set[str]] = {m: set() for m in sources}
    for module, source in sources.items():
        is_package = (PACKAGE.parent / module.replace(".", "/") / "__init__.py").is_file()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # a package's `.` is itself, a module's `.` its package
                    pkg = module.split(".")[: len(module.split(".")) - node.level + is_package]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base for a in node.names]
            else:
                continue
            edges[module] |= {t for t in targets if t in sources and t != module}
    return edges


def import_circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_between_modules():
    """No two modules of appo_trl import each other, directly or through others (lazy imports count)."""
    circles = import_circles(import_edges(_package_sources()))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)
    fake = {
        "appo_trl.configs.a": "from appo_trl.configs import b\n",
        "appo_trl.configs.b": "def f():\n    from . import a\n",
    }
    assert import_circles(import_edges(fake)) == [["appo_trl.configs.a", "appo_trl.configs.b"]]


def test_config_and_strategies_import_in_one_order():
    """`config` imports `strategies` (the strategy validates its part of the config); no strategy module imports
    the config back, not even lazily (the strategy's checks run from `APPOConfig`), nor the trainer: a strategy
    sees the policy through `strategies.base.PolicyForward` only, and reads no `.trainer` of anything."""
    sources = _package_sources()
    edges = import_edges(sources)
    config = ("appo_trl.config", "appo_trl.trainer")
    back = sorted((m, w) for m, ws in edges.items() if m.startswith("appo_trl.strategies")
                  for w in ws if w in config or w.startswith(tuple(f"{c}." for c in config)))  # fmt: skip
    assert not back, f"strategies import the config or the trainer: {back}"
    assert any(w.startswith("appo_trl.strategies") for w in edges["appo_trl.config.appo"])
    reads = sorted(f"{m}:{node.lineno}" for m, src in sources.items() if m.startswith("appo_trl.strategies")
                   for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Attribute) and node.attr == "trainer")  # fmt: skip
    assert not reads, f"strategies read `.trainer` (use `PolicyForward`): {reads}"
