"""Trains a coding agent with binary-reward RL (GRPO + Prefix Sampling, or SPO).

    python train.py --config configs/default.py --workdir runs/default
    python train.py --config configs/default.py:smoke --workdir /tmp/smoke
    python train.py --config configs/ps_qwen3_14b_swe.py --workdir gs://... --dry_run

Reads top to bottom: config -> mesh -> tasks -> tokenizer -> model -> learner ->
engine -> environment -> algorithm (rl.algos) -> resume or SFT warm start -> KL
reference -> loop {collect, advantages, batch, train_step, the algorithm's
bookkeeping, weight sync, eval, metrics, checkpoint}. Rerunning the same command
resumes from the workdir. On a pod every host runs the same command, one JAX process
each (started from `config.distributed`); rl.distributed says how rollouts, host
state, evals, checkpoints and weight sync are shared between them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from configs import common
from env import latency
from env.tasks import Task
from inference import sglang
from models import sharding
from rl import algos, distributed, learner, setup, sft
from rl.batch import pack_trajectories
from rl.checkpoint import Checkpointer
from rl.metrics import MetricWriter
from rl.reference import Reference
from rl.rollout import Agent, RolloutConfig, RolloutJob

log = logging.getLogger("train")
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
                   default=os.environ.get("JAX_COMPILATION_CACHE_DIR", setup.COMPILATION_CACHE),
                   help="XLA programs compiled once are kept here for later runs (on a "
                        "rerun the default's first rollout phase takes 14 s instead of 39 s); "
                        "'' turns it off")
    args = p.parse_args(argv)
    setup.compilation_cache(args.compilation_cache)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save chatter

    # ------------------------------------------------------------------ config
    config = common.load_config(args.config)
    config = common.apply_overrides(config, common.parse_overrides(args.set))
    # Launched SGLang servers own their GPUs; the learner's JAX devices are the rest.
    sglang.restrict_learner_devices(config)
    distributed.initialize(config.distributed)  # before anything touches a device
    setup.check_config(config)
    distributed.check_supported(config)
    if args.dry_run:
        print(json.dumps({**setup.dry_run(config), "layout": distributed.layout(config.mesh)},
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
        asyncio.run(run(config, workdir, eval_only=args.eval_only,
                        eval_out=os.path.abspath(args.eval_out) if args.eval_out else None,
                        eval_step=args.eval_step))
    except OSError as e:  # a full disk, a lost mount: its cause, not a traceback of the loop
        log.error("stopped: %s: %s", type(e).__name__, e)
        sys.exit(1)


async def run(config, workdir: str, eval_only: bool = False, eval_out: str | None = None,
              eval_step: int | None = None) -> None:
    """Everything after the config, on one event loop (engine batching, sandbox slots
    and in-flight rollouts all live on it). eval_only: evaluate checkpoint eval_step
    (None: the latest) into eval_out if given."""
    # ------------------------------------------------------------------ mesh
    mesh = sharding.make_mesh(**config.mesh)
    if jax.process_count() > 1:
        log.info("layout: %s", json.dumps(distributed.layout(config.mesh)))

    # ------------------------------------------------------------------ tasks
    train_tasks, eval_tasks = setup.tasks(config.env)
    log.info("tasks: %d train, %d held-out eval", len(train_tasks), len(eval_tasks))

    # ------------------------------------------------------------------ tokenizer
    tokenizer = setup.tokenizer(config, workdir, train_tasks)

    # ------------------------------------------------------------------ model
    model_cfg = setup.model_config(config.model, tokenizer.vocab_size)
    model = setup.model(config.model, model_cfg, mesh, seed=config.seed)
    graphdef, state = learner.init_train_state(model, config.learner, mesh)
    del model
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    log.info("model: %s, %.2fM parameters", model_cfg, n_params / 1e6)
    train_step = learner.make_train_step(graphdef, config.learner, mesh)
    compute_logprobs = learner.make_compute_logprobs(graphdef, config.learner, mesh)
    row_multiple = learner.row_multiple(config.learner, mesh)
    pack = functools.partial(pack_trajectories, buckets=config.learner.row_buckets,
                             row_multiple=row_multiple, pad_id=tokenizer.pad_id)
    score = learner.make_score(compute_logprobs, buckets=config.learner.row_buckets,
                               row_multiple=row_multiple, pad_id=tokenizer.pad_id)

    # ------------------------------------------------------------------ engine
    engine = setup.engine(config, graphdef, state.params, workdir, model_cfg)

    # ------------------------------------------------------------------ environment
    sandbox_factory = setup.sandbox_factory(config.env)
    rollout_cfg = RolloutConfig(**config.rollout)
    agent = Agent(engine, tokenizer, sandbox_factory, rollout_cfg,
                  max_concurrent_envs=config.env.max_concurrent,
                  tools_in_prompt=config.env.tools_in_prompt,
                  latency=latency.from_config(config.env.latency, config.seed))

    # ------------------------------------------------------------------ algorithm
    algo = algos.build(algos.Context(config, agent, train_tasks, score))

    # ------------------------------------------------------------------ resume or warm start
    ckpt = Checkpointer(workdir, keep=config.ckpt_keep)

    async def sync_weights(params) -> None:
        """Loads `params` into the engine: one policy version more (the engine counts its
        updates alike; turns and trajectories carry the versions that sampled them)."""
        await distributed.sync_weights(engine, params, config.engine.kind == "sglang")
        agent.policy_version += 1

    def save(step: int, state) -> None:
        """Checkpoint `step` (every process calls it); the host state, replicated on
        every process, is checked identical first and written once."""
        host = {"step": step, **algo.state_dict()}
        log.info("host state at step %d: %s", step,
                 distributed.check_consistent(host, f"step {step}"))
        ckpt.save(step, state, host)
        writer.mark(step)  # a resume from `step` keeps exactly the metrics written so far

    if eval_only:
        try:
            await evaluate_checkpoint(config, ckpt, graphdef, state, mesh, engine, agent,
                                      eval_tasks, workdir, eval_out, eval_step)
        finally:
            ckpt.close()
            engine.close()
        return
    first_step = 0
    resumed = ckpt.latest_step() is not None
    if resumed:
        _, state, host = restore(config, ckpt, None, graphdef, state, mesh)
        first_step = int(host["step"])
        algo.load_state_dict(host)
        log.info("resumed from %s at step %d (host state %s)", ckpt.directory, first_step,
                 distributed.check_consistent({"step": first_step, **algo.state_dict()},
                                              f"resume at step {first_step}"))
        await sync_weights(state.params)
    # Metric rows a killed run wrote after its last checkpoint (all of them without one,
    # e.g. a warm start cut short) are written again below.
    writer = MetricWriter(workdir, resume_step=first_step if resumed else -1)
    if not resumed and config.sft.steps:
        state = await warm_start(config, agent, train_tasks, graphdef, state, mesh, writer)
        await sync_weights(state.params)
        save(0, state)
    reference = kl_reference(config, workdir, resumed, ckpt, graphdef, state, mesh,
                             compute_logprobs)

    def learn(state, kept, advs):
        """One learner update on the kept trajectories; (state, metrics)."""
        batch, info = pack(kept, advs)
        ref_params = None
        if reference is not None:
            batch, ref_params = reference.train_inputs(batch)
        state, step_metrics = train_step(state, batch, ref_params)
        metrics = {f"learner/{k}": float(v) for k, v in jax.device_get(step_metrics).items()}
        return state, {**metrics, **info.stats()}

    # ------------------------------------------------------------------ train loop
    async def rl_loop(state):
        last_save = time.perf_counter()  # for config.ckpt_every_s
        if first_step == 0 and not (resumed and os.path.exists(os.path.join(workdir,
                                                                            "eval_0.json"))):
            # (A workdir seeded with a shared warm start already holds its step-0 eval.)
            await evaluate(config, agent, eval_tasks, writer, 0, workdir)
            writer.mark(0)  # eval_0.json exists: a resume from step 0 keeps its row
        if not algo.started:
            t0 = time.perf_counter()
            with setup.progress(0, "offline start") as bar:
                start_metrics = await algo.start(bar.update)
            start_metrics["time/start_s"] = time.perf_counter() - t0
            writer.write_scalars(first_step, start_metrics)
            log.info("offline start: %s", json.dumps(start_metrics))
        for step in range(first_step + 1, config.total_steps + 1):
            t_step, idle0 = time.perf_counter(), agent.activity.idle_s()
            # -- collect
            t0 = time.perf_counter()
            with setup.progress(algo.rollouts_per_step, f"step {step} rollouts") as bar:
                groups = await algo.collect(step, bar.update)
            trajs = [t for g in groups for t in g]
            # Versions each trajectory lags the policy the learner now updates.
            lags = np.array([agent.policy_version - t.versions[0] for t in trajs], np.float64)
            metrics = {"time/rollout_s": time.perf_counter() - t0,
                       **setup.rollout_metrics(trajs, groups), **setup.lag_metrics(lags),
                       **getattr(sandbox_factory, "metrics", dict)()}  # a fleet's engines
            # -- advantages, learner, the algorithm's bookkeeping under the new policy
            kept, advs, algo_metrics = algo.advantages(step, groups)
            metrics.update(algo_metrics, **{"train/trajectories": len(kept)})
            t0 = time.perf_counter()
            if kept:
                state, learner_metrics = await asyncio.to_thread(learn, state, kept, advs)
                metrics.update(learner_metrics)
                metrics.update(await algo.after_update(step, state.params))
            metrics["time/learner_s"] = time.perf_counter() - t0
            # -- weight sync
            t0 = time.perf_counter()
            await sync_weights(state.params)
            metrics["time/sync_s"] = time.perf_counter() - t0
            metrics.update(engine.update_stats())  # export and reload times, sizes, counts
            metrics["time/step_s"] = time.perf_counter() - t_step
            # The learner waits out the collection; the engine waits on tools and learner.
            metrics["time/inference_idle_s"] = agent.activity.idle_s() - idle0
            # Per second of the phase that generated the tokens: the rollout phase, or
            # the whole step when generation overlaps the learner (a stream).
            gen_s = metrics["time/step_s"] if algo.stream else metrics["time/rollout_s"]
            metrics["rollout/generated_tokens_per_s"] = sum(
                t.num_generated_tokens for t in trajs) / max(gen_s, 1e-9)
            # -- eval, metrics, checkpoint
            if step % config.eval_every == 0 or step == config.total_steps:
                metrics.update(await evaluate(config, agent, eval_tasks, None, step, workdir))
            writer.write_scalars(step, metrics)
            writer.write_histograms(step, {**setup.histograms(groups),
                                           **({"async/lag": lags} if lags.size else {})})
            # Which rollouts this step consumed (task:seed), for auditing a resumed run.
            writer.write_texts(step, {"rollout/consumed": " ".join(
                f"{t.task_id}:{t.seed}" for t in trajs)})
            if step % config.log_texts_every == 0 and trajs:
                writer.write_texts(step, {"rollout/sample": tokenizer.decode(
                    trajs[0].token_arrays()[0])})
            if distributed.is_primary():
                print(setup.console_line(step, metrics), flush=True)
            timed = config.ckpt_every_s and time.perf_counter() - last_save >= config.ckpt_every_s
            if step % config.ckpt_every == 0 or step == config.total_steps or timed:
                save(step, state)
                last_save = time.perf_counter()
        return state

    try:
        state = await rl_loop(state)
    finally:
        await algo.close()
        ckpt.wait()
        ckpt.close()
        writer.close()
        engine.close()


def kl_reference(config, workdir: str, resumed: bool, ckpt: Checkpointer, graphdef, state,
                 mesh, compute_logprobs) -> Reference | None:
    """The KL anchor when learner.loss.kl is on: the policy a fresh run starts from,
    saved in workdir/reference; a resumed run loads it from there (a workdir seeded
    with a warm-start checkpoint only takes that step-0 checkpoint's parameters)."""
    kl = config.learner.loss.kl
    if kl == "none":
        return None
    path = os.path.join(workdir, "reference")
    if resumed and os.path.exists(path):
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params)
        return Reference(Reference.load_params(path, abstract), kl, compute_logprobs, mesh)
    if resumed:
        if 0 not in ckpt.all_steps():
            raise FileNotFoundError(f"learner.loss.kl={kl!r}: no reference policy in {path} "
                                    "and no step-0 checkpoint to take it from")
        state = restore(config, ckpt, 0, graphdef, state, mesh)[1]
        log.info("KL reference: the step-0 checkpoint's parameters")
    reference = Reference(state.params, kl, compute_logprobs, mesh)
    reference.save(path)
    return reference


