"""Builders and small reporting helpers for train.py, one per config section.

train.py reads top to bottom; what each of its sections needs from a config lives
here so that the entry point stays a page of wiring.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import tqdm
from flax import nnx

from env import miniswe
from env.grading import error_kind
from env.swebench import SWEBENCH_IMAGE_TEMPLATE
from env.tasks import Task, load_tasks
from models import qwen3
from models.tokenizer import Tokenizer, render_tool_call, train_bpe
from rl import distributed, learner, prefix
from rl.rollout import ENGINE_ERROR, Agent
from rl.sampler import TaskSampler
from rl.types import Trajectory

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ checks

# Keyed by the program and the compiler's options, so a cached program is the one a
# fresh compile would give.
COMPILATION_CACHE = "~/.cache/prefix-spo-rl/xla"


def compilation_cache(path: str) -> None:
    """Keeps compiled XLA programs in `path` for later runs ('' keeps none)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def check_config(config) -> None:
    """Every numeric key's range (configs.common.check_values), then combinations that no
    single section can check; each error names the keys."""
    from configs import common
    from rl import advantages, loss

    common.check_values(config)
    if config.algo not in ("grpo", "spo"):
        raise ValueError(f"algo must be 'grpo' or 'spo', got {config.algo!r}")
    if config.algo == "grpo":
        advantages.get(config.advantage)
        if config.group_size < 2:
            raise ValueError(f"algo='grpo' needs group_size >= 2, got {config.group_size}")
    if config.algo == "spo" and config.ps.enabled:
        raise ValueError("ps.enabled needs algo='grpo' (Prefix Sampling classifies groups)")
    if config.algo == "spo" and config.spo.in_flight < config.batch_tasks:
        raise ValueError(f"spo.in_flight ({config.spo.in_flight}) must be >= batch_tasks "
                         f"({config.batch_tasks})")
    if config.engine.kind == "embedded" and config.engine.max_len < config.rollout.max_context:
        raise ValueError(f"engine.max_len ({config.engine.max_len}) must be >= "
                         f"rollout.max_context ({config.rollout.max_context})")
    if max(config.learner.row_buckets) < config.rollout.max_context:
        raise ValueError(f"the longest learner.row_buckets ({max(config.learner.row_buckets)}) "
                         f"must hold rollout.max_context ({config.rollout.max_context})")
    loss.check_config(config.learner.loss)


# ------------------------------------------------------------------ tasks


def tasks(env_cfg) -> tuple[list[Task], list[Task]]:
    """(train, held-out eval) tasks: generated mini-SWE, or JSONL files `train|eval`."""
    if env_cfg.tasks == "miniswe":
        diffs = tuple(env_cfg.difficulties)
        train = miniswe.generate_tasks(env_cfg.train_tasks, env_cfg.task_seed, diffs)
        held_out = miniswe.generate_tasks(env_cfg.eval_tasks, env_cfg.eval_seed, diffs)
        seen = {t.problem_statement for t in train}
        held_out = [t for t in held_out if t.problem_statement not in seen]
        return train, held_out
    train_path, _, eval_path = env_cfg.tasks.partition("|")
    template = image_template(env_cfg)
    train = load_tasks(train_path, template)
    held_out = load_tasks(eval_path, template) if eval_path else []
    if env_cfg.train_tasks:
        train = train[:env_cfg.train_tasks]
    if env_cfg.eval_tasks:
        held_out = held_out[:env_cfg.eval_tasks]
    if env_cfg.image:
        for t in (*train, *held_out):
            t.image = t.image or env_cfg.image
    return train, held_out


def image_template(env_cfg) -> str:
    """`env.image_template` ("" or absent: the SWE-bench convention)."""
    return env_cfg.get("image_template", "") or SWEBENCH_IMAGE_TEMPLATE


def task_images(env_cfg) -> dict[str, Any]:
    """For the dry run: per task file, instance id -> the image its sandbox will use."""
    if env_cfg.tasks == "miniswe":
        return {}
    return {path: {t.instance_id: t.image or env_cfg.image
                   for t in load_tasks(path, image_template(env_cfg))}
            if os.path.exists(path) else "file not found"
            for path in filter(None, env_cfg.tasks.split("|"))}


# ------------------------------------------------------------------ tokenizer


def tokenizer_corpus(train_tasks: Sequence[Task]) -> Iterator[str]:
    """Text the default BPE is trained on: the training repositories, statements and
    the expert's tool calls (never the held-out tasks)."""
    for task in train_tasks:
        yield task.problem_statement
        yield from (task.repo_files or {}).values()
        yield "\n".join(expert_actions_text(miniswe.expert_demo(task)))


