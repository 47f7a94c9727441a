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
from rl.algos.base import Algorithm, Context, Progress
from rl.rollout import RolloutJob, StreamCollector, decode_jobs, encode_jobs
from rl.sampler import TaskSampler
from rl.seeds import job_seed
from rl.types import Trajectory


class GRPOPrefix(Algorithm):
    """GRPO + Prefix Sampling; host state: data loader, prefix queue and controller, rng."""

    @classmethod
    def check_config(cls, config) -> None:
        adv_lib.get(config.advantage)
        if config.group_size < 2:
            raise ValueError(f"algo='grpo' needs group_size >= 2, got {config.group_size}")

    def __init__(self, ctx: Context):
        c = ctx.config
        self.agent, self.group_size, self.batch_tasks = ctx.agent, c.group_size, c.batch_tasks
        self.advantage, self.reject_degenerate = c.advantage, c.reject_degenerate
        self.ps_cfg = prefix.PrefixConfig(**c.ps)
        self.ps_enabled = self.ps_cfg.enabled
        self.rollouts_per_step = c.batch_tasks * c.group_size
        self.task_by_id = {t.instance_id: t for t in ctx.train_tasks}
        self.sampler = TaskSampler(ctx.train_tasks, seed=c.seed)
        self.queue = prefix.PrefixQueue(max_age=self.ps_cfg.max_age)
        self.controller = prefix.AdaptiveController(self.ps_cfg)
        self.rng = seeds.host_rng(c.seed)
        self.max_staleness, self.stale = c.rollout.max_staleness, c.rollout.stale
        self.stream = bool(self.max_staleness)  # generation goes on while the learner trains
        self._collector: StreamCollector | None = None
        self._chunks = 0  # chunks of jobs drawn ahead (their seeds)
        self._local: list[RolloutJob] = []  # this process's share of them, not yet started
        self._pending: list[RolloutJob] = []  # a resumed run's unfinished jobs

    def _jobs(self, step: int, seed_step: int) -> list[RolloutJob]:
        """batch_tasks jobs: queued prefix tasks, then new tasks; seeds from seed_step."""
        queued = (self.queue.take(step, self.batch_tasks, self.ps_cfg.max_share)
                  if self.ps_enabled else [])
        jobs = [RolloutJob(self.task_by_id[pt.task_id], prefix=pt, seed=job_seed(seed_step, i),
                           replay=self.ps_cfg.replay) for i, pt in enumerate(queued)]
        return jobs + [RolloutJob(task, seed=job_seed(seed_step, len(jobs) + i))
                       for i, task in enumerate(self.sampler.next(self.batch_tasks - len(jobs)))]

    def _next_job(self) -> RolloutJob | None:
        return self._local.pop(0) if self._local else None

    async def collect(self, step: int, progress: Progress = None) -> list[list[Trajectory]]:
        if not self.max_staleness:
            # Over several processes each runs its share of the jobs; all get every group.
            return await distributed.collect_groups(self.agent, self._jobs(step, step),
                                                    self.group_size, progress)
        # Chunks are drawn at the same points on every process (host state stays
        # replicated): step + max_staleness chunks by step `step`. Each process runs its
        # share of each chunk and trains its share of the batch; all get every group.
        while self._chunks < step + self.max_staleness:
            self._chunks += 1
            jobs = self._jobs(step, self._chunks)
            self._local += [jobs[i] for i in distributed.share(len(jobs))]
        mine = len(distributed.share(self.batch_tasks))
        if self._collector is None:
            self._collector = StreamCollector(
                self.agent, self._next_job, (self.max_staleness + 1) * mine,
                group_size=self.group_size, max_staleness=self.max_staleness, stale=self.stale)
            self._collector.requeue(self._pending)
            self._pending = []
        groups = await self._collector.collect(mine, progress, version=self.agent.policy_version)
        return await distributed.gather_lists(groups)

    def advantages(self, step: int, groups: Sequence[Sequence[Trajectory]]
                   ) -> tuple[list[Trajectory], np.ndarray, dict[str, float]]:
        metrics: dict[str, float] = {}
        if self.ps_enabled:
            ps_step = prefix.build_prefix_tasks(groups, step, self.ps_cfg, self.controller,
                                                self.rng)
            self.queue.push(ps_step.tasks)
            metrics.update(prefix.prefix_metrics(ps_step, groups, self.controller, self.queue))
        kept, advs, rejected = adv_lib.group_advantages(groups, self.advantage,
                                                        self.reject_degenerate)
        metrics["train/rejected_groups"] = rejected
        if self._collector is not None:
            metrics.update(self._collector.stats())
        return kept, advs, metrics

    def state_dict(self) -> dict[str, Any]:
        state = {"sampler": self.sampler.state_dict(), "queue": self.queue.state_dict(),
                 "controller": self.controller.state_dict(),
                 "np_rng": self.rng.bit_generator.state}
        if self.max_staleness:  # every process's jobs not yet trained on (a collective)
            pending = self._collector.pending() if self._collector else self._pending
            state["ahead"] = {"chunks": self._chunks, "jobs": distributed.allgather_objects(
                encode_jobs([*pending, *self._local]))}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.queue.load_state_dict(state["queue"])
        self.controller.load_state_dict(state["controller"])
        self.rng.bit_generator.state = state["np_rng"]
        if self.max_staleness and "ahead" in state:
            jobs = state["ahead"]["jobs"]
            if len(jobs) != distributed.process_count():
                raise ValueError(f"the checkpoint holds the jobs in flight of {len(jobs)} "
                                 f"processes; resume it with as many (this run has "
                                 f"{distributed.process_count()})")
            self._chunks = int(state["ahead"]["chunks"])
            self._pending = decode_jobs(jobs[distributed.process_index()], self.task_by_id)
            self._local = []

    async def close(self) -> None:
        if self._collector is not None:
            await self._collector.close()

