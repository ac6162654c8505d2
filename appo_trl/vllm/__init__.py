"""Floor 2: vLLM. Its samplers (a server over HTTP, TRL's colocated engine), replicas and router, weight sync.

Imports `appo_trl.sampling` (floor 1) and third-party packages only; never `rollout/` (the backends here
implement the contract `rollout/` consumes, `appo_trl.sampling`), algorithms, rewards or any higher floor.

Public API::

    from appo_trl.vllm import ServerClient, ServerSpec, VLLMServerBackend, resolve_servers

    backend = VLLMServerBackend("http://127.0.0.1:8000")      # a `Backend` for `rollout.RolloutEngine`
    spec = resolve_servers(args)                               # start-up: replicas, router, health, max_model_len
    backend = spec.backend(max_concurrency=512)                # on the router (resending) or the one server
    ServerClient(url).wait_healthy(240); ServerClient(url).reset_prefix_cache()

- `client`: `ServerClient` (health, served length, server info, `reload_weights`, prefix-cache reset) and the errors;
- `server`: `VLLMServerBackend`; `colocate`: `VLLMColocateBackend` (needs vLLM when used);
- `replicas` (`ReplicaSet`, `ReplicaBackend`), `router` (`VLLMRouter`, `RouterClient`), `spec` (`ServerSpec`);
- `weight_sync` (`DiskWeightSync`, `ColocateWeightSync`, `weight_sync_factory`) and `nccl` (`ReplicatedNCCLSync`):
  TRL's `VLLMGeneration` subclasses, imported from their modules (they load TRL and torch);
- `lora` (`AdapterVersions`, `choose_adapter_sync`): the adapter-only sync of a LoRA run, one name per version;
- `inflight` (`ServerPause`, `PolicyClock`, `pause_capability`): in-flight weight updates (docs/streaming.md).
"""

from appo_trl.vllm.client import (
    ServerClient,
    ServerMismatchError,
    ServerNotReadyError,
    VLLMAbortedError,
    VLLMRequestError,
    VLLMServerError,
    VLLMServerRestarted,
    WeightSyncError,
)
from appo_trl.vllm.colocate import VLLMColocateBackend, VLLMColocateError
from appo_trl.vllm.inflight import InFlightUpdateError, PauseMode, PolicyClock, ServerPause, pause_capability
from appo_trl.vllm.replicas import (
    ReplicaBackend,
    ReplicaRemovalError,
    ReplicasDownError,
    ReplicaSet,
    parse_server_urls,
)
from appo_trl.vllm.router import RouterClient, RouterError, VLLMRouter
from appo_trl.vllm.server import VLLMServerBackend
from appo_trl.vllm.spec import ServerSpec, resolve_servers, server_urls

__all__ = [
    "InFlightUpdateError",
    "PauseMode",
    "PolicyClock",
    "ReplicaBackend",
    "ReplicaRemovalError",
    "ReplicaSet",
    "ReplicasDownError",
    "RouterClient",
    "RouterError",
    "ServerClient",
    "ServerMismatchError",
    "ServerNotReadyError",
    "ServerSpec",
    "VLLMAbortedError",
    "VLLMColocateBackend",
    "VLLMColocateError",
    "VLLMRequestError",
    "VLLMRouter",
    "VLLMServerBackend",
    "VLLMServerError",
    "VLLMServerRestarted",
    "ServerPause",
    "WeightSyncError",
    "pause_capability",
    "parse_server_urls",
    "resolve_servers",
    "server_urls",
]
