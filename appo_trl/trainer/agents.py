"""Training the user's own agent: `APPOTrainer(agent=...)` / recipe `agent: module:function`.

The contract: `agent(row, base_url, model) -> float | None` (or `async def`) runs one trajectory of dataset row
`row` against `base_url`, an OpenAI-compatible base URL of the trainer's endpoint unique to this run
(`appo_trl.rollout.agent_endpoint`); its return value is the trajectory's reward, None lets the reward functions
score the captured conversation (TRL's signature: `prompts`, `completions` as messages, the row's columns). With
`advantage_estimator: tree` it may return a list, one reward per model call (`appo_trl.trainer.turn_rewards`).
`AgentRounds.generate` runs `num_generations` agent runs per prompt (each on a daemon thread of its own, an async agent
on its own event loop there: `appo_trl.trainer.agent_threads`; at most `rollout_concurrency` at a time) and turns
each run into one row of its group.

Rows: TRL scores one row per run (`AgentSession.row`: its last chain of exact ids; a branch's: the chain of its
branch call), so rewards and group statistics are over runs. A run whose agent rewrote its history (`agent/restarts`)
also trains on its other sampled chains (`row.chain_rows`, `agent/chain_rows`), appended with the run's reward and
advantage after TRL's scoring (`appo_trl.trainer.chain_rows`). Rewards: the agent's number reaches TRL as the
`agent_reward` column of the reward function `agent_reward` (first in `reward_funcs`); where it is set, the other
reward functions' values, per-turn lists included, are ignored (`agent_rewards_override`), so a row is never scored
twice.

Faults: an agent that raises or runs past `agent_timeout_s` gets reward 0 (`agent/errors`, `agent/timeouts`; each
distinct error's first line logged once) or, with `agent_errors: raise`, stops the run; an agent that returns
without any request is an error naming it. A reward that is not finite (inf, NaN, over 1e15) is None, with one
warning naming the agent; an async agent that blocks its loop is named in one warning. `close()` (Ctrl-C included)
cancels the runs, ends every session, stops the endpoint and its loop, and waits for the runs' threads at most
`EXIT_GRACE_S` in all; runs still going are abandoned (their threads are daemons).

Branching is by replay, for every strategy whose class has `branches_by_replay`: the strategy samples through
`AgentEngine`, chooses its points on the recorded runs (appo: after its forward; arpo/aepo: their hook at each fork
point, `appo_trl.strategies.arpo_replay`), and `branch_many` re-runs the agent with the parent's recorded
answers up to the branch call (`AgentSession.branch_call`). Background rounds (`max_staleness >= 1`): `generate`
runs on the round's thread, `report` logs the round's counts at its hand-over on the trainer's thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
import math
import numbers
import threading
import time

from appo_trl.rollout.types import Origin, Role, Trajectory
from appo_trl.strategies import AgentReport, Round
from appo_trl.trainer import trl_seams
from appo_trl.trainer.agent_threads import AgentRun, join_within
from appo_trl.trainer.reward_checks import REWARD_LIMIT, non_finite_note, usable_reward
from appo_trl.trainer.turn_rewards import call_rewards_per_turn

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 3.0  # at close (the end, Ctrl-C, an error): how long all agent runs together get to stop
BLOCKED_LOOP_S = 1.0  # an async agent whose own loop was blocked this long is named in a warning


def agent_label(agent) -> str:
    """The agent as messages name it, quoted: `agent 'agent' failed`, not `agent agent failed`."""
    return repr(getattr(agent, "__qualname__", None) or getattr(agent, "__name__", None) or type(agent).__name__)


class AgentError(RuntimeError):
    """The user's agent failed (raised, timed out, or returned a bad value) under `agent_errors: raise`."""


