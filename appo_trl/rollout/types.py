"""Data types of the rollout layer: trajectories, tool-call records, the rollout config, branch contexts.

Everything here is plain data (dataclasses); no I/O and no torch. The backend contract (`SamplingParams`,
`Segment`, `Backend`) lives one floor down in `appo_trl.sampling` and is re-exported here. The token-level
contract every consumer relies on:

- `Segment` is one backend call: the exact token ids the sampler produced, each with the logprob of *that*
  token (matched by id, never the top-1 of the distribution), plus optional top-k logprobs.
- `Trajectory` is one row of the batch: `completion_ids`, `loss_mask` and `logprobs` always have the same
  length; `loss_mask` is 1 exactly for tokens the policy sampled, and tokens it did not sample (tool results,
  the template around them, a forced EOS) have mask 0 and logprob NaN.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import uuid
from typing import Any, Literal

from appo_trl.sampling import Backend, FinishReason, SamplingParams, Segment


@dataclasses.dataclass
class ToolCallRecord:
    """One tool call inside a trajectory.

    Args:
        tag: the tool's trigger tag (`"python"`, `"search"`).
        query: the text between `<tag>` and `</tag>`, stripped.
        result: the tool's output text as injected (before the result template).
        ok: False when the tool reported a failure.
        latency_s: wall time of the call.
        start, end: span of the injected result tokens in `completion_ids` (`completion_ids[start:end]`). Chat
            format with several calls in one assistant turn: `start` is where this call's template part and
            result begin, and the turn's calls share `end`, the end of their tool turn (where sampling resumes).
    """

    tag: str
    query: str
    result: str
    ok: bool
    latency_s: float
    start: int
    end: int


class Origin(enum.StrEnum):
    """A row's lineage: how it began (a `str`, so the rollout dump and TRL's `branch_origin` column read it as text).

    ROOT: an initial rollout. FORK: ARPO / AEPO's in-loop copy after a tool result (by a branching hook, or applied
    to an agent's recorded runs). REFILL: a fresh rollout that brings a group to size. BRANCH: a continuation from
    a parent's prefix between rounds, or an agent run branched by replay. RESTART: an agent chain begun because the
    agent rewrote its history.
    """

    ROOT = "root"
    FORK = "fork"
    REFILL = "refill"
    BRANCH = "branch"
    RESTART = "restart"


class Role(enum.StrEnum):
    """What a row is to TRL's batch: SAMPLE, a row TRL scores; CHAIN, an agent run's other sampled chain, trained
    with its run's reward and advantage (`Trajectory.chain_rows`, `appo_trl.trainer.chain_rows`)."""

    SAMPLE = "sample"
    CHAIN = "chain"


def new_uid() -> str:
    return uuid.uuid4().hex[:16]


