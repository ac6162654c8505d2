"""Recipes: flat YAML files parsed into the script's dataclasses, plus the `accelerate launch` relaunch.

A recipe is one flat mapping whose keys are fields of the stage's dataclasses (for `appo train`:
`APPOScriptArguments`, `APPOConfig`, TRL's `ModelConfig`), plus an optional `env:` mapping exported to the
environment before anything loads. `--key value` flags on the command line override the YAML. An unknown
key (in the YAML or on the command line) fails before any model or dataset is touched, naming the key and
the closest valid keys.

Launch flags (`--accelerate_config NAME|PATH`, `--num_processes N`, `--mixed_precision`, `--main_process_port`,
and for multi-node `--num_machines`, `--machine_rank`, `--main_process_ip`) are not recipe keys: when present, `maybe_relaunch` re-executes the stage's entry script through
`accelerate launch`; otherwise the stage runs in this process. Config names resolve to the repository's
`accelerate_configs/<name>.yaml`.

Every problem is a `RecipeError` (`appo_trl.configs.errors`), which the CLI prints as one line with exit code 2:
malformed YAML (file:line:column), an unknown key, a value argparse cannot convert, a scalar of the wrong
type, or a combination a config's `__post_init__` rejects. A scalar where a list is expected is read as a
one-element list.

What this does not do: it does not merge several recipes or nest sections (a recipe is flat, like open-r1's).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from appo_trl.configs.errors import RecipeError
from appo_trl.configs.paths import SHIPPED_ROOT, find_recipe, resolve_recipe_paths

# set by `run_launcher` for the launched ranks: the pid of the `appo` process that launched them
# (`appo_trl.stages.interrupts.watch_launching_parent` stops a rank whose launching process is gone)
PARENT_PID_ENV = "APPO_PARENT_PID"

LAUNCH_FLAGS = (
    "--accelerate_config", "--num_processes", "--mixed_precision", "--main_process_port",
    "--num_machines", "--machine_rank", "--main_process_ip",
)  # fmt: skip
# the repository in a checkout, the copies inside the wheel otherwise (see appo_trl.configs.paths)
REPO_ROOT = SHIPPED_ROOT
ACCELERATE_CONFIG_DIRS = (Path.cwd() / "accelerate_configs", REPO_ROOT / "accelerate_configs")


class ParsedRecipe(tuple):
    """What `parse_recipe` returns: the dataclass instances, in the order asked for (unpack it as a tuple), and
    `folder`, the recipe file's folder (None without `--config`), where dotted tool paths are looked up first."""

    folder: str | None

    def __new__(cls, parsed, folder: str | None = None):
        out = super().__new__(cls, parsed)
        out.folder = folder
        return out


def valid_keys(dataclass_types: Sequence[type]) -> set[str]:
    return {f.name for dc in dataclass_types for f in dataclasses.fields(dc) if f.init}


def _unknown_key_error(keys: Sequence[str], known: set[str], where: str) -> RecipeError:
    items = []
    for key in keys:
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
        hint = f" (did you mean: {', '.join(close)}?)" if close else ""
        items.append(f"{key}{hint}")
    return RecipeError(f"Unknown {where} key(s): " + "; ".join(items))