async def evaluate(config, agent: Agent, tasks: list[Task], writer: MetricWriter | None,
                   step: int, workdir: str, path: str | None = None) -> dict[str, float]:
    """Held-out pass rate: one rollout per task at the eval temperature, saved with each
    task's reward at `path` (default workdir/eval_{step}.json), and every episode's
    decoded conversation beside it (`..._transcripts.jsonl`). Written by `writer` if
    given (else the caller writes the returned scalars with its own). Over several
    processes, each runs its share of the tasks and process 0 writes the whole."""
    eval_agent = agent.with_sampling(temperature=config.eval_temperature, logprobs=False)
    jobs = [RolloutJob(t, seed=i) for i, t in enumerate(tasks)]
    with setup.progress(len(jobs), f"eval @ {step}") as bar:
        groups = await distributed.collect_groups(eval_agent, jobs, 1, bar.update)
    scored = [g[0].reward for g in groups if not g[0].is_env_error]
    out = {"eval/pass_rate": float(np.mean(scored)) if scored else float("nan"),
           "eval/env_errors": float(len(groups) - len(scored))}
    if writer is not None:
        writer.write_scalars(step, out)
    if not distributed.is_primary():
        return out
    path = path or os.path.join(workdir, f"eval_{step}.json")
    with open(path, "w") as f:
        json.dump({"step": step, **out, "rewards": {g[0].task_id: g[0].reward for g in groups}},
                  f)
    with open(path.removesuffix(".json") + "_transcripts.jsonl", "w") as f:
        for (traj,) in groups:
            f.write(json.dumps({"task_id": traj.task_id, "reward": traj.reward,
                                "status": traj.status, "error": traj.error,
                                "text": agent.tokenizer.decode(traj.token_arrays()[0])}) + "\n")
    log.info("eval @ step %d: pass rate %.3f over %d tasks", step, out["eval/pass_rate"],
             len(scored))
    return out


