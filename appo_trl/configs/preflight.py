"""Start-up checks: everything that can be wrong with a run is found before the model loads.

`appo train` (and `appo sft` for the parts that apply) calls these in order, each raising a one-line
`appo_trl.configs.errors.ConfigError` subclass that the CLI prints and exits 2 on:

1. `check_model_source`: the model is a local folder, or a Hub id that resolves (cache or network). A
   missing local path is named as such, with the `appo tiny-model` hint for tiny recipe paths, instead of
   the Hub's "couldn't connect to huggingface.co".
2. `check_quantization`: `load_in_4bit` / `load_in_8bit` build TRL's `BitsAndBytesConfig`
   (`trl.get_quantization_config`, as `trl grpo` does) into `model_init_kwargs`: QLoRA. Without
   bitsandbytes or a CUDA GPU, or without `use_peft`, the run stops: the setting is never ignored.
   `check_peft`: LoRA options and the module names they give (`configs.lora_checks`, on a meta-device build of the
   model's config), and `vllm_sync_adapter=always` without `use_peft`, stop too.
3. `prompt_token_limit`: the most prompt tokens the sampler takes (in vLLM server mode the `max_model_len`
   the server reports when it answers at start-up, else `vllm_max_model_length`, else the model config's
   `max_position_embeddings`), which `appo_trl.data` checks every prompt against (`configs.rows`).
4. `plan_startup`: the run's `StartupPlan` (`appo_trl.configs.plan`): a built-in reward that scores against
   gold answers needs an answer column; the tools are resolved and built once (names, parameters), then each
   tool's own `check()` runs (the search tool asks its server's `/health` whether it is appo-trl's search server
   and which corpus it serves). The plan goes on to the trainer.
5. `check_output_dir`: `output_dir` (or, when it does not exist yet, its nearest existing parent) takes a new
   folder: a read-only disk or a missing permission is found now, not at the first save. `check_rollouts_dir`: with
   `dump_rollouts`, `output_dir/rollouts` is not a file and, when it exists, takes new files.
6. `check_agent_port`: with an agent and a fixed `agent_port`, the endpoint's port can be bound (one line naming
   `agent_port`, not a socket traceback after the model loaded).
7. `check_hub`: with `push_to_hub`, the token works, may write, and its owner may write to the repo's
   namespace; the push itself still happens once, at the end (`appo_trl.reporting.hub`).

`configs.recipes` also calls three launch checks, in every launched rank and (the first two) before
`appo train` / `appo sft` relaunch themselves: `check_launch_precision` (a DeepSpeed launch's mixed precision
must be the recipe's), `check_launch_engine` (FSDP on CPU would silently be DDP), and
`skip_deepspeed_cpu_comm_build` (no JIT build of DeepSpeed's CPU shm comm op, which training never uses).

What this does not do: load weights, or wait for the vLLM server (the trainer waits for it at start-up, up to
`vllm_server_timeout`; a server that does not answer yet only leaves the prompt length to the model's limit here).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import tempfile
from typing import Any

from appo_trl.configs.errors import ModelPathError, PreflightError
from appo_trl.configs.paths import looks_local
from appo_trl.configs.plan import StartupPlan, parse_tool_config

TINY_MODEL_HINT = "for the tiny CPU model run `appo tiny-model {path}` first (or `make demo`, which does it for you)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_model_source(name_or_path: str | None, revision: str | None = None, trust_remote_code: bool = False):
    """Fail with one line unless `name_or_path` is a model folder or a Hub model that resolves."""
    if not name_or_path:
        raise ModelPathError("No model given: set `model_name_or_path` in the recipe or pass --model_name_or_path.")
    expanded = os.path.expanduser(name_or_path)
    hint = f"; {TINY_MODEL_HINT.format(path=name_or_path)}" if "tiny" in name_or_path.lower() else ""
    if os.path.isdir(expanded):
        if not any(os.path.isfile(os.path.join(expanded, f)) for f in ("config.json", "adapter_config.json")):
            raise ModelPathError(f"Model folder {name_or_path!r} has no config.json: not a saved model{hint}.")
        return
    if os.path.exists(expanded):
        raise ModelPathError(f"Model path {name_or_path!r} is a file; point model_name_or_path at a model folder.")
    if looks_local(name_or_path):
        hint = f"; {TINY_MODEL_HINT.format(path=name_or_path)}"  # the usual cause on a fresh clone
        raise ModelPathError(
            f"Model folder {name_or_path!r} does not exist (looked for {os.path.abspath(expanded)}){hint}."
        )
    from transformers import AutoConfig

    try:  # one small file: the same resolution the model load will do, without its traceback
        AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelPathError(
            f"Model {name_or_path!r} is not a local folder (no {os.path.abspath(expanded)}) and could not be "
            f"loaded from the Hub: {_first_line(exc)}{hint}"
        ) from exc


def check_output_dir(output_dir: str | None) -> None:
    """Fail with one line unless a folder can be created in `output_dir` (or its nearest existing parent)."""
    if not output_dir:
        return
    folder = os.path.abspath(os.path.expanduser(output_dir))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise PreflightError(f"output_dir {output_dir!r} cannot be created: {existing} is a file; choose another "
                             f"--output_dir")  # fmt: skip
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".appo-write-check-", dir=existing))
    except OSError as exc:
        where = "" if existing == folder else f" (its nearest existing parent {existing})"
        raise PreflightError(f"output_dir {output_dir!r} is not writable{where}: {exc.strerror or exc}; choose "
                             f"another --output_dir, or make it writable") from exc  # fmt: skip


def check_rollouts_dir(output_dir: str | None, dump_rollouts: int) -> None:
    """With `dump_rollouts`, fail with one line when `output_dir/rollouts` is a file or a folder that takes no file."""
    if not output_dir or not dump_rollouts:
        return
    folder = os.path.join(os.path.abspath(os.path.expanduser(output_dir)), "rollouts")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise PreflightError(f"dump_rollouts: {folder} is a file, where the rollout dump's folder goes; move it "
                             f"away, or set dump_rollouts: 0")  # fmt: skip
    if os.path.isdir(folder):
        try:
            os.close((probe := tempfile.mkstemp(prefix=".appo-write-check-", dir=folder))[0])
            os.unlink(probe[1])
        except OSError as exc:
            raise PreflightError(f"dump_rollouts: {folder} takes no new file: {exc.strerror or exc}; make it "
                                 f"writable, or set dump_rollouts: 0") from exc  # fmt: skip


def agent_port_problem(host: str, port: int) -> str | None:
    """Why the agent endpoint cannot listen on `host`:`port` (a port in use, an address not of this machine), or
    None; port 0 (any free port) is always fine."""
    if not port:
        return None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()  # SO_REUSEADDR, as uvicorn binds it
    except OSError as exc:
        return (f"agent_port={port} cannot be used on agent_host={host!r}: {exc.strerror or exc}; choose a free "
                "port, or agent_port: 0 for any free one")  # fmt: skip
    return None


def check_agent_port(training_args) -> None:
    """With an agent and a fixed `agent_port`: one line when the endpoint could not listen there, before the
    model loads (the trainer checks it again for `APPOTrainer(agent=...)`)."""
    if training_args.agent:
        problem = agent_port_problem(training_args.agent_host, training_args.agent_port)
        if problem:
            raise PreflightError(problem)


def check_quantization(model_args, training_args) -> None:
    """QLoRA as `trl grpo` does it, or a clear error; sets `model_init_kwargs["quantization_config"]`."""
    flag = "load_in_4bit" if getattr(model_args, "load_in_4bit", False) else None
    flag = flag or ("load_in_8bit" if getattr(model_args, "load_in_8bit", False) else None)
    if flag is None:
        return
    problems = []
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append("bitsandbytes is not installed (pip install bitsandbytes)")
    import torch

    if training_args.use_cpu:
        problems.append("use_cpu=True")
    elif not torch.cuda.is_available():
        problems.append("no CUDA GPU is visible")
    if problems:
        raise PreflightError(
            f"{flag}=True loads the model quantized with bitsandbytes on a CUDA GPU, which this run cannot do: "
            + "; ".join(problems)
            + f". Remove {flag} or run on a GPU machine."
        )
    if not getattr(model_args, "use_peft", False):
        raise PreflightError(f"{flag}=True trains adapters on a frozen quantized model (QLoRA): set use_peft=true.")
    from trl import get_quantization_config

    training_args.model_init_kwargs = dict(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs["quantization_config"] = get_quantization_config(model_args)


def check_peft(model_args, training_args) -> None:
    """LoRA settings that cannot work, before the model loads: the options themselves and the modules they name
    (`configs.lora_checks`), `vllm_sync_adapter=always` without an adapter to send (`use_peft`), or with one vLLM
    cannot serve as a LoRA adapter (DoRA, `lora_modules_to_save`)."""
    from appo_trl.configs.lora_checks import check_lora

    check_lora(model_args, training_args.trust_remote_code)
    if training_args.vllm_sync_adapter != "always":
        return
    if not getattr(model_args, "use_peft", False):
        raise PreflightError("vllm_sync_adapter=always sends the LoRA adapter to vLLM, but use_peft is false: set "
                             "use_peft: true, or vllm_sync_adapter: auto.")  # fmt: skip
    for key, why in (("use_dora", "DoRA's magnitude vector"), ("lora_modules_to_save", "fully trained modules")):
        if getattr(model_args, key, None):
            raise PreflightError(f"vllm_sync_adapter=always: {key} adds {why}, which a vLLM LoRA adapter cannot "
                                 "carry; remove it, or use vllm_sync_adapter: auto (merged weights).")  # fmt: skip


def plan_startup(training_args, tool_dirs=(), reward_funcs=(), dataset=None, answer_column: str = "answer"):
    """The run's `StartupPlan` (reward columns checked, tools resolved and built once), each tool's `check()` run.

    Every failure is one `PreflightError` line; the tools built so far are closed on the way out. On success the
    tools stay open for the trainer (`APPOTrainer(tools=plan)`).
    """
    try:
        plan = StartupPlan.resolve(training_args, None, tool_dirs, reward_funcs=reward_funcs, dataset=dataset,
                                   answer_column=answer_column)  # fmt: skip
    except PreflightError:
        raise
    except (ValueError, TypeError) as exc:
        raise PreflightError(f"tools: {exc}") from exc
    try:
        for tool in (plan.tools or {}).values():
            check = getattr(tool, "check", None)
            if check is not None:
                try:
                    check()
                except (ValueError, OSError) as exc:
                    raise PreflightError(f"tool {getattr(tool, 'name', '?')!r}: {exc}") from exc
    except BaseException:
        plan.close()
        raise
    return plan


def check_tools(training_args, tool_dirs=()) -> None:
    """`plan_startup`'s tool checks alone, the tools closed again (`appo eval`, which builds its own afterwards)."""
    plan_startup(training_args, tool_dirs).close()


