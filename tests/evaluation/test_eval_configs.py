"""The shipped eval/*.yaml configs parse into EvalConfig and name only registry benchmarks."""

from pathlib import Path

import pytest

from appo_trl.configs.recipes import parse_recipe
from appo_trl.evaluation import EvalConfig, load_registry

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval"


@pytest.mark.parametrize("path", sorted(EVAL_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_eval_config_parses(path):
    (cfg,) = parse_recipe([EvalConfig], ["--config", str(path)])
    assert set(cfg.benchmarks) <= set(load_registry())
    assert cfg.num_samples >= max(cfg.ks or [1])
    assert "api_key" not in path.read_text().replace("api_key_env", "")


def test_command_line_overrides_yaml():
    (cfg,) = parse_recipe([EvalConfig], ["--config", str(EVAL_DIR / "tiny.yaml"), "--num_samples", "3",
                                          "--benchmarks", "aime24", "gaia"])  # fmt: skip
    assert cfg.num_samples == 3 and cfg.benchmarks == ["aime24", "gaia"] and cfg.backend == "transformers"