def restore(config, ckpt: Checkpointer, step: int | None, graphdef, state, mesh,
            set_aside: bool = True):
    """(step, train state, host state) of checkpoint `step`, laid out like `state`; step
    None: the latest that reads back (a damaged newer step is skipped with a warning, and
    moved aside unless `set_aside` is False)."""
    _, abstract = learner.abstract_train_state(nnx.merge(graphdef, state.params),
                                               config.learner, mesh)
    if step is None:
        return ckpt.restore_latest(abstract, set_aside)
    return (step, *ckpt.restore(step, abstract))


async def evaluate_checkpoint(config, ckpt: Checkpointer, graphdef, state, mesh, engine,
                              agent: Agent, tasks: list[Task], workdir: str,
                              path: str | None = None, step: int | None = None) -> None:
    """--eval_only: checkpoint `step`'s weights (None: the latest readable one) on `tasks`
    (e.g. a larger held-out set than the run's, via --set env.eval_tasks=N), written to
    `path` (default workdir/eval_only_{step}_{n}tasks.json)."""
    if ckpt.latest_step() is None:
        raise FileNotFoundError(f"--eval_only: no checkpoint in {ckpt.directory}")
    # The newest step that reads back (a damaged newer one is named in a warning and left
    # where it is); the output's name and rows carry the step evaluated.
    step, state, _ = restore(config, ckpt, step, graphdef, state, mesh, set_aside=False)
    await distributed.sync_weights(engine, state.params, config.engine.kind == "sglang")
    await evaluate(config, agent, tasks, None, step, workdir,
                   path or os.path.join(workdir, f"eval_only_{step}_{len(tasks)}tasks.json"))


