"""Prefix Sampling (PS): steer each task's rollout pass rate towards 50% (seed 000).

Per task with N scored rollouts and k successes, p = k/N (ps.low, ps.high):

    all_fail   k = 0                 drop (rejection sampling)
    all_pass   k = N                 drop
    normal     low <= p <= high      train
    too_hard   0 < p < low           train; one success becomes a prefix source
    too_easy   high < p < 1          train; one failure becomes a prefix source

A source of `total` agent steps is replayed for k steps:

    too_hard ("remaining" mode): remaining = min(int(total * remaining_ratio), remaining_cap)
                                 k = total - remaining
    too_easy ("prefix" mode):    k = min(int(total * prefix_ratio), prefix_cap)
    k is clamped to [1, total - 1]; a source with total < 2 makes no prefix task; a cap
    of 0 is none.

revisit=True is the control of the method: every skewed group queues its task to run
again from the start (k = 0, no source replayed), scheduled like a prefix task, so a
comparison with it separates what the prefix does from re-running the same tasks.

One training step of the bookkeeping, as rl.algos.grpo_ps runs it with ps.enabled and
rollout.max_staleness = 0 (above 0, every chunk of jobs drawn ahead starts with the
same take() at the step that draws it, and a step trains on the first groups to finish,
whichever chunk they came from):

    prefix_tasks = queue.take(step, batch_size, cfg.max_share)   # run first, freshest first
    ...fill the batch with loader tasks, run N rollouts per task -> groups...
    ps = build_prefix_tasks(groups, step, cfg, controller, rng)  # classify, adapt, pick sources
    queue.push(ps.tasks)                                         # they run from step + 1
    log prefix_metrics(ps, groups, controller, queue)
    train on rl.advantages.group_advantages(groups, ...): the learner's own rejection
    (reject_degenerate drops all-pass / all-fail groups) decides what trains; ps.train,
    the classification's keep mask above, is reported, not applied.

Trajectories with status env_error (infrastructure failure) or reward None are unscored:
they never count as failures and never enter pass rates; a group without any scored
rollout is "unscored" and dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from rl.types import PrefixInfo, Trajectory, Turn

log = logging.getLogger(__name__)

Kind = Literal["too_hard", "too_easy"]
KINDS: tuple[str, ...] = ("too_hard", "too_easy")
CLASSES: tuple[str, ...] = ("all_fail", "all_pass", "normal", "too_hard", "too_easy")
UNSCORED = "unscored"


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """The `ps` section, `PrefixConfig(**config.ps)`: one field per key, each documented
    with its default in configs.common.prefix_defaults. The caps keep the config's
    0 = uncapped; cap() reads them as None (uncapped) or a step count."""

    enabled: bool
    low: float
    high: float
    remaining_ratio: float
    prefix_ratio: float
    remaining_cap: int
    prefix_cap: int
    max_share: float
    max_age: int
    reprefix: bool
    adaptive: bool
    ema_alpha: float
    ema_init: float | None
    target: float
    band: float
    step_size: float
    cooldown: int
    ratio_min: float
    ratio_max: float
    replay: str
    revisit: bool

    def __post_init__(self):
        # Each key's range and choices: configs.common (RANGES, CHOICES); here the
        # section's combinations.
        for low, high in (("low", "high"), ("ratio_min", "ratio_max")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"ps.{low} ({getattr(self, low)}) must be <= ps.{high} "
                                 f"({getattr(self, high)})")

    def cap(self, kind: str) -> int | None:
        """The step cap of a kind's mode; None when uncapped (0 in the config)."""
        cap = self.remaining_cap if _check_kind(kind) == "too_hard" else self.prefix_cap
        return cap or None


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"prefix kind must be one of {KINDS}, got {kind!r}")
    return kind


# ---------------------------------------------------------------- classification


