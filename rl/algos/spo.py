"""SPO (seed 002; the maths in rl.tracker): one response per prompt, a persistent Beta
baseline per task id, prioritised prompts collected as a single stream.

A step, in the official code's order (verl-recipe spo_ray_trainer.py):
  1. the first `batch_tasks` rollouts of the stream to finish (the rest carry over),
     in the order their prompts were drawn;
  2. advantages from each prompt's value before this step;
  3. the learner update (train.py);
  4. after it, under the updated parameters: the drift D of each prompt's stored
     response (whole, in its context), the tracker update with rho(D), and this
     step's responses stored with their log-probs.

Offline start (before the first step): `spo.init_samples` = n0 rollouts of every pool
prompt with the initial policy, through the same stream collector, or
`spo.init_values` = a JSONL file of {"task_id", "successes", "n"}; either gives
(alpha0, beta0) in `spo.init_form` (rl.tracker.offline_prior). Without one, every prompt
starts at `spo.prior`.

Prompts are drawn in chunks of `batch_tasks` at fixed points: step s draws until
s + ceil(in_flight / batch_tasks) chunks are out, with the tracker's weights after step
s - 1 and seeds from the host generator, as a stream drawing a chunk whenever its queue
runs out would (in one process the two give the same prompts and seeds). Over several
processes every process draws every chunk alike (the sampler, tracker and generator are
replicated) and runs its share of each (rl.distributed);
a step takes each process's first finished share of the batch and gathers them, so
every process trains on, and updates the tracker from, the same batch. Jobs drawn and
not yet trained on are checkpointed, each process re-running its own on resume.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl import distributed, seeds
from rl.algos.base import AlgoConfig, Algorithm, Context, Progress, load_ahead, save_ahead
from rl.rollout import RolloutJob, StreamCollector
from rl.tracker import (
    BetaTracker,
    PrioritizedSampler,
    drift_mask,
    load_offline_values,
    spo_advantages,
)
from rl.types import Trajectory

log = logging.getLogger(__name__)


class SPO(Algorithm):
    """SPO; host state: tracker (values and stored responses), prompt sampler, rng (the
    offline start's seeds), the jobs drawn and not yet trained on."""

    stream = True

    @classmethod
    def check_config(cls, cfg: AlgoConfig) -> None:
        if cfg.ps.enabled:
            raise ValueError("ps.enabled needs algo='grpo' (Prefix Sampling classifies groups)")
        if cfg.spo.in_flight < cfg.batch_tasks:
            raise ValueError(f"spo.in_flight ({cfg.spo.in_flight}) must be >= batch_tasks "
                             f"({cfg.batch_tasks})")

    def __init__(self, ctx: Context):
        self.run_cfg, self.agent, self.score = ctx.cfg, ctx.agent, ctx.score
        self.cfg = ctx.cfg.spo
        self.rollouts_per_step = ctx.cfg.batch_tasks
        self.tracker = BetaTracker(self.cfg)
        self.sampler = PrioritizedSampler(self.tracker, seed=ctx.cfg.seed, eps=self.cfg.sampler_eps)
        self.rng = seeds.host_rng(ctx.cfg.seed)
        self.task_by_id = {t.instance_id: t for t in ctx.train_tasks}
        ids = list(self.task_by_id)
        self.pool_ids = ids[:self.cfg.pool_size] if self.cfg.pool_size else ids
        self.started = not (self.cfg.init_samples or self.cfg.init_values)
        self._collector: StreamCollector | None = None
        self._chunks = 0  # chunks of prompts drawn
        self._drawn = 0  # jobs drawn (by every process alike)
        self._order: dict[tuple[str, int], int] = {}  # (task id, seed) -> place in the draw
        self._local: list[RolloutJob] = []  # this process's share of them, not yet started
        self._resumed: list[RolloutJob] = []  # a resumed run's unfinished jobs
        # the step's scored batch, for after_update: (task ids, rewards, drift windows)
        self._batch: tuple[list[str], np.ndarray, list[tuple[np.ndarray, np.ndarray]]] | None
        self._batch = None

    # ------------------------------------------------------------ offline start

    async def start(self, progress: Progress = None) -> dict[str, float]:
        """The offline values: n0 rollouts per pool prompt (init_samples) or a file."""
        if self.cfg.init_values:
            ids, successes, n = load_offline_values(self.cfg.init_values)
            known = [i for i, t in enumerate(ids) if t in self.task_by_id]
            if len(known) < len(ids):
                log.warning("%s: %d of %d task ids are not training tasks; ignored",
                            self.cfg.init_values, len(ids) - len(known), len(ids))
            ids, successes, n = [ids[i] for i in known], successes[known], n[known]
            m = {"spo/init_prompts": float(len(ids))}
        else:
            ids, successes, n, m = await self._sample_offline(progress)
        self.tracker.init_offline(ids, successes, n, form=self.cfg.init_form)
        if ids:
            m["spo/init_v_mean"] = float(self.tracker.values(ids).mean())
        self.started = True
        return m

    async def _sample_offline(self, progress: Progress):
        """init_samples rollouts of every pool prompt (each process runs its share of
        them), scored ones counted per prompt, prompts in pool order."""
        jobs = [RolloutJob(self.task_by_id[t], seed=int(self.rng.integers(1 << 30)))
                for t in self.pool_ids for _ in range(self.cfg.init_samples)]
        mine = iter([jobs[i] for i in distributed.share(len(jobs))])
        collector = StreamCollector(self.agent, lambda: next(mine, None),
                                    len(distributed.share(self.cfg.in_flight)))
        try:
            groups = await collector.collect(len(distributed.share(len(jobs))), progress)
        finally:
            await collector.close()
        outcomes = await distributed.gather_lists(
            [(t.task_id, t.is_scored, t.reward) for g in groups for t in g])
        counts: dict[str, list[int]] = {}
        for task_id, is_scored, reward in outcomes:
            if is_scored:
                s_n = counts.setdefault(task_id, [0, 0])
                s_n[0], s_n[1] = s_n[0] + int(reward), s_n[1] + 1
        ids = [t for t in self.pool_ids if t in counts]
        successes = np.array([counts[t][0] for t in ids], np.int64)
        n = np.array([counts[t][1] for t in ids], np.int64)
        scored = int(n.sum())
        m = {"spo/init_rollouts": float(len(outcomes)),
             "spo/init_env_errors": float(len(outcomes) - scored),
             "spo/init_prompts": float(len(ids)),
             "spo/init_pass_rate": float(successes.sum() / scored) if scored else float("nan")}
        return ids, successes, n, m

    # ------------------------------------------------------------ collection

    def _pool(self) -> list[str]:
        if self.cfg.unseen == "draw":
            return self.pool_ids
        pool = [t for t in self.pool_ids if t in self.tracker]
        if not pool:
            raise ValueError("spo.unseen='skip' leaves no prompt to draw: no pool prompt "
                             "has an offline value (spo.init_samples or spo.init_values)")
        return pool

    def _draw(self) -> list[RolloutJob]:
        """The next chunk of prompts and seeds, drawn alike on every process (the
        tracker's weights now, the replicated generators); this process's share of it."""
        pool = self._pool()
        ids = self.sampler.sample(pool, min(self.run_cfg.batch_tasks, len(pool)))
        jobs = [RolloutJob(self.task_by_id[t], seed=int(self.rng.integers(1 << 30))) for t in ids]
        for job in jobs:
            self._order[(job.task.instance_id, job.seed)] = self._drawn
            self._drawn += 1
        return [jobs[i] for i in distributed.share(len(jobs))]

    def _next_job(self) -> RolloutJob | None:
        return self._local.pop(0) if self._local else None

    async def collect(self, step: int, progress: Progress = None) -> list[list[Trajectory]]:
        batch = self.run_cfg.batch_tasks
        while self._chunks < step + -(-self.cfg.in_flight // batch):
            self._chunks += 1
            self._local += self._draw()
        if self._collector is None:
            self._collector = StreamCollector(
                self.agent, self._next_job, len(distributed.share(self.cfg.in_flight)),
                # rollout.max_staleness 0: the stream as it always ran, ages unbounded.
                max_staleness=self.run_cfg.rollout.max_staleness or None,
                stale=self.run_cfg.rollout.stale)
            self._collector.requeue(self._resumed)
            self._resumed = []
        mine = await self._collector.collect(len(distributed.share(batch)), progress,
                                             version=self.agent.policy_version)
        # Draw order, whichever process ran a rollout and when it finished.
        groups = await distributed.gather_lists(mine)
        return sorted(groups, key=lambda g: self._order.pop((g[0].task_id, g[0].seed)))

    # ------------------------------------------------------------ the tracker

    def advantages(self, step: int, groups: Sequence[Sequence[Trajectory]]
                   ) -> tuple[list[Trajectory], np.ndarray, dict[str, float]]:
        """A = r - v_before, batch-normalised; remembers the batch for after_update."""
        scored = [t for g in groups for t in g if t.is_scored]
        self._batch = None
        if not scored:
            return [], np.zeros(0), {}
        ids = [t.task_id for t in scored]
        rewards = np.array([t.reward for t in scored], np.float64)
        v_before = self.tracker.values(ids)
        self._batch = (ids, rewards, [self._drift_window(t) for t in scored])
        adv = spo_advantages(rewards, v_before, ddof=self.cfg.adv_std_ddof)
        metrics = {"spo/v_mean": float(v_before.mean())}
        if rewards.var() > 0:  # the share of the reward's variance the baseline leaves
            metrics["spo/residual_var_ratio"] = float((rewards - v_before).var()
                                                      / rewards.var())
        if self.run_cfg.rollout.max_staleness and self._collector is not None:
            metrics.update(self._collector.stats())
        return scored, adv, metrics

    def _drift_window(self, traj: Trajectory) -> tuple[np.ndarray, np.ndarray]:
        """(ids[T], the tokens D averages over[T]) of one response (spo.drift_tokens)."""
        ids, loss_mask = traj.token_arrays()[:2]
        prompt_len = len(traj.turns[0].obs_ids) if traj.turns else len(ids)
        return ids, drift_mask(loss_mask, prompt_len, self.cfg.drift_tokens)

    async def after_update(self, step: int, params) -> dict[str, float]:
        """D under the updated params, the tracker update, this step's responses stored."""
        if self._batch is None:
            return {}
        ids, rewards, arrays = self._batch
        self._batch = None
        if self.tracker.rho_type == "constant":
            rho = self.tracker.update(ids, rewards)
            return {"spo/rho_mean": float(rho.mean()), "spo/tracked": float(len(self.tracker))}
        stored = self.tracker.pending_d_requests(ids)
        windows = [(r.ids, r.mask) for r in stored.values()] + list(arrays)
        scores = await asyncio.to_thread(self.score, params, windows)
        D = self.tracker.drift(ids, dict(zip(stored, scores[:len(stored)], strict=True)))
        rho = self.tracker.update(ids, rewards, D=D)
        for task_id, (tokens, mask), logp in zip(ids, arrays, scores[len(stored):],
                                                 strict=True):
            n = len(logp)  # the packer keeps at most the longest row bucket
            self.tracker.store_response(task_id, tokens[:n], logp, mask[:n])
        return {"spo/drift_mean": float(D.mean()), "spo/rho_mean": float(rho.mean()),
                "spo/tracked": float(len(self.tracker)),
                # samples of prompts with no stored response yet (D = 0 for them)
                "spo/first_visit_frac": float(np.mean([t not in stored for t in ids]))}

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        pending = self._collector.pending() if self._collector else self._resumed
        return {"tracker": self.tracker.state_dict(), "spo_sampler": self.sampler.state_dict(),
                "np_rng": self.rng.bit_generator.state, "started": self.started,
                # every process's jobs not yet trained on (a collective), and their places
                "ahead": {**save_ahead(self._chunks, [*pending, *self._local]),
                          "drawn": self._drawn,
                          "order": [[t, s, i] for (t, s), i in self._order.items()]}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "tracker" not in state:
            # The step-0 checkpoint of a warm start shared with GRPO arms holds GRPO's
            # host state: before any RL step there is nothing of SPO's to restore.
            if int(state.get("step", -1)) != 0:
                raise ValueError(f"the checkpoint at step {state.get('step')} holds no SPO "
                                 f"state (keys {sorted(state)}): not an SPO run's")
            log.info("step-0 checkpoint of another algorithm: SPO starts fresh")
            return
        self.tracker.load_state_dict(state["tracker"])
        self.sampler.load_state_dict(state["spo_sampler"])
        self.rng.bit_generator.state = state["np_rng"]
        self.started = bool(state["started"])
        self._load_ahead(state)

    def _load_ahead(self, state: Mapping[str, Any]) -> None:
        """This process's jobs in flight at the checkpoint, to run again first."""
        self._local, self._resumed, self._order = [], [], {}
        if "ahead" not in state:  # a checkpoint that kept none: draw on from its step
            self._chunks, self._drawn = int(state.get("step", 0)), 0
            return
        self._chunks, self._resumed = load_ahead(state["ahead"], self.task_by_id)
        self._drawn = int(state["ahead"]["drawn"])
        self._order = {(t, int(s)): int(i) for t, s, i in state["ahead"]["order"]}

    async def close(self) -> None:
        if self._collector is not None:
            await self._collector.close()
