"""GRPO with rejection sampling, plus Prefix Sampling (seed 000; rl.prefix).

Each step runs `group_size` rollouts of `batch_tasks` start states: queued prefix tasks
first (freshest first, at most ps.max_share of the batch), then new tasks from the data
loader. The groups are classified, skewed ones leave prefix tasks for the next steps,
and group advantages (rl.advantages, `config.advantage`) drop degenerate groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl import advantages as adv_lib
from rl import distributed, prefix
from rl.algos.base import Algorithm, Context, Progress
from rl.rollout import RolloutJob
from rl.sampler import TaskSampler
from rl.types import Trajectory


def prefix_config(ps_cfg) -> prefix.PrefixConfig:
    """PrefixConfig from the config's `ps` section (caps of 0 mean uncapped)."""
    fields = {f.name for f in dataclasses.fields(prefix.PrefixConfig)}
    kw = {k: v for k, v in ps_cfg.items() if k in fields}
    kw["remaining_cap"] = ps_cfg.remaining_cap or None
    kw["prefix_cap"] = ps_cfg.prefix_cap or None
    return prefix.PrefixConfig(**kw)


def job_seed(step: int, index: int) -> int:
    return step * 100_003 + index


class GRPOPrefix(Algorithm):
    """GRPO + Prefix Sampling; host state: data loader, prefix queue and controller, rng."""

    def __init__(self, ctx: Context):
        c = ctx.config
        self.agent, self.group_size, self.batch_tasks = ctx.agent, c.group_size, c.batch_tasks
        self.advantage, self.reject_degenerate = c.advantage, c.reject_degenerate
        self.ps_enabled = bool(c.ps.enabled)
        self.ps_cfg = prefix_config(c.ps)
        self.rollouts_per_step = c.batch_tasks * c.group_size
        self.task_by_id = {t.instance_id: t for t in ctx.train_tasks}
        self.sampler = TaskSampler(ctx.train_tasks, seed=c.seed)
        self.queue = prefix.PrefixQueue(max_age=self.ps_cfg.max_age)
        self.controller = prefix.AdaptiveController.from_config(self.ps_cfg)
        self.rng = np.random.default_rng([c.seed, 1])

    async def collect(self, step: int, progress: Progress = None) -> list[list[Trajectory]]:
        queued = (self.queue.take(step, self.batch_tasks, self.ps_cfg.max_share)
                  if self.ps_enabled else [])
        jobs = [RolloutJob(self.task_by_id[pt.task_id], prefix=pt, seed=job_seed(step, i),
                           replay=self.ps_cfg.replay) for i, pt in enumerate(queued)]
        jobs += [RolloutJob(task, seed=job_seed(step, len(jobs) + i))
                 for i, task in enumerate(self.sampler.next(self.batch_tasks - len(jobs)))]
        # Over several processes each runs its share of the jobs; all get every group.
        return await distributed.collect_groups(self.agent, jobs, self.group_size, progress)

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
        return kept, advs, metrics

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "queue": self.queue.state_dict(),
                "controller": self.controller.state_dict(),
                "np_rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.queue.load_state_dict(state["queue"])
        self.controller.load_state_dict(state["controller"])
        self.rng.bit_generator.state = state["np_rng"]
