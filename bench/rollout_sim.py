"""Group vs single-stream collection on a simulated long tail of agent rollouts.

    python -m bench.rollout_sim [--batch 24] [--group_size 8] [--concurrency 24] [--batches 6]
        [--time_scale 0.01] [--learner_s 20] [--seed 0] [--<LongTailModel field> value]

The collectors are the real ones: `rl.rollout.collect_groups` ("group": B/N tasks x N
rollouts launched together, wait for all, then learn) and `rl.rollout.StreamCollector`
("stream": `concurrency` rollouts in flight, learn on the first B that finish while the
rest keep running), through a real `Agent` and real `Episode`s (tool-call parsing, the
ToolBox, grading). Only the two slow parts are simulated, behind their real interfaces:

- `SimEngine(Engine)` answers each request after `tokens * seconds_per_token` (requests
  are independent: a batching server below its capacity) with the ids of a Hermes tool
  call: `execute_bash` with `sleep <tool latency>` on intermediate turns, `finish` on the
  last. It draws a trajectory's plan when it sees its first turn and recognises later
  turns by the context up to the end of the first action, which carries a unique label.
- `SimSandbox(Sandbox)` sleeps for `sleep X` commands and grades by a Bernoulli draw.

Long-tail model (`LongTailModel`, all times in simulated seconds):

    turns per trajectory   T ~ clip(round(LogNormal(ln 10, 0.6)), 1, 50)
    tokens per turn            LogNormal(ln 300, 0.5), decoded at 20 ms/token (50 tok/s)
    tool latency per turn      LogNormal(ln 2 s, 1.0)   (T - 1 tool calls; the last turn
                                                          calls finish)
    reward                     Bernoulli(0.3)

Why these shapes: SWE-style agents mostly stop after a handful to a few dozen steps but
some wander to the step cap, so the step count is log-normal (median 10, p95 ~27) and
capped as rollout budgets cap it; turn lengths vary less (sigma 0.5) around a few hundred
tokens of reasoning plus a call; tool calls are mostly quick (`ls`, `grep`, median 2 s)
with a heavy tail of test runs and installs (sigma 1.0, p99 ~20 s). Prefill, grading and
weight sync are left out: they add about the same to both modes. Simulated time runs at
`time_scale` real seconds per simulated second; every reported time is simulated.

Why the ratio comes out as it does. A trajectory's duration D is dominated by its step
count, so it inherits the log-normal tail (E[D] ~118 s here). Group mode waits for the
slowest of the B rollouts and then learns with nothing running:

    group seconds/batch  ~  E[max(D_1..D_B)] + learner_s          (concurrency >= B)
    stream seconds/batch ~  max(B * E[D] / concurrency, learner_s)   (Little's law; the
                                                   learner overlaps the running rollouts)

so the speedup is about E[max of B] / E[D] (x concurrency / B), plus the learner phase
that stream mode hides. `predicted` in the output evaluates both lines by Monte Carlo
draws from the same model; `group` / `stream` are what the real collectors measured.
With the defaults E[max of 24] ~ 2.9 E[D] and the prediction is ~3.0x. The ratio grows
with the tail: turns_sigma 0.9 without the 50-step cap predicts ~4.5x, which is the
tail a 486 s vs 112 s comparison (seed 002, 4.35x) implies; the cap bounds the max, so
capped models stay near 3-3.5x. The measured stream figure includes its cold start (the
first batch starts with no rollout under way) and the learner phase, during which
finished rollouts are not replaced (as `StreamCollector` tops up only inside
`collect`), so it sits a little above the prediction; group's per-batch maximum is
noisy over a few batches.

Each mode gets a fresh engine, sandboxes and agent; the k-th stream job uses the seed of
the k-th group rollout, and plans are drawn from (seed, request seed), so both modes see
the same trajectories where their jobs coincide. Prints ONE JSON object; progress goes
to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import posixpath
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from configs import common, default
from env.sandbox import SandboxFactory
from env.sandbox.base import ExecResult, Sandbox, SandboxError
from env.sandbox.pool import SandboxPool
from env.tasks import Task
from inference.engine import Engine, EngineError, GenerateRequest, GenerateResult
from models.tokenizer import TOOL_CALL_END, Tokenizer, render_chat, render_tool_call, train_bpe
from rl.rollout import (
    Agent,
    RolloutConfig,
    RolloutJob,
    StreamCollector,
    collect_groups,
)
from rl.types import Trajectory

# The default config's rollout section: the simulated runs change their budgets only.
ROLLOUT = default.get_config().rollout

GRADE_COMMAND = "sim-grade"
_SLEEP = re.compile(r"sleep (\d+(?:\.\d+)?)(?: # .*)?")


# ---- the long-tail model ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrajectoryPlan:
    """What one simulated trajectory will do.

    tokens: generated tokens per turn [turns]; tool_s: simulated latency of the tool
    call of each turn but the last (which calls finish) [turns - 1].
    """

    tokens: tuple[int, ...]
    tool_s: tuple[float, ...]

    @property
    def turns(self) -> int:
        return len(self.tokens)

    def duration_s(self, seconds_per_token: float) -> float:
        """D = sum(tokens) * seconds_per_token + sum(tool_s), in simulated seconds."""
        return sum(self.tokens) * seconds_per_token + sum(self.tool_s)


@dataclasses.dataclass(frozen=True)
class LongTailModel:
    """Distributions of a trajectory's plan (see the module docstring)."""

    turns_median: float = 10.0
    turns_sigma: float = 0.6
    max_turns: int = 50
    tokens_median: float = 300.0
    tokens_sigma: float = 0.5
    seconds_per_token: float = 0.02
    tool_median_s: float = 2.0
    tool_sigma: float = 1.0
    pass_rate: float = 0.3

    def draw(self, rng: np.random.Generator) -> TrajectoryPlan:
        turns = int(np.clip(round(rng.lognormal(np.log(self.turns_median), self.turns_sigma)),
                            1, self.max_turns))
        tokens = np.maximum(np.rint(rng.lognormal(np.log(self.tokens_median), self.tokens_sigma,
                                                  turns)), 1).astype(int)
        # Rounded as the sleep command writes them, so plan and command agree exactly.
        tool_s = np.round(rng.lognormal(np.log(self.tool_median_s), self.tool_sigma, turns - 1),
                          3)
        return TrajectoryPlan(tuple(tokens.tolist()), tuple(tool_s.tolist()))


