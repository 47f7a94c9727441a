"""Every random stream of a run, derived from `config.seed` in one place.

The run is reproducible bit for bit (a resumed run continues each stream where it
stopped, tests/test_async compares digests of the state), so each stream keeps the
formula it has always had; what they share is the scheme: a stream is named by its
coordinates (step, index in the step, group member, retry, turn), and each coordinate
is mixed in with its own prime stride, so that no two coordinates of one stream
collide within the run's ranges (fewer than 100 003 jobs a step, 1009 members a
group, 7919 turns an episode).

    host streams        numpy default_rng([seed, 1]): Prefix Sampling's picks, SPO's
                        job seeds (rl.algos); default_rng([seed, epoch]): the task
                        loader's order each epoch (rl.sampler); default_rng(seed): SPO's
                        prompt sampler (rl.tracker)
    job seed            step * 100_003 + index                  (GRPO + PS jobs)
    member seed         job_seed * 1009 + member                (the N rollouts of a job)
    request seed        (member_seed * 1_000_003 + attempt * 7919 + turn) mod (2^31 - 1)
                        (one engine request: the sampler's seed, inference.engine)
"""

from __future__ import annotations

import numpy as np

HOST_STREAM = 1  # the second word of default_rng([seed, HOST_STREAM]): the algorithms'


def host_rng(seed: int) -> np.random.Generator:
    """The algorithm's host-side generator (prefix sources, SPO's job seeds)."""
    return np.random.default_rng([seed, HOST_STREAM])


def job_seed(step: int, index: int) -> int:
    """The seed of job `index` of step `step` (GRPO + Prefix Sampling)."""
    return step * 100_003 + index


def member_seed(job: int, member: int) -> int:
    """The seed of rollout `member` of a job's group."""
    return job * 1009 + member


def request_seed(rollout: int, attempt: int, turn: int) -> int:
    """The sampler seed of one engine request: a rollout's `turn` (its context length),
    on its `attempt`-th try after environment errors."""
    return (rollout * 1_000_003 + attempt * 7919 + turn) % (2**31 - 1)
