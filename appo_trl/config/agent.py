"""The help of `APPOConfig`'s agent fields (training the user's own agent through the OpenAI-compatible endpoint).

The fields themselves are declared on `APPOConfig`; the contract and the endpoint are described in
`appo_trl.trainer.agents` and `appo_trl.rollout.agent_endpoint`.
"""

from __future__ import annotations

from appo_trl.config.script import _rollout

AGENT_HELP = {
    "agent": _rollout(
        "Your own agent, `module:function` (a file beside the recipe or a module on the path, as `tools`): "
        "`agent(row, base_url, model) -> float | None` (or `async def`) runs one trajectory against the trainer's "
        "OpenAI-compatible endpoint at `base_url`; its return value is the reward (None: the reward functions score "
        "the conversation)."
    ),
    "agent_errors": _rollout(
        "An agent that raises or times out: `zero` gives its trajectory reward 0 (counted in `agent/errors`, each "
        "distinct error logged once); `raise` stops the run."
    ),
    "agent_timeout_s": _rollout("Seconds one agent run may take before it is abandoned (as an error)."),
    "max_failed_agent_rounds": _rollout(
        "Training rounds in a row in which every agent run fails (raises or times out) before the run stops with the "
        "most common error; such a round trains nothing (a warning at its first). 0: never stop."
    ),
    "agent_host": _rollout(
        "Address the agent endpoint binds (another host: for agents in remote sandboxes; the per-run secret in "
        "every URL keeps other clients out). A wildcard (0.0.0.0, ::) gives agents this machine's address on its "
        "default route (else loopback) in their base URL."
    ),
    "agent_port": _rollout("Port of the agent endpoint (0: any free port)."),
}