def predict(model: LongTailModel, batch: int, concurrency: int, learner_s: float,
            draws: int = 4000, seed: int = 0) -> dict[str, float]:
    """Monte Carlo of the two formulas of the module docstring:

    group = E[max of `batch` durations] + learner_s;
    stream = max(batch * E[D] / concurrency, learner_s); speedup = group / stream.
    The group line assumes concurrency >= batch (all rollouts of a batch run at once).
    """
    rng = np.random.default_rng(seed)
    durations = np.array([model.draw(rng).duration_s(model.seconds_per_token)
                          for _ in range(draws * batch)]).reshape(draws, batch)
    group = float(durations.max(axis=1).mean()) + learner_s
    stream = max(batch * float(durations.mean()) / concurrency, learner_s)
    return {"trajectory_s_mean": float(durations.mean()), "group_seconds_per_batch": group,
            "stream_seconds_per_batch": stream, "speedup": group / stream}


# ---- the simulated engine --------------------------------------------------------------------

class SimEngine(Engine):
    """Answers with the tool calls of drawn plans after their simulated decode time.

    Busy accounting (real seconds): `busy_s` while any request is in flight,
    `request_s` the integral of the number of requests in flight.
    """

    def __init__(self, tokenizer: Tokenizer, model: LongTailModel, time_scale: float,
                 seed: int = 0):
        self.tokenizer = tokenizer
        self.model = model
        self.time_scale = time_scale
        self.seed = seed
        self._end_id = tokenizer.special_ids[TOOL_CALL_END]
        self._plans: dict[tuple[int, ...], TrajectoryPlan] = {}
        self._rng = np.random.default_rng(seed)
        self._next_label = 0
        self._closed = False
        self._in_flight = 0
        self._last = time.perf_counter()
        self.busy_s = 0.0
        self.request_s = 0.0

    # ---- Engine ----

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def update_weights(self, params_or_path: Any) -> None:
        """Weights do not change the simulated behaviour."""

    async def health(self) -> bool:
        return not self._closed

    def close(self) -> None:
        self._closed = True

    # ---- plans ----

    def plan_for(self, ids: Sequence[int]) -> TrajectoryPlan | None:
        """The plan of the trajectory whose context starts with `ids` (the first turn's
        prompt and action), None if no trajectory did."""
        return self._locate(ids)[0]

    def _locate(self, context: Sequence[int]) -> tuple[TrajectoryPlan | None, int]:
        """(plan, turns already taken) from the context up to the end of the first action;
        (None, 0) for a context no known trajectory starts."""
        ends = [i for i, t in enumerate(context) if t == self._end_id]
        for n, i in enumerate(ends):
            plan = self._plans.get(tuple(context[:i + 1]))
            if plan is not None:
                return plan, len(ends) - n
        return None, 0

    def _action(self, plan: TrajectoryPlan, turn: int, label: int | None) -> str:
        """Turn `turn` (0-based) of `plan`; the first carries the trajectory's label."""
        tag = f"trajectory {label}" if label is not None else ""
        if turn == plan.turns - 1:
            call = {"name": "finish", "arguments": {"message": tag} if tag else {}}
        else:
            command = f"sleep {plan.tool_s[turn]:.3f}" + (f" # {tag}" if tag else "")
            call = {"name": "execute_bash", "arguments": {"command": command}}
        return render_tool_call(call)

    async def _one(self, request: GenerateRequest) -> GenerateResult:
        if self._closed:
            return GenerateResult([], [], "abort")
        plan, turn = self._locate(request.prompt_ids)
        label = None
        if plan is None:  # a first turn: a new trajectory
            rng = (self._rng if request.seed is None
                   else np.random.default_rng([self.seed, request.seed]))
            plan, turn, label = self.model.draw(rng), 0, self._next_label
            self._next_label += 1
        if turn >= plan.turns:
            raise EngineError(f"a trajectory planned for {plan.turns} turns asked for turn "
                              f"{turn + 1}")
        ids = self.tokenizer.encode(self._action(plan, turn, label))
        if len(ids) > request.max_new_tokens:
            raise ValueError(f"the simulated action needs {len(ids)} tokens but the request "
                             f"allows max_new_tokens={request.max_new_tokens}; raise "
                             "RolloutConfig.max_turn_tokens")
        if label is not None:
            self._plans[(*request.prompt_ids, *ids)] = plan
        decode_s = plan.tokens[turn] * self.model.seconds_per_token * self.time_scale
        self._account(+1)
        try:
            await asyncio.sleep(decode_s)
        finally:
            self._account(-1)
        if self._closed:
            return GenerateResult([], [], "abort")
        return GenerateResult(ids, [0.0] * len(ids), "stop", {"decode_s": decode_s})

    def _account(self, change: int) -> None:
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        self.request_s += self._in_flight * dt
        if self._in_flight:
            self.busy_s += dt
        self._in_flight += change

    def accounting(self) -> tuple[float, float]:
        """(busy_s, request_s) up to now, in real seconds since construction."""
        self._account(0)
        return self.busy_s, self.request_s