def resolve_agent(args, agent, tool_dirs=(), *, tools=None):
    """The agent callable of `APPOTrainer(agent=...)` or `args.agent` (`module:function`, found as tools are), or None;
    ValueError for an agent that cannot be found or called, or a taken `agent_port`. What cannot run beside an agent
    is refused by the sampling path (`appo_trl.trainer.sampling_paths.REFUSALS`)."""
    if agent is not None and args.agent:
        raise ValueError("APPOTrainer: pass the agent either as APPOTrainer(agent=...) or APPOConfig(agent=...).")
    agent = agent if agent is not None else args.agent
    if agent is None:
        return None
    from appo_trl.configs.plan import StartupPlan

    if isinstance(tools, StartupPlan):  # `appo train`: the plan carries the recipe's folder
        tool_dirs, tools = (*tool_dirs, *tools.tool_dirs), tools.tool_specs
    if isinstance(agent, str):
        from appo_trl.tools.callables import ToolSpecError, load_callable

        try:
            agent = load_callable(agent, tool_dirs)
        except ToolSpecError as exc:
            raise ValueError(f"agent: {exc}") from None
    if not callable(agent):
        raise ValueError(f"agent {agent!r} is not callable: give `def agent(row, base_url, model) -> float | None`")
    from appo_trl.configs.preflight import agent_port_problem

    problem = agent_port_problem(args.agent_host, args.agent_port)  # before the model loads
    if problem:
        raise ValueError(f"agent {agent_label(agent)}: {problem}")
    return agent


class AgentReward:
    """The reward function that hands TRL each run's own reward (the `agent_reward` column; None: not given)."""

    __name__ = "agent_reward"

    def __call__(self, prompts=None, completions=None, agent_reward=None, **kwargs):
        return list(agent_reward) if agent_reward is not None else [None] * len(completions)


def with_agent_reward(reward_funcs, args, agent):
    """`reward_funcs` with `AgentReward` first when an agent is set (and a weight of 1 for it)."""
    if agent is None:
        return reward_funcs
    funcs = [] if reward_funcs is None else (reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])
    if args.reward_weights is not None:
        args.reward_weights = [1.0, *args.reward_weights]
    return [AgentReward(), *funcs]


def agent_rewards_override(trainer, rewards_per_func):
    """Rows whose agent returned a number keep that number only (the other reward functions' values become NaN)."""
    if trainer.agent is None:
        return rewards_per_func
    given = ~rewards_per_func[:, 0].isnan()
    rewards_per_func[given, 1:] = math.nan
    return rewards_per_func


