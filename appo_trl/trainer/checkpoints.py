"""Checkpoints that survive interruptions: atomic saves, resume from the newest *complete* checkpoint.

Saving (`AtomicCheckpointMixin`, mixed into `APPOTrainer` and the SFT stage's trainer). transformers writes
`checkpoint-N/` in place, so a save cut short (SIGKILL, Ctrl-C or SIGTERM mid-save, a full disk) leaves a
folder that looks like the newest checkpoint and breaks every later resume. Here transformers' own
`Trainer._save_checkpoint` runs unchanged, but into `output_dir/_tmp-checkpoint-N/checkpoint-N` (its
`_get_output_dir` is redirected for the duration of the save); when every rank has written its files, the
writing process fsyncs them and renames the folder to `output_dir/checkpoint-N` (one `rename`, atomic on a
POSIX filesystem), then rotates old checkpoints (`save_total_limit`) and pushes (`hub_strategy`) as
transformers would. A save that fails removes its `_tmp-checkpoint-N`; one that is killed leaves it, and the
next save of the run removes it. A full disk raises `CheckpointSaveError`: "No space left on device", the
folder, and which earlier checkpoint is intact, if any (transformers' message is torch's
`unexpected pos 1763584 vs 1763472`).

Resuming (`resolve_resume_checkpoint`). `resume_from_checkpoint: true` (YAML) or `--resume_from_checkpoint true`
(CLI) means "continue from the newest complete `checkpoint-N` in `output_dir` if there is one, else start
fresh" (transformers raises when asked to resume and no checkpoint exists, which breaks re-running the same
recipe after a crash that came before the first save). A checkpoint is complete when `checkpoint_problem`
finds nothing wrong: not empty, a `trainer_state.json` that parses, no 0-byte file, every `*.json` parses and
every `*.safetensors` is as long as its header says. Broken folders (left by older versions or other tools)
are skipped with a warning naming each one and why. A path is used as is and must be a complete checkpoint;
`false`/empty means no resume.

Checkpoints are plain `transformers` folders (`model.safetensors`, `config.json`, tokenizer files,
`optimizer.pt`, `scheduler.pt`, `trainer_state.json`, `rng_state*.pth`; `APPOTrainer` adds
`appo_sampler_state.json`, the round counter its sampling seeds derive from): they load with
`AutoModelForCausalLM.from_pretrained` without any conversion step. Under DeepSpeed ZeRO-3 this needs
`zero3_save_16bit_model: true` in the accelerate config (the shipped zero3.yaml sets it).

What this does not do: make a save on a filesystem without atomic `rename` (some object-store mounts) atomic,
or check tensor values inside the files.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import struct

from appo_trl.configs.errors import ConfigError

logger = logging.getLogger(__name__)

TRUE_VALUES = {"true", "yes", "1", "last"}
FALSE_VALUES = {"false", "no", "0", "none", "null", ""}
PREFIX = "checkpoint"
STAGING_PREFIX = "_tmp-checkpoint-"  # `_*` is also left out of transformers' Hub uploads of output_dir
SAMPLER_STATE_NAME = "appo_sampler_state.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
LOW_DISK_BYTES = 64 * 2**20  # a torch write error with less free space than this is a full disk


class CheckpointError(ConfigError, FileNotFoundError):
    """`resume_from_checkpoint` names a folder that is missing or is not a complete checkpoint."""


class CheckpointSaveError(ConfigError, OSError):
    """A checkpoint could not be written (a full disk); the earlier checkpoints, if any, are intact."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


# ---- completeness ----------------------------------------------------------------------------------------------
def _safetensors_problem(path: str) -> str | None:
    """Why a `.safetensors` file is not whole (header length, header JSON, data length), or None."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{os.path.basename(path)} is truncated ({size} bytes)"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"{os.path.basename(path)} is truncated ({size} bytes, header says more)"
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            return f"{os.path.basename(path)} has an unreadable header"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{os.path.basename(path)} is truncated ({size} bytes of {8 + n + end})"
    return None


def checkpoint_problem(path: str) -> str | None:
    """What makes `path` an incomplete checkpoint (one short phrase), or None when it looks complete."""
    if not os.path.isdir(path):
        return "not a folder"
    names = sorted(os.listdir(path))
    if not names:
        return "empty folder"
    empty = [n for n in names if os.path.isfile(os.path.join(path, n)) and os.path.getsize(os.path.join(path, n)) == 0]
    state = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state):
        return "no trainer_state.json" + (f" (0-byte {', '.join(empty)})" if empty else "")
    if empty:
        return f"0-byte {', '.join(empty)}"
    for name in names:
        file = os.path.join(path, name)
        if name.endswith(".json") and os.path.getsize(file) < 2**26:
            try:
                with open(file, encoding="utf-8") as fh:
                    json.load(fh)
            except (ValueError, UnicodeDecodeError) as exc:
                return f"{name} is truncated or not JSON ({os.path.getsize(file)} bytes: {exc})"
        elif name.endswith(".safetensors"):
            problem = _safetensors_problem(file)
            if problem:
                return problem
    return None


def list_checkpoints(output_dir: str) -> list[str]:
    """`checkpoint-N` folders of `output_dir`, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(output_dir) if (m := _CHECKPOINT_RE.match(n))]
    return [os.path.join(output_dir, n) for _, n in sorted(found, reverse=True)]


