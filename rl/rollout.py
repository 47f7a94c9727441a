"""Multi-turn agent rollouts over an Engine and an Episode, token in, token out.

One trajectory: render the system prompt and the task, then repeat {generate until
a tool call closes or the turn ends; parse and step the environment; append the
observation's ids}. The ids sent to and returned by the engine are stored as they
are, so the learner trains on exactly what was sampled.

Stop ids are `</tool_call>`, `<|im_end|>` and `<|endoftext|>`. When a turn stops at
`</tool_call>`, the `<|im_end|>` that closes the assistant turn in the chat format
is fed (not generated) at the start of the next observation.

Budgets, each ending the trajectory with its status:
  max_steps (Episode) -> "max_steps"; generated tokens or context length -> "truncated";
  wall-clock -> "timeout" ("env_error" when it ends before the policy's first turn: the
  engine's delay, not the task's outcome); sandbox failure, or any other exception out of one
  rollout -> "env_error" (never scored, the exception in `error`; never fails the
  collection).
Every trajectory that is not env_error is graded by the task's tests at the end: by
default its final patch in a new sandbox, which takes the episode's slot once its own
sandbox is closed (`grading`, env.episode.Episode), once per patch: a trajectory whose
final patch was graded before for the same task takes that grade (`grade_cache`,
env.grading.GradeCache).

A trajectory can start from a prefix of another (Prefix Sampling, DESIGN section 4):
the sandbox is restored to the state after step k, the source's first k turns are
copied as `replayed` (their ids are prefilled as prompt, never decoded or trained)
and the step counter and token budget continue from there.

Collection modes: `collect_groups` (N rollouts per task, wait for all) and
`StreamCollector` (keep more groups in flight than the batch needs, return the
first B that finish, carry the rest into the next call, which runs them on under
newer weights).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from env import episode as episode_lib
from env.grading import GRADINGS, GradeCache
from env.latency import LatencyModel
from env.sandbox import SandboxError
from env.sandbox.pool import SandboxPool
from env.tasks import Task
from env.tools import TOOL_SCHEMAS
from inference.engine import (
    BrokenSampleError,
    ContextLengthError,
    Engine,
    EngineError,
    GenerateRequest,
)
from models.tokenizer import TOOL_CALL_END, Tokenizer
from rl.prefix import PrefixQueue, PrefixTask
from rl.seeds import member_seed, request_seed
from rl.types import Trajectory, Turn

log = logging.getLogger(__name__)

# Prefix of `Trajectory.error` for a broken sample of the engine (NaN logits).
ENGINE_ERROR = "engine: "


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Budgets and sampling parameters of one trajectory: the `rollout` section, whole
    (configs/default.py documents its values; no defaults here).

    max_steps: tool steps (one assistant turn each), replayed ones included.
    max_turn_tokens: generated tokens in one assistant turn.
    max_response_tokens: generated tokens in the whole trajectory (replayed included).
    max_context: prompt + all turns, in tokens.
    wall_timeout_s: seconds for the whole trajectory, grading excluded.
    system_prompt: the system message of every conversation.
    grade_cache: an episode whose final patch was graded before for the same task
      takes that grade (env.grading.GradeCache); False runs the tests of every episode.
      Fresh grading only (in place, a grade also depends on the sandbox's state).
    grading: "fresh" grades the final patch in a new sandbox, as the official harness
      does; "in_place" in the episode's own sandbox: one sandbox less per episode, but
      whatever the agent left outside its patch reaches the reward (env.episode.Episode).
    max_staleness, stale: how far rollouts run ahead of the learner, in policy versions,
      and what becomes of a group past that bound (read by rl.algos; StreamCollector).
    """

    max_steps: int
    max_turn_tokens: int
    max_response_tokens: int
    max_context: int
    wall_timeout_s: float
    temperature: float
    top_p: float
    top_k: int
    test_timeout_s: float
    env_retries: int  # env_error rollouts are re-run this many times
    system_prompt: str
    grade_cache: bool
    grading: str
    max_staleness: int
    stale: str

    def __post_init__(self):
        if self.grading not in GRADINGS:
            raise ValueError(f"rollout.grading must be one of {GRADINGS}, got {self.grading!r}")


# What becomes of a group older than rollout.max_staleness: re-run, or trained on anyway.
STALE_POLICIES = ("drop", "finish")


@dataclasses.dataclass(frozen=True)
class RolloutJob:
    """One rollout to run. replay: how a prefix's state is restored, "patch" (apply the
    recorded diff of step k) or "reexec" (re-run the k tool calls); env.episode.restore."""

    task: Task
    prefix: PrefixTask | None = None  # start from step k of a source (replayed)
    seed: int = 0
    replay: str = "patch"
    max_steps: int = 0  # a demonstration's own step limit; 0: the rollout section's