# ---- the simulated sandbox -------------------------------------------------------------------

class SimSandbox(Sandbox):
    """`sleep X` sleeps X simulated seconds; GRADE_COMMAND passes with `pass_rate`.

    `timeout` is read in simulated seconds, like every time the sandbox sees. `pwd -P`
    answers the workdir (the ToolBox asks it once); other commands are not found.
    """

    def __init__(self, time_scale: float, pass_rate: float, rng: np.random.Generator,
                 rng_lock: threading.Lock, workdir: str = "/testbed"):
        self.time_scale = time_scale
        self.pass_rate = pass_rate
        self.workdir = workdir
        self.files: dict[str, str] = {}
        self._rng, self._rng_lock = rng, rng_lock
        self._closed = False

    def run(self, cmd: str, timeout: float = 60.0) -> ExecResult:
        if self._closed:
            raise SandboxError("run() on a closed SimSandbox")
        sleep = _SLEEP.fullmatch(cmd)
        if sleep:
            seconds = float(sleep[1])
            time.sleep(min(seconds, timeout) * self.time_scale)
            return ExecResult(-1, "", timed_out=True) if seconds > timeout else ExecResult(0, "")
        if cmd == GRADE_COMMAND:
            with self._rng_lock:
                passed = self._rng.random() < self.pass_rate
            return ExecResult(0, "1 passed") if passed else ExecResult(1, "1 failed")
        if cmd == "pwd -P":
            return ExecResult(0, self.workdir + "\n")
        return ExecResult(127, f"bash: {cmd.split(' ', 1)[0]}: command not found")

    def _key(self, path: str) -> str:
        rel = posixpath.normpath(path)
        if path.startswith("/") or rel == ".." or rel.startswith("../"):
            raise ValueError(f"path {path!r} is absolute or leaves the repository")
        return rel

    def read_file(self, path: str) -> str:
        key = self._key(path)
        if key not in self.files:
            raise FileNotFoundError(path)
        return self.files[key]

    def write_file(self, path: str, content: str) -> None:
        self.files[self._key(path)] = content

    def patch(self) -> str:
        return ""

    def unpatched(self) -> list[str]:
        return []

    def apply_patch(self, patch: str) -> None:
        """Nothing to apply: the simulated repository has no tracked changes."""

    def close(self) -> None:
        self._closed = True


