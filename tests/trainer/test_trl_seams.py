"""`appo_trl.trainer.trl_seams`: each seam into TRL writes exactly its attribute and restores what it swapped, also
when the body raises; and no other module reads one of `GRPOTrainer`'s private members itself."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from appo_trl.trainer import trl_seams


def test_vllm_generation_is_swapped_within_and_restored_even_on_error():
    import trl.trainer.grpo_trainer as grpo_trainer

    original = grpo_trainer.VLLMGeneration
    seen = []
    with trl_seams.vllm_generation_replaced(lambda trl_class: seen.append(trl_class) or "factory"):
        assert grpo_trainer.VLLMGeneration == "factory"
    assert seen == [original] and grpo_trainer.VLLMGeneration is original
    with pytest.raises(RuntimeError, match="init failed"):
        with trl_seams.vllm_generation_replaced(lambda trl_class: "factory"):
            raise RuntimeError("init failed")
    assert grpo_trainer.VLLMGeneration is original


def test_synced_step_sleeping_flag_and_importance_correction():
    trainer = SimpleNamespace(_last_loaded_step=-1, state=SimpleNamespace(global_step=3), use_vllm=False)
    assert trl_seams.weights_synced_at(trainer) == -1
    trl_seams.mark_weights_synced(trainer)
    assert trl_seams.weights_synced_at(trainer) == trainer._last_loaded_step == 3
    generation = SimpleNamespace()
    assert trl_seams.weights_sleeping(generation) is False  # server mode: TRL never sets it
    trl_seams.mark_weights_sleeping(generation)
    assert trl_seams.weights_sleeping(generation) is True and generation._llm_weights_sleeping is True
    with trl_seams.trl_importance_correction(trainer):
        assert trainer.use_vllm is True
    assert trainer.use_vllm is False
    with pytest.raises(KeyError), trl_seams.trl_importance_correction(trainer):
        raise KeyError("loss failed")
    assert trainer.use_vllm is False
    trainer.use_vllm = True  # a vLLM run: already on, left on
    with trl_seams.trl_importance_correction(trainer):
        pass
    assert trainer.use_vllm is True


def test_a_metric_joins_trls_list_for_the_step():
    from collections import defaultdict

    trainer = SimpleNamespace(_metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    trl_seams.log_metric(trainer, "train", "tree/tokens_ratio", 0.5)
    trl_seams.log_metric(trainer, "train", "tree/tokens_ratio", 0.25)
    assert trainer._metrics["train"]["tree/tokens_ratio"] == [0.5, 0.25] and not trainer._metrics["eval"]


PACKAGE = Path(__file__).resolve().parents[2] / "appo_trl"
# the copied TRL rules read these as TRL's own code does (floor 1 cannot import trl_seams): module -> members
COPIES_READ = {"appo_trl/trl_rules.py": {"_tokenizer", "_multi_environment"}}


def trl_private_names() -> set[str]:
    """Every private member of `GRPOTrainer`: its classes' own names and every `self._x` TRL and transformers set."""
    import transformers.trainer
    import trl.trainer.grpo_trainer as grpo_trainer

    names = {
        n for cls in grpo_trainer.GRPOTrainer.__mro__ for n in vars(cls) if n.startswith("_") and not n.endswith("__")
    }
    for module in (grpo_trainer, transformers.trainer):
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)", inspect.getsource(module)))
    return names


def private_reads(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, `base._member`) of each `X._member` in `source` whose member is TRL's, except `super()._hook(...)`
    and a name the module itself defines or stores on `self` (an override of TRL's hook, a class's own `_generate`)."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):  # and what its own classes store on `self` (`self._generate = generate`)
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for e in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                own.add(e.attr)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in names) or node.attr in own:
            continue
        base = ast.unparse(node.value)
        if base != "super()":
            out.append((node.lineno, f"{base}.{node.attr}"))
    return out


def test_only_trl_seams_reads_trls_private_members():
    names = trl_private_names()
    assert {"_tokenizer", "_tokenize_prompts", "_env_tools", "_dist", "_step"} <= names
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "appo_trl/trainer/trl_seams.py":
            continue
        for line, read in private_reads(path.read_text(), names):
            if read.rsplit(".", 1)[1] not in COPIES_READ.get(rel, ()):
                problems.append(f"{rel}:{line} reads {read}")
    assert not problems, "TRL's private members read outside trl_seams (add a seam there):\n" + "\n".join(problems)


def test_the_check_catches_a_private_read_and_spares_an_override():
    names = {"_tokenizer", "_generate"}
    assert private_reads("def f(trainer):\n    return trainer._tokenizer\n", names) == [(2, "trainer._tokenizer")]
    override = "class T:\n    def _generate(self, p):\n        return super()._generate(p) or self._generate(p)\n"
    assert private_reads(override, names) == []
    assert (
        private_reads(
            "class E:\n    def __init__(self, g):\n        self._generate = g\n        self._generate()\n", names
        )
        == []
    )
