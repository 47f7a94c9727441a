"""Trains a coding agent with binary-reward RL (GRPO + Prefix Sampling, or SPO).

    python train.py --config configs/default.py --workdir runs/default
    python train.py --config configs/default.py:smoke --workdir /tmp/smoke
    python train.py --config configs/ps_qwen3_14b_swe.py --workdir gs://... --dry_run

Reads top to bottom: config -> mesh -> tasks -> tokenizer -> model -> engine ->
environment -> learner and algorithm (rl.algos), held by a `Run` whose methods are the
phases -> resume or SFT warm start -> KL reference -> loop {collect, advantages,
batch, train_step, the algorithm's bookkeeping, weight sync, eval, metrics,
checkpoint}. Rerunning the same command
resumes from the workdir. On a pod every host runs the same command, one JAX process
each (started from `config.distributed`); rl.distributed says how rollouts, host
state, evals, checkpoints and weight sync are shared between them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from configs import common
from env import latency, splits
from env import sandbox as sandboxes_lib
from env.config import EnvConfig
from env.sandbox.pool import SandboxPool
from env.tasks import Task
from inference import build as engines
from models import loading, sharding
from rl import algos, distributed, learner, sft
from rl.batch import pack_trajectories
from rl.checkpoint import Checkpointer
from rl.metrics import (
    MetricWriter,
    console_line,
    group_outcomes,
    histograms,
    lag_metrics,
    progress,
    rollout_metrics,
    timed,
)
from rl.prefix import PrefixConfig
from rl.reference import Reference
from rl.rollout import Agent, RolloutConfig, RolloutJob
from rl.tracker import SPOConfig

log = logging.getLogger("train")
# Keyed by the program and the compiler's options, so a cached program is the one a
# fresh compile would give.
COMPILATION_CACHE = "~/.cache/prefix-spo-rl/xla"


def compilation_cache(path: str) -> None:
    """Keeps compiled XLA programs in `path` for later runs ('' keeps none)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The top-level keys of the loop: its length, evaluations, checkpoints and texts
    (configs/default.py documents each)."""

    total_steps: int
    eval_every: int
    eval_temperature: float
    ckpt_every: int
    ckpt_every_s: float
    ckpt_keep: int
    log_texts_every: int
    max_env_error_steps: int


@dataclasses.dataclass(frozen=True)
class Owners:
    """The run config's sections as their owners, built once from the ConfigDict by
    `owners`: nothing below train.py sees the ConfigDict."""

    algo: algos.AlgoConfig  # with the ps, spo and rollout sections
    learner: learner.LearnerConfig  # with learner.optim and learner.loss
    sft: sft.SFTConfig
    tokenizer: sft.TokenizerConfig
    engine: engines.EngineConfig  # with engine.sglang
    distributed: distributed.DistributedConfig
    env: EnvConfig  # with env.latency
    loop: LoopConfig


def owners(config) -> Owners:
    """Each section's owner (which checks the combinations within its section)."""
    return Owners(
        algo=algos.AlgoConfig(
            name=config.algo, advantage=config.advantage,
            reject_degenerate=config.reject_degenerate, batch_tasks=config.batch_tasks,
            group_size=config.group_size, seed=config.seed, ps=PrefixConfig(**config.ps),
            spo=SPOConfig(**config.spo), rollout=RolloutConfig(**config.rollout)),
        learner=learner.LearnerConfig.from_section(config.learner),
        sft=sft.SFTConfig(**config.sft), tokenizer=sft.TokenizerConfig(**config.tokenizer),
        engine=engines.EngineConfig.from_section(config.engine),
        distributed=distributed.DistributedConfig(**config.distributed),
        env=EnvConfig.from_section(config.env),
        loop=LoopConfig(**{f.name: config[f.name] for f in dataclasses.fields(LoopConfig)}))


def served(config, model_cfg) -> engines.Served:
    """The model the engine serves: the checkpoint or the run's model, its longest context
    and the seed of requests that come without one."""
    return engines.Served(hf_path=config.model.hf_path, model_config=model_cfg,
                          max_context=int(config.rollout.max_context), seed=int(config.seed))


