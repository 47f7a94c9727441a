"""Supervised warm start on demonstrations.

A demonstration is a `Trajectory` whose actions are the expert's: its loss_mask
(from `Trajectory.token_arrays`) is 1 on assistant tokens only, so the "sft"
loss (-log p of each assistant token, token-mean) trains exactly what the policy
will later generate. Packing, kernels, optimizer and the jitted step are the RL
learner's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import ml_collections
import numpy as np

from rl import learner
from rl.batch import Batch, PackInfo, pack_trajectories
from rl.types import Trajectory


def sft_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of the learner section with the cross-entropy loss, token-mean, no KL, and
    no padding rows."""
    cfg = cfg.copy_and_resolve_references()
    # Batches of a fixed number of demonstrations pack into a narrow range of row counts
    # (9-15 in the default): padding them to a multiple would cost more compute than
    # compiling each count once.
    cfg.rows_multiple = 1
    cfg.loss.name, cfg.loss.agg = "sft", "token-mean"
    cfg.loss.kl, cfg.loss.kl_coef = "none", 0.0
    cfg.loss.old_logprobs, cfg.loss.tis_cap = "sampler", 0.0
    return cfg


def pack_demonstrations(demos: Sequence[Trajectory], *, buckets: Sequence[int],
                        row_multiple: int = 1) -> tuple[Batch, PackInfo]:
    """Packs demonstrations (advantages are unused by the sft loss: zeros)."""
    for demo in demos:
        if demo.num_generated_tokens == 0:
            raise ValueError(f"demonstration {demo.uid!r} has no assistant tokens to train on")
    return pack_trajectories(demos, np.zeros(len(demos)), buckets=buckets,
                             row_multiple=row_multiple)


def demo_batches(demos: Sequence[Trajectory], batch_size: int, epochs: int,
                 seed: int = 0) -> Iterator[list[Trajectory]]:
    """`epochs` passes over `demos` in a fresh seeded order each, `batch_size` per batch
    (the last, shorter batch of an epoch is kept)."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(demos))
        for start in range(0, len(demos), batch_size):
            yield [demos[i] for i in order[start:start + batch_size]]


def train_sft(state: learner.TrainState, graphdef, demos: Sequence[Trajectory],
              cfg: ml_collections.ConfigDict, *, buckets: Sequence[int], batch_size: int,
              epochs: int, mesh=None,
              on_metrics: Callable[[int, dict], None] | None = None) -> learner.TrainState:
    """Runs the warm start; `on_metrics(step, host_metrics)` after every step.

    cfg: the learner section (its loss is replaced by `sft_config`).
    """
    cfg = sft_config(cfg)
    train_step = learner.make_train_step(graphdef, cfg, mesh)
    multiple = learner.row_multiple(cfg, mesh)
    for demo_batch in demo_batches(demos, batch_size, epochs, seed=cfg.seed):
        batch, info = pack_demonstrations(demo_batch, buckets=buckets, row_multiple=multiple)
        state, metrics = train_step(state, batch)
        if on_metrics is not None:
            host = {k: float(v) for k, v in metrics.items()}
            on_metrics(int(host["step"]), {**host, **info.stats()})
    return state