def tokenizer(config, workdir: str, train_tasks: Sequence[Task]) -> Tokenizer:
    """A released tokenizer.json, or the BPE trained on the tasks (saved in the workdir
    on first use, so a resumed run tokenizes exactly as before)."""
    if config.tokenizer.path:
        return Tokenizer.from_file(config.tokenizer.path)
    path = os.path.join(workdir, "tokenizer.json")
    if os.path.exists(path):
        return Tokenizer.from_file(path)
    tok = train_bpe(tokenizer_corpus(train_tasks), config.tokenizer.bpe_vocab_size)
    # Replaced whole: the other processes of a multi-host run train the same BPE and
    # may read the file while this one writes it.
    tok.save(f"{path}.{jax.process_index()}.tmp")
    os.replace(f"{path}.{jax.process_index()}.tmp", path)
    return tok


# ------------------------------------------------------------------ model

_MODEL_KEYS = {f.name for f in dataclasses.fields(qwen3.Qwen3Config)}
# Qwen3Config fields a checkpoint's config.json does not hold: the run config sets them.
_RUNTIME_KEYS = ("dtype", "param_dtype", "remat", "attention")


def model_config(model_cfg, vocab_size: int | None, dry_run: bool = False
                 ) -> qwen3.Qwen3Config:
    """The checkpoint's config.json, or the preset with the config's overrides (also for a
    dry run on a machine without the checkpoint); from-scratch models take the
    tokenizer's vocabulary, rounded up to a multiple of 64 (ids past it are never
    produced)."""
    if model_cfg.hf_path and not (dry_run and not os.path.exists(model_cfg.hf_path)):
        from models import hf_io

        runtime = {k: model_cfg[k] for k in _RUNTIME_KEYS if k in model_cfg}
        return hf_io.load_config(model_cfg.hf_path, **runtime)
    if model_cfg.preset not in qwen3.PRESETS:
        raise KeyError(f"unknown model preset {model_cfg.preset!r}; known: "
                       f"{sorted(qwen3.PRESETS)}")
    overrides = {k: v for k, v in model_cfg.items() if k in _MODEL_KEYS}
    if vocab_size is not None and not model_cfg.hf_path:
        overrides["vocab_size"] = -(-vocab_size // 64) * 64
    return dataclasses.replace(qwen3.PRESETS[model_cfg.preset], **overrides)


def model(model_cfg, cfg: qwen3.Qwen3Config, mesh, seed: int) -> qwen3.Qwen3:
    """Loads HF weights straight into their shardings, or initialises from `seed`."""
    if model_cfg.hf_path:
        from models import hf_io

        return hf_io.load_hf(model_cfg.hf_path, mesh=mesh, dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype, remat=cfg.remat,
                             attention=cfg.attention)[1]
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))


# ------------------------------------------------------------------ engine


def engine(config, graphdef, params, workdir: str, model_cfg: qwen3.Qwen3Config):
    """The embedded JAX sampler, or a client of SGLang servers (launched if asked)."""
    if config.engine.kind == "embedded":
        from inference.embedded import EmbeddedEngine, options_from_config

        return EmbeddedEngine((graphdef, distributed.local_params(params)), seed=config.seed,
                              **options_from_config(config.engine))
    if config.engine.kind == "sglang":
        from inference import sglang

        return sglang.from_config(config, workdir, model_config=model_cfg)
    raise ValueError(f"engine.kind must be 'embedded' or 'sglang', got {config.engine.kind!r}")


# ------------------------------------------------------------------ environment


def sandbox_factory(env_cfg) -> Callable[[Task], Any]:
    """task -> a fresh sandbox of `env.backend` holding the task's repository; for Docker,
    tasks without an image of their own run in `env.image`."""
    from env.episode import sandbox_factory as factory

    if env_cfg.backend not in ("local", "docker"):
        raise ValueError(f"env.backend must be 'local' or 'docker', got {env_cfg.backend!r}")
    defaults = {"image": env_cfg.image} if env_cfg.backend == "docker" and env_cfg.image else {}
    if env_cfg.backend == "docker":  # on every engine named (removing exited runs' containers)
        from env.episode import FleetFactory
        from env.sandbox.docker import docker_host

        return FleetFactory(list(env_cfg.docker_hosts) or [docker_host()],
                            env_cfg.docker_slots or env_cfg.max_concurrent, **defaults)
    if env_cfg.backend == "local":
        from env.sandbox import local

        stale = local.reap_stale()
        if stale:
            log.info("removed %d sandbox directories of exited processes", len(stale))
        defaults["allow_unisolated"] = env_cfg.local_allow_unisolated
    return factory(env_cfg.backend, **defaults)


