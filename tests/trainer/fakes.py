"""Scripted stand-ins for the rollout engine (the `appo_trl.rollout.RolloutEngine` contract), for trainer tests.

`ScriptedEngine` returns deterministic trajectories built from real token ids of the tiny tokenizer:
    <think> … </think> <python> print(k) </python>   sampled (loss_mask 1, logprob −0.5, entropy varies)
    <result> k </result>                             tool output (loss_mask 0, logprob NaN)
    <answer> a </answer><|im_end|>                   sampled
where the answer `a` of row j of a group is `j % 3`. Branches copy the parent's prefix up to the branch point
and append a scripted continuation ending in `<answer> 1 </answer>`. Every call is recorded.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from appo_trl.rollout.types import new_uid


@dataclass
class FakeTrajectory:
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    entropies: list[float]
    tool_calls: list = field(default_factory=list)
    num_calls: int = 0
    finish_reason: str = "stop"
    group: int = 0
    uid: str = field(default_factory=new_uid)
    parent: str | None = None
    branch_pos: int | None = None
    origin: str = "root"
    role: str = "sample"
    meta: dict = field(default_factory=dict)


class ScriptedEngine:
    """A `Sampler` (`appo_trl.sampling`) of scripted rows: roots from `rollout`, continuations from `branch_many`."""

    replays_branches = False

    def __init__(self, tokenizer, filler: int = 0):
        from appo_trl.rollout import RolloutConfig

        self.config = RolloutConfig()
        self.tok = tokenizer
        self.filler = filler  # extra "the" tokens in the think segment (longer completions)
        self.rollout_calls: list[tuple[int, int]] = []  # (num prompts, n)
        self.branch_requests: list[dict] = []
        self.hooks: list = []
        self.initial: list[FakeTrajectory] = []  # every rollout() trajectory, groups flattened, in order

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _segments(self, j: int):
        think = (
            "<think> what is the answer" + " the" * self.filler + " </think> <python> print(" + str(j) + ") </python>"
        )
        return [
            (self._ids(think), 1),
            (self._ids(f"<result> {j} </result>"), 0),
            (self._ids(f"<answer> {j % 3} </answer>") + [self.tok.convert_tokens_to_ids("<|im_end|>")], 1),
        ]

    def _traj(self, prompt_ids, segments, **kw):
        ids, mask = [], []
        for seg, m in segments:
            ids += seg
            mask += [m] * len(seg)
        lps = [-0.5 if m else math.nan for m in mask]
        ents = [0.1 + 0.05 * (i % 7) if m else math.nan for i, m in enumerate(mask)]
        return FakeTrajectory(list(prompt_ids), ids, mask, lps, ents, **kw)

    async def rollout(self, prompts, n, *, seed, hook=None, group_size=None, route_seed=None):
        """Scripted roots only: the hook is recorded, never called; a group gets `group_size` (default n) rows."""
        self.rollout_calls.append((len(prompts), n))
        self.hooks.append(hook)
        sizes = group_size if group_size is not None else n
        sizes = sizes if isinstance(sizes, list) else [sizes] * len(prompts)
        groups = [
            [self._traj(p, self._segments(j), num_calls=1, group=g) for j in range(k)]
            for g, (p, k) in enumerate(zip(prompts, sizes))
        ]
        self.initial += [t for g in groups for t in g]
        return groups

    async def branch_many(self, requests, *, seed, resample=True):
        out = []
        for parent, pos in requests:
            self.branch_requests.append((parent, pos, resample))
            cut = pos if resample else pos + 1
            prefix = [(parent.completion_ids[:cut], None)]
            cont = self._ids("<answer> 1 </answer>") + [self.tok.convert_tokens_to_ids("<|im_end|>")]
            t = self._traj(parent.prompt_ids, [(cont, 1)], num_calls=parent.num_calls, parent=parent.uid, branch_pos=pos,
                           origin="branch")  # fmt: skip
            t.completion_ids = parent.completion_ids[:cut] + t.completion_ids
            t.loss_mask = [0] * cut + t.loss_mask
            t.logprobs = parent.logprobs[:cut] + t.logprobs
            t.entropies = parent.entropies[:cut] + t.entropies
            del prefix
            out.append(t)
        return out

    def run(self, coro):
        return asyncio.run(coro)