class SimSandboxes(SandboxFactory):
    """task -> a new SimSandbox; all share one seeded grading stream."""

    def __init__(self, model: LongTailModel, time_scale: float, seed: int):
        super().__init__("local")
        self.model, self.time_scale = model, time_scale
        self.rng, self.lock = np.random.default_rng([seed, 1]), threading.Lock()

    def __call__(self, task) -> SimSandbox:
        return SimSandbox(self.time_scale, self.model.pass_rate, self.rng, self.lock,
                          task.workdir)


def sandbox_factory(model: LongTailModel, time_scale: float, seed: int) -> SimSandboxes:
    """task -> a new SimSandbox; all share one seeded grading stream."""
    return SimSandboxes(model, time_scale, seed)


# ---- the training-loop simulation ------------------------------------------------------------

def sim_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on the rendered conversations the simulation produces."""
    texts = []
    for i in range(64):
        calls = [{"name": "execute_bash",
                  "arguments": {"command": f"sleep {i * 0.731 % 9:.3f} # trajectory {i}"}},
                 {"name": "finish", "arguments": {"message": f"trajectory {i}"}}]
        messages = [{"role": "system", "content": common.SYSTEM_PROMPT},
                    {"role": "user", "content": task(i).problem_statement}]
        for call in calls:
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": "(no output)"}]
        texts.append(render_chat(messages, add_generation_prompt=True))
    return train_bpe(texts, 512)


def task(index: int) -> Task:
    # No git in the simulated sandbox: nothing to restore before grading.
    return Task(instance_id=f"sim-{index:05d}", repo_files={}, test_command=GRADE_COMMAND,
                problem_statement=f"Simulated task {index}: make the tests pass.",
                protect_tests=False)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """batch: samples per learner step (B); group_size: rollouts per task in group mode
    (N, B/N tasks); concurrency: rollouts running at once in both modes; time_scale: real
    seconds per simulated second; learner_s: simulated seconds of one learner step;
    max_steps: the agent's step budget."""

    batch: int = 24
    group_size: int = 8
    concurrency: int = 24
    batches: int = 6
    time_scale: float = 0.01
    learner_s: float = 20.0
    seed: int = 0
    max_steps: int = 50
    model: LongTailModel = LongTailModel()

    def __post_init__(self):
        for name in ("batch", "group_size", "concurrency", "batches", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch % self.group_size:
            raise ValueError(f"batch={self.batch} is not a multiple of "
                             f"group_size={self.group_size}")
        if not self.time_scale > 0 or self.learner_s < 0:
            raise ValueError(f"need time_scale > 0 and learner_s >= 0, got "
                             f"{self.time_scale}, {self.learner_s}")


@dataclasses.dataclass
class ModeResult:
    """batches: the trajectories trained on per learner step; wall_s / busy_s /
    request_s: real seconds of the whole run, of the engine busy, of requests in flight."""

    mode: str
    batches: list[list[Trajectory]]
    engine: SimEngine
    wall_s: float
    busy_s: float
    request_s: float


async def run_mode(mode: str, cfg: SimConfig, tokenizer: Tokenizer) -> ModeResult:
    """`cfg.batches` learner steps of `mode` ("group" or "stream"), each a collection of
    `cfg.batch` trajectories followed by a learner phase of `cfg.learner_s`."""
    if mode not in ("group", "stream"):
        raise ValueError(f"mode must be 'group' or 'stream', got {mode!r}")
    engine = SimEngine(tokenizer, cfg.model, cfg.time_scale, cfg.seed)
    rollout_cfg = RolloutConfig(**{
        **ROLLOUT, "max_steps": cfg.max_steps, "max_turn_tokens": 128,
        "max_response_tokens": 1 << 20, "max_context": 1 << 20, "wall_timeout_s": 86_400.0,
        "temperature": 1.0, "test_timeout_s": 60.0})
    agent = Agent(engine, tokenizer,
                  SandboxPool(sandbox_factory(cfg.model, cfg.time_scale, cfg.seed),
                              cfg.concurrency), rollout_cfg, tools_in_prompt=False)
    n = cfg.group_size
    tasks_per_batch = cfg.batch // n
    jobs_started = iter(range(1 << 62))

    def next_job() -> RolloutJob:
        # The k-th stream job is the k-th group rollout: task k // N, seed as collect_groups
        # derives it for rollout k % N.
        k = next(jobs_started)
        return RolloutJob(task(k // n), seed=(k // n) * 1009 + k % n)

    collector = StreamCollector(agent, next_job, cfg.concurrency) if mode == "stream" else None
    batches = []
    start = time.perf_counter()
    for step in range(cfg.batches):
        agent.policy_version = step
        if collector is None:
            jobs = [RolloutJob(task(g), seed=g)
                    for g in range(step * tasks_per_batch, (step + 1) * tasks_per_batch)]
            batch = [t for group in await collect_groups(agent, jobs, n) for t in group]
        else:
            batch = [t for g in await collector.collect(cfg.batch) for t in g]
        batches.append(batch)
        # The learner runs on a thread, as in train.py: running rollouts keep going.
        await asyncio.to_thread(time.sleep, cfg.learner_s * cfg.time_scale)
        print(f"{mode}: batch {step + 1}/{cfg.batches} at "
              f"{(time.perf_counter() - start) / cfg.time_scale:.0f} simulated s",
              file=sys.stderr)
    wall_s = time.perf_counter() - start
    busy_s, request_s = engine.accounting()
    if collector is not None:
        await collector.close()
    engine.close()
    return ModeResult(mode, batches, engine, wall_s, busy_s, request_s)


def summarize(result: ModeResult, cfg: SimConfig) -> dict[str, Any]:
    """Per-mode numbers in simulated seconds."""
    scale = cfg.time_scale
    trajs = [t for batch in result.batches for t in batch]
    durations = [sum(t.timings.values()) / scale for t in trajs]
    lags = [step - t.policy_version for step, batch in enumerate(result.batches) for t in batch]
    return {
        "samples_per_s": len(trajs) / (result.wall_s / scale),
        "seconds_per_batch": result.wall_s / scale / len(result.batches),
        "engine_idle_fraction": 1.0 - result.busy_s / result.wall_s,
        "mean_requests_in_flight": result.request_s / result.wall_s,
        "trajectory_s_mean": float(np.mean(durations)),
        "trajectory_s_max": float(np.max(durations)),
        "mean_policy_lag": float(np.mean(lags)),
        "reward_mean": float(np.mean([t.reward for t in trajs])),
        "statuses": {s: sum(t.status == s for t in trajs) for s in sorted({t.status
                                                                         for t in trajs})},
    }


def simulate(cfg: SimConfig, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Both modes, side by side, and the model's prediction: the benchmark's JSON."""
    tokenizer = tokenizer or sim_tokenizer()
    t0 = time.perf_counter()
    modes = {mode: summarize(asyncio.run(run_mode(mode, cfg, tokenizer)), cfg)
             for mode in ("group", "stream")}
    predicted = predict(cfg.model, cfg.batch, cfg.concurrency, cfg.learner_s, seed=cfg.seed)
    return {
        "benchmark": "rollout_sim",
        **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"},
        "model": dataclasses.asdict(cfg.model),
        **modes,
        "speedup": modes["stream"]["samples_per_s"] / modes["group"]["samples_per_s"],
        "predicted": predicted,
        "real_wall_s": time.perf_counter() - t0,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    defaults = SimConfig()
    for name in ("batch", "group_size", "concurrency", "batches", "seed"):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    for name in ("time_scale", "learner_s"):
        p.add_argument(f"--{name}", type=float, default=getattr(defaults, name))
    model_fields = [f.name for f in dataclasses.fields(LongTailModel)]
    for name in model_fields:
        value = getattr(defaults.model, name)
        p.add_argument(f"--{name}", type=type(value), default=value)
    args = vars(p.parse_args())
    model = LongTailModel(**{name: args.pop(name) for name in model_fields})
    print(json.dumps(simulate(SimConfig(**args, model=model)), indent=1))


if __name__ == "__main__":
    main()