def check_config(config) -> Owners:
    """Every key's range and choice (configs.common.check_values), the combinations
    across sections (once, here), the owners (each checks its section's combinations)
    and what the algorithm needs; each error names the keys. Returns the owners."""
    common.check_values(config)
    check_across_sections(config)
    sections = owners(config)
    algos.check_config(sections.algo)
    return sections


def check_across_sections(config) -> None:
    """The combinations of keys of several sections (each section's own are its owner's)."""
    if config.learner.temperature != config.rollout.temperature:
        raise ValueError(f"learner.temperature ({config.learner.temperature}) must equal "
                         f"rollout.temperature ({config.rollout.temperature}): the learner's "
                         "log-probs are the sampler's")
    if config.model.hf_path and config.tokenizer.path not in ("", config.model.hf_path):
        raise ValueError(f"tokenizer.path ({config.tokenizer.path!r}) differs from "
                         f"model.hf_path ({config.model.hf_path!r}); set both together")
    # A rollout's longest context fits the embedded engine's slots and the learner's
    # longest row.
    if config.engine.kind == "embedded" and config.engine.max_len < config.rollout.max_context:
        raise ValueError(f"engine.max_len ({config.engine.max_len}) must be >= "
                         f"rollout.max_context ({config.rollout.max_context})")
    if max(config.learner.row_buckets) < config.rollout.max_context:
        raise ValueError(f"the longest learner.row_buckets ({max(config.learner.row_buckets)}) "
                         f"must hold rollout.max_context ({config.rollout.max_context})")


def check_processes(config) -> None:
    """Refuses what does not run over several processes, naming the key."""
    if jax.process_count() == 1:
        return
    if config.algo == "spo" and config.batch_tasks < jax.process_count():
        raise ValueError(f"algo='spo' over {jax.process_count()} processes needs batch_tasks "
                         f">= {jax.process_count()} (each runs its share of every batch), got "
                         f"{config.batch_tasks}")
    if config.engine.kind == "sglang" and not config.engine.sglang.urls:
        raise ValueError("a multi-host run takes its SGLang servers from engine.sglang.urls "
                         "(every host's client shares them; process 0 updates them once per "
                         "version), not engine.sglang.launch on every host")

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/default.py", help="path.py[:arg]")
    p.add_argument("--workdir", default="runs/default")
    p.add_argument("--dry_run", action="store_true",
                   help="build everything except remote services and exit")
    p.add_argument("--eval_only", action="store_true",
                   help="evaluate the workdir's latest checkpoint on the config's held-out "
                        "tasks, write eval_only_{step}_{n}tasks.json there (or --eval_out), "
                        "and exit")
    p.add_argument("--eval_out", default="", metavar="PATH",
                   help="with --eval_only: where to write the evaluation's JSON")
    p.add_argument("--eval_step", type=int, default=None, metavar="N",
                   help="with --eval_only: evaluate checkpoint N instead of the latest")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set learner.optim.lr=1e-4 (repeatable; "
                        "values are Python literals, else strings)")
    p.add_argument("--compilation_cache", metavar="DIR",
                   default=os.environ.get("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE),
                   help="XLA programs compiled once are kept here for later runs (on a "
                        "rerun the default's first rollout phase takes 14 s instead of 39 s); "
                        "'' turns it off")
    args = p.parse_args(argv)
    compilation_cache(args.compilation_cache)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save chatter

    # ------------------------------------------------------------------ config
    config = common.load_config(args.config)
    config = common.apply_overrides(config, common.parse_overrides(args.set))
    sections = check_config(config)  # before anything is built from it: errors name the keys
    # Launched SGLang servers own their GPUs; the learner's JAX devices are the rest.
    engines.restrict_learner_devices(sections.engine)
    distributed.initialize(sections.distributed)  # before anything touches a device
    check_processes(config)
    if args.dry_run:
        print(json.dumps({**dry_run(config), "layout": distributed.layout(dict(config.mesh))},
                         indent=1))
        return
    workdir = os.path.abspath(args.workdir)
    if args.eval_only and not os.path.isdir(os.path.join(workdir, "ckpt")):
        p.error(f"--eval_only: no checkpoints under {workdir}")
    if (args.eval_out or args.eval_step is not None) and not args.eval_only:
        p.error("--eval_out and --eval_step need --eval_only")
    os.makedirs(workdir, exist_ok=True)
    if not args.eval_only and distributed.is_primary():  # (an evaluation leaves it as it is)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=1))
    try:
        asyncio.run(run(config, sections, workdir, eval_only=args.eval_only,
                        eval_out=os.path.abspath(args.eval_out) if args.eval_out else None,
                        eval_step=args.eval_step))
    except OSError as e:  # a full disk, a lost mount: its cause, not a traceback of the loop
        log.error("stopped: %s: %s", type(e).__name__, e)
        sys.exit(1)


def dry_run(config) -> dict[str, Any]:
    """Builds everything that needs no remote service or weights: the model's abstract
    parameters and optimizer state, the mesh plan, Prefix Sampling / SPO state, the
    rollout budgets and (for SGLang) the server command line. Returns a summary."""
    sections = check_config(config)
    cfg = loading.model_config(dict(config.model), config.tokenizer.bpe_vocab_size,
                               dry_run=True)
    # before the slow part: refused up front
    engines.check_context(sections.engine, served(config, cfg))
    _, state = learner.abstract_train_state(loading.abstract_model(cfg), sections.learner)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    opt_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                    for x in jax.tree.leaves(state.opt_state))
    algos.check_sections(sections.algo)
    summary = {"model": dataclasses.asdict(cfg), "params": n_params,
               "optimizer_state_bytes": opt_bytes, "mesh": dict(config.mesh),
               "algo": config.algo, "batch_tasks": config.batch_tasks,
               "group_size": config.group_size, "prefix_sampling": bool(config.ps.enabled),
               "engine": config.engine.kind, "env_backend": config.env.backend}
    if config.engine.kind == "sglang":
        summary["placement"] = engines.placement(sections.engine)
        summary["sglang_commands"] = [" ".join(c) for c in engines.launch_commands(
            sections.engine, served(config, cfg))]
    images = splits.task_images(sections.env)
    if images:
        summary["task_images"] = images
    return summary