@dataclasses.dataclass
class Trajectory:
    """One sampled episode: prompt, completion with tool results spliced in, and per-token records.

    Args:
        prompt_ids: the prompt as given to the engine.
        completion_ids: every token after the prompt, sampled or injected, exactly as fed to the sampler.
        loss_mask: 1 for tokens sampled by the policy, 0 for tool results, templates and forced tokens.
        logprobs: the sampler's logprob of each sampled token; NaN where `loss_mask` is 0.
        entropies: per-token truncated top-k entropy (nats) from the sampler's top logprobs when they were
            requested; NaN where not sampled or unknown. None when entropies were not recorded.
        tool_calls: the calls made, in order.
        num_calls: calls counted against `RolloutConfig.call_limit` (a branch starts from its prefix's count).
        finish_reason: `"eos"`, `"length"` (completion budget or model length), `"call_limit"` (a call over
            the call or turn limit: tags append a forced EOS; chat ends on the turn's own sampled end), `"empty_call"` (a tool tag with nothing inside) or
            `"running"` while unfinished.
        group: index of the prompt in the `rollout` call (branches keep their parent's).
        uid: unique id of this trajectory.
        parent: uid of the trajectory this one was branched from, None for a root.
        branch_pos: `completion_ids[:branch_pos]` was copied from the parent, never regenerated.
        origin: the row's lineage, an `Origin` (root, fork, refill, branch, restart).
        role: what the row is to TRL's batch, a `Role` (a sample TRL scores, or an agent run's other chain).
        seed: the row's sampling seed, keyed on its lineage (never on the order of creation).
        route_key: the routing key of its prompt group in its round (keeps the group and its branches on one replica).
        request_seeds: the seed of each sampler request, in order.
        root_entropy: window entropy of the first sampled segment (inherited by forks and branches); None before
            it is known or when entropies are not recorded.
        agent_reward: the reward an agent returned for its run (None: not an agent run, or it returned none); a
            list when it returned one reward per model call: one reward per assistant turn of this row.
        chain_rows: an agent run's other sampled chains (`role=Role.CHAIN`), trained with the run's reward.
        run: for a chain row, the uid of the run row it belongs to.
        chain: the index of this chain in its agent session.
        messages: an agent run's assistant messages (what reward functions see as the completion).
        generation_s: wall time spent sampling this row (agent chains).
        versions: per completion token, the policy version it was sampled under (from `Segment.version_runs`); an
            injected token (mask 0) carries the version of the token before it (the first sampled token's when it
            opens the row). None: the backend records no versions (every token is of the round's one version).
            `version_runs` gives them run-length encoded; a prefix copy (a branch) keeps its prefix's versions.
    """

    prompt_ids: list[int]
    completion_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    entropies: list[float] | None = None
    tool_calls: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    num_calls: int = 0
    finish_reason: str = "running"
    group: int = 0
    uid: str = dataclasses.field(default_factory=new_uid)
    parent: str | None = None
    branch_pos: int | None = None
    origin: Origin = Origin.ROOT
    role: Role = Role.SAMPLE
    seed: int = 0
    route_key: str | None = None
    request_seeds: list[int] = dataclasses.field(default_factory=list)
    root_entropy: float | None = None
    agent_reward: float | list[float] | None = None
    chain_rows: list[Trajectory] = dataclasses.field(default_factory=list)
    run: str | None = None
    chain: int | None = None
    messages: list[dict[str, Any]] | None = None
    generation_s: float = 0.0
    versions: list[int] | None = None

    @property
    def version_runs(self) -> list[tuple[int, int]] | None:
        """`versions` run-length encoded, `[(version, n_tokens), ...]` in token order (None: not recorded)."""
        if self.versions is None:
            return None
        runs: list[tuple[int, int]] = []
        for v in self.versions:
            if runs and runs[-1][0] == v:
                runs[-1] = (v, runs[-1][1] + 1)
            else:
                runs.append((v, 1))
        return runs

    def oldest_version(self) -> int | None:
        """The oldest version of a token the policy sampled (mask 1); None when versions are not recorded or the row
        sampled nothing. The staleness bound applies to it."""
        if self.versions is None:
            return None
        sampled = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(sampled) if sampled else None

    def check(self) -> None:
        """Raise `AssertionError` if the per-token lists disagree (cheap; the engine calls it on every row)."""
        n = len(self.completion_ids)
        assert len(self.loss_mask) == n and len(self.logprobs) == n, (n, len(self.loss_mask), len(self.logprobs))
        assert self.entropies is None or len(self.entropies) == n
        assert self.versions is None or len(self.versions) == n, (n, len(self.versions))

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None,
               entropies: list[float] | None = None, versions: list[int] | None = None) -> None:  # fmt: skip
        """Append tokens with one mask value; missing logprobs/entropies become NaN. `versions` (per token) starts
        or extends `self.versions`; without it an injected token takes the version before it, and a sampled
        token on a row that records versions is an error (its version would be guessed)."""
        if versions is not None:
            if len(versions) != len(ids):
                raise ValueError(f"{len(ids)} token ids but {len(versions)} versions")
            if self.versions is None:  # tokens before the first recorded ones (injected): the first version
                self.versions = [versions[0]] * len(self.completion_ids) if versions else None
            if self.versions is not None:
                self.versions.extend(int(v) for v in versions)
        elif self.versions is not None and ids:
            if mask:
                raise ValueError(f"row {self.uid}: {len(ids)} sampled tokens without policy versions on a row "
                                 "that records them")  # fmt: skip
            self.versions.extend([self.versions[-1] if self.versions else 0] * len(ids))
        self.completion_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [math.nan] * len(ids))
        if self.entropies is not None:
            self.entropies.extend(entropies if entropies is not None else [math.nan] * len(ids))

    def prefix_copy(self, position: int, **overrides: Any) -> Trajectory:
        """A new running trajectory whose completion is exactly `completion_ids[:position]` of this one.

        Tool calls whose result lies inside the prefix are carried over, and so is the call counter.
        """
        calls = [c for c in self.tool_calls if c.end <= position]
        fields = dict(
            prompt_ids=list(self.prompt_ids),
            completion_ids=self.completion_ids[:position],
            loss_mask=self.loss_mask[:position],
            logprobs=self.logprobs[:position],
            entropies=None if self.entropies is None else self.entropies[:position],
            versions=None if self.versions is None else self.versions[:position],
            tool_calls=[dataclasses.replace(c) for c in calls],
            num_calls=len(calls),
            group=self.group,
            parent=self.uid,
            branch_pos=position,
            root_entropy=self.root_entropy,
            route_key=self.route_key,
        )
        fields.update(overrides)
        return Trajectory(**fields)