def encode_jobs(jobs: Sequence[RolloutJob]) -> dict[str, Any]:
    """Host state of rollout jobs (task ids, seeds, replay modes and prefix tasks)."""
    # The queue only encodes the prefix tasks: its max_age is never read (2, as the
    # checkpoints written so far hold).
    prefixes = PrefixQueue(max_age=2)
    prefixes.push([j.prefix for j in jobs if j.prefix is not None])
    return {"task_ids": [j.task.instance_id for j in jobs], "seeds": [j.seed for j in jobs],
            "replay": [j.replay for j in jobs],
            "has_prefix": [j.prefix is not None for j in jobs],
            "prefixes": prefixes.state_dict()}


def decode_jobs(state: Mapping[str, Any], task_by_id: Mapping[str, Any]) -> list[RolloutJob]:
    """The jobs `encode_jobs` saved."""
    prefixes = PrefixQueue(max_age=2)  # (restored from the state: a codec, as above)
    prefixes.load_state_dict(state["prefixes"])
    queued = iter(prefixes.tasks)
    return [RolloutJob(task_by_id[t], prefix=next(queued) if has else None, seed=int(seed),
                       replay=replay)
            for t, seed, replay, has in zip(state["task_ids"], state["seeds"],
                                            state["replay"], state["has_prefix"], strict=True)]


