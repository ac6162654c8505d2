"""Floor 2: the sampler. Generation backends, the async multi-turn tool loop, exact-token trajectories, branching.

Imports `appo_trl.tools` and `appo_trl.sampling` (floor 1) only; never `vllm/` (its backends plug in through the
`Backend` contract), the trainer, algorithms or evaluation.

Public API::

    from appo_trl.rollout import (RolloutEngine, RolloutConfig, SamplingParams, Segment, Trajectory,
                                  ToolCallRecord, BranchContext, TransformersBackend, to_trl_generate_outputs)
    from appo_trl.vllm import VLLMServerBackend

    backend = VLLMServerBackend("http://127.0.0.1:8000")          # or TransformersBackend(model, tokenizer)
    engine = RolloutEngine(backend, tokenizer, RolloutConfig(max_completion_length=8192, call_limit=3), tools)
    groups = engine.run(engine.rollout(prompt_ids, n=8, seed=step))  # list (per prompt) of list[Trajectory]
    child = engine.run(engine.branch(groups[0][1], position=57, seed=step))     # re-sample token 57 onward
    kept = engine.run(engine.branch(groups[0][1], 57, seed=step, resample=False))  # keep token 57
    out = to_trl_generate_outputs([t for g in groups for t in g], tokenizer)       # GRPOTrainer._generate tuple
    engine.metrics(); engine.close()

- `Backend.generate(prompt_ids, SamplingParams) -> Segment` (`appo_trl.sampling`): `TransformersBackend`
  (in-process, batches concurrent requests) here; `appo_trl.vllm`'s `VLLMServerBackend` (HTTP `/v1/completions`
  of `vllm serve`, token ids in and out) and `VLLMColocateBackend` (TRL's in-process `vllm.LLM`).
- `engine.environments = environments.RoundEnvironments(...)`: TRL's `environment_factory`, one instance per
  trajectory, forks and branches in their parent's state at the fork (set per round by the trainer).
- `RolloutEngine.rollout(prompts, n, *, seed, hook=None, group_size=None)`: every trajectory is its own task
  (no per-round barrier). `hook(ctx: BranchContext) -> int` (sync or async) runs after each tool result and
  returns how many copies to fork there; groups are capped at `group_size` (default `n`) and refilled from
  the bare prompt when they have no active trajectory, so each group ends with exactly `group_size` rows.
- `RolloutEngine.branch(parent, position, *, seed, resample=True)` / `branch_many(requests, *, seed)`:
  continue from `prompt + completion[:position]` (`resample=False` keeps token `position` too).
- `RolloutEngine.run(coro)`: run a coroutine from synchronous code (the engine owns one event-loop thread).
"""

from appo_trl.rollout.engine import Hook, RolloutEngine, mix_seed
from appo_trl.rollout.transformers_backend import TransformersBackend
from appo_trl.rollout.trl_outputs import to_trl_generate_outputs
from appo_trl.rollout.types import (
    Backend,
    BranchContext,
    RolloutConfig,
    SamplingParams,
    Segment,
    ToolCallRecord,
    Trajectory,
)

__all__ = [
    "Backend",
    "BranchContext",
    "Hook",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingParams",
    "Segment",
    "ToolCallRecord",
    "Trajectory",
    "TransformersBackend",
    "mix_seed",
    "to_trl_generate_outputs",
]