@dataclasses.dataclass
class RolloutConfig:
    """How the engine samples and runs tools.

    Args:
        max_completion_length: most completion tokens per trajectory, tool results included.
        max_model_len: most prompt + completion tokens (the sampler's context length).
        call_limit: tool calls per trajectory over all tools (3 for reasoning, 6 for deep search); None: no
            limit. A call beyond it is not executed: a forced EOS (mask 0) ends the trajectory, as ARPO does. Chat
            format: each call of a multi-call turn counts; a turn that would pass the limit runs none of its calls.
        turn_limit: tool-calling turns per trajectory (TRL's `max_tool_calling_iterations`); None (default): no
            limit. Checked alongside `call_limit`: a turn beyond it runs none of its calls and ends the trajectory
            the same way. In the tag format every call is its own turn.
        temperature, top_p, top_k: sampling defaults.
        tool_tags: tags that trigger tools; `</tag>` is a stop string for each.
        result_template: the text injected after a call (ARPO's training format); `{result}` is the output.
        max_result_tokens: tool result tokens kept (the template included); longer results are cut.
        entropy_topk: top logprobs requested per token when entropies are recorded (ARPO: 10).
        entropy_window: tokens over which segment/root entropies are reduced (ARPO: 20).
        entropy_reduce: `"sum"` (ARPO's code) or `"mean"` over the window.
        entropy_normalize: divide window entropies by ln(vocabulary size), as ARPO's code does.
        record_entropies: request top-k logprobs and store per-token entropies even without a hook.
        hook_mode: `"faithful"` (the hook runs right after a result with the entropy of the segment that
            made the call) or `"lookahead"` (the engine samples `entropy_window` tokens after the result
            first; forks re-sample them from the position before).
        concurrency: most backend requests in flight from this engine.
    """

    max_completion_length: int = 1024
    max_model_len: int = 32768
    call_limit: int | None = 3
    turn_limit: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tool_tags: list[str] = dataclasses.field(default_factory=lambda: ["python", "search"])
    result_template: str = " <result>\n{result}\n</result>"
    max_result_tokens: int = 4096
    entropy_topk: int = 10
    entropy_window: int = 20
    entropy_reduce: Literal["sum", "mean"] = "sum"
    entropy_normalize: bool = True
    record_entropies: bool = False
    hook_mode: Literal["faithful", "lookahead"] = "faithful"
    concurrency: int = 256

    def __post_init__(self):
        if self.max_completion_length < 1 or self.max_model_len < 2:
            raise ValueError("max_completion_length must be >= 1 and max_model_len >= 2")
        for name in ("call_limit", "turn_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 or None (no limit), got {getattr(self, name)}")
        if self.entropy_reduce not in ("sum", "mean"):
            raise ValueError(f"entropy_reduce must be 'sum' or 'mean', got {self.entropy_reduce!r}")
        if self.hook_mode not in ("faithful", "lookahead"):
            raise ValueError(f"hook_mode must be 'faithful' or 'lookahead', got {self.hook_mode!r}")
        if "{result}" not in self.result_template:
            raise ValueError("result_template must contain '{result}'")

    @property
    def stop_strings(self) -> list[str]:
        return [f"</{tag}>" for tag in self.tool_tags]


@dataclasses.dataclass
class BranchContext:
    """What an in-loop branching hook sees after a tool result was appended to `trajectory`.

    Args:
        trajectory: the trajectory (read it, do not modify it).
        position: where forks would start: `completion_ids[:position]` is shared. In "faithful" mode this is
            right after the result; in "lookahead" mode it is before the `entropy_window` look-ahead tokens.
        segment_entropy: window entropy of the segment that ended with this tool call.
        root_entropy: window entropy of the trajectory's first segment (inherited by forks and branches).
        lookahead_entropy: window entropy of the tokens sampled right after the result ("lookahead" mode).
        group_size: trajectories created so far in this group (including this one).
        target: the group's final size.
        active: unfinished trajectories in the group (including this one).
    """

    trajectory: Trajectory
    position: int
    segment_entropy: float
    root_entropy: float
    lookahead_entropy: float | None
    group_size: int
    target: int
    active: int


__all__ = ["Backend", "BranchContext", "FinishReason", "RolloutConfig", "SamplingParams", "Segment", "ToolCallRecord",
           "Origin", "Role", "Trajectory", "new_uid"]  # fmt: skip
