"""Supervised warm start on scripted expert demonstrations (the `sft` config section),
and the BPE tokenizer trained on the tasks and those demonstrations (`tokenizer`).

A demonstration is a `Trajectory` whose actions are the expert's: its loss_mask
(from `Trajectory.token_arrays`) is 1 on assistant tokens only, so the "sft"
loss (-log p of each assistant token, token-mean) trains exactly what the policy
will later generate. Packing, kernels, optimizer and the jitted step are the RL
learner's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from env import miniswe
from env.tasks import Task
from models.tokenizer import Tokenizer, render_tool_call, train_bpe
from rl import distributed, learner
from rl.batch import Batch, PackInfo, pack_trajectories
from rl.metrics import MetricWriter, progress
from rl.rollout import Agent
from rl.sampler import TaskSampler
from rl.types import Trajectory

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The `sft` section: the warm start's length, batch and learning-rate schedule, and
    its demonstrations (how many, the share of them imperfect, the share that explore
    before they edit, and the tool steps a demonstration may take: 0 holds it to
    rollout.max_steps as RL's episodes are)."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    end_lr_frac: float
    num_demos: int
    imperfect_share: float
    explore_share: float
    max_steps: int

    def __post_init__(self):
        if self.steps and min(self.batch_size, self.num_demos) < 1:
            raise ValueError(f"sft.steps={self.steps} needs sft.batch_size >= 1 and "
                             f"sft.num_demos >= 1, got {self.batch_size} and {self.num_demos}")


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """The `tokenizer` section: a released tokenizer.json (`path`), or '' for the BPE of
    `bpe_vocab_size` tokens trained on the tasks."""

    path: str
    bpe_vocab_size: int


def sft_config(cfg: learner.LearnerConfig) -> learner.LearnerConfig:
    """The learner's owner with the cross-entropy loss, token-mean, no KL, and no padding
    rows."""
    # Batches of a fixed number of demonstrations pack into a narrow range of row counts
    # (9-15 in the default): padding them to a multiple would cost more compute than
    # compiling each count once.
    loss = dataclasses.replace(cfg.loss, name="sft", agg="token-mean", kl="none", kl_coef=0.0,
                               old_logprobs="sampler", tis_cap=0.0)
    return dataclasses.replace(cfg, rows_multiple=1, loss=loss)


def sft_learner_config(cfg: learner.LearnerConfig, sft: SFTConfig,
                       total_steps: int) -> learner.LearnerConfig:
    """The learner's owner for SFT (`sft_config`) with its own lr and warmup, then a cosine
    decay to `sft.end_lr_frac` of the lr at the last of `total_steps` updates (a constant
    lr leaves the final weights wherever the last noisy steps put them)."""
    optim = dataclasses.replace(cfg.optim, lr=sft.lr, warmup_steps=sft.warmup_steps,
                                schedule="cosine",
                                decay_steps=max(1, total_steps - sft.warmup_steps),
                                end_lr_frac=sft.end_lr_frac)
    return dataclasses.replace(sft_config(cfg), optim=optim)


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


def train_sft(state: learner.TrainState, graphdef, batches: Iterable[Sequence[Trajectory]],
              cfg: learner.LearnerConfig, *, mesh=None,
              on_metrics: Callable[[int, dict], None] | None = None) -> learner.TrainState:
    """Runs the warm start, one train step per batch of demonstrations (e.g. from
    `demo_batches`) packed into cfg.row_buckets; `on_metrics(step, host_metrics)` after
    every step.

    cfg: the learner's owner for SFT (`sft_config`, `sft_learner_config`).
    """
    train_step = learner.make_train_step(graphdef, cfg, mesh)
    multiple = learner.row_multiple(cfg, mesh)
    for demo_batch in batches:
        batch, info = pack_demonstrations(demo_batch, buckets=cfg.row_buckets,
                                          row_multiple=multiple)
        state, metrics = train_step(state, batch)
        if on_metrics is not None:
            host = {k: float(v) for k, v in metrics.items()}
            on_metrics(int(host["step"]), {**host, **info.stats()})
    return state


# ------------------------------------------------------------------ the run's warm start


def expert_actions_text(calls: Sequence[dict[str, Any]] | miniswe.Demo) -> list[str]:
    """Each expert tool call as the exact `<tool_call>` text the model should generate
    (rendered by the chat template, models.tokenizer)."""
    if isinstance(calls, miniswe.Demo):
        calls = calls.calls
    return [render_tool_call(c) for c in calls]


async def demonstrations(cfg: SFTConfig, seed: int, agent: Agent,
                         train: Sequence[Task]) -> list[Trajectory]:
    """Scripted expert demonstrations on training tasks, a share of them imperfect,
    rendered through the agent's own loop (identical token layout); over several
    processes each renders its share and all get every demonstration."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    chosen = TaskSampler(train, seed=seed).next(cfg.num_demos)
    scripts = []
    for task in chosen:
        imperfect = rng.random() < cfg.imperfect_share
        # drawn only where some demonstrations explore, so that other configs' draws
        # (and their warm starts) stay as they were
        explore = cfg.explore_share > 0 and rng.random() < cfg.explore_share
        demo = miniswe.expert_demo(task, imperfect, rng, explore)
        scripts.append((task, expert_actions_text(demo)))
    with progress(len(scripts), "demonstrations") as bar:
        async def one(task, actions):
            traj = await agent.demonstrate(task, actions, cfg.max_steps)
            bar.update(1)
            return traj

        async def render(mine):
            return await asyncio.gather(*(one(t, a) for t, a in mine))

        demos = await distributed.gather_map(render, scripts)
    kept = [d for d in demos if not d.is_env_error and d.num_generated_tokens]
    if not kept:
        raise RuntimeError(no_demonstrations_reason(demos))
    log.info("SFT on %d demonstrations (%d correct, %d tokens; rendered in %.0fs)", len(kept),
             sum(d.reward == 1 for d in kept), sum(len(d.token_arrays()[0]) for d in kept),
             time.perf_counter() - t0)
    return kept


