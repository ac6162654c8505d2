"""Floor 1: the sampler contract: `SamplingParams` (a request), `Segment` (its answer), `Backend` (who answers), and
`Sampler` (what a rollout strategy samples a round on).

Plain data and two `Protocol`s: no I/O, no torch. Every backend (`appo_trl.rollout`'s in-process sampler,
`appo_trl.vllm`'s server and colocated engines) and every consumer (the rollout engine) speak it, so it sits
below them all. It imports nothing of `appo_trl`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "eos", "length"]


@dataclasses.dataclass
class SamplingParams:
    """What one backend request asks for.

    Args:
        max_tokens: most tokens to sample in this request (>= 1).
        temperature: softmax temperature (0 = greedy).
        top_p: nucleus sampling mass (1.0 = disabled).
        top_k: keep the k most likely tokens (-1 = disabled).
        seed: per-request seed; the engine gives every request a distinct one.
        stop: stop strings; the segment ends with the token that completes one (that token is kept whole).
        logprobs: top logprobs wanted per token besides the sampled one (0 = only the sampled token's).
        session_id: routing key, not a sampling setting: every request of one tree (a prompt's group, its
            branches and tool rounds) carries the same one, so a router in front of several vLLM replicas sends
            them all to the replica that holds their prefix in its cache (`X-Session-ID`). None: no key.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    logprobs: int = 0
    session_id: str | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")


@dataclasses.dataclass
class Segment:
    """The tokens sampled by one backend request.

    Args:
        token_ids: exact sampled ids, including the whole token that completes a stop string and the EOS id
            when the model ended the sequence.
        logprobs: per token, the logprob of the sampled token (processed: after temperature/top-k/top-p).
        top_logprobs: per token, `{token_id: logprob}` of the top `SamplingParams.logprobs` tokens plus the
            sampled one; None when `logprobs=0` was requested.
        finish_reason: `"stop"` (a stop string), `"eos"` (an end-of-sequence token) or `"length"` (`max_tokens`).
        stop_str: the stop string that ended the segment when `finish_reason == "stop"`.
        latency_s: wall time of the request, seconds (metrics only).
        version_runs: the policy version each token was sampled under, run-length encoded: `(version, n_tokens)`
            in token order, summing to `len(token_ids)` (a weight update in flight splits a completion in two
            runs). Empty: the backend does not record versions (every token is of the round's one version).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason = "length"
    stop_str: str | None = None
    latency_s: float = 0.0
    version_runs: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.top_logprobs)} top_logprobs entries")
        if self.version_runs and sum(n for _, n in self.version_runs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but version_runs {self.version_runs} cover "
                             f"{sum(n for _, n in self.version_runs)}")  # fmt: skip


def add_version_run(runs: list[tuple[int, int]], version: int, n_tokens: int) -> None:
    """Append `n_tokens` sampled under `version` to the run-length list `runs` (merged into its last run when that
    is of the same version; `n_tokens` 0 adds nothing)."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if not n_tokens:
        return
    if runs and runs[-1][0] == version:
        runs[-1] = (version, runs[-1][1] + n_tokens)
    elif runs and version < runs[-1][0]:
        raise ValueError(f"version {version} after version {runs[-1][0]}: a completion's versions never go back")
    else:
        runs.append((version, n_tokens))


@runtime_checkable
class Backend(Protocol):
    """A sampler: continue `prompt_ids` with `params`. Many calls may be in flight at once."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Segment: ...


@runtime_checkable
class Sampler(Protocol):
    """What a rollout strategy samples one round on (`RolloutStrategy.generate(..., engine)`): appo-trl's
    `RolloutEngine`, an agent round's `AgentEngine`, or a `rollout_engine=` of the user's.

    `rollout` samples n rows per prompt (groups, initial first; `hook` is ARPO/AEPO's in-loop branch rule),
    `branch_many` continues each (parent row, completion position) request, `run` runs either coroutine to its end
    on the sampler's loop, `config` is its `RolloutConfig`. `replays_branches`: True when the rows are recorded runs
    that branch by replay (the user's agent): a strategy then applies its in-loop rule to the recorded runs instead
    of passing `hook`.
    """

    replays_branches: bool
    config: Any

    async def rollout(self, prompts: list[list[int]], n: Any, *, seed: int, hook: Any = None, group_size: Any = None,
                      route_seed: Any = None) -> list[list[Any]]: ...  # fmt: skip

    async def branch_many(self, requests: list[tuple[Any, int]], *, seed: int, resample: bool = True) -> list[Any]: ...

    def run(self, coro: Any) -> Any: ...


def missing_members(obj: object, protocol: type) -> list[str]:
    """The members of `protocol` that `obj` lacks (empty: it speaks the protocol)."""
    members = [*getattr(protocol, "__annotations__", {}), *(k for k, v in vars(protocol).items() if callable(v)
                                                            and not k.startswith("_"))]  # fmt: skip
    return [m for m in dict.fromkeys(members) if not hasattr(obj, m)]


__all__ = ["Backend", "FinishReason", "Sampler", "SamplingParams", "Segment", "add_version_run", "missing_members"]