# ------------------------------------------------------------------ warm start


def expert_actions_text(calls: Sequence[dict[str, Any]] | miniswe.Demo) -> list[str]:
    """Each expert tool call as the exact `<tool_call>` text the model should generate
    (rendered by the chat template, models.tokenizer)."""
    if isinstance(calls, miniswe.Demo):
        calls = calls.calls
    return [render_tool_call(c) for c in calls]


async def demonstrations(config, agent: Agent, train: Sequence[Task]) -> list[Trajectory]:
    """Scripted expert demonstrations on training tasks, a share of them imperfect,
    rendered through the agent's own loop (identical token layout); over several
    processes each renders its share and all get every demonstration."""
    rng = random.Random(config.seed)
    chosen = TaskSampler(train, seed=config.seed).next(config.sft.num_demos)
    scripts = []
    for task in chosen:
        demo = miniswe.expert_demo(task, imperfect=rng.random() < config.sft.imperfect_share,
                                   rng=rng)
        scripts.append((task, expert_actions_text(demo)))
    with progress(len(scripts), "demonstrations") as bar:
        async def one(task, actions):
            traj = await agent.demonstrate(task, actions)
            bar.update(1)
            return traj

        async def render(mine):
            return await asyncio.gather(*(one(t, a) for t, a in mine))

        demos = await distributed.gather_map(render, scripts)
    return [d for d in demos if not d.is_env_error and d.num_generated_tokens]


def sft_learner_config(config, total_steps: int):
    """The learner config for SFT: its own lr and warmup, then a cosine decay to
    `sft.end_lr_frac` of the lr at the last of `total_steps` updates (a constant lr leaves
    the final weights wherever the last noisy steps put them)."""
    cfg = config.learner.copy_and_resolve_references()
    cfg.optim.lr = config.sft.lr
    cfg.optim.warmup_steps = config.sft.warmup_steps
    cfg.optim.schedule = "cosine"
    cfg.optim.decay_steps = max(1, total_steps - config.sft.warmup_steps)
    cfg.optim.end_lr_frac = config.sft.end_lr_frac
    return cfg


# ------------------------------------------------------------------ reporting


@contextlib.contextmanager
def progress(total: int, desc: str):
    """A progress bar on stderr for long phases (silent when stderr is not a terminal)."""
    bar = tqdm.tqdm(total=total, desc=desc, leave=False, file=sys.stderr,
                    disable=not sys.stderr.isatty())
    try:
        yield bar
    finally:
        bar.close()


def rollout_metrics(trajs: Sequence[Trajectory], groups: Sequence[Sequence[Trajectory]]
                    ) -> dict[str, float]:
    """Pass rate, solve_none / partial / all, statuses and lengths of one step's rollouts."""
    scored = [t for t in trajs if not t.is_env_error and t.reward is not None]
    m: dict[str, float] = {"rollout/trajectories": len(trajs),
                           "rollout/env_errors": len(trajs) - len(scored)}
    for t in trajs:  # by reason: a sandbox failure, or tests that never ran (and why)
        if t.is_env_error:
            key = f"rollout/env_errors_{error_kind(t.error)}"
            m[key] = m.get(key, 0) + 1
    if scored:
        m["rollout/pass_rate"] = float(np.mean([t.reward for t in scored]))
        m["rollout/steps_mean"] = float(np.mean([t.num_steps for t in scored]))
        m["rollout/generated_tokens_mean"] = float(np.mean([t.num_generated_tokens
                                                            for t in scored]))
    for status in ("finished", "max_steps", "truncated", "timeout"):
        m[f"rollout/status_{status}"] = sum(t.status == status for t in trajs)
    m["rollout/grades_cached"] = sum(t.grade_cached for t in scored)
    m["rollout/engine_errors"] = sum(t.is_env_error and t.error.startswith(ENGINE_ERROR)
                                     for t in trajs)
    fresh = prefix.fresh_pass_rate(groups)
    if fresh is not None:
        m["rollout/fresh_pass_rate"] = fresh
    rewards = [[t.reward for t in g if not t.is_env_error and t.reward is not None]
               for g in groups]
    rewards = [r for r in rewards if r]
    m["rollout/solve_none"] = sum(max(r) == 0 for r in rewards)
    m["rollout/solve_all"] = sum(min(r) == 1 for r in rewards)
    m["rollout/solve_partial"] = len(rewards) - m["rollout/solve_none"] - m["rollout/solve_all"]
    gen = [t.timings.get("generate_s", 0.0) for t in trajs]
    env = [t.timings.get("env_s", 0.0) + t.timings.get("grade_s", 0.0) for t in trajs]
    m["time/generate_s_sum"], m["time/env_s_sum"] = float(sum(gen)), float(sum(env))
    return m