class Activity:
    """Wall time during which no request of this process waited on the engine: the
    inference engine idle, as the rollouts see it (waiting on tools, on the learner, or
    on nothing to do)."""

    def __init__(self):
        self.active, self._idle_s, self._since = 0, 0.0, time.perf_counter()

    def start(self) -> None:
        if self.active == 0:
            self._idle_s += time.perf_counter() - self._since
        self.active += 1

    def end(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._since = time.perf_counter()

    def idle_s(self) -> float:
        """Seconds idle so far."""
        return self._idle_s + (time.perf_counter() - self._since if self.active == 0 else 0.0)


class Agent:
    """Runs trajectories: one Engine, one tokenizer, sandboxes from a pool.

    `sandboxes` bounds the number of live sandboxes (episodes) at once, and closes them
    and its factory (what it made, on this machine or a Ray cluster) on exit, on
    exceptions and on SIGTERM.
    `latency`: a model of slow tool calls (env.latency), slept before each call.
    `logprobs`: the engine computes the sampled tokens' log-probs (off for greedy
    evaluation, whose turns are never trained on: NaN in their place; with_sampling).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, sandboxes: SandboxPool,
                 cfg: RolloutConfig, *, tools_in_prompt: bool,
                 latency: LatencyModel | None = None):
        self.engine = engine
        self.latency = latency if latency is not None and latency.enabled else None
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.logprobs = True
        self.policy_version = 0
        # The tool schemas in the system prompt (Qwen3's format); a model trained from
        # scratch on these tasks can do without them and save the context.
        self.tools = TOOL_SCHEMAS if tools_in_prompt else None
        # Sandbox calls run in the pool's threads (they block on subprocesses).
        self.pool = sandboxes
        self.stop_ids = sorted({tokenizer.special_ids[TOOL_CALL_END], tokenizer.eos_id,
                                tokenizer.pad_id})
        self.grades = GradeCache()  # shared with the agents of with_sampling
        self.activity = Activity()  # likewise

    def close(self) -> None:
        """Closes every live sandbox (also done at exit and on SIGTERM)."""
        self.pool.close()

    def with_sampling(self, logprobs: bool = True, **sampling) -> Agent:
        """An agent sharing engine, tokenizer and sandbox slots, with other sampling
        parameters (e.g. temperature=0 and logprobs=False for greedy evaluation)."""
        other = copy.copy(self)
        other.cfg = dataclasses.replace(self.cfg, **sampling)
        other.logprobs = logprobs
        return other

    async def run(self, job: RolloutJob) -> Trajectory:
        """One trajectory; env_error ones are retried `cfg.env_retries` times."""
        for attempt in range(self.cfg.env_retries + 1):
            uid = uuid.uuid4().hex  # the episode's id: its turns' routing key (one server)
            traj = await self._run_once(job, functools.partial(self._generate, job, attempt, uid),
                                        uid)
            if not traj.is_env_error:
                break
        return traj

    async def demonstrate(self, task: Task, actions: Sequence[str], max_steps: int = 0
                          ) -> Trajectory:
        """A trajectory whose turns are the given assistant texts (e.g. a scripted expert's
        tool calls), with exactly the token layout of a rollout; logprobs are 0.
        max_steps: the episode's step limit (0: the rollout section's)."""
        script = iter(actions)

        async def act(context, budget):
            text = next(script, None)
            if text is None:
                return None
            ids = self.tokenizer.encode(text)[:budget]
            return ids, [0.0] * len(ids), None

        return await self._run_once(RolloutJob(task, max_steps=max_steps), act)

    async def _generate(self, job: RolloutJob, attempt: int, session: str, context: list[int],
                        budget: int):
        cfg = self.cfg
        request = GenerateRequest(
            context, budget, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            stop_token_ids=self.stop_ids, seed=request_seed(job.seed, attempt, len(context)),
            return_logprob=self.logprobs, session=session)
        self.activity.start()
        try:
            [result] = await self.engine.generate([request])
        finally:
            self.activity.end()
        if result.finish_reason == "abort":
            raise EngineError(f"engine aborted a request of task {job.task.instance_id}")
        version = self.policy_version if result.policy_version is None \
            else result.policy_version
        return result.output_ids, result.logprobs, version

    async def _run_once(self, job: RolloutJob, act, uid: str = "") -> Trajectory:
        traj = Trajectory(task_id=job.task.instance_id, uid=uid or uuid.uuid4().hex, turns=[],
                          policy_version=self.policy_version, seed=job.seed)
        traj.timings = {"generate_s": 0.0, "env_s": 0.0, "grade_s": 0.0}
        try:
            async with self.pool.acquire(job.task) as sandbox:
                await self._episode(job, traj, sandbox, act)
        except Exception as e:  # noqa: BLE001 - one broken episode never fails the step
            _raise_if_cancelling(e)
            _log_env_error(job, e)
            traj.status, traj.error, traj.reward = "env_error", _describe(e), None
        return traj

    async def _episode(self, job: RolloutJob, traj: Trajectory, sandbox, act) -> None:
        """Steps one episode in `sandbox` until it ends, then grades it."""
        timings = traj.timings
        t0 = time.perf_counter()
        episode, obs_ids = await self.pool.call(self._start, job, traj, sandbox)
        timings["env_s"] += time.perf_counter() - t0
        await self._loop(traj, episode, obs_ids, act)
        if traj.status != "env_error":
            t0 = time.perf_counter()
            traj.reward = await self.pool.call(episode.reward)
            traj.grade_cached = episode.grade_cached
            timings["grade_s"] += time.perf_counter() - t0
            if episode.status == "env_error":
                traj.status, traj.error, traj.reward = "env_error", episode.error, None

    def _start(self, job: RolloutJob, traj: Trajectory, sandbox):
        """A ready episode in `sandbox` and the ids to feed before the first generated turn."""
        options = episode_lib.EpisodeOptions(max_steps=job.max_steps or self.cfg.max_steps,
                                             test_timeout=self.cfg.test_timeout_s,
                                             grading=self.cfg.grading)
        kwargs = {"grades": self.grades if self.cfg.grade_cache else None,
                  "grader": self.pool.grader(sandbox)}
        if self.latency is not None:
            kwargs["call_delay"] = functools.partial(self.latency.sleep, job.task.instance_id,
                                                     job.seed)
        if job.prefix is None or job.prefix.k == 0:  # (k = 0: a revisit, from the start)
            episode = episode_lib.Episode(sandbox, job.task, options, **kwargs)
            first = episode.reset()
            if episode.status == "env_error":
                raise SandboxError(episode.error)
            if job.prefix is not None:
                traj.prefix = job.prefix.info
            return episode, self.tokenizer.prompt_ids(self.cfg.system_prompt, first,
                                                      self.tools)
        p = job.prefix
        # With the action text: a call that did not parse is replayed as written.
        records = [episode_lib.StepRecord(t.tool_call, t.observation, t.patch,
                                          self.tokenizer.decode(t.action_ids), t.unpatched)
                   for t in p.turns]
        episode, mismatches = episode_lib.restore(job.task, records, p.k, sandbox,
                                                  reexec=job.replay == "reexec",
                                                  options=options, **kwargs)
        for m in mismatches:
            log.warning("%s replay of %s to step %d: the %s of step %d differs from the "
                        "source's%s", job.replay, p.source_uid, p.k, m.what, m.step,
                        f" (not restored: {m.recorded.splitlines()}; not in the source: "
                        f"{m.replayed.splitlines()})" if m.what == "unpatched" else "")
        traj.turns = [dataclasses.replace(t, replayed=True) for t in p.turns]
        traj.prefix = p.info
        # The source's own ids for the observation after step k: the restored prompt is
        # token-for-token the source's context at that point.
        return episode, list(p.next_obs_ids)

    async def _loop(self, traj: Trajectory, episode, obs_ids: list[int], act) -> None:
        cfg, tok, timings = self.cfg, self.tokenizer, traj.timings
        context = [i for t in traj.turns for i in (*t.obs_ids, *t.action_ids)]
        generated = sum(len(t.action_ids) for t in traj.turns)
        deadline = time.monotonic() + cfg.wall_timeout_s
        while True:
            context += obs_ids
            budget = min(cfg.max_turn_tokens, cfg.max_response_tokens - generated,
                         cfg.max_context - len(context))
            if budget < 1:
                traj.status = "truncated"
                return
            t0 = time.perf_counter()
            try:
                action = await asyncio.wait_for(act(list(context), budget),
                                                deadline - time.monotonic())
            except TimeoutError:
                traj.status = "timeout"
                if all(t.replayed for t in traj.turns):  # the policy never got a turn
                    traj.status, traj.error = "env_error", (
                        f"{ENGINE_ERROR}no turn sampled within rollout.wall_timeout_s "
                        f"({cfg.wall_timeout_s:g} s)")
                return
            except ContextLengthError:  # the engine's context is shorter than max_context
                traj.status = "truncated"
                return
            except BrokenSampleError as e:  # never trained on; counted in the metrics
                traj.status, traj.error = "env_error", f"{ENGINE_ERROR}{e}"
                return
            timings["generate_s"] += time.perf_counter() - t0
            if action is None:  # a script that ran out of actions
                traj.status = "max_steps"
                return
            turn = Turn(list(obs_ids), list(action[0]), list(action[1]),
                        policy_version=action[2])
            traj.turns.append(turn)
            context += turn.action_ids
            generated += len(turn.action_ids)
            t0 = time.perf_counter()
            observation, done = await self.pool.call(episode.step, tok.decode(turn.action_ids))
            timings["env_s"] += time.perf_counter() - t0
            if episode.status == "env_error":
                traj.status, traj.error = "env_error", episode.error
                return
            record = episode.steps[-1]
            turn.tool_call, turn.observation, turn.patch, turn.unpatched = (
                record.tool_call, record.observation, record.patch, record.unpatched)
            if done:
                traj.status = episode.status
                return
            if time.monotonic() > deadline:
                traj.status = "timeout"
                return
            obs_ids = tok.tool_response_ids(observation)
            if not turn.action_ids or turn.action_ids[-1] != tok.eos_id:
                obs_ids = [tok.eos_id, *obs_ids]  # close the assistant turn


def _describe(error: BaseException) -> str:
    """`Type: message` of an exception, the message cut to a log line's length."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 2000 else text[:2000] + " [...]"