class AgentRounds:
    """The endpoint, the agents' event loop and thread pool of one trainer, and one round's agent runs at a time."""

    def __init__(self, trainer, agent):
        self.trainer, self.agent, self.name = trainer, agent, agent_label(agent)
        self.is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__)
        self.endpoint = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runs: set[AgentRun] = set()  # one thread per agent run (agent_threads); abandoned ones until close
        self._warned_blocked, self._lock = False, threading.Lock()
        self._seen_errors: set[str] = set()
        self._warned_non_finite = False
        self.failed_rounds = 0  # training rounds in a row in which every run failed

    def _start(self) -> None:
        from appo_trl.rollout.agent_endpoint import AgentEndpoint
        from appo_trl.rollout.agent_session import ChatRenderer
        from appo_trl.rollout.chat_format import ChatTemplateToolError, ChatToolFormat

        t, args = self.trainer, self.trainer.args
        engine = t.rollout_engine
        fmt = t.chat_tool_format
        if fmt is None:
            try:
                fmt = ChatToolFormat(trl_seams.tokenizer(t), t.chat_template, t.chat_template_kwargs)
            except ChatTemplateToolError:
                fmt = None  # the template cannot express tool calls: answers never carry `tool_calls`
        renderer = ChatRenderer(trl_seams.tokenizer(t), t.chat_template, t.chat_template_kwargs, fmt)
        cfg = engine.config
        from appo_trl.rollout.types import SamplingParams

        params = SamplingParams(max_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                                top_k=cfg.top_k, logprobs=cfg.entropy_topk if self._entropies() else 0)  # fmt: skip
        try:
            self.endpoint = AgentEndpoint(
                engine.submit, lambda ids, p: engine.backend.generate(ids, p), renderer, params, cfg.max_model_len,
                model_name=self.model_name,
                host=args.agent_host, port=args.agent_port, concurrency=args.rollout_concurrency,
            ).start()  # fmt: skip
        except OSError as exc:  # taken since the check at start-up
            raise AgentError(f"agent {self.name}: agent_port={args.agent_port} cannot be used on agent_host="
                             f"{args.agent_host!r}: {exc.strerror or exc}") from exc  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="appo-agents", daemon=True)
        self._thread.start()

    def _entropies(self) -> bool:
        """Whether the runs record top-k sampler entropies (the engine's setting, or the strategy's branch rule)."""
        args = self.trainer.args
        return self.trainer.rollout_engine.config.record_entropies or args.strategy_class.needs_agent_entropies(args)

    @property
    def model_name(self) -> str:
        return str(getattr(self.trainer.model, "name_or_path", None) or "policy")

    def close(self) -> None:
        """Cancel the agent runs, end every session, stop the endpoint and the loop, and wait for the runs' threads,
        all within `EXIT_GRACE_S` together (idempotent). Runs still going then are abandoned (`agent_threads`)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        left = lambda: max(deadline - time.monotonic(), 0.0)  # noqa: E731
        loop, self._loop = self._loop, None
        if loop is not None:

            async def _cancel():
                others = [x for x in asyncio.all_tasks() if x is not asyncio.current_task()]
                for task in others:
                    task.cancel()
                await asyncio.gather(*others, return_exceptions=True)

            with contextlib.suppress(concurrent.futures.TimeoutError):
                asyncio.run_coroutine_threadsafe(_cancel(), loop).result(timeout=left())
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=left())
            if not self._thread.is_alive():
                loop.close()
        if self.endpoint is not None:  # later requests of running agents fail at once
            self.endpoint.close()
            self.endpoint = None
        for run in list(self._runs):
            run.cancel()
        stuck = join_within(list(self._runs), left())
        self._runs.clear()
        if stuck:
            logger.warning("%d run(s) of agent %s did not stop within %g s of the end (blocked in a call that cannot be "
                           "cancelled); abandoned: their threads end when that call returns (later requests fail, "
                           "results are dropped) or with the process", len(stuck), self.name,
                           EXIT_GRACE_S)  # fmt: skip

    # ---- one round ---------------------------------------------------------------------------------------------
    def generate(self, strategy, prompt_ids: list[list[int]], n: int, seed: int, inputs: list[dict]) -> Round:
        """`strategy.generate` on agent runs: n per prompt of TRL's generation batch `inputs` (n consecutive rows per
        prompt), branches re-run the agent by replay; `prompt_ids`: TRL's tokenised prompts (for runs that failed
        before their first answer). On any thread (a background round's too): the round's counts ride in
        `Round.agent` until `report` logs them on the trainer's thread."""
        if self.endpoint is None:
            self._start()
        if len(inputs) != len(prompt_ids):
            raise RuntimeError(f"{len(inputs)} rows for {len(prompt_ids)} prompts")
        runs = AgentEngine(self, inputs, n, prompt_ids[::n])
        batch = strategy.generate(prompt_ids[::n], n, seed, runs)  # the strategy samples on the agent's runs
        batch.agent = self.round_report([runs])
        return batch

    def start_group(self, inputs: list[dict], prompt_ids: list[int], n: int, seed: int) -> tuple:
        """rollout_stream: one group's n runs (`inputs`: its n rows of one prompt) on the agents' loop, without
        blocking: `(future of its rows, its AgentEngine)`, the engine for `round_report` once handed over."""
        if self.endpoint is None:
            self._start()
        runs = AgentEngine(self, inputs, n, [prompt_ids])

        async def group():
            return (await runs.rollout([prompt_ids], n, seed=seed))[0]

        return asyncio.run_coroutine_threadsafe(group(), self._loop), runs

    def round_report(self, engines: list[AgentEngine]) -> AgentReport:
        """A round's `agent/*` report: its runs' counts (a streamed batch: its groups' summed) and the endpoint's
        metrics since the last report."""
        runs, *others = engines  # the first group's engine takes the others' counts (every run is done)
        for other in others:
            runs.runs += other.runs
            runs.errors.update(other.errors)
            runs.counts = {k: v + other.counts[k] for k, v in runs.counts.items()}
        metrics = {**{f"agent/{k}": v for k, v in runs.counts.items()}, **self.endpoint.metrics()}
        self.endpoint.reset_metrics()
        return AgentReport(runs, metrics)

    def report(self, batch: Round, mode: str) -> None:
        """On the trainer's thread, once per round handed to TRL: its `agent/*` metrics, and (training) the check
        for a round in which every run failed (a collective: every rank calls it at the same round)."""
        (runs, metrics), batch.agent = batch.agent, None
        for key, value in metrics.items():
            trl_seams.log_metric(self.trainer, mode, key, float(value))
        if mode == "train":
            self._check_failed_round(runs)

    def _check_failed_round(self, runs: AgentEngine) -> None:
        """A training round in which every run (of every rank) failed trains nothing: one warning at the first of
        a streak; `max_failed_agent_rounds` in a row stop the run with the most common error (every rank alike)."""
        import torch

        t = self.trainer
        counts = t.accelerator.gather(torch.tensor([[runs.counts["errors"], runs.runs]], device=t.accelerator.device))
        failed, total = (int(x) for x in counts.sum(dim=0).tolist())
        if total == 0 or failed < total:
            self.failed_rounds = 0
            return
        self.failed_rounds += 1
        limit = t.args.max_failed_agent_rounds
        error, times = runs.errors.most_common(1)[0] if runs.errors else ("?", 0)
        what = f"every run of agent {self.name} failed ({total} runs; most common error, {times}x: {error})"
        if limit and self.failed_rounds >= limit:
            raise AgentError(f"{what} in {self.failed_rounds} training rounds in a row (max_failed_agent_rounds="
                             f"{limit}): nothing trains; fix the agent, or set max_failed_agent_rounds: 0 to go on")  # fmt: skip
        if self.failed_rounds == 1:
            stop = f"; after {limit} such rounds in a row the run stops" if limit else ""
            logger.warning("step %d: %s, so this round trains nothing%s", t.state.global_step, what, stop)

    async def call(self, row: dict, base_url: str):
        """Run the agent once on `row` against `base_url` on a thread of its own (`agent_threads`): (its value, None)
        or (None, the error's first line)."""
        args = self.trainer.args
        run = AgentRun(lambda: self.agent(row, base_url, self.model_name), self.is_async, asyncio.get_running_loop(),
                       self._warn_if_blocked)  # fmt: skip
        self._runs = {r for r in self._runs if not r.thread_done} | {run}
        try:
            return self._check_value(await asyncio.wait_for(run.future, args.agent_timeout_s)), None
        except asyncio.TimeoutError:
            error = f"timed out after agent_timeout_s={args.agent_timeout_s}"
        except Exception as exc:  # noqa: BLE001 - the user's agent: any error is its trajectory's
            lines = str(exc).strip().splitlines()
            error = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        finally:
            run.cancel()  # an async agent past its time (or the round cancelled): CancelledError in its own loop
            self.endpoint.end_session(base_url)
            self._warn_if_blocked(run.blocked_s)  # a block in progress (the run's end reports the rest)
            if run.thread_done:
                self._runs.discard(run)
        self._fault(error)
        return None, error

    def _warn_if_blocked(self, blocked: float) -> None:
        """One warning per trainer when an async agent blocked its own event loop `BLOCKED_LOOP_S` or more (called
        from the runner's loop and from the runs' threads)."""
        with self._lock:
            if blocked < BLOCKED_LOOP_S or self._warned_blocked:
                return
            self._warned_blocked = True
        logger.warning("async agent %s blocked its event loop for %.1f s (a blocking call inside `async def`, such as "
                       "time.sleep or a sync HTTP client): each run has a loop of its own, so this delays that run only "
                       "and agent_timeout_s still applies, but its own tasks and timeouts stall meanwhile; await "
                       "asyncio.sleep / async clients, or make the agent a plain `def`", self.name,
                       blocked)  # fmt: skip

    def _check_value(self, value):
        if isinstance(value, (list, tuple)) and value and all(_is_real(v) for v in value):  # one per model call
            if self.trainer.args.advantage_estimator != "tree":
                raise TypeError(f"agent {self.name} returned a list (one reward per model call); per-call rewards "
                                "need advantage_estimator: tree, or return one number")  # fmt: skip
            if all(usable_reward(v) for v in value) and usable_reward(sum(value)):
                return [float(v) for v in value]
            value = next((v for v in value if not usable_reward(v)), sum(value))  # as the completion's: None
        elif not (value is None or _is_real(value)):
            raise TypeError(f"agent {self.name} returned {type(value).__name__} {value!r}; return a float, a list "
                            "of floats (one per model call) or None")  # fmt: skip
        if usable_reward(value):
            return None if value is None else float(value)
        if not self._warned_non_finite:  # inf, NaN, 1e308: as None (TRL's NaN), one warning per run
            self._warned_non_finite = True
            logger.warning("agent %s returned %s; a reward that is not finite (or over %g) is handled as None (the "
                           "reward functions score the run; none: it is not scored), here and for the rest of the run "
                           "without another warning", self.name, non_finite_note(float(value)),
                           REWARD_LIMIT)  # fmt: skip
        return None

    def _fault(self, error: str) -> None:
        if self.trainer.args.agent_errors == "raise":
            raise AgentError(f"agent {self.name} failed: {error} (agent_errors: raise)")
        if error not in self._seen_errors:
            self._seen_errors.add(error)
            logger.warning("agent %s failed: %s; its trajectory gets reward 0 (counted in agent/errors; "
                           "agent_errors: raise stops the run instead)", self.name, error)  # fmt: skip


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class AgentEngine:
    """The rollout engine's interface (`run`, `rollout`, `branch_many`) over agent runs, for one round's strategy.

    `rollout` runs the agent n times per prompt (or `n[g]` times for prompt g); `branch_many` re-runs it once per
    (parent row, position): the branch's session answers the parent's calls before the branch call with the recorded
    answers while its requests match token for token, and at the branch call the parent's tokens up to `position`
    then a fresh continuation (`AgentSession.branch_call`). `counts` are the round's `agent/*` metrics. `replays_branches` tells a strategy
    that branches inside the loop to choose its points on the recorded runs instead.
    """

    replays_branches = True

    def __init__(self, rounds: AgentRounds, inputs: list[dict], n: int, prompt_ids: list[list[int]]):
        self.rounds, self.inputs, self.n, self.prompt_ids = rounds, inputs, n, prompt_ids
        self.sessions: dict[str, object] = {}  # row uid -> its run's session (branches replay it)
        self.counts = dict.fromkeys(("errors", "timeouts", "restarts", "chain_rows", "branches", "replay_divergence",
                                     "replayed_calls"), 0)  # fmt: skip
        self.runs, self.errors = 0, collections.Counter()  # runs made, and each error's first line: how often
        self._sem: asyncio.Semaphore | None = None
        self.config = rounds.trainer.rollout_engine.config  # entropy window, timing (strategies read them)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.rounds._loop).result()

    async def rollout(self, prompts, n, *, seed: int, hook=None, group_size=None, route_seed=None):
        if hook is not None:
            raise RuntimeError("agent runs cannot branch inside the loop (no hook); branching is by replay")
        ns = [n] * len(prompts) if isinstance(n, int) else list(n)
        rows = await self._gather([self._run(g, (g, j), seed) for g, k in enumerate(ns) for j in range(k)])
        ends = [sum(ns[: g + 1]) for g in range(len(ns))]
        return [rows[end - k : end] for k, end in zip(ns, ends)]

    async def branch_many(self, requests, *, seed: int, resample: bool = True):
        jobs = []
        for b, (parent, position) in enumerate(requests):
            try:
                replay = self.sessions[parent.uid].branch_call(position, resample)
            except (KeyError, ValueError):  # a failed run's placeholder row: nothing to replay
                replay = None
            jobs.append(self._run(parent.group, ("branch", b), seed, replay, parent, position))
        return await self._gather(jobs)

    async def _gather(self, jobs):
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _run(self, g: int, index, seed: int, replay=None, parent=None, position=None) -> Trajectory:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.rounds.trainer.args.rollout_concurrency)
        endpoint = self.rounds.endpoint
        base_url, session = endpoint.open_session(seed=hash((seed, index)) % (2**31), group=g,
                                                  session_id=f"{seed}-{g}")  # fmt: skip
        session.replay = replay
        async with self._sem:
            value, error = await self.rounds.call(dict(self.inputs[g * self.n]), base_url)
        row = session.row
        if isinstance(value, list) and row is not None:  # per model call: per turn of the row, or refused
            try:
                value = call_rewards_per_turn(session.answered, row, value)
            except ValueError as exc:
                value, error = None, str(exc)
                self.rounds._fault(error)
        if row is None and error is None and session.refusals:  # it called, and caught every refusal: a failed run
            error = (f"the endpoint refused all {len(session.refusals)} of its requests, so it has no row (the "
                     f"first: {session.refusals[0][:200]})")  # fmt: skip
            self.rounds._fault(error)
        elif row is None and error is None:
            raise AgentError(
                f"agent {self.rounds.name} returned without sending a single request to the base_url it was given: "
                "an agent must send its chat requests there (openai.OpenAI(base_url=base_url, api_key='-'))"
            )
        if row is None:  # failed before its first answer: one masked token (no entropy), reward 0
            eos = trl_seams.tokenizer(self.rounds.trainer).eos_token_id
            row = Trajectory(prompt_ids=list(self.prompt_ids[g]), completion_ids=[eos], loss_mask=[0],
                             logprobs=[math.nan], finish_reason="error",
                             entropies=[math.nan] if self.rounds._entropies() else None)  # fmt: skip
        c = self.counts
        self.runs += 1
        if error is not None:
            self.errors[error] += 1
        c["errors"] += error is not None
        c["timeouts"] += error is not None and error.startswith("timed out")
        c["restarts"] += max(len(session.chains) - 1, 0)
        reward = 0.0 if error is not None else value
        chains = session.chain_rows() if session.row is not None else []
        for other in chains:  # the run's earlier (or, in a branch, later) chains: rows of their own, same reward
            other.group, other.agent_reward, other.role, other.run = g, reward, Role.CHAIN, row.uid
        c["chain_rows"] += len(chains)
        row.group = g
        row.agent_reward, row.chain_rows = reward, chains  # origin: root, or restart (the session's last chain)
        row.messages = session.completion_messages() or [{"role": "assistant", "content": ""}]
        if parent is not None:
            c["branches"] += 1
            c["replayed_calls"] += session.replayed
            c["replay_divergence"] += bool(session.diverged or replay is None)
            row.parent, row.branch_pos = parent.uid, position
            row.origin = Origin.BRANCH
        self.sessions[row.uid] = session
        return row


__all__ = ["AgentEngine", "AgentError", "AgentReward", "AgentRounds", "agent_label", "agent_rewards_override",
           "resolve_agent",
           "with_agent_reward"]  # fmt: skip
