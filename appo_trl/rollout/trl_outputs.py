"""Conversion of trajectories into the 8-tuple TRL 1.16's `GRPOTrainer._generate` returns.

`(prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images)`:

- `tool_mask` is the trajectory's `loss_mask` (1 = sampled by the policy; tool results, templates and a forced
  EOS are 0), exactly how TRL's own tool loop marks tool tokens;
- `logprobs` are the sampler's logprobs with NaN (not sampled) replaced by 0.0, which is what TRL pads tool
  tokens with; those positions have `tool_mask == 0`, so they never enter the importance-sampling ratio;
- `completions` are the decoded completions (`skip_special_tokens=True`, as TRL decodes), plain strings;
- `extra_fields` holds per-row lists that reach reward functions as keyword arguments: `uid`, `parent`,
  `branch_pos`, `group`, `num_calls`, `finish_reason` and `tool_calls` (list of dicts per row);
- `images` is None and `tool_images` is `[]` (text-only rollouts).
"""

from __future__ import annotations

import dataclasses
import math

from appo_trl.rollout.types import Trajectory


def to_trl_generate_outputs(trajs: list[Trajectory], tokenizer) -> tuple:
    """Build `GRPOTrainer._generate`'s return tuple from `trajs` (rows in the given order)."""
    for t in trajs:
        t.check()
    prompt_ids = [list(t.prompt_ids) for t in trajs]
    completion_ids = [list(t.completion_ids) for t in trajs]
    tool_mask = [list(t.loss_mask) for t in trajs]
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True) if trajs else []
    logprobs = [[0.0 if math.isnan(x) else float(x) for x in t.logprobs] for t in trajs]
    extra_fields = {
        "uid": [t.uid for t in trajs],
        "parent": [t.parent for t in trajs],
        "branch_pos": [t.branch_pos for t in trajs],
        "group": [t.group for t in trajs],
        "num_calls": [t.num_calls for t in trajs],
        "finish_reason": [t.finish_reason for t in trajs],
        "tool_calls": [[dataclasses.asdict(c) for c in t.tool_calls] for t in trajs],
    }
    return prompt_ids, completion_ids, tool_mask, list(completions), logprobs, extra_fields, None, []
