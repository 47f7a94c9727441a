"""A latency model for tool calls: the long tail of real environments, reproduced here.

Real SWE sandboxes answer a tool call in seconds to minutes (builds, test suites,
slow repositories), and some tasks are slow on every call. On a laptop a call takes
milliseconds, so the effects of a long tail (a step waiting for its slowest rollout)
never show. This model sleeps before the environment answers each action (a tool call,
or a reply without one), off by default:

    delay = median_s * exp(sigma * z) * (slow_factor if the task is slow else 1)

z ~ N(0, 1), drawn from (seed, task, rollout, call index): the same rollout waits the
same, run after run. A task is slow with probability slow_share, drawn from (seed,
task) alone, so every rollout of a slow task is slow. The delay is a sleep (a thread
waits; nothing computes), like a sandbox that waits on a container.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time

import numpy as np


def _key(text: str) -> int:
    """A stable 63-bit integer of `text` (Python's hash() changes between processes)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@dataclasses.dataclass(frozen=True)
class LatencyConfig:
    """The `env.latency` section, whole (configs.common.latency_defaults documents it):
    median_s, sigma, slow_share, slow_factor."""

    median_s: float
    sigma: float
    slow_share: float
    slow_factor: float

    def __post_init__(self):
        if self.median_s < 0 or self.sigma < 0 or self.slow_factor <= 0:
            raise ValueError(f"latency: need median_s >= 0, sigma >= 0, slow_factor > 0; got "
                             f"{self.median_s}, {self.sigma}, {self.slow_factor}")
        if not 0 <= self.slow_share <= 1:
            raise ValueError(f"latency: slow_share must be in [0, 1], got {self.slow_share}")


class LatencyModel:
    """Per-tool-call delays of a LatencyConfig, drawn from `seed` (the run's); median_s 0
    turns the model off.

    median_s: median delay of a call of a normal task, seconds.
    sigma: log-normal spread (the standard deviation of log(delay)).
    slow_share: probability that a task is slow; slow_factor: its delays' multiplier.
    """

    def __init__(self, cfg: LatencyConfig, seed: int):
        self.cfg, self.seed = cfg, seed

    @property
    def enabled(self) -> bool:
        return self.cfg.median_s > 0

    def is_slow(self, task_id: str) -> bool:
        """Whether every call of `task_id` is slow (drawn from seed and task alone)."""
        u = np.random.default_rng([self.seed, _key(task_id), 0]).random()
        return bool(u < self.cfg.slow_share)

    def delay_s(self, task_id: str, rollout: int, call: int) -> float:
        """Seconds before tool call `call` (0-based) of rollout `rollout` of `task_id`."""
        if not self.enabled:
            return 0.0
        z = np.random.default_rng([self.seed, _key(task_id), 1, rollout % 2**63, call]
                                  ).standard_normal()
        factor = self.cfg.slow_factor if self.is_slow(task_id) else 1.0
        return self.cfg.median_s * math.exp(self.cfg.sigma * z) * factor

    def sleep(self, task_id: str, rollout: int, call: int) -> None:
        """Waits `delay_s(task_id, rollout, call)`."""
        delay = self.delay_s(task_id, rollout, call)
        if delay > 0:
            time.sleep(delay)