def load_recipe(path: str | os.PathLike) -> dict:
    """Read a recipe YAML into a dict (no validation beyond "it is a mapping").

    A relative path that does not exist from the working directory is looked up among the shipped recipes.
    The values are as written; `parse_recipe` resolves relative input paths against the recipe file.
    """
    path = find_recipe(path)
    if not path.is_file():
        raise RecipeError(f"Recipe file not found: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(_yaml_error(path, exc)) from exc
    if not isinstance(data, dict):
        raise RecipeError(f"Recipe {path} must be a YAML mapping, got {type(data).__name__}.")
    return data


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """`recipe.yaml:3:7: malformed YAML: <problem>` (1-based line and column, as editors show them)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = " ".join(str(p) for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
    return f"{where}: malformed YAML: {problem or exc}"


def split_launch_args(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Pull the launch flags out of argv: returns ({flag: value}, remaining argv). Dash-style names are accepted."""
    from appo_trl.configs.arguments import normalize_flags

    launch, rest, it = {}, [], iter(normalize_flags(argv))
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in LAUNCH_FLAGS:
            if not eq:
                value = next(it, None)
                if value is None:
                    raise RecipeError(f"{flag} needs a value.")
            launch[flag] = value
        else:
            rest.append(arg)
    return launch, rest


def parse_recipe(dataclass_types: Sequence[type], argv: Sequence[str]) -> ParsedRecipe:
    """Parse `--config recipe.yaml` and `--key value` flags into instances of `dataclass_types` (a `ParsedRecipe`:
    unpack it as a tuple; its `folder` is the recipe's folder, for `APPOTrainer(tool_dirs=[folder])`).

    Precedence: dataclass defaults < YAML < command line. The recipe's `env:` mapping is exported first.
    Raises `RecipeError` naming any unknown key, before anything heavy is imported.
    """
    from trl import TrlParser

    _, argv = split_launch_args(argv)
    argv = list(argv)
    known = valid_keys(dataclass_types)
    config, folder = {}, None
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise RecipeError("--config needs a path to a recipe YAML.")
        config = resolve_recipe_paths(load_recipe(argv[i + 1]), find_recipe(argv[i + 1]))
        folder = str(find_recipe(argv[i + 1]).resolve().parent)  # dotted tool paths resolve from here first
        del argv[i : i + 2]
    env = config.pop("env", None) or {}
    if not isinstance(env, dict):
        raise RecipeError("The recipe's `env:` entry must be a mapping of variable names to values.")
    cli_keys = [a[2:].split("=")[0] for a in argv if a.startswith("--")]
    removed = {k: v for dc in dataclass_types for k, v in getattr(dc, "REMOVED_FIELDS", {}).items()}
    for key in [*config, *cli_keys, *(k[3:] for k in cli_keys if k.startswith("no_"))]:
        if key in removed:  # a field that was removed: one line naming its replacement
            raise RecipeError(removed[key])
    unknown = [k for k in config if k not in known]
    if unknown:
        raise _unknown_key_error(unknown, known, "recipe")
    unknown = [k for k in cli_keys if k not in known and not (k.startswith("no_") and k[3:] in known)]
    if unknown:
        raise _unknown_key_error(unknown, known, "command-line")
    for name, value in env.items():
        os.environ[str(name)] = str(value)

    parser = TrlParser(dataclass_types)
    parser.error = _raise_recipe_error  # argparse would print the whole usage (hundreds of flags) and exit
    config = coerce_recipe_values(parser, config)
    parser.set_defaults_with_config(**config)
    from appo_trl.configs.preflight import check_launch_engine, check_launch_precision, skip_deepspeed_cpu_comm_build

    skip_deepspeed_cpu_comm_build()  # before the training arguments start DeepSpeed's distributed state
    try:
        parsed = tuple(parser.parse_args_into_dataclasses(args=argv))
    except RecipeError:
        raise
    except (ValueError, TypeError) as exc:  # a config's __post_init__ rejected the combination
        message = str(exc)
        if "generation_batch_size" in message and "--generation_batch_size" not in argv:
            message += (
                " (generation_batch_size = per_device_train_batch_size × steps_per_generation × processes; "
                "choose them so that it is a multiple of num_generations)"
            )
        raise RecipeError(message) from exc
    check_launch_precision(parsed)  # under `accelerate launch` with DeepSpeed: one line before the model loads
    check_launch_engine(parsed)  # FSDP on CPU would silently be DDP
    return ParsedRecipe(parsed, folder)


def _raise_recipe_error(message: str):
    raise RecipeError(f"invalid value: {message}")


_SCALARS = (str, int, float, bool)


def _scalar_kinds(dataclass_types: Sequence[type]) -> dict[str, type]:
    """Field name -> `int` or `float` for fields typed so (`X | None` included), from the type hints."""
    import types
    import typing

    kinds: dict[str, type] = {}
    for dc in dataclass_types:
        try:
            hints = typing.get_type_hints(dc)
        except Exception:  # noqa: BLE001 - unresolvable hints: leave those fields to argparse
            continue
        for name, hint in hints.items():
            args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
            args = tuple(a for a in args if a is not type(None))
            if len(args) == 1 and args[0] in (int, float):
                kinds[name] = args[0]
    return kinds


def coerce_recipe_values(parser, config: dict) -> dict:
    """Check YAML values against the parser's field types before argparse sees them.

    A scalar where a list is expected (`tools: python`, `reward_funcs: math_verify`) becomes a one-element
    list. A non-string value of the wrong type for an int or float field (`num_generations: 4.5`, `seed: [1]`)
    raises `RecipeError` naming the key; strings are left to argparse, which converts or rejects them with
    the flag's name (`argument --num_generations: invalid int value: 'four'`).
    """
    config = dict(config)
    actions = {a.dest: a for a in parser._actions}
    kinds = _scalar_kinds(parser.dataclass_types)
    for key, value in config.items():
        action = actions.get(key)
        if action is None or value is None:
            continue
        if action.nargs in ("+", "*"):
            if isinstance(value, _SCALARS):
                config[key] = [value]
            continue
        kind = kinds.get(key)
        if kind is int and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise RecipeError(f"recipe key {key!r} expects an integer, got {value!r}.")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float, str))):
            raise RecipeError(f"recipe key {key!r} expects a number, got {value!r}.")
    return config