def classify(rewards, low: float = 0.3, high: float = 0.7) -> str:
    """Class of one task from its scored rewards[N] in {0, 1} (p = k/N, table above)."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if r.size == 0:
        raise ValueError("classify needs at least one scored reward")
    if not np.all((r == 0) | (r == 1)):
        raise ValueError(f"rewards must be 0 or 1, got {np.unique(r).tolist()}")
    return str(_classes(np.array([int(r.sum())]), np.array([r.size]), low, high)[0])


def _classes(k: np.ndarray, n: np.ndarray, low: float, high: float) -> np.ndarray:
    """Vectorised table: k[G] successes of n[G] scored rollouts -> class names[G]."""
    p = k / np.maximum(n, 1)
    return np.select(
        [n == 0, k == 0, k == n, p < low, p > high],
        [UNSCORED, "all_fail", "all_pass", "too_hard", "too_easy"],
        default="normal")


@dataclasses.dataclass
class GroupClasses:
    """classes[G]: one of CLASSES or "unscored"; counts: per class plus rLLM's
    solve_none (= all_fail), solve_all (= all_pass), solve_partial (0 < k < N)."""

    classes: list[str]
    counts: dict[str, int]


def classify_groups(groups: Sequence[Sequence[Trajectory]], low: float = 0.3,
                    high: float = 0.7) -> GroupClasses:
    """Classify every group (the N rollouts of one task from one start state)."""
    k, n = np.zeros(len(groups), np.int64), np.zeros(len(groups), np.int64)
    for i, group in enumerate(groups):
        rewards = [t.reward for t in group if t.is_scored]
        if any(r not in (0, 1) for r in rewards):
            raise ValueError(f"group {i}: rewards must be 0 or 1, got {sorted(set(rewards))}")
        k[i], n[i] = sum(rewards), len(rewards)
    classes = _classes(k, n, low, high).tolist()
    counts = {c: classes.count(c) for c in (*CLASSES, UNSCORED)}
    counts["solve_none"] = counts["all_fail"]
    counts["solve_all"] = counts["all_pass"]
    counts["solve_partial"] = counts["normal"] + counts["too_hard"] + counts["too_easy"]
    return GroupClasses(classes, counts)


# ---------------------------------------------------------------- prefix selection


def prefix_k(total: int, kind: str, ratio: float, cap: int | None = None) -> int | None:
    """Replayed steps k for a source of `total` steps (module docstring), or None if total < 2.

    int(total * ratio) is taken after adding 1e-9 so that a ratio reached by repeated
    +-0.05 steps (0.35 stored as 0.34999...) floors like the decimal it stands for.
    """
    _check_kind(kind)
    if total < 2:
        return None
    steps = math.floor(total * ratio + 1e-9)
    if cap is not None:
        steps = min(steps, cap)
    k = total - steps if kind == "too_hard" else steps
    return min(max(k, 1), total - 1)


def select_source(trajs: Sequence[Trajectory], kind: str,
                  rng: np.random.Generator) -> Trajectory | None:
    """A uniformly random success (too_hard) or failure (too_easy) that can be prefixed.

    Unscored rollouts are never sources; rollouts with fewer than 2 steps are skipped
    because they cannot make a prefix task. None when no rollout qualifies.
    """
    want = 1 if _check_kind(kind) == "too_hard" else 0
    cands = [t for t in trajs if t.is_scored and t.reward == want and t.num_steps >= 2]
    if not cands:
        return None
    return cands[int(rng.integers(len(cands)))]


@dataclasses.dataclass
class PrefixTask:
    """A task to rerun from step k of a source trajectory (k = 0: from the start, a
    revisit with no source: no turns, no observation, no patch).

    turns: the source's first k turns, marked replayed (prefilled, never trained).
    next_obs_ids: the source's turns[k].obs_ids, i.e. the observation of step k (and the
      assistant header): the conversation resumes right after it.
    patch: the repository diff after step k, applied to a fresh sandbox of the task.
    The step counter resumes at k; the token budget is reduced by num_prefix_tokens.
    """

    task_id: str
    source_uid: str
    kind: str
    k: int
    source_steps: int
    turns: list[Turn]
    next_obs_ids: list[int]
    patch: str
    created_step: int

    @property
    def info(self) -> PrefixInfo:
        """What each rollout of this task stores as Trajectory.prefix."""
        return PrefixInfo(self.source_uid, self.k, self.kind)

    @property
    def num_prefix_tokens(self) -> int:
        return (sum(len(t.obs_ids) + len(t.action_ids) for t in self.turns)
                + len(self.next_obs_ids))


def make_prefix_task(source: Trajectory, k: int, kind: str, step: int) -> PrefixTask:
    """Compact record of `source` replayed for k steps (1 <= k < source.num_steps)."""
    if not 1 <= k < source.num_steps:
        raise ValueError(f"k={k} outside [1, {source.num_steps - 1}] for source {source.uid}")
    turns = [dataclasses.replace(t, obs_ids=list(t.obs_ids), action_ids=list(t.action_ids),
                                 action_logprobs=list(t.action_logprobs), replayed=True)
             for t in source.turns[:k]]
    return PrefixTask(task_id=source.task_id, source_uid=source.uid, kind=_check_kind(kind),
                      k=k, source_steps=source.num_steps, turns=turns,
                      next_obs_ids=list(source.turns[k].obs_ids),
                      patch=source.turns[k - 1].patch, created_step=step)


def revisit_task(task_id: str, kind: str, step: int) -> PrefixTask:
    """The task run again from its start (k = 0), queued like a prefix task (revisit)."""
    return PrefixTask(task_id=task_id, source_uid="", kind=_check_kind(kind), k=0,
                      source_steps=0, turns=[], next_obs_ids=[], patch="", created_step=step)


# ---------------------------------------------------------------- queue


class PrefixQueue:
    """Prefix tasks waiting for a batch; stale ones expire (on-policy sources only).

    A task created at step s is eligible at steps s+1 .. s+max_age and expires after.
    take() hands out the freshest first (ties: insertion order) and removes them.
    """

    def __init__(self, max_age: int):
        self.max_age = max_age  # ps.max_age, >= 1 (configs.common.RANGES)
        self.tasks: list[PrefixTask] = []
        self.expired_total = 0
        self.last_expired = 0

    def __len__(self) -> int:
        return len(self.tasks)

    def push(self, tasks: Sequence[PrefixTask]) -> None:
        self.tasks.extend(tasks)

    def expire(self, step: int) -> int:
        """Drop tasks older than max_age at `step`; returns how many were dropped."""
        keep = [t for t in self.tasks if step - t.created_step <= self.max_age]
        dropped = len(self.tasks) - len(keep)
        self.tasks = keep
        self.expired_total += dropped
        self.last_expired = dropped
        return dropped

    def take(self, step: int, batch_size: int, max_share: float) -> list[PrefixTask]:
        """Expire, then remove and return up to floor(max_share * batch_size) tasks,
        freshest first. Only tasks created before `step` are eligible."""
        self.expire(step)
        limit = math.floor(max_share * batch_size + 1e-9)
        order = sorted((i for i, t in enumerate(self.tasks) if t.created_step < step),
                       key=lambda i: -self.tasks[i].created_step)
        chosen = set(order[:limit])
        out = [self.tasks[i] for i in order[:limit]]
        self.tasks = [t for i, t in enumerate(self.tasks) if i not in chosen]
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-able metadata plus packed numpy token arrays; load_state_dict inverts it."""
        turns = [turn for task in self.tasks for turn in task.turns]
        return {
            "max_age": self.max_age,
            "expired_total": self.expired_total,
            "last_expired": self.last_expired,
            "tasks": [{f.name: getattr(task, f.name) for f in dataclasses.fields(task)
                       if f.name not in ("turns", "next_obs_ids")} | {"num_turns": len(task.turns)}
                      for task in self.tasks],
            "turns": [{"tool_call": t.tool_call, "observation": t.observation, "patch": t.patch,
                       "unpatched": t.unpatched} for t in turns],
            "obs_len": np.array([len(t.obs_ids) for t in turns], np.int64),
            "action_len": np.array([len(t.action_ids) for t in turns], np.int64),
            "obs_ids": _concat([t.obs_ids for t in turns], np.int64),
            "action_ids": _concat([t.action_ids for t in turns], np.int64),
            "action_logprobs": _concat([t.action_logprobs for t in turns], np.float64),
            "next_obs_len": np.array([len(t.next_obs_ids) for t in self.tasks], np.int64),
            "next_obs_ids": _concat([t.next_obs_ids for t in self.tasks], np.int64),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.max_age = int(state["max_age"])
        self.expired_total = int(state["expired_total"])
        self.last_expired = int(state["last_expired"])
        obs = _split(state["obs_ids"], state["obs_len"])
        act = _split(state["action_ids"], state["action_len"])
        logp = _split(state["action_logprobs"], state["action_len"])
        turns = [Turn(obs_ids=[int(x) for x in o], action_ids=[int(x) for x in a],
                      action_logprobs=[float(x) for x in lp], tool_call=m["tool_call"],
                      observation=m["observation"], patch=m["patch"],
                      unpatched=list(m.get("unpatched", [])), replayed=True)
                 for o, a, lp, m in zip(obs, act, logp, state["turns"], strict=True)]
        next_obs = _split(state["next_obs_ids"], state["next_obs_len"])
        self.tasks, start = [], 0
        for meta, nxt in zip(state["tasks"], next_obs, strict=True):
            fields = {k: v for k, v in meta.items() if k != "num_turns"}
            end = start + int(meta["num_turns"])
            self.tasks.append(PrefixTask(**fields, turns=turns[start:end],
                                         next_obs_ids=[int(x) for x in nxt]))
            start = end


def _concat(lists: Sequence[Sequence], dtype) -> np.ndarray:
    return np.array([x for xs in lists for x in xs], dtype)


def _split(flat, lengths) -> list[np.ndarray]:
    return np.split(np.asarray(flat), np.cumsum(np.asarray(lengths))[:-1]) if len(lengths) else []


# ---------------------------------------------------------------- adaptive control


class AdaptiveController:
    """Per-kind EMA of the prefix-task pass rate that nudges that kind's ratio (seed 000).

    update() is called once per training step with each kind's pass rate over this
    batch's prefix-task rollouts (None when the batch had none of that kind):
      ema <- (1 - alpha) * ema + alpha * rate          (only when rate is not None)
      if adaptive, not cooling down and a rate was observed:
        ema > target + band -> ratio += step_size      (harder: fewer success steps
        ema < target - band -> ratio -= step_size       replayed / more failure steps)
      ratio is clamped to [ratio_min, ratio_max] and rounded to 1e-9 so steps stay on
      the 0.05 grid; after a change the next `cooldown` steps make none, so two
      changes are at least cooldown + 1 steps apart.
    EMA initialisation: ps.ema_init=0.5 (the default) starts at the set point, so one early
    batch with one or two prefix tasks cannot swing the ratio; the EMA leaves the dead
    band only once evidence accumulates (a steady 0.8 pass rate crosses 0.53 on the
    third observation, a steady 0.6 on the seventh). ps.ema_init=None takes the first
    observation as the EMA instead. With adaptive=False the EMA is still tracked for
    the metrics and the ratios stay fixed.
    """

    def __init__(self, cfg: PrefixConfig):
        if not 0.0 < cfg.ema_alpha <= 1.0:
            raise ValueError(f"EMA alpha must be in (0, 1], got {cfg.ema_alpha}")
        if not 0.0 <= cfg.ratio_min <= cfg.ratio_max <= 1.0:
            raise ValueError(f"need 0 <= ratio_min <= ratio_max <= 1, got {cfg.ratio_min}, "
                             f"{cfg.ratio_max}")
        self.adaptive, self.alpha, self.ema_init = cfg.adaptive, cfg.ema_alpha, cfg.ema_init
        self.target, self.band, self.step_size = cfg.target, cfg.band, cfg.step_size
        self.cooldown, self.ratio_min, self.ratio_max = cfg.cooldown, cfg.ratio_min, cfg.ratio_max
        self.ratios = {"too_hard": self._clamp(cfg.remaining_ratio),
                       "too_easy": self._clamp(cfg.prefix_ratio)}
        self.emas: dict[str, float | None] = {k: cfg.ema_init for k in KINDS}
        self.cooling = {k: 0 for k in KINDS}
        self.observations = {k: 0 for k in KINDS}

    def _clamp(self, ratio: float) -> float:
        return round(min(max(ratio, self.ratio_min), self.ratio_max), 9)

    def ratio(self, kind: str) -> float:
        """remaining_ratio for too_hard, prefix_ratio for too_easy."""
        return self.ratios[_check_kind(kind)]

    def ema(self, kind: str) -> float | None:
        return self.emas[_check_kind(kind)]

    def update(self, pass_rates: Mapping[str, float | None]) -> None:
        """One training step: fold in each kind's batch pass rate, maybe move its ratio."""
        for kind in KINDS:
            rate = pass_rates.get(kind)
            if rate is not None:
                prev = self.emas[kind]
                self.emas[kind] = (rate if prev is None
                                   else (1 - self.alpha) * prev + self.alpha * rate)
                self.observations[kind] += 1
            if self.cooling[kind] > 0:
                self.cooling[kind] -= 1
                continue
            if not self.adaptive or rate is None:
                continue
            ema = self.emas[kind]
            delta = (self.step_size if ema > self.target + self.band
                     else -self.step_size if ema < self.target - self.band else 0.0)
            new = self._clamp(self.ratios[kind] + delta)
            if new != self.ratios[kind]:
                self.ratios[kind] = new
                self.cooling[kind] = self.cooldown

    def state_dict(self) -> dict[str, Any]:
        return {"ratios": dict(self.ratios), "emas": dict(self.emas),
                "cooling": dict(self.cooling), "observations": dict(self.observations)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the EMAs and cooldowns, and the ratios once an adaptive controller has
        observed something (they are learned state then). Otherwise the ratios are
        configuration and the constructed ones win, so a resumed run honours an edited
        config (e.g. arms resumed from a shared warm-start checkpoint)."""
        saved = {k: float(state["ratios"][k]) for k in KINDS}
        if self.adaptive and any(int(n) for n in state["observations"].values()):
            self.ratios = saved
        elif saved != self.ratios:
            log.warning("prefix ratios: using the configured %s, not the checkpoint's %s",
                        self.ratios, saved)
        self.emas = {k: None if state["emas"][k] is None else float(state["emas"][k])
                     for k in KINDS}
        self.cooling = {k: int(state["cooling"][k]) for k in KINDS}
        self.observations = {k: int(state["observations"][k]) for k in KINDS}


# ---------------------------------------------------------------- one step


def prefix_pass_rates(groups: Sequence[Sequence[Trajectory]]) -> dict[str, tuple[int, int]]:
    """(successes, scored rollouts) of the prefix-task rollouts of each kind."""
    out = {k: (0, 0) for k in KINDS}
    for group in groups:
        for t in group:
            if t.is_scored and t.prefix is not None:
                s, n = out[t.prefix.kind]
                out[t.prefix.kind] = (s + int(t.reward), n + 1)
    return out


def fresh_pass_rate(groups: Sequence[Sequence[Trajectory]]) -> float | None:
    """Pass rate of the scored rollouts of groups run from the task's start (no prefix
    task, no revisit): the learning curve of a run with Prefix Sampling, whose pooled
    pass rate the prefix tasks lift. None when no such rollout was scored."""
    rewards = [t.reward for g in groups for t in g if t.is_scored and t.prefix is None]
    return float(np.mean(rewards)) if rewards else None


@dataclasses.dataclass
class PrefixStep:
    """What build_prefix_tasks decided for one batch.

    classes: GroupClasses of the batch's groups; train[G]: keep group g for the update
    (normal, too_hard, too_easy); tasks: new prefix tasks for the queue;
    pass_counts: (successes, scored) of this batch's prefix-task rollouts by kind;
    no_source: skewed groups that yielded no task (no usable source or already prefixed).
    """

    classes: GroupClasses
    train: list[bool]
    tasks: list[PrefixTask]
    pass_counts: dict[str, tuple[int, int]]
    no_source: int


def build_prefix_tasks(groups: Sequence[Sequence[Trajectory]], step: int, cfg: PrefixConfig,
                       controller: AdaptiveController, rng: np.random.Generator) -> PrefixStep:
    """Classify the batch, update the controller with its prefix-task pass rates, then make
    one prefix task per too_hard / too_easy group with the updated ratios.

    groups: the N rollouts of each task of this step (fresh and prefix tasks alike).
    Groups of prefix tasks are not re-prefixed unless cfg.reprefix.
    """
    classes = classify_groups(groups, cfg.low, cfg.high)
    counts = prefix_pass_rates(groups)
    controller.update({k: s / n if n else None for k, (s, n) in counts.items()})
    tasks, no_source = [], 0
    for group, cls in zip(groups, classes.classes, strict=True):
        if cls not in KINDS:
            continue
        is_prefix_task = any(t.prefix is not None for t in group)
        if cfg.revisit:
            if not is_prefix_task or cfg.reprefix:
                tasks.append(revisit_task(group[0].task_id, cls, step))
            continue
        source = None if is_prefix_task and not cfg.reprefix else select_source(group, cls, rng)
        k = None if source is None else prefix_k(
            source.num_steps, cls, controller.ratio(cls), cfg.cap(cls))
        if k is None:
            no_source += 1
            continue
        tasks.append(make_prefix_task(source, k, cls, step))
    train = [c in ("normal", *KINDS) for c in classes.classes]
    return PrefixStep(classes, train, tasks, counts, no_source)


def prefix_metrics(ps: PrefixStep, groups: Sequence[Sequence[Trajectory]],
                   controller: AdaptiveController, queue: PrefixQueue | None = None
                   ) -> dict[str, float]:
    """Scalars for one step under "ps/": class counts, prefix tasks run and their pass
    rate by kind and pooled (absent when none ran), EMA and ratio by kind, replayed vs generated
    tokens, effective training tasks, new prefix tasks, queue size and expiries."""
    m: dict[str, float] = {f"ps/{c}": float(v) for c, v in ps.classes.counts.items()}
    m["ps/effective_tasks"] = float(sum(ps.train))
    for kind in KINDS:
        runs = sum(1 for g in groups if g and g[0].prefix is not None
                   and g[0].prefix.kind == kind)
        m[f"ps/prefix_tasks/{kind}"] = float(runs)
        s, n = ps.pass_counts[kind]
        if n:
            m[f"ps/prefix_pass_rate/{kind}"] = s / n
        if controller.ema(kind) is not None:
            m[f"ps/ema/{kind}"] = float(controller.ema(kind))
        m[f"ps/ratio/{kind}"] = controller.ratio(kind)
        m[f"ps/new_prefix_tasks/{kind}"] = float(sum(t.kind == kind for t in ps.tasks))
    s, n = (sum(ps.pass_counts[kind][i] for kind in KINDS) for i in (0, 1))
    if n:
        m["ps/prefix_pass_rate"] = s / n  # both kinds pooled
    m["ps/no_source"] = float(ps.no_source)
    m["ps/replayed_tokens"] = float(sum(t.num_replayed_tokens for g in groups for t in g))
    m["ps/generated_tokens"] = float(sum(t.num_generated_tokens for g in groups for t in g))
    if queue is not None:
        m["ps/queue_size"] = float(len(queue))
        m["ps/queue_expired"] = float(queue.last_expired)
    return m
