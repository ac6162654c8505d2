"""Trackers: wandb offline without an account, trackio / tensorboard as pip extras, missing packages named early."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

from appo_trl.reporting.trackers import TRACKERS, prepare_trackers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))


def test_wandb_without_account_goes_offline(no_wandb_account):
    prepare_trackers(SimpleNamespace(report_to=["wandb"]))
    assert os.environ["WANDB_MODE"] == "offline"


def test_explicit_wandb_mode_and_accounts_are_respected(no_wandb_account, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    prepare_trackers(SimpleNamespace(report_to="wandb"))
    assert os.environ["WANDB_MODE"] == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    prepare_trackers(SimpleNamespace(report_to=["wandb"]))
    assert "WANDB_MODE" not in os.environ
    prepare_trackers(SimpleNamespace(report_to="none"))


def test_missing_tracker_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    with pytest.raises(
        ValueError, match=r'report_to: trackio needs the `trackio` package: pip install -e "\.\[trackio\]" in the '
    ):  # issue 34: the extra from a checkout (was "appo-trl[trackio]", a name not on the package index)
        prepare_trackers(SimpleNamespace(report_to=["trackio"]))


def test_trackio_and_tensorboard_are_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("trackio", "tensorboard"):
        assert name in extras, name
        assert any(req.split(">")[0].split("=")[0].strip() == name for req in extras[name])
        assert TRACKERS[name][1] == f"appo-trl[{name}]"


RUN_ONE_STEP = """
import sys
from pathlib import Path
from transformers import AutoTokenizer
from appo_trl.reporting.trackers import prepare_trackers
from tests.trainer.test_trainer import RewardSpy, make_trainer
from tests.trainer.test_trainer_engine import real_engine

tracker, model, out = sys.argv[1:]
tok = AutoTokenizer.from_pretrained(model)
engine = real_engine(tok)
trainer = make_trainer(Path(out), tok, model, engine, RewardSpy(), tools=["python"], num_generations=4,
                       per_device_train_batch_size=4, max_steps=1, max_completion_length=96, report_to=[tracker])
prepare_trackers(trainer.args)  # what `appo train` does before the model loads
trainer.train()
engine.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("tracker", ["wandb", "tensorboard", "trackio"])
def test_one_step_writes_to_the_tracker_offline(tracker, tmp_path, tiny_model_path):
    """A fresh process per tracker: the trackers read their directories from the environment at import."""
    if tracker != "wandb" and importlib.util.find_spec(tracker) is None:
        pytest.skip(f'pip install "appo-trl[{tracker}]"')
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"), WANDB_DIR=str(tmp_path),
               TRACKIO_DIR=str(tmp_path / "trackio"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # fmt: skip
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", RUN_ONE_STEP, tracker, tiny_model_path, str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    if tracker == "wandb":
        assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    elif tracker == "tensorboard":
        assert list(out.glob("runs/*/events.out.tfevents.*"))
    else:
        assert list((tmp_path / "trackio").glob("*.db"))


def test_missing_tensorboard_is_one_config_line_naming_the_checkout_extra(monkeypatch):
    """Issue 34: a `ConfigError` (the CLI prints one line, exit 2), naming what to install from a checkout."""
    from appo_trl.configs.errors import ConfigError

    real = importlib.util.find_spec
    missing = ("tensorboard", "tensorboardX")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(ConfigError) as err:
        prepare_trackers(SimpleNamespace(report_to="tensorboard"))
    assert str(err.value) == ('report_to: tensorboard needs the `tensorboard` package: pip install -e ".[tensorboard]" '
                              "in the appo-trl checkout (or pip install tensorboard).")  # fmt: skip