async def run(config, sections: Owners, workdir: str, eval_only: bool = False,
              eval_out: str | None = None, eval_step: int | None = None
              ) -> None:  # (6: the config, its owners, the workdir, --eval_only's three)
    """Everything after the config, on one event loop (engine batching, sandbox slots
    and in-flight rollouts all live on it). eval_only: evaluate checkpoint eval_step
    (None: the latest) into eval_out if given."""
    # ------------------------------------------------------------------ mesh
    mesh = sharding.make_mesh(**config.mesh)
    if jax.process_count() > 1:
        log.info("layout: %s", json.dumps(distributed.layout(dict(config.mesh))))

    # ------------------------------------------------------------------ tasks
    train_tasks, eval_tasks = splits.splits(sections.env)
    log.info("tasks: %d train, %d held-out eval", len(train_tasks), len(eval_tasks))

    # ------------------------------------------------------------------ tokenizer
    tokenizer = sft.build_tokenizer(sections.tokenizer, workdir, train_tasks)

    # ------------------------------------------------------------------ model
    model_cfg = loading.model_config(dict(config.model), tokenizer.vocab_size)
    model = loading.build_model(dict(config.model), model_cfg, mesh, seed=config.seed)
    graphdef, state = learner.init_train_state(model, sections.learner, mesh)
    del model
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    log.info("model: %s, %.2fM parameters", model_cfg, n_params / 1e6)

    # ------------------------------------------------------------------ engine
    engine = engines.from_config(
        sections.engine, served(config, model_cfg),
        lambda: (graphdef, distributed.local_params(state.params)), workdir)

    # ------------------------------------------------------------------ environment
    sandboxes = sandboxes_lib.from_config(sections.env)
    slow_calls = latency.LatencyModel(sections.env.latency, config.seed)
    agent = Agent(engine, tokenizer, SandboxPool(sandboxes, sections.env.max_concurrent),
                  sections.algo.rollout, tools_in_prompt=sections.env.tools_in_prompt,
                  latency=slow_calls)

    # ------------------------------------------------------------------ learner, algorithm
    r = Run(sections, workdir, mesh, graphdef, agent, eval_tasks)
    r.algo = algos.build(algos.Context(sections.algo, agent, train_tasks, r.score))

    if eval_only:
        try:
            await r.evaluate_checkpoint(state, eval_out, eval_step)
        finally:
            r.ckpt.close()
            engine.close()
        return
    try:
        state, first_step = await r.resume_or_warm_start(state, train_tasks)
        await r.loop(state, first_step)
    finally:
        await r.algo.close()
        r.ckpt.wait()
        r.ckpt.close()
        r.writer.close()
        engine.close()