def prompt_token_limit(training_args, model_args) -> tuple[int, str] | None:
    """`(limit, what sets it)`: a prompt of `limit` tokens or more leaves the sampler no room to generate.

    In vLLM server mode, the `max_model_len` the server reports (`served_max_model_len`) when it answers now;
    else `vllm_max_model_length` when set, else the model config's `max_position_embeddings` (config.json only,
    no weights), as the rollout engine takes it; None when neither is known.
    """
    served = served_max_model_len(training_args)
    if served is not None:
        return served
    if training_args.vllm_max_model_length:
        return int(training_args.vllm_max_model_length), "vllm_max_model_length"
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            model_args.model_name_or_path,
            revision=getattr(model_args, "model_revision", None),
            trust_remote_code=training_args.trust_remote_code,
        )
    except (OSError, ValueError):
        return None  # check_model_source has vouched for the model; a config we cannot read here is not fatal
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    return (int(limit), "the model's max_position_embeddings") if limit else None


def served_max_model_len(training_args, timeout_s: float = 5.0) -> tuple[int, str] | None:
    """With `use_vllm` and `vllm_mode="server"`: `(max_model_len, where)` from the servers' `GET /v1/models`.

    The sampler takes the length the server serves (`appo_trl.trainer.weight_sync.prepare_vllm_server`), which
    may be smaller than the model's. Of several replicas (`vllm_server_base_url` lists them) the smallest length
    counts; the first model a server lists is the one sampled from, as in `appo_trl.vllm.server`. A
    `vllm_max_model_length` that differs from a served length is an error here, before the model loads.
    None when no server answers in `timeout_s` (the trainer waits for it later) or none reports the length.
    """
    if not (training_args.use_vllm and training_args.vllm_mode == "server"):
        return None
    from appo_trl.vllm import ServerClient, VLLMServerError, server_urls

    configured = training_args.vllm_max_model_length
    found = []
    for url in server_urls(training_args):
        server = ServerClient(url, timeout_s, connect_timeout_s=timeout_s, max_retries=0)
        try:
            _, served = server.resolve_max_model_len(configured)
        except VLLMServerError:  # not up yet, or no length reported: the trainer checks again when it connects
            continue
        except ValueError as exc:  # a configured length the server does not serve
            raise PreflightError(str(exc)) from None
        found.append((served, f"the vLLM server's max_model_len at {server.base_url}"))
    return min(found) if found else None