def staging_folders(output_dir: str) -> list[str]:
    """`_tmp-checkpoint-N` folders: saves that were interrupted (or one in progress)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(os.path.join(output_dir, n) for n in os.listdir(output_dir) if n.startswith(STAGING_PREFIX))


def last_complete_checkpoint(output_dir: str, log: bool = True) -> str | None:
    """The newest complete `checkpoint-N` of `output_dir`; each broken one newer than it is logged as skipped."""
    for path in list_checkpoints(output_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if log:
            logger.warning("resume: skipping %s, an incomplete checkpoint (%s)", path, problem)
    return None


def resolve_resume_checkpoint(value: str | bool | None, output_dir: str) -> str | None:
    """Map `resume_from_checkpoint` to a checkpoint folder (or None to start fresh).

    Args:
        value: True / "true" / "last" for the newest complete checkpoint in `output_dir`; a folder path; or a false
            value.
        output_dir: the run's output folder, searched for `checkpoint-N` sub-folders.

    Raises:
        CheckpointError: `value` is a path that does not exist or is not a complete checkpoint.
    """
    if value is None or value is False:
        return None
    text = str(value).strip()
    if text.lower() in FALSE_VALUES:
        return None
    if value is True or text.lower() in TRUE_VALUES:
        for stale in staging_folders(output_dir):
            logger.warning("resume: ignoring %s, an interrupted save (the next save removes it)", stale)
        last = last_complete_checkpoint(output_dir)
        if last is None:
            logger.info("resume_from_checkpoint: no complete checkpoint in %s yet, starting from scratch", output_dir)
        else:
            logger.info("Resuming from %s", last)
        return last
    if not os.path.isdir(text):
        raise CheckpointError(f"resume_from_checkpoint={text!r} is not a folder.")
    problem = checkpoint_problem(text)
    if problem is not None:
        newest = last_complete_checkpoint(os.path.dirname(os.path.abspath(text)), log=False)
        hint = f"; the newest complete one there is {newest}" if newest else ""
        raise CheckpointError(f"resume_from_checkpoint={text!r} is an incomplete checkpoint ({problem}){hint}.")
    return text


# ---- sampler state ---------------------------------------------------------------------------------------------
def write_sampler_state(folder: str, state: dict) -> None:
    with open(os.path.join(folder, SAMPLER_STATE_NAME), "w", encoding="utf-8") as fh:
        json.dump(state, fh)


def read_sampler_state(folder: str) -> dict | None:
    """The state `write_sampler_state` saved in `folder`, or None for a checkpoint without one."""
    path = os.path.join(folder, SAMPLER_STATE_NAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


# ---- atomic save -----------------------------------------------------------------------------------------------
def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staged: str, final: str) -> None:
    """Move the finished `staged` folder to `final` with one rename (a broken `final` of an earlier run is
    replaced: moved aside into the staging folder first, removed after)."""
    _fsync_tree(staged)
    staging_root = os.path.dirname(staged)
    if os.path.lexists(final):
        os.rename(final, os.path.join(staging_root, "replaced"))
    os.rename(staged, final)
    _fsync_dir(os.path.dirname(final))
    shutil.rmtree(staging_root, ignore_errors=True)


def is_disk_full(exc: BaseException, folder: str) -> bool:
    """True when `exc` (or its cause) is ENOSPC, or a torch write error while `folder`'s disk is (nearly) full."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or "StorageFull" in text:
            return True
        if "unexpected pos" in text or "file write failed" in text:
            try:
                return shutil.disk_usage(folder).free < LOW_DISK_BYTES
            except OSError:
                return False
        seen = seen.__cause__ or seen.__context__
    return False


FINAL_STAGING = "_tmp-final-model"  # the final save's staging folder inside output_dir (left out of Hub uploads)