def stop_on_nothing_trained(step: int, groups, steps_so_far: int, limit: int) -> int:
    """Steps in a row, to `step`, whose rollouts were all env errors; raises once they
    reach `limit` (0: never), so that a run whose environment is broken does not train
    on nothing and exit 0."""
    trajs = [t for g in groups for t in g]
    steps_so_far = steps_so_far + 1 if all(t.is_env_error for t in trajs) else 0
    if limit and steps_so_far >= limit:
        errors = sorted({t.error for t in trajs})[:3]
        raise RuntimeError(f"{steps_so_far} RL steps in a row (to step {step}) trained on "
                           f"nothing: every rollout was an env error (max_env_error_steps="
                           f"{limit}); first errors: {errors}")
    return steps_so_far


class Run:
    """What the phases of a run share, built once by `run`: the learner's jitted
    functions, the agent and its engine, the algorithm, checkpoints and metrics. Its
    methods are the phases: resume or warm start, the KL reference, the RL steps,
    evaluation, checkpoints."""

    def __init__(self, cfg: Owners, workdir: str, mesh, graphdef, agent: Agent,
                 eval_tasks: list[Task]):
        self.cfg, self.workdir, self.mesh, self.graphdef = cfg, workdir, mesh, graphdef
        self.agent, self.engine, self.sandboxes = agent, agent.engine, agent.pool.factory
        self.eval_tasks = eval_tasks
        self.ckpt = Checkpointer(workdir, keep=cfg.loop.ckpt_keep)
        buckets, pad_id = cfg.learner.row_buckets, agent.tokenizer.pad_id
        row_multiple = learner.row_multiple(cfg.learner, mesh)
        self.train_step = learner.make_train_step(graphdef, cfg.learner, mesh)
        self.compute_logprobs = learner.make_compute_logprobs(graphdef, cfg.learner, mesh)
        self.pack = functools.partial(pack_trajectories, buckets=buckets,
                                      row_multiple=row_multiple, pad_id=pad_id)
        self.score = learner.make_score(self.compute_logprobs, buckets=buckets,
                                        row_multiple=row_multiple, pad_id=pad_id)
        self.algo: algos.Algorithm | None = None
        self.writer: MetricWriter | None = None
        self.reference: Reference | None = None
        self.resumed = False

    # ------------------------------------------------------------------ weights, checkpoints

    async def sync_weights(self, params) -> None:
        """Loads `params` into the engine: one policy version more (the engine counts its
        updates alike; turns and trajectories carry the versions that sampled them)."""
        await distributed.sync_weights(self.engine, params,
                                       self.cfg.engine.kind == "sglang")
        self.agent.policy_version += 1

    def save(self, step: int, state) -> None:
        """Checkpoint `step` (every process calls it); the host state, replicated on
        every process, is checked identical first and written once."""
        host = {"step": step, **self.algo.state_dict()}
        log.info("host state at step %d: %s", step,
                 distributed.check_consistent(host, f"step {step}"))
        self.ckpt.save(step, state, host)
        self.writer.mark(step)  # a resume from `step` keeps exactly the metrics written so far

    def restore(self, step: int | None, state, set_aside: bool = True):
        """(step, train state, host state) of checkpoint `step`, laid out like `state`;
        step None: the latest that reads back (a damaged newer step is skipped with a
        warning, and moved aside unless `set_aside` is False)."""
        _, abstract = learner.abstract_train_state(nnx.merge(self.graphdef, state.params),
                                                   self.cfg.learner, self.mesh)
        if step is None:
            return self.ckpt.restore_latest(abstract, set_aside)
        return (step, *self.ckpt.restore(step, abstract))

    # ------------------------------------------------------------------ resume or warm start

    async def resume_or_warm_start(self, state, train_tasks) -> tuple[Any, int]:
        """(train state, last step done): the workdir's latest checkpoint, or the SFT
        warm start (checkpointed as step 0) when sft.steps is set; opens the metric
        writer and the KL reference."""
        first_step = 0
        resumed = self.ckpt.latest_step() is not None
        if resumed:
            _, state, host = self.restore(None, state)
            first_step = int(host["step"])
            self.algo.load_state_dict(host)
            log.info("resumed from %s at step %d (host state %s)", self.ckpt.directory,
                     first_step, distributed.check_consistent(
                         {"step": first_step, **self.algo.state_dict()},
                         f"resume at step {first_step}"))
            await self.sync_weights(state.params)
        # Metric rows a killed run wrote after its last checkpoint (all of them without
        # one, e.g. a warm start cut short) are written again below.
        self.writer = MetricWriter(self.workdir, resume_step=first_step if resumed else -1)
        if not resumed and self.cfg.sft.steps:
            demos = await sft.demonstrations(self.cfg.sft, self.cfg.learner.seed, self.agent,
                                             train_tasks)
            state = await sft.warm_start(self.cfg.sft, self.cfg.learner, demos,
                                         nnx.merge(self.graphdef, state.params), self.mesh,
                                         self.writer)
            await self.sync_weights(state.params)
            self.save(0, state)
        self.reference = self.kl_reference(resumed, state)
        self.resumed = resumed
        return state, first_step

    def kl_reference(self, resumed: bool, state) -> Reference | None:
        """The KL anchor when learner.loss.kl is on: the policy a fresh run starts from,
        saved in workdir/reference; a resumed run loads it from there (a workdir seeded
        with a warm-start checkpoint only takes that step-0 checkpoint's parameters)."""
        kl = self.cfg.learner.loss.kl
        if kl == "none":
            return None
        path = os.path.join(self.workdir, "reference")
        if resumed and os.path.exists(path):
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                state.params)
            return Reference(Reference.load_params(path, abstract), kl, self.compute_logprobs,
                             self.mesh)
        if resumed:
            if 0 not in self.ckpt.all_steps():
                raise FileNotFoundError(f"learner.loss.kl={kl!r}: no reference policy in "
                                        f"{path} and no step-0 checkpoint to take it from")
            state = self.restore(0, state)[1]
            log.info("KL reference: the step-0 checkpoint's parameters")
        reference = Reference(state.params, kl, self.compute_logprobs, self.mesh)
        reference.save(path)
        return reference

    # ------------------------------------------------------------------ train loop

    async def loop(self, state, first_step: int):
        """The step-0 eval, the algorithm's start, then the RL steps to total_steps."""
        loop, writer = self.cfg.loop, self.writer
        if first_step == 0:
            # A resumed run (or a workdir seeded with a shared warm start) whose step-0
            # eval finished keeps it, its row written again if a kill dropped it.
            if not (self.resumed and saved_eval_row(self.workdir, writer, 0)):
                await self.evaluate(0, writer)
            writer.mark(0)  # eval_0.json exists: a resume from step 0 keeps its row
        if not self.algo.started:
            start_metrics: dict[str, float] = {}
            with timed(start_metrics, "time/start_s"), progress(0, "offline start") as bar:
                start_metrics.update(await self.algo.start(bar.update))
            writer.write_scalars(first_step, start_metrics)
            log.info("offline start: %s", json.dumps(start_metrics))
        last_save = time.perf_counter()  # for loop.ckpt_every_s
        env_error_steps = 0  # steps in a row whose rollouts were all env errors
        for step in range(first_step + 1, loop.total_steps + 1):
            state, groups, lags, metrics = await self.step(step, state)
            if step % loop.eval_every == 0 or step == loop.total_steps:
                metrics.update(await self.evaluate(step))
            self.report(step, groups, lags, metrics)
            env_error_steps = stop_on_nothing_trained(step, groups, env_error_steps,
                                                      loop.max_env_error_steps)
            timed_out = (loop.ckpt_every_s
                         and time.perf_counter() - last_save >= loop.ckpt_every_s)
            if step % loop.ckpt_every == 0 or step == loop.total_steps or timed_out:
                self.save(step, state)
                last_save = time.perf_counter()
        return state

    async def step(self, step: int, state):
        """One RL step: collect, advantages, learner update, the algorithm's bookkeeping
        under the new policy, weight sync; (state, groups, lags, metrics)."""
        algo, agent = self.algo, self.agent
        metrics: dict[str, float] = {}
        idle0 = agent.activity.idle_s()
        with timed(metrics, "time/step_s"):
            with timed(metrics, "time/rollout_s"), \
                    progress(algo.rollouts_per_step, f"step {step} rollouts") as bar:
                groups = await algo.collect(step, bar.update)
            trajs = [t for g in groups for t in g]
            # Versions each trajectory lags the policy the learner now updates.
            lags = np.array([agent.policy_version - t.versions[0] for t in trajs], np.float64)
            metrics.update(**rollout_metrics(trajs, groups), **lag_metrics(lags),
                           **self.sandboxes.metrics())  # engines, sandboxes without a memory bound
            kept, advs, algo_metrics = algo.advantages(step, groups)
            metrics.update(algo_metrics, **{"train/trajectories": len(kept)})
            with timed(metrics, "time/learner_s"):
                if kept:
                    state, learner_metrics = await asyncio.to_thread(self.learn, state, kept,
                                                                     advs)
                    metrics.update(learner_metrics)
                    metrics.update(await algo.after_update(step, state.params))
            with timed(metrics, "time/sync_s"):
                await self.sync_weights(state.params)
            metrics.update(self.engine.update_stats())  # export and reload times, sizes
        # The learner waits out the collection; the engine waits on tools and learner.
        metrics["time/inference_idle_s"] = agent.activity.idle_s() - idle0
        # Per second of the phase that generated the tokens: the rollout phase, or the
        # whole step when generation overlaps the learner (a stream).
        gen_s = metrics["time/step_s"] if algo.stream else metrics["time/rollout_s"]
        metrics["rollout/generated_tokens_per_s"] = sum(
            t.num_generated_tokens for t in trajs) / max(gen_s, 1e-9)
        return state, groups, lags, metrics

    def learn(self, state, kept, advs):
        """One learner update on the kept trajectories; (state, metrics)."""
        batch, info = self.pack(kept, advs)
        ref_params = None
        if self.reference is not None:
            batch, ref_params = self.reference.train_inputs(batch)
        state, step_metrics = self.train_step(state, batch, ref_params)
        metrics = {f"learner/{k}": float(v) for k, v in jax.device_get(step_metrics).items()}
        return state, {**metrics, **info.stats()}

    def report(self, step: int, groups, lags: np.ndarray, metrics: dict[str, float]) -> None:
        """The step's scalars, histograms and texts, and its console line."""
        writer, trajs = self.writer, [t for g in groups for t in g]
        writer.write_scalars(step, metrics)
        writer.write_histograms(step, {**histograms(groups),
                                       **({"async/lag": lags} if lags.size else {})})
        # Which rollouts this step consumed (task:seed), for auditing a resumed run, and
        # each group's outcome (prefix kind and k, successes of scored).
        writer.write_texts(step, {"rollout/consumed": " ".join(
            f"{t.task_id}:{t.seed}" for t in trajs), "rollout/groups": group_outcomes(groups)})
        if step % self.cfg.loop.log_texts_every == 0 and trajs:
            writer.write_texts(step, {"rollout/sample": self.agent.tokenizer.decode(
                trajs[0].token_arrays()[0])})
        if distributed.is_primary():
            print(console_line(step, metrics), flush=True)

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self, step: int, writer: MetricWriter | None = None,
                       path: str | None = None) -> dict[str, float]:
        """Held-out pass rate: one rollout per task at the eval temperature, saved with
        each task's reward at `path` (default workdir/eval_{step}.json), and every
        episode's decoded conversation beside it (`..._transcripts.jsonl`). Written by
        `writer` if given (else the caller writes the returned scalars with its own).
        Over several processes, each runs its share of the tasks and process 0 writes
        the whole."""
        eval_agent = self.agent.with_sampling(temperature=self.cfg.loop.eval_temperature,
                                              logprobs=False)
        jobs = [RolloutJob(t, seed=i) for i, t in enumerate(self.eval_tasks)]
        with progress(len(jobs), f"eval @ {step}") as bar:
            groups = await distributed.collect_groups(eval_agent, jobs, 1, bar.update)
        scored = [g[0].reward for g in groups if not g[0].is_env_error]
        out = {"eval/pass_rate": float(np.mean(scored)) if scored else float("nan"),
               "eval/env_errors": float(len(groups) - len(scored))}
        if writer is not None:
            writer.write_scalars(step, out)
        if not distributed.is_primary():
            return out
        path = path or os.path.join(self.workdir, f"eval_{step}.json")
        with open(path.removesuffix(".json") + "_transcripts.jsonl", "w") as f:
            for (traj,) in groups:
                f.write(json.dumps({"task_id": traj.task_id, "reward": traj.reward,
                                    "status": traj.status, "error": traj.error,
                                    "text": self.agent.tokenizer.decode(
                                        traj.token_arrays()[0])}) + "\n")
        # Last and whole (written beside, then renamed): it exists only for a finished eval.
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step, **out,
                       "rewards": {g[0].task_id: g[0].reward for g in groups}}, f)
        os.replace(path + ".tmp", path)
        log.info("eval @ step %d: pass rate %.3f over %d tasks", step, out["eval/pass_rate"],
                 len(scored))
        return out

    async def evaluate_checkpoint(self, state, path: str | None = None,
                                  step: int | None = None) -> None:
        """--eval_only: checkpoint `step`'s weights (None: the latest readable one) on the
        held-out tasks (e.g. a larger set than the run's, via --set env.eval_tasks=N),
        written to `path` (default workdir/eval_only_{step}_{n}tasks.json)."""
        if self.ckpt.latest_step() is None:
            raise FileNotFoundError(f"--eval_only: no checkpoint in {self.ckpt.directory}")
        # The newest step that reads back (a damaged newer one is named in a warning and
        # left where it is); the output's name and rows carry the step evaluated.
        step, state, _ = self.restore(step, state, set_aside=False)
        await distributed.sync_weights(self.engine, state.params,
                                       self.cfg.engine.kind == "sglang")
        n = len(self.eval_tasks)
        await self.evaluate(step, None, path or os.path.join(
            self.workdir, f"eval_only_{step}_{n}tasks.json"))


def saved_eval_row(workdir: str, writer: MetricWriter, step: int) -> bool:
    """Whether workdir/eval_{step}.json holds a finished eval of `step` (Run.evaluate
    writes it last, whole). If so and the metric rows lack its row (a kill between the file
    and the checkpoint's mark, whose rows a resume keeps), the row is written again from
    the file, so it is in metrics.jsonl and TensorBoard once whatever the kill point."""
    path = os.path.join(workdir, f"eval_{step}.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        scalars = {k: float(v) for k, v in saved.items() if k.startswith("eval/")}
    except FileNotFoundError:
        return False
    except (ValueError, TypeError, AttributeError) as e:
        log.warning("%s is unreadable (%s): the eval runs again", path, e)
        return False
    if not writer.has_row(step, "eval/pass_rate"):
        writer.write_scalars(step, scalars)
        log.info("eval @ step %d: its row written again from %s", step, path)
    return True


if __name__ == "__main__":
    sys.exit(main())
