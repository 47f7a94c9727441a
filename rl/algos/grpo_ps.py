"""GRPO with rejection sampling, plus Prefix Sampling (seed 000; rl.prefix).

Each step runs `group_size` rollouts of `batch_tasks` start states: queued prefix tasks
first (freshest first, at most ps.max_share of the batch), then new tasks from the data
loader. The groups are classified, skewed ones leave prefix tasks for the next steps,
and group advantages (rl.advantages, `config.advantage`) drop degenerate groups.

rollout.max_staleness = 0: a step collects its own batch, then learns (synchronous).
k > 0: (k + 1) batches of groups run at once (rl.rollout.StreamCollector), drawn in
chunks of batch_tasks as above; a step trains on the first batch_tasks groups whose
last member has finished, while the others run on under the new weights; a group that
started more than k versions before the learner's is dropped and run again, or trained
on (`rollout.stale`). Prefix tasks built from a step's groups join the next chunk
drawn. Jobs started and not yet trained on are checkpointed and re-run on resume. Over
several processes each runs its share of every chunk and of every batch, and the
groups are gathered (rl.distributed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl import advantages as adv_lib
from rl import distributed, prefix, seeds
from rl.algos.base import AlgoConfig, Algorithm, Context, Progress, load_ahead, save_ahead
from rl.rollout import RolloutJob, StreamCollector
from rl.sampler import TaskSampler
from rl.seeds import job_seed
from rl.types import Trajectory


class GRPOPrefix(Algorithm):
    """GRPO + Prefix Sampling; host state: data loader, prefix queue and controller, rng."""

    @classmethod
    def check_config(cls, cfg: AlgoConfig) -> None:
        adv_lib.get(cfg.advantage)
        if cfg.group_size < 2:
            raise ValueError(f"algo='grpo' needs group_size >= 2, got {cfg.group_size}")

    def __init__(self, ctx: Context):
        self.cfg, self.agent = ctx.cfg, ctx.agent
        self.rollouts_per_step = self.cfg.batch_tasks * self.cfg.group_size
        self.task_by_id = {t.instance_id: t for t in ctx.train_tasks}
        self.sampler = TaskSampler(ctx.train_tasks, seed=self.cfg.seed)
        self.queue = prefix.PrefixQueue(max_age=self.cfg.ps.max_age)
        self.controller = prefix.AdaptiveController(self.cfg.ps)
        self.rng = seeds.host_rng(self.cfg.seed)
        # generation goes on while the learner trains
        self.stream = bool(self.cfg.rollout.max_staleness)
        self._collector: StreamCollector | None = None
        self._chunks = 0  # chunks of jobs drawn ahead (their seeds)
        self._local: list[RolloutJob] = []  # this process's share of them, not yet started
        self._pending: list[RolloutJob] = []  # a resumed run's unfinished jobs

    def _jobs(self, step: int, seed_step: int) -> list[RolloutJob]:
        """batch_tasks jobs: queued prefix tasks, then new tasks; seeds from seed_step."""
        queued = (self.queue.take(step, self.cfg.batch_tasks, self.cfg.ps.max_share)
                  if self.cfg.ps.enabled else [])
        jobs = [RolloutJob(self.task_by_id[pt.task_id], prefix=pt, seed=job_seed(seed_step, i),
                           replay=self.cfg.ps.replay) for i, pt in enumerate(queued)]
        new = self.sampler.next(self.cfg.batch_tasks - len(jobs))
        return jobs + [RolloutJob(task, seed=job_seed(seed_step, len(jobs) + i))
                       for i, task in enumerate(new)]

    def _next_job(self) -> RolloutJob | None:
        return self._local.pop(0) if self._local else None

    async def collect(self, step: int, progress: Progress = None) -> list[list[Trajectory]]:
        if not self.cfg.rollout.max_staleness:
            # Over several processes each runs its share of the jobs; all get every group.
            return await distributed.collect_groups(self.agent, self._jobs(step, step),
                                                    self.cfg.group_size, progress)
        # Chunks are drawn at the same points on every process (host state stays
        # replicated): step + max_staleness chunks by step `step`. Each process runs its
        # share of each chunk and trains its share of the batch; all get every group.
        while self._chunks < step + self.cfg.rollout.max_staleness:
            self._chunks += 1
            jobs = self._jobs(step, self._chunks)
            self._local += [jobs[i] for i in distributed.share(len(jobs))]
        mine = len(distributed.share(self.cfg.batch_tasks))
        if self._collector is None:
            self._collector = StreamCollector(
                self.agent, self._next_job, (self.cfg.rollout.max_staleness + 1) * mine,
                group_size=self.cfg.group_size, max_staleness=self.cfg.rollout.max_staleness,
                stale=self.cfg.rollout.stale)
            self._collector.requeue(self._pending)
            self._pending = []
        groups = await self._collector.collect(mine, progress, version=self.agent.policy_version)
        return await distributed.gather_lists(groups)

    def advantages(self, step: int, groups: Sequence[Sequence[Trajectory]]
                   ) -> tuple[list[Trajectory], np.ndarray, dict[str, float]]:
        metrics: dict[str, float] = {}
        if self.cfg.ps.enabled:
            ps_step = prefix.build_prefix_tasks(groups, step, self.cfg.ps, self.controller,
                                                self.rng)
            self.queue.push(ps_step.tasks)
            metrics.update(prefix.prefix_metrics(ps_step, groups, self.controller, self.queue))
        kept, advs, rejected = adv_lib.group_advantages(groups, self.cfg.advantage,
                                                        self.cfg.reject_degenerate)
        metrics["train/rejected_groups"] = rejected
        if self._collector is not None:
            metrics.update(self._collector.stats())
        return kept, advs, metrics

    def state_dict(self) -> dict[str, Any]:
        state = {"sampler": self.sampler.state_dict(), "queue": self.queue.state_dict(),
                 "controller": self.controller.state_dict(),
                 "np_rng": self.rng.bit_generator.state}
        # every process's jobs not yet trained on (a collective)
        if self.cfg.rollout.max_staleness:
            pending = self._collector.pending() if self._collector else self._pending
            state["ahead"] = save_ahead(self._chunks, [*pending, *self._local])
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.queue.load_state_dict(state["queue"])
        self.controller.load_state_dict(state["controller"])
        self.rng.bit_generator.state = state["np_rng"]
        if self.cfg.rollout.max_staleness and "ahead" in state:
            self._chunks, self._pending = load_ahead(state["ahead"], self.task_by_id)
            self._local = []

    async def close(self) -> None:
        if self._collector is not None:
            await self._collector.close()

