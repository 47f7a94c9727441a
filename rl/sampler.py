"""The task stream the trainer draws batches from.

`TaskSampler` walks a seeded permutation of the task list epoch by epoch; its
position (epoch, index) is part of the checkpoint's host state, so a resumed run
draws exactly the tasks the uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")


class TaskSampler(Generic[T]):
    def __init__(self, tasks: Sequence[T], seed: int):
        if not tasks:
            raise ValueError("TaskSampler needs at least one task")
        self.tasks = list(tasks)
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))

    def next(self, n: int) -> list[T]:
        """The next `n` tasks, continuing into the next epoch's permutation."""
        out = []
        while len(out) < n:
            if self.index == len(self.tasks):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), len(self.tasks) - self.index)
            out += [self.tasks[i] for i in self._order[self.index:self.index + take]]
            self.index += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"sampler seed {state['seed']} in the checkpoint differs from the "
                             f"config's {self.seed}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
