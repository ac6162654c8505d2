"""Several training processes and one set of vLLM servers: who is the main process, and its view broadcast.

The main process (global rank 0) starts the router, watches the replicas and syncs them; the other ranks take
its word through `broadcast_from_main` (a collective). With one process every function here is a plain call.
"""

from __future__ import annotations

import os

from appo_trl.vllm.client import WeightSyncError


def several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_from_main(obj):
    """`obj` of the main process (global rank 0) on every rank (a collective; `obj` itself when one process)."""
    if not several_processes():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_main_process(args) -> bool:
    """Global rank 0, or the only process. Under a launcher (`WORLD_SIZE` > 1) the process group is set up first,
    as `Trainer` would (`TrainingArguments.device`, accelerate's `PartialState`)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not several_processes():
        return True
    if not (dist.is_available() and dist.is_initialized()):
        getattr(args, "device", None)  # TrainingArguments._setup_devices: init_process_group
    if not several_processes():
        raise WeightSyncError(
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} but no torch.distributed process group: several training "
            "processes share the main process's vLLM router, and need the process group to learn its URL"
        )
    return dist.get_rank() == 0


def share_replica_view(replicas, is_main: bool, error: BaseException | None) -> None:
    """After a sync, on every rank: the main process's view of the replicas (and its error) to the others.

    A collective, so also the end-of-sync barrier. The main process raises its `error`; the others adopt its
    view, then raise a `WeightSyncError` with its message."""
    message, view = broadcast_from_main(
        (None if error is None else f"{type(error).__name__}: {error}", replicas.snapshot() if is_main else None)
    )
    if is_main:
        if error is not None:
            raise error
        return
    replicas.adopt(view)
    if message is not None:
        raise WeightSyncError(f"the weight sync of the vLLM replicas failed on the main process: {message}")


__all__ = ["broadcast_from_main", "is_main_process", "several_processes", "share_replica_view"]