def no_demonstrations_reason(demos: Sequence[Trajectory]) -> str:
    """Why SFT has nothing to train on: how many demonstrations were asked for, how many
    were env errors (with the first distinct errors) and how many produced no tokens."""
    errors = [d for d in demos if d.is_env_error]
    first = sorted({d.error for d in errors})[:3]
    return (f"SFT has no demonstration to train on: of {len(demos)} scripted demonstrations "
            f"{len(errors)} were env errors and {len(demos) - len(errors)} produced no "
            f"tokens (first errors: {first}); check the env (sandbox, grading timeouts) "
            f"or set sft.steps=0")


async def warm_start(cfg: SFTConfig, learner_cfg: learner.LearnerConfig,
                     demos: Sequence[Trajectory], model: nnx.Module, mesh,
                     writer: MetricWriter) -> learner.TrainState:
    """SFT of `model` on `demos` (`demonstrations`), then a fresh RL optimizer."""
    t0 = time.perf_counter()
    epochs = max(1, round(cfg.steps * cfg.batch_size / len(demos)))
    total = epochs * -(-len(demos) // cfg.batch_size)
    sft_cfg = sft_learner_config(learner_cfg, cfg, total)
    graphdef, sft_state = learner.init_train_state(model, sft_cfg, mesh)
    with progress(total, "SFT") as bar:
        def on_metrics(step, m):
            bar.update(1)
            if step % 10 == 0:
                writer.write_scalars(step, {f"sft/{k}": v for k, v in m.items()})
            if step % 25 == 0:
                log.info("SFT step %d: loss %.3f", step, m["loss"])
        batches = demo_batches(demos, cfg.batch_size, epochs, seed=sft_cfg.seed)
        sft_state = await asyncio.to_thread(train_sft, sft_state, graphdef, batches, sft_cfg,
                                            mesh=mesh, on_metrics=on_metrics)
    log.info("SFT: %d steps in %.0fs", total, time.perf_counter() - t0)
    _, state = learner.init_train_state(nnx.merge(graphdef, sft_state.params), learner_cfg,
                                        mesh)
    return state


# ------------------------------------------------------------------ the tokenizer


def tokenizer_corpus(train_tasks: Sequence[Task]) -> Iterator[str]:
    """Text the default BPE is trained on: the training repositories, statements and
    the expert's tool calls (never the held-out tasks)."""
    for task in train_tasks:
        yield task.problem_statement
        yield from (task.repo_files or {}).values()
        yield "\n".join(expert_actions_text(miniswe.expert_demo(task)))


def build_tokenizer(cfg: TokenizerConfig, workdir: str, train_tasks: Sequence[Task]
                    ) -> Tokenizer:
    """A released tokenizer.json (`tokenizer.path`), or the BPE trained on the tasks
    (saved in the workdir on first use, so a resumed run tokenizes exactly as before)."""
    if cfg.path:
        return Tokenizer.from_file(cfg.path)
    path = os.path.join(workdir, "tokenizer.json")
    if os.path.exists(path):
        return Tokenizer.from_file(path)
    tok = train_bpe(tokenizer_corpus(train_tasks), cfg.bpe_vocab_size)
    # Replaced whole: the other processes of a multi-host run train the same BPE and
    # may read the file while this one writes it.
    tok.save(f"{path}.{jax.process_index()}.tmp")
    os.replace(f"{path}.{jax.process_index()}.tmp", path)
    return tok
