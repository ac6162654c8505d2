"""Configuration errors: one readable line and exit code 2, instead of a traceback.

Everything a user can fix by editing a recipe or a command line raises a subclass of `ConfigError`:

- `RecipeError`: the recipe or the flags (missing or malformed YAML, unknown key, a value of the wrong type,
  an invalid combination rejected by a config's `__post_init__`, such as an unknown strategy or a batch shape).
- `DataError`: a dataset path that does not exist, an empty data file, a missing column.
- `ModelPathError`: a model that is neither a local folder nor loadable from the Hub (cache).
- `PreflightError`: a check run before the model loads failed (tools, the search server, Hub access,
  4-bit loading, a reward that needs a column the data lacks).

`run_cli(prog, fn, argv)` runs a command and turns a `ConfigError` into `prog: error: <message>` on stderr
and exit code 2. `--debug` anywhere on the command line (or `APPO_DEBUG=1`) re-raises instead, so the
traceback is there when it is needed. Errors that are not configuration errors (bugs, a crash mid-training)
keep their traceback: they are not hidden behind a short message.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

DEBUG_FLAG = "--debug"
DEBUG_ENV = "APPO_DEBUG"


class ConfigError(ValueError):
    """A problem the user fixes in the recipe, the command line or the environment (exit code 2)."""

    exit_code = 2


class RecipeError(ConfigError):
    """A recipe or command line that cannot be parsed (unknown key, missing file, bad value, bad combination)."""


class DataError(ConfigError):
    """A dataset that cannot be used as configured (missing path, empty file, missing column)."""


class ModelPathError(ConfigError, FileNotFoundError):
    """A model that is neither a local folder nor available from the Hub."""


class PreflightError(ConfigError):
    """A start-up check failed (tools, search server, Hub access, quantization, reward columns)."""


def fail(msg: str):
    """A config error of `APPOConfig.__post_init__` (its checks and the strategies' `validate`): one ValueError line
    starting `APPOConfig: `."""
    raise ValueError(f"APPOConfig: {msg}")


def one_line(message: object) -> str:
    """The message on one line: inner newlines become '; ' (indentation dropped); an agent endpoint's secret (an
    agent's error quoting its base URL) written as `***`."""
    parts = [part.strip() for part in str(message).splitlines() if part.strip()]
    text = "; ".join(parts).replace(":;", ":")
    endpoint = sys.modules.get("appo_trl.rollout.agent_endpoint")  # loaded only where an endpoint was made
    return endpoint.redact(text) if endpoint is not None else text


def pop_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """Remove `--debug` from argv; returns (argv, debug). `APPO_DEBUG=1` also turns debugging on."""
    argv = list(argv)
    debug = DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    return [a for a in argv if a != DEBUG_FLAG], debug


def run_cli(prog: str, fn: Callable[[list[str]], int | None], argv: Sequence[str]) -> int:
    """Run `fn(argv)`; a `ConfigError` prints one line to stderr and returns 2 (unless debugging)."""
    argv, debug = pop_debug(argv)
    if debug:
        os.environ[DEBUG_ENV] = "1"  # relaunched `accelerate launch` children inherit it
    try:
        return int(fn(argv) or 0)
    except ConfigError as exc:
        if debug:
            raise
        print(f"{prog}: error: {one_line(exc)} (run with --debug for the traceback)", file=sys.stderr, flush=True)
        return exc.exit_code