def hub_repo_id(training_args) -> str:
    """The repo a push goes to: `hub_model_id`, else the output folder's name (as `appo_trl.reporting.hub` pushes)."""
    return training_args.hub_model_id or os.path.basename(os.path.normpath(training_args.output_dir))


def check_hub(training_args, api=None) -> None:
    """With `push_to_hub`: the Hub is reachable, the token is valid and may write to the repo's namespace."""
    if not training_args.push_to_hub:
        return
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise PreflightError("push_to_hub=True, but HF_HUB_OFFLINE=1: the final push would fail. Unset one of them.")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=training_args.hub_token)
    try:
        who = api.whoami()
    except Exception as exc:  # noqa: BLE001 - any failure means the final push would fail too
        raise PreflightError(
            f"push_to_hub=True, but the Hub token does not work ({_first_line(exc)}); run `hf auth login`, "
            "set HF_TOKEN, or pass --hub_token."
        ) from exc
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise PreflightError("push_to_hub=True, but the Hub token is read-only; use a token with write access.")
    repo_id = hub_repo_id(training_args)
    owners = [who.get("name")] + [org.get("name") for org in who.get("orgs") or [] if isinstance(org, dict)]
    namespace = repo_id.split("/")[0] if "/" in repo_id else who.get("name")
    if namespace not in owners:
        raise PreflightError(
            f"push_to_hub=True, but the token of {who.get('name')!r} cannot create {repo_id!r}: it may write to "
            f"{', '.join(repr(o) for o in owners if o)}. Set hub_model_id to <one of those>/<name>."
        )