async def warm_start(config, agent: Agent, train_tasks, graphdef, state, mesh,
                     writer: MetricWriter):
    """SFT on scripted expert demonstrations, some imperfect, then a fresh RL optimizer."""
    t0 = time.perf_counter()
    demos = await setup.demonstrations(config, agent, train_tasks)
    log.info("SFT on %d demonstrations (%d correct, %d tokens; rendered in %.0fs)", len(demos),
             sum(d.reward == 1 for d in demos), sum(len(d.token_arrays()[0]) for d in demos),
             time.perf_counter() - t0)
    t0 = time.perf_counter()
    epochs = max(1, round(config.sft.steps * config.sft.batch_size / len(demos)))
    total = epochs * -(-len(demos) // config.sft.batch_size)
    sft_cfg = setup.sft_learner_config(config, total)
    _, sft_state = learner.init_train_state(nnx.merge(graphdef, state.params), sft_cfg, mesh)
    with setup.progress(total, "SFT") as bar:
        def on_metrics(step, m):
            bar.update(1)
            if step % 10 == 0:
                writer.write_scalars(step, {f"sft/{k}": v for k, v in m.items()})
            if step % 25 == 0:
                log.info("SFT step %d: loss %.3f", step, m["loss"])
        sft_state = await asyncio.to_thread(
            sft.train_sft, sft_state, graphdef, demos, sft_cfg,
            buckets=config.learner.row_buckets, batch_size=config.sft.batch_size,
            epochs=epochs, mesh=mesh, on_metrics=on_metrics)
    log.info("SFT: %d steps in %.0fs", total, time.perf_counter() - t0)
    _, state = learner.init_train_state(nnx.merge(graphdef, sft_state.params), config.learner,
                                        mesh)
    return state


if __name__ == "__main__":
    sys.exit(main())
