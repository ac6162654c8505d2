"""Experiment trackers (`report_to`): checked before the model loads, and wandb offline without credentials.

`report_to` goes to transformers' own tracker callbacks unchanged; this module only makes the common cases
work on a machine with no network and no accounts, and fails early where transformers would fail late:

- `wandb` with no credentials (no `WANDB_API_KEY`, no `api.wandb.ai` entry in `~/.netrc`) and no
  `WANDB_MODE` runs offline (`WANDB_MODE=offline`): the run is written under `./wandb` (or `$WANDB_DIR`) and
  can be uploaded later with `wandb sync`. An explicit `WANDB_MODE` (online, offline, disabled) is respected.
- a tracker whose package is missing fails at start-up, in one line (a `ConfigError`), with the extra that
  installs it from a checkout (`pip install -e ".[trackio]"`, `".[tensorboard]"`; the project is not on the
  package index), instead of an error from inside `Trainer.__init__` after the model has loaded.

What this does not do: configure the trackers (project names, Spaces, directories): use transformers' own
settings (`run_name`, `project`, `trackio_space_id`, `$WANDB_PROJECT`, `$TENSORBOARD_LOGGING_DIR`, ...).
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os

from appo_trl.configs.errors import ConfigError

logger = logging.getLogger("appo_trl.reporting.trackers")

# report_to name -> (modules that can serve it, the pip extra that installs one)
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "wandb": (("wandb",), "appo-trl"),  # a core dependency
    "trackio": (("trackio",), "appo-trl[trackio]"),
    "tensorboard": (("tensorboard", "tensorboardX"), "appo-trl[tensorboard]"),
}


def _report_to(args) -> list[str]:
    value = getattr(args, "report_to", None) or []
    value = [value] if isinstance(value, str) else list(value)
    return [v for v in value if v not in ("none", None)]


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def prepare_trackers(args) -> None:
    """Check that every tracker of `args.report_to` can be imported; set wandb offline when it has no account.

    Raises `ConfigError` naming the missing package and the extra that installs it.
    """
    names = _report_to(args)
    if names == ["all"]:
        return  # transformers picks whatever is installed
    for name in names:
        modules, extra = TRACKERS.get(name, ((), ""))
        if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
            bracket = extra[extra.find("[") :] if "[" in extra else ""
            raise ConfigError(
                f'report_to: {name} needs the `{modules[0]}` package: pip install -e ".{bracket}" in the appo-trl '
                f"checkout (or pip install {modules[0]})."
            )
    if "wandb" in names and not os.environ.get("WANDB_MODE") and not wandb_has_credentials():
        os.environ["WANDB_MODE"] = "offline"
        where = os.environ.get("WANDB_DIR", ".")
        logger.warning(
            "report_to: wandb with no wandb credentials: logging offline to %s/wandb "
            "(upload later with `wandb sync`; set WANDB_MODE=online after `wandb login`).",
            where,
        )
