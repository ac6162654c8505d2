"""`AgentFields`: the config of training the user's own agent through the OpenAI-compatible endpoint.

A field mixin of `APPOConfig` (after `GRPOConfig` in its bases, so TRL's positional fields keep their places). The
agent contract and the endpoint are described in `appo_trl.trainer.agents` and `appo_trl.rollout.agent_endpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from appo_trl.trainer.config.script import _rollout


@dataclass
class AgentFields:
    agent: str | None = field(
        default=None,
        metadata=_rollout(
            "Your own agent, `module:function` (a file beside the recipe or a module on the path, as `tools`): "
            "`agent(row, base_url, model) -> float | None` (or `async def`) runs one trajectory against the "
            "trainer's OpenAI-compatible endpoint at `base_url`; its return value is the reward (None: the "
            "reward functions score the conversation).",
        ),
    )
    agent_errors: Literal["zero", "raise"] = field(
        default="zero",
        metadata=_rollout(
            "An agent that raises or times out: `zero` gives its trajectory reward 0 (counted in `agent/errors`, "
            "each distinct error logged once); `raise` stops the run.",
        ),
    )
    agent_timeout_s: float = field(
        default=600.0, metadata=_rollout("Seconds one agent run may take before it is abandoned (as an error).")
    )
    agent_host: str = field(
        default="127.0.0.1",
        metadata=_rollout(
            "Address the agent endpoint binds (another host: for agents in remote sandboxes; the per-run secret "
            "in every URL keeps other clients out).",
        ),
    )
    agent_port: int = field(default=0, metadata=_rollout("Port of the agent endpoint (0: any free port)."))