def _raise_if_cancelling(error: Exception) -> None:
    """An exception raised while the task was being cancelled (a cleanup failing under
    the CancelledError) must not end the cancellation: the rollout stops."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from error


def _log_env_error(job: RolloutJob, error: Exception) -> None:
    """Infrastructure failures are expected and logged briefly; anything else is a bug
    to see, logged with its traceback (the trajectory is env_error either way)."""
    if isinstance(error, SandboxError):
        log.warning("env_error in task %s: %s", job.task.instance_id, _describe(error))
    else:
        log.warning("env_error in task %s", job.task.instance_id, exc_info=error)


async def run_guarded(agent: Agent, job: RolloutJob) -> Trajectory:
    """`agent.run(job)`, with any exception it lets through as an env_error trajectory:
    one rollout never fails a collection (cancellation still propagates)."""
    try:
        return await agent.run(job)
    except Exception as e:  # noqa: BLE001
        _raise_if_cancelling(e)
        _log_env_error(job, e)
        return Trajectory(task_id=job.task.instance_id, uid=uuid.uuid4().hex, turns=[],
                          policy_version=agent.policy_version, status="env_error",
                          error=_describe(e), seed=job.seed)


async def collect_groups(agent: Agent, jobs: Sequence[RolloutJob], n: int,
                         progress: Callable[[int], None] | None = None,
                         ) -> list[list[Trajectory]]:
    """N rollouts of every job, all awaited. Returns one group per job, in order."""

    async def one(job: RolloutJob, i: int) -> Trajectory:
        traj = await run_guarded(agent, dataclasses.replace(job, seed=member_seed(job.seed, i)))
        if progress is not None:
            progress(1)
        return traj

    flat = await asyncio.gather(*(one(job, i) for job in jobs for i in range(n)))
    return [list(flat[j * n:(j + 1) * n]) for j in range(len(jobs))]


class StreamCollector:
    """Rollouts that run ahead of the learner: `in_flight` groups of `group_size` rollouts
    run at once; `collect(B, version)` returns the first B groups whose last member has
    finished; the others keep running (across weight updates: partial rollouts, each
    turn stamped with the version that sampled it) and count for the next call.

    SPO's single stream is groups of one; GRPO and Prefix Sampling run groups of N with
    (max_staleness + 1) batches in flight (rl.algos.grpo_ps).

    max_staleness: None, no bound; else a group is stale when its oldest turn is more
      than max_staleness versions older than `version` (the policy the learner updates).
    stale: what happens to a stale group: "drop" (its trajectories are discarded and its
      job runs again) or "finish" (trained on all the same); each counted in `stats()`.
    The importance ratio against the stored sampler log-probs (rl.loss) corrects for the
    older policies.
    """

    def __init__(self, agent: Agent, next_job: Callable[[], RolloutJob | None],
                 in_flight: int, group_size: int = 1, max_staleness: int | None = None,
                 stale: str = "drop"):
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        if stale not in STALE_POLICIES:
            raise ValueError(f"stale must be one of {STALE_POLICIES}, got {stale!r}")
        self.agent = agent
        self.next_job = next_job
        self.in_flight = in_flight
        self.group_size = group_size
        self.max_staleness, self.stale = max_staleness, stale
        self._running: set[asyncio.Task] = set()
        self._jobs: dict[asyncio.Task, RolloutJob] = {}  # in start order
        self._requeued: list[RolloutJob] = []
        self._counts = {"dropped_stale": 0, "trained_stale": 0}

    async def _group(self, job: RolloutJob) -> list[Trajectory]:
        if self.group_size == 1:
            return [await run_guarded(self.agent, job)]
        return (await collect_groups(self.agent, [job], self.group_size))[0]

    def _top_up(self) -> None:
        while len(self._running) < self.in_flight:
            job = self._requeued.pop(0) if self._requeued else self.next_job()
            if job is None:  # a finite stream has run out
                return
            task = asyncio.create_task(self._group(job))
            self._running.add(task)
            self._jobs[task] = job

    def _is_stale(self, group: Sequence[Trajectory], version: int | None) -> bool:
        if self.max_staleness is None or version is None:
            return False
        return version - min(t.versions[0] for t in group) > self.max_staleness

    async def collect(self, batch_size: int, progress: Callable[[int], None] | None = None,
                      version: int | None = None) -> list[list[Trajectory]]:
        """The first `batch_size` groups to finish (fewer when a finite stream runs out);
        `version`: the policy version the learner will update (for the staleness bound)."""
        done: list[tuple[asyncio.Task, list[Trajectory]]] = []
        while len(done) < batch_size:
            self._top_up()
            if not self._running:  # a finite stream, all of it collected
                break
            finished, self._running = await asyncio.wait(
                self._running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                group = task.result()
                if self._is_stale(group, version):
                    key = "dropped_stale" if self.stale == "drop" else "trained_stale"
                    self._counts[key] += 1
                    if self.stale == "drop":
                        self._requeued.append(self._jobs.pop(task))
                        continue
                done.append((task, group))
                if progress is not None:
                    progress(len(group))
        # Extra finishers beyond B stay for the next batch, in finishing order.
        extra, done = done[batch_size:], done[:batch_size]
        for task, group in extra:
            carried = _completed(group)
            self._jobs[carried] = self._jobs.pop(task)
            self._running.add(carried)
        for task, _ in done:
            del self._jobs[task]
        self._top_up()  # keep the stream full while the caller trains on this batch
        return [group for _, group in done]

    def pending(self) -> list[RolloutJob]:
        """Jobs started or queued and not yet returned by collect, in start order (what a
        checkpoint re-queues: none of them has been trained on)."""
        return [*self._jobs.values(), *self._requeued]

    def requeue(self, jobs: Sequence[RolloutJob]) -> None:
        """Runs `jobs` before any new one (a resumed run's pending work)."""
        self._requeued[:0] = list(jobs)

    def stats(self) -> dict[str, float]:
        """Stale groups since the last call: dropped (and re-run) or trained on."""
        out = {f"async/{k}": float(v) for k, v in self._counts.items()}
        self._counts = dict.fromkeys(self._counts, 0)
        return out

    async def close(self) -> None:
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        self._running.clear()
        self._jobs.clear()


def _completed(group: list[Trajectory]) -> asyncio.Task:
    async def value() -> list[Trajectory]:
        return group

    return asyncio.ensure_future(value())