def lag_metrics(lags: np.ndarray) -> dict[str, float]:
    """Mean and max of the policy versions a step's trajectories lag the learner's, and
    the count of each lag (async/lag_k)."""
    if not lags.size:
        return {}
    values, counts = np.unique(lags.astype(np.int64), return_counts=True)
    return {"async/lag_mean": float(lags.mean()), "async/lag_max": float(lags.max()),
            **{f"async/lag_{v}": float(c) for v, c in zip(values, counts, strict=True)}}


def histograms(groups: Sequence[Sequence[Trajectory]]) -> dict[str, np.ndarray]:
    rates = [np.mean([t.reward for t in g if t.reward is not None]) for g in groups
             if any(t.reward is not None for t in g)]
    lengths = [t.num_generated_tokens for g in groups for t in g]
    # A step whose rollouts were all env errors has no pass rates to histogram.
    out = {"rollout/task_pass_rate": rates, "rollout/generated_tokens": lengths}
    return {k: np.asarray(v, np.float64) for k, v in out.items() if v}


def console_line(step: int, m: dict[str, float]) -> str:
    get = lambda k, default=float("nan"): m.get(k, default)
    env_share = get("time/env_s_sum", 0.0) / max(
        get("time/env_s_sum", 0.0) + get("time/generate_s_sum", 0.0), 1e-9)
    line = (f"step {step:4d} | pass {get('rollout/pass_rate'):.3f} | "
            f"none/partial/all {get('rollout/solve_none', 0):.0f}/"
            f"{get('rollout/solve_partial', 0):.0f}/{get('rollout/solve_all', 0):.0f} | "
            f"tok/s {get('rollout/generated_tokens_per_s', 0):.0f} | "
            f"rollout {get('time/rollout_s', 0):.1f}s (env {env_share:.0%}) "
            f"learner {get('time/learner_s', 0):.1f}s sync {get('time/sync_s', 0):.2f}s")
    if "ps/prefix_tasks/too_hard" in m:
        line += (f" | prefix tasks {m['ps/prefix_tasks/too_hard']:.0f}+"
                 f"{m['ps/prefix_tasks/too_easy']:.0f}")
    if "eval/pass_rate" in m:
        line += f" | eval {m['eval/pass_rate']:.3f}"
    return line


# ------------------------------------------------------------------ dry run


@functools.lru_cache(maxsize=4)
def _abstract_model(cfg: qwen3.Qwen3Config) -> qwen3.Qwen3:
    """The model with abstract parameters (nothing allocated); cached because tracing a
    large preset takes seconds, and the dry runs of a config's options share it."""
    return nnx.eval_shape(lambda: qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)))


def dry_run(config) -> dict[str, Any]:
    """Builds everything that needs no remote service or weights: the model's abstract
    parameters and optimizer state, the mesh plan, Prefix Sampling / SPO state, the
    rollout budgets and (for SGLang) the server command line. Returns a summary."""
    from inference import sglang
    from rl.rollout import RolloutConfig

    check_config(config)
    cfg = model_config(config.model, config.tokenizer.get("bpe_vocab_size", None), dry_run=True)
    if config.engine.kind == "sglang":
        sglang.check_context(config, cfg)  # before the slow part: refused up front
    _, state = learner.abstract_train_state(_abstract_model(cfg), config.learner)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    opt_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                    for x in jax.tree.leaves(state.opt_state))
    from rl.algos import grpo_ps
    from rl.algos import spo as spo_algo

    RolloutConfig(**config.rollout)
    prefix.AdaptiveController.from_config(grpo_ps.prefix_config(config.ps))
    spo_algo.tracker_from_config(config.spo)
    summary = {"model": dataclasses.asdict(cfg), "params": n_params,
               "optimizer_state_bytes": opt_bytes, "mesh": dict(config.mesh),
               "algo": config.algo, "batch_tasks": config.batch_tasks,
               "group_size": config.group_size, "prefix_sampling": bool(config.ps.enabled),
               "engine": config.engine.kind, "env_backend": config.env.backend}
    if config.engine.kind == "sglang":
        summary["placement"] = sglang.placement(config)
        summary["sglang_commands"] = [" ".join(c) for c in sglang.launch_commands(config)]
    images = task_images(config.env)
    if images:
        summary["task_images"] = images
    return summary