def save_final_model(trainer, output_dir: str, save_state: bool = True) -> None:
    """`trainer.save_model(output_dir)` (and `save_state()`), never leaving a folder that looks complete but is not.

    The model (weights, config, tokenizer) is written into `output_dir/_tmp-final-model/` first and its files are
    moved into `output_dir` once all are written, `config.json` last. A failed save removes the staging folder; a
    full disk raises `CheckpointSaveError` naming the newest complete checkpoint (the trained weights it keeps).
    """
    staging, writer = os.path.join(output_dir, FINAL_STAGING), trainer.args.should_save
    if writer:
        shutil.rmtree(staging, ignore_errors=True)  # a final save killed earlier
    try:
        trainer.save_model(staging)
        trainer.accelerator.wait_for_everyone()
        if writer:
            _fsync_tree(staging)
            for name in sorted(os.listdir(staging), key=lambda n: n == "config.json"):
                dest = os.path.join(output_dir, name)
                if os.path.isdir(dest) and not os.path.islink(dest):
                    shutil.rmtree(dest)
                os.replace(os.path.join(staging, name), dest)
            os.rmdir(staging)
            _fsync_dir(output_dir)
        if save_state:
            trainer.save_state()  # trainer_state.json (the log history `appo plot OUTPUT_DIR` draws)
    except BaseException as exc:  # also Ctrl-C / SIGTERM: no half-written model stays behind
        full = writer and is_disk_full(exc, output_dir)
        if writer:
            shutil.rmtree(staging, ignore_errors=True)
        if not full:
            raise
        last = last_complete_checkpoint(output_dir, log=False)
        kept = (
            f"the newest complete checkpoint, {last}, keeps the weights of its step"
            if last
            else "no checkpoint was saved, so the trained weights are lost (set save_strategy)"
        )
        free = shutil.disk_usage(output_dir).free // 2**20
        raise CheckpointSaveError(
            f"saving the final model to {output_dir} failed: No space left on device ({free} MiB free after "
            f"removing the unfinished save); {kept}. Free some space, then {_next_step(last)}"
        ) from exc


def _next_step(last: str | None) -> str:
    """What to do after a full disk: resume from `last`, or (no checkpoint) run again."""
    return "resume with --resume_from_checkpoint true" if last else "run again (there is no checkpoint to resume)"


class AtomicCheckpointMixin:
    """Atomic `_save_checkpoint` for a transformers `Trainer` subclass (put it first among the bases).

    Everything transformers (and TRL above it) writes into a checkpoint lands in a staging folder first; see the
    module docstring. Every rank calls `_save_checkpoint`, so the barriers here are collective like the save.
    """

    _staging_root: str | None = None
    _push_deferred: bool = False

    def _get_output_dir(self, trial):
        return self._staging_root or super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder):
        if self._staging_root is not None:  # pushed from the final folder once it exists
            self._push_deferred = True
            return
        super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import rotate_checkpoints

        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        staging_root = os.path.join(run_dir, f"{STAGING_PREFIX}{self.state.global_step}")
        staged = os.path.join(staging_root, name)
        writer = self.args.should_save
        if writer:
            for stale in staging_folders(run_dir):  # saves killed earlier (this process saves one at a time)
                shutil.rmtree(stale, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_root, self._push_deferred = staging_root, False
        try:
            super()._save_checkpoint(model, trial)
            self._staging_root = None
            if writer and self.state.best_model_checkpoint == staged:  # transformers saw the staged path
                self.state.best_model_checkpoint = final
                self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
            self.accelerator.wait_for_everyone()  # every rank's files (rng_state_K.pth, shards) are in `staged`
            if writer:
                publish(staged, final)
        except BaseException as exc:  # also Ctrl-C / SIGTERM: nothing half-written stays behind
            self._staging_root = None
            full = writer and is_disk_full(exc, run_dir)
            if writer:
                shutil.rmtree(staging_root, ignore_errors=True)
            if full:
                free = shutil.disk_usage(run_dir).free // 2**20
                last = last_complete_checkpoint(run_dir, log=False)
                kept = (
                    f"the earlier checkpoints are intact (newest: {last})" if last else "no checkpoint was saved yet"
                )
                raise CheckpointSaveError(
                    f"saving {final} failed: No space left on device ({run_dir}: {free} MiB free after removing "
                    f"the unfinished save); {kept}. Free some space, then {_next_step(last)}",
                ) from exc
            raise
        finally:
            self._staging_root = None
        if writer:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()
        if self._push_deferred:
            self._push_deferred = False
            super()._push_from_checkpoint(final)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers' loader; on a multi-process CPU run the optimizer state is mapped to `"cpu"`, not to
        `args.device` (`cpu:0`, a location `torch.load` cannot restore to: every such resume crashed)."""
        device = self.args.device
        if checkpoint is None or self.args.world_size <= 1 or device.type != "cpu" or device.index is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        import torch

        real_load = torch.load

        def load(*args, map_location=None, **kwargs):
            if isinstance(map_location, torch.device) and map_location.type == "cpu":
                map_location = "cpu"
            return real_load(*args, map_location=map_location, **kwargs)

        torch.load = load  # only for this call (no other thread loads while a run resumes)
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            torch.load = real_load

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint=True` takes the newest *complete* checkpoint of `output_dir`."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise CheckpointError(f"resume_from_checkpoint=True: no complete checkpoint in {self.args.output_dir}")
        return super().train(resume_from_checkpoint, *args, **kwargs)
