"""The interface every training algorithm implements; train.py's loop calls only this.

One RL step, as train.py runs it:

    groups = await algo.collect(step, progress)          # rollouts, one group per start state
    kept, advantages, m = algo.advantages(step, groups)  # what the learner trains on
    ...pack, reference log-probs, train_step -> params...
    m |= await algo.after_update(step, params)           # bookkeeping under the new policy
    checkpoint {"step": step, **algo.state_dict()}

and before the first step, until the algorithm reports `started` (a fresh run, or a
run resumed before its start finished):

    m = await algo.start(progress)                       # e.g. SPO's offline values

Host-side state lives in the algorithm object and round-trips through
state_dict / load_state_dict (JSON-able values and NumPy arrays), so a checkpoint, or
another host, can carry it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from env.tasks import Task
from rl import distributed
from rl.prefix import PrefixConfig
from rl.rollout import Agent, RolloutConfig, RolloutJob, decode_jobs, encode_jobs
from rl.tracker import SPOConfig
from rl.types import Trajectory

Progress = Callable[[int], None] | None
# score(params, [(ids[T], mask[T]), ...]) -> [logp[T], ...]: log-probs of each whole
# token stream under `params`, nonzero only where mask is (rl.learner.make_score).
Score = Callable[[Any, Sequence[tuple[np.ndarray, np.ndarray]]], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """What an algorithm reads of the run config: the top-level keys `algo` (as `name`),
    `advantage`, `reject_degenerate`, `batch_tasks`, `group_size` and `seed`, and the
    owners of the `ps`, `spo` and `rollout` sections."""

    name: str
    advantage: str
    reject_degenerate: bool
    batch_tasks: int
    group_size: int
    seed: int
    ps: PrefixConfig
    spo: SPOConfig
    rollout: RolloutConfig


@dataclasses.dataclass
class Context:
    """What an algorithm is built from: its config, the rollout agent, the training tasks
    and a log-prob scorer for the policy's parameters."""

    cfg: AlgoConfig
    agent: Agent
    train_tasks: Sequence[Task]
    score: Score


class Algorithm(abc.ABC):
    """One training algorithm: how to collect, what to train on, what to keep.

    rollouts_per_step: trajectories collect() returns (for the progress bar).
    stream: generation runs on while the learner trains (tokens/s per step time).
    started: start() has nothing (left) to do.
    """

    rollouts_per_step: int
    stream: bool = False
    started: bool = True

    @classmethod
    def check_config(cls, cfg: AlgoConfig) -> None:
        """Raises ValueError naming the keys when `cfg` does not suit the algorithm
        (before anything is built: train.py and the dry run call it)."""
        del cfg

    async def start(self, progress: Progress = None) -> dict[str, float]:
        """Work before the first RL step (runs while `started` is False); metrics."""
        del progress
        self.started = True
        return {}

    @abc.abstractmethod
    async def collect(self, step: int, progress: Progress = None) -> list[list[Trajectory]]:
        """This step's rollouts, grouped by start state (a group of one in SPO)."""

    @abc.abstractmethod
    def advantages(self, step: int, groups: Sequence[Sequence[Trajectory]]
                   ) -> tuple[list[Trajectory], np.ndarray, dict[str, float]]:
        """(trajectories to train on, one advantage each, metrics)."""

    async def after_update(self, step: int, params) -> dict[str, float]:
        """Bookkeeping that needs the updated parameters; runs only after an update."""
        del step, params
        return {}

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Host state to checkpoint (JSON-able values and NumPy arrays)."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what state_dict returned."""

    async def close(self) -> None:
        """Stops background work (e.g. rollouts still in flight)."""
        return None


def save_ahead(chunks: int, jobs: Sequence[RolloutJob]) -> dict[str, Any]:
    """Host state of the chunks drawn and this process's jobs of them not yet trained on,
    every process's jobs gathered (a collective)."""
    return {"chunks": chunks, "jobs": distributed.allgather_objects(encode_jobs(jobs))}


def load_ahead(ahead: Mapping[str, Any], task_by_id: Mapping[str, Task]
               ) -> tuple[int, list[RolloutJob]]:
    """(chunks drawn, this process's jobs to run again first) from `save_ahead`'s state;
    a checkpoint of another process count is refused."""
    jobs = ahead["jobs"]
    if len(jobs) != distributed.process_count():
        raise ValueError(f"the checkpoint holds the jobs in flight of {len(jobs)} "
                         f"processes; resume it with as many (this run has "
                         f"{distributed.process_count()})")
    return int(ahead["chunks"]), decode_jobs(jobs[distributed.process_index()], task_by_id)