def resolve_accelerate_config(name_or_path: str) -> Path:
    """`zero3` -> accelerate_configs/zero3.yaml (cwd first, then the repository); a path is used as is."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    for folder in ACCELERATE_CONFIG_DIRS:
        candidate = folder / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    names = sorted({p.stem for d in ACCELERATE_CONFIG_DIRS if d.is_dir() for p in d.glob("*.yaml")})
    raise RecipeError(f"Unknown accelerate config {name_or_path!r}: not a file, and not one of {names}.")


def launch_command(
    launch: dict[str, str],
    entry_script: str | os.PathLike,
    script_argv: Sequence[str],
    mixed_precision: str | None = None,
) -> list[str]:
    """The `accelerate launch ...` command line that runs `entry_script` with `script_argv`.

    `mixed_precision`: the recipe's (`check_before_relaunch`); without `--mixed_precision` it overrides the
    accelerate config's `mixed_precision`, so that the launch trains as the recipe says.
    """
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    num_processes = launch.get("--num_processes")
    if "--accelerate_config" in launch:
        cmd += ["--config_file", str(resolve_accelerate_config(launch["--accelerate_config"]))]
    elif num_processes and int(num_processes) > 1:
        # `--cpu` silently runs one process; --multi_gpu becomes MULTI_CPU (gloo) on a machine without GPUs.
        cmd += ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    if "--mixed_precision" in launch:
        cmd += ["--mixed_precision", launch["--mixed_precision"]]
    elif "--accelerate_config" not in launch:
        cmd += ["--mixed_precision", "no"]
    elif mixed_precision is not None:
        cmd += ["--mixed_precision", mixed_precision]
    for flag in ("--main_process_port", "--num_machines", "--machine_rank", "--main_process_ip"):
        if flag in launch:
            cmd += [flag, launch[flag]]
    return [*cmd, str(entry_script), *script_argv]


def check_before_relaunch(dataclass_types: Sequence[type], argv: Sequence[str]) -> str | None:
    """When `argv` will be relaunched through `accelerate launch`, parse it here first: a configuration error
    is then one `RecipeError` in this process instead of a failure report from every launched rank.

    Returns the recipe's mixed precision (`bf16`, `fp16`, `no`) for `maybe_relaunch`, None when nothing is
    relaunched; a `--mixed_precision` flag that contradicts the recipe is an error here.
    """
    from appo_trl.configs.preflight import check_launch_engine, check_launch_precision, recipe_mixed_precision

    launch, rest = split_launch_args(argv)
    if not launch or os.environ.get("APPO_LAUNCHED") == "1":
        return None
    parsed = parse_recipe(dataclass_types, rest)
    check_launch_precision(parsed, launch.get("--mixed_precision"), where="--mixed_precision")
    if "--accelerate_config" in launch:
        config = yaml.safe_load(resolve_accelerate_config(launch["--accelerate_config"]).read_text()) or {}
        check_launch_engine(parsed, str(config.get("distributed_type", "")))
    return recipe_mixed_precision(parsed)


def maybe_relaunch(
    argv: Sequence[str], entry_script: str | os.PathLike, mixed_precision: str | None = None
) -> int | None:
    """Re-run `entry_script` under `accelerate launch` when launch flags are present.

    `mixed_precision`: the recipe's, from `check_before_relaunch`. Returns the child's exit code, or None when
    the stage should run in this process.
    """
    launch, rest = split_launch_args(argv)
    if not launch or os.environ.get("APPO_LAUNCHED") == "1":
        return None
    cmd = launch_command(launch, entry_script, rest, mixed_precision)
    print("appo: launching " + " ".join(cmd), file=sys.stderr, flush=True)
    return run_launcher(cmd, {**os.environ, "APPO_LAUNCHED": "1"})


def run_launcher(cmd: Sequence[str], env: dict, grace: float = 25.0) -> int:
    """Run `cmd` (`accelerate launch ...`) in its own process group and return its exit code.

    SIGTERM (Slurm, Kubernetes) and Ctrl-C sent to this process are forwarded to the whole group, so the launcher
    and every rank get them, and this process waits until every process of the group has exited (SIGKILL to the
    group after `grace` seconds): stopping `appo train` leaves no rank behind. Then it returns 128 + the signal.
    (`accelerate launch` with one process dies on SIGTERM without passing it on; its rank handles it.)

    The group runs in its own session, so a SIGKILL of this process reaches none of it, and PR_SET_PDEATHSIG
    would only reach the launcher, which passes no signal on. So the ranks get this process's pid in
    `APPO_PARENT_PID` (`PARENT_PID_ENV`), and each rank's stage watches it and stops when it is gone
    (`appo_trl.stages.interrupts`). The launcher's stderr comes through a pipe (`_relay_stderr`) and is dropped once
    a signal was forwarded; the ranks write to this process's stderr directly, one line each.
    """
    import signal
    import threading
    import time

    env = {**env, PARENT_PID_ENV: str(os.getpid())}
    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True, stderr=subprocess.PIPE)
    received: list[int] = []
    relay = threading.Thread(target=_relay_stderr, args=(proc.stderr, received), name="appo-launch-stderr",
                             daemon=True)  # fmt: skip
    relay.start()

    def forward(signum, frame):
        received.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        code = proc.wait()
        if received:
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                try:
                    os.killpg(proc.pid, 0)  # a rank of the group is still shutting down
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        relay.join(timeout=5)
    return 128 + received[0] if received else code


def _relay_stderr(pipe, received: list[int]) -> None:
    """Copy the launcher's stderr to ours as it comes, until a signal was forwarded: from then on the launcher's
    own report of the signal (torch's `SignalException` traceback) is dropped. The ranks write to our stderr
    directly (`appo_trl.stages.interrupts.attach_stderr`), so their one-line stop messages are not in this pipe."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    while chunk := os.read(pipe.fileno(), 65536):
        if received:
            continue
        try:
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                os.write(sys.stderr.fileno(), chunk)
        except (OSError, ValueError):
            pass
    pipe.close()
