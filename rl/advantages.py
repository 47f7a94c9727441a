"""Group-relative advantages: short pure functions, chosen by name.

Each function maps the rewards of one task's N rollouts, r[N], to per-rollout
advantages A[N] (one scalar per trajectory, broadcast to its tokens by the batch).

- grpo:        A_i = (r_i - mean(r)) / (std(r) + eps)        (Shao et al. 2024)
- grpo_nostd:  A_i = r_i - mean(r)
- drgrpo:      A_i = r_i - mean(r); pair with `seq-mean-token-sum` aggregation
               (Liu et al. 2025, "Understanding R1-Zero-like training")
- rloo:        A_i = r_i - mean_{j != i} r_j = N/(N-1) * (r_i - mean(r))
               (Ahmadian et al. 2024)

`std` is the population standard deviation, as in the GRPO reference code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from rl.types import Trajectory

EPS = 1e-6


def grpo(rewards: np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, np.float64)
    return (r - r.mean()) / (r.std() + EPS)


def grpo_nostd(rewards: np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, np.float64)
    return r - r.mean()


def rloo(rewards: np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, np.float64)
    n = len(r)
    if n < 2:
        return np.zeros_like(r)
    return n / (n - 1) * (r - r.mean())


ADVANTAGES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "grpo": grpo,
    "grpo_nostd": grpo_nostd,
    "drgrpo": grpo_nostd,
    "rloo": rloo,
}


def get(name: str) -> Callable[[np.ndarray], np.ndarray]:
    if name not in ADVANTAGES:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGES)}")
    return ADVANTAGES[name]


def scored(group: Sequence[Trajectory]) -> list[Trajectory]:
    """The trajectories that count (Trajectory.is_scored): env_error ones never enter
    statistics or training."""
    return [t for t in group if t.is_scored]


def is_degenerate(rewards: np.ndarray) -> bool:
    """All-pass or all-fail: zero group-relative signal (rejection sampling drops it)."""
    r = np.asarray(rewards)
    return len(r) == 0 or bool(np.all(r == r[0]))


def group_advantages(
    groups: Sequence[Sequence[Trajectory]], name: str, reject_degenerate: bool = True,
) -> tuple[list[Trajectory], np.ndarray, int]:
    """Advantages for a batch of task groups.

    Returns (trajectories kept, their advantages, number of groups rejected).
    Groups are rejected when fewer than two scored rollouts remain or, with
    `reject_degenerate`, when every scored rollout has the same reward.
    """
    fn = get(name)
    kept, advs, rejected = [], [], 0
    for group in groups:
        group = scored(group)
        rewards = np.array([t.reward for t in group], np.float64)
        if len(group) < 2 or (reject_degenerate and is_degenerate(rewards)):
            rejected += 1
            continue
        kept += group
        advs.append(fn(rewards))
    return kept, (np.concatenate(advs) if advs else np.zeros(0)), rejected