def default_search_cache(training_args) -> dict[str, Any] | None:
    """`tool_config` with `search.cache_path` defaulting to `<output_dir>/search_cache.sqlite` (one per run).

    A configured `cache_path` (or `cache: false`) is kept; runs never share a cache file by accident.
    """
    config = parse_tool_config(training_args.tool_config)
    if "search" not in (training_args.tools or []):
        return config or training_args.tool_config
    search = dict(config.get("search") or {})
    if search.get("cache", True) and not search.get("cache_path") and search.get("backend", "local") != "cache":
        search["cache_path"] = os.path.join(training_args.output_dir, "search_cache.sqlite")
    config["search"] = search
    return config


def recipe_mixed_precision(parsed) -> str:
    """`bf16`, `fp16` or `no`: the mixed precision the parsed training arguments train in."""
    for obj in parsed:
        if hasattr(obj, "bf16") and hasattr(obj, "fp16"):
            return "bf16" if obj.bf16 else "fp16" if obj.fp16 else "no"
    return "no"


def check_launch_precision(
    parsed, launched: str | None = None, where: str = "accelerate launch (its config or --mixed_precision)"
) -> None:
    """Under DeepSpeed the launch's mixed precision (accelerate config or `--mixed_precision`) must be the recipe's.

    DeepSpeed's config takes `bf16.enabled` from the launch and transformers refuses a run whose `bf16` differs
    (`ds bf16.enabled=True vs hf bf16=False`), but only after the model has loaded. `launched` defaults to what
    `accelerate launch` exported (`ACCELERATE_MIXED_PRECISION`, checked only when it launched DeepSpeed).
    """
    if launched is None:
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
            return
        launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    wanted = recipe_mixed_precision(parsed)
    if launched is not None and launched != wanted:
        alternative = f", or set `{launched}: true` in the recipe" if launched != "no" else ""
        raise PreflightError(
            f"{where} sets mixed_precision={launched} but the recipe trains in {wanted} (its bf16/fp16 keys); "
            f"both must agree: pass --mixed_precision {wanted}{alternative}."
        )


def check_launch_engine(parsed, distributed_type: str | None = None) -> None:
    """FSDP needs GPUs: on CPU accelerate keeps no FSDP plugin and trains plain DDP, silently. Say so instead.

    `distributed_type`: the accelerate config's (before the launch); default: what `accelerate launch` exported.
    """
    fsdp = distributed_type == "FSDP" if distributed_type is not None else (
        os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"))  # fmt: skip
    if not fsdp:
        return
    import torch

    use_cpu = any(getattr(obj, "use_cpu", False) for obj in parsed)
    if use_cpu or not torch.cuda.is_available():
        raise PreflightError(
            "accelerate runs FSDP only on GPUs; on CPU it would train plain DDP instead"
            + (" (the recipe sets use_cpu: true)" if use_cpu else "")
            + ": use --accelerate_config zero2 or zero3 (sharded, CPU-capable) or ddp."
        )


def skip_deepspeed_cpu_comm_build() -> bool:
    """Under DeepSpeed on CPU, skip the JIT build of DeepSpeed's shared-memory comm op (`deepspeed_shm_comm`).

    `deepspeed.init_distributed` builds that C++ op on CPU at the first start (measured: docs/benchmarks.md, up to
    minutes on a loaded machine, silently). It serves only `inference_all_reduce` (DeepSpeed's tensor-parallel
    inference); training's collectives go through gloo either way. Marking it incompatible, as DeepSpeed itself
    does on platforms without it, makes `init_distributed` fall back to gloo at once. Must run before the
    training arguments are built (they start the distributed state). Returns whether it skipped.
    """
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        return False
    if importlib.util.find_spec("deepspeed") is None:
        return False
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # read by deepspeed.comm.torch.build_shm_op
    return True
