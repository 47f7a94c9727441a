"""Trains a coding agent with binary-reward RL (GRPO + Prefix Sampling, or SPO).

    python train.py --config configs/default.py --workdir runs/default
    python train.py --config configs/default.py:smoke --workdir /tmp/smoke
    python train.py --config configs/ps_qwen3_14b_swe.py --workdir gs://... --dry_run

Reads top to bottom: config -> mesh -> tasks -> tokenizer -> model -> learner ->
engine -> environment -> resume or SFT warm start -> loop {collect, Prefix
Sampling / SPO bookkeeping, advantages, batch, train_step, weight sync, eval,
metrics, checkpoint}. Rerunning the same command resumes from the workdir.
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
from env.tasks import Task
from models import sharding
from rl import advantages as adv_lib
from rl import learner, prefix, setup, sft, spo
from rl.batch import pack_trajectories, unpack
from rl.checkpoint import Checkpointer
from rl.metrics import MetricWriter
from rl.rollout import Agent, RolloutConfig, RolloutJob, StreamCollector, collect_groups
from rl.sampler import TaskSampler

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
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set learner.optim.lr=1e-4 (repeatable; "
                        "values are Python literals, else strings)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save chatter

    # ------------------------------------------------------------------ config
    config = common.load_config(args.config)
    config = common.apply_overrides(config, common.parse_overrides(args.set))
    setup.check_config(config)
    if args.dry_run:
        print(json.dumps(setup.dry_run(config), indent=1))
        return
    workdir = os.path.abspath(args.workdir)
    if args.eval_only and not os.path.isdir(os.path.join(workdir, "ckpt")):
        p.error(f"--eval_only: no checkpoints under {workdir}")
    if args.eval_out and not args.eval_only:
        p.error("--eval_out needs --eval_only")
    os.makedirs(workdir, exist_ok=True)
    if not args.eval_only:  # (an evaluation leaves the run's own config in place)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=1))
    asyncio.run(run(config, workdir, eval_only=args.eval_only,
                    eval_out=os.path.abspath(args.eval_out) if args.eval_out else None))


async def run(config, workdir: str, eval_only: bool = False, eval_out: str | None = None) -> None:
    """Everything after the config, on one event loop (engine batching, sandbox slots
    and in-flight rollouts all live on it). eval_only: evaluate the latest checkpoint
    (into eval_out if given)."""
    # ------------------------------------------------------------------ mesh
    mesh = sharding.make_mesh(**config.mesh)

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

    # ------------------------------------------------------------------ engine
    engine = setup.engine(config, graphdef, state.params, workdir, model_cfg)

    # ------------------------------------------------------------------ environment
    sandbox_factory = setup.sandbox_factory(config.env)
    rollout_cfg = RolloutConfig(**config.rollout)
    agent = Agent(engine, tokenizer, sandbox_factory, rollout_cfg,
                  max_concurrent_envs=config.env.max_concurrent,
                  tools_in_prompt=config.env.tools_in_prompt)

    # ------------------------------------------------------------------ host state
    np_rng = np.random.default_rng([config.seed, 1])
    sampler = TaskSampler(train_tasks, seed=config.seed)
    task_by_id = {t.instance_id: t for t in train_tasks}
    ps_cfg = setup.prefix_config(config.ps)
    queue = prefix.PrefixQueue(max_age=ps_cfg.max_age)
    controller = prefix.AdaptiveController.from_config(ps_cfg)
    tracker = spo.BetaTracker(**setup.tracker_kwargs(config.spo))
    spo_sampler = spo.PrioritizedSampler(tracker, seed=config.seed, eps=config.spo.sampler_eps)

    def host_state(step: int) -> dict:
        return {"step": step, "sampler": sampler.state_dict(), "queue": queue.state_dict(),
                "controller": controller.state_dict(), "tracker": tracker.state_dict(),
                "spo_sampler": spo_sampler.state_dict(),
                "np_rng": np_rng.bit_generator.state}

    # ------------------------------------------------------------------ resume or warm start
    ckpt = Checkpointer(workdir, keep=config.ckpt_keep)
    if eval_only:
        try:
            await evaluate_checkpoint(config, ckpt, graphdef, state, mesh, engine, agent,
                                      eval_tasks, workdir, eval_out)
        finally:
            ckpt.close()
            engine.close()
        return
    writer = MetricWriter(workdir)
    first_step = 0
    if ckpt.latest_step() is not None:
        state, host = restore(config, ckpt, ckpt.latest_step(), graphdef, state, mesh)
        first_step = int(host["step"])
        sampler.load_state_dict(host["sampler"])
        queue.load_state_dict(host["queue"])
        controller.load_state_dict(host["controller"])
        tracker.load_state_dict(host["tracker"])
        spo_sampler.load_state_dict(host["spo_sampler"])
        np_rng.bit_generator.state = host["np_rng"]
        log.info("resumed from %s at step %d", ckpt.directory, first_step)
        await engine.update_weights(setup.engine_params(state.params))
    elif config.sft.steps:
        state = await warm_start(config, agent, train_tasks, graphdef, state, mesh, writer)
        await engine.update_weights(setup.engine_params(state.params))
        ckpt.save(0, state, host_state(0))

    # ------------------------------------------------------------------ train loop
    async def rl_loop(state):
        collector = None
        if config.algo == "spo":
            collector = StreamCollector(agent, setup.spo_job_stream(
                spo_sampler, [t.instance_id for t in train_tasks], task_by_id,
                config.batch_tasks, np_rng), in_flight=config.spo.in_flight)
        if first_step == 0 and not os.path.exists(os.path.join(workdir, "eval_0.json")):
            # (A workdir seeded with a shared warm start already holds its step-0 eval.)
            await evaluate(config, agent, eval_tasks, writer, 0, workdir)
        for step in range(first_step + 1, config.total_steps + 1):
            t_step = time.perf_counter()
            metrics: dict[str, float] = {}
            agent.policy_version = step - 1
            # -- collect
            t0 = time.perf_counter()
            if config.algo == "grpo":
                jobs = [RolloutJob(task_by_id[pt.task_id], prefix=pt, seed=_job_seed(step, i))
                        for i, pt in enumerate(queue.take(step, config.batch_tasks,
                                                          ps_cfg.max_share)
                                               if config.ps.enabled else [])]
                jobs += [RolloutJob(task, seed=_job_seed(step, len(jobs) + i))
                         for i, task in enumerate(sampler.next(config.batch_tasks - len(jobs)))]
                with setup.progress(len(jobs) * config.group_size, f"step {step} rollouts") as bar:
                    groups = await collect_groups(agent, jobs, config.group_size, bar.update)
                trajs = [t for g in groups for t in g]
            else:
                with setup.progress(config.batch_tasks, f"step {step} rollouts") as bar:
                    trajs = await collector.collect(config.batch_tasks, bar.update)
                groups = [[t] for t in trajs]
            metrics["time/rollout_s"] = time.perf_counter() - t0
            metrics.update(setup.rollout_metrics(trajs, groups))
            # -- Prefix Sampling / SPO bookkeeping, advantages
            if config.algo == "grpo":
                if config.ps.enabled:
                    ps_step = prefix.build_prefix_tasks(groups, step, ps_cfg, controller, np_rng)
                    queue.push(ps_step.tasks)
                    metrics.update(prefix.prefix_metrics(ps_step, groups, controller, queue))
                kept, advs, rejected = adv_lib.group_advantages(
                    groups, config.advantage, config.reject_degenerate)
                metrics["train/rejected_groups"] = rejected
            else:
                kept, advs = await spo_advantages(state, trajs, tracker, compute_logprobs,
                                                  pack, metrics)
            metrics["train/trajectories"] = len(kept)
            # -- learner
            t0 = time.perf_counter()
            if kept:
                batch, info = pack(kept, advs)
                state, step_metrics = await asyncio.to_thread(train_step, state, batch)
                metrics.update({f"learner/{k}": float(v)
                                for k, v in jax.device_get(step_metrics).items()})
                metrics.update(info.stats())
                if config.algo == "spo":
                    windows = [spo.drift_window(*t.token_arrays()[:2], tracker.max_stored_tokens)
                               for t in kept]
                    scores = score_windows(compute_logprobs, pack, state.params, windows)
                    for traj, (ids, mask), lp in zip(kept, windows, scores, strict=True):
                        tracker.store_response(traj.task_id, ids, lp, mask)
            metrics["time/learner_s"] = time.perf_counter() - t0
            # -- weight sync
            t0 = time.perf_counter()
            await engine.update_weights(setup.engine_params(state.params))
            metrics["time/sync_s"] = time.perf_counter() - t0
            metrics["time/step_s"] = time.perf_counter() - t_step
            gen = sum(t.num_generated_tokens for t in trajs)
            # Per second of the phase that generated them: the rollout phase in group mode;
            # the whole step in stream mode, whose generation overlaps the learner.
            gen_s = metrics["time/rollout_s"] if config.algo == "grpo" else metrics["time/step_s"]
            metrics["rollout/generated_tokens_per_s"] = gen / max(gen_s, 1e-9)
            # -- eval, metrics, checkpoint
            if step % config.eval_every == 0 or step == config.total_steps:
                metrics.update(await evaluate(config, agent, eval_tasks, None, step, workdir))
            writer.write_scalars(step, metrics)
            writer.write_histograms(step, setup.histograms(groups))
            if step % config.log_texts_every == 0 and trajs:
                writer.write_texts(step, {"rollout/sample": tokenizer.decode(
                    trajs[0].token_arrays()[0])})
            print(setup.console_line(step, metrics), flush=True)
            if step % config.ckpt_every == 0 or step == config.total_steps:
                ckpt.save(step, state, host_state(step))
        if collector is not None:
            await collector.close()
        return state

    try:
        state = await rl_loop(state)
    finally:
        ckpt.wait()
        ckpt.close()
        writer.close()
        engine.close()


def _job_seed(step: int, index: int) -> int:
    return step * 100_003 + index


async def evaluate(config, agent: Agent, tasks: list[Task], writer: MetricWriter | None,
                   step: int, workdir: str, path: str | None = None) -> dict[str, float]:
    """Held-out pass rate: one rollout per task at the eval temperature, saved with each
    task's reward at `path` (default workdir/eval_{step}.json), and every episode's
    decoded conversation beside it (`..._transcripts.jsonl`). Written by `writer` if
    given (else the caller writes the returned scalars with its own)."""
    eval_agent = agent.with_sampling(temperature=config.eval_temperature)
    jobs = [RolloutJob(t, seed=i) for i, t in enumerate(tasks)]
    with setup.progress(len(jobs), f"eval @ {step}") as bar:
        groups = await collect_groups(eval_agent, jobs, 1, bar.update)
    scored = [g[0].reward for g in groups if not g[0].is_env_error]
    out = {"eval/pass_rate": float(np.mean(scored)) if scored else float("nan"),
           "eval/env_errors": float(len(groups) - len(scored))}
    if writer is not None:
        writer.write_scalars(step, out)
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


def restore(config, ckpt: Checkpointer, step: int, graphdef, state, mesh):
    """(train state, host state) of checkpoint `step`, laid out like `state`."""
    _, abstract = learner.abstract_train_state(nnx.merge(graphdef, state.params),
                                               config.learner, mesh)
    return ckpt.restore(step, abstract)


async def evaluate_checkpoint(config, ckpt: Checkpointer, graphdef, state, mesh, engine,
                              agent: Agent, tasks: list[Task], workdir: str,
                              path: str | None = None) -> None:
    """--eval_only: the latest checkpoint's weights on `tasks` (e.g. a larger held-out set
    than the run's, via --set env.eval_tasks=N), written to `path` (default
    workdir/eval_only_{step}_{n}tasks.json)."""
    step = ckpt.latest_step()
    if step is None:
        raise FileNotFoundError(f"--eval_only: no checkpoint in {ckpt.directory}")
    state, _ = restore(config, ckpt, step, graphdef, state, mesh)
    await engine.update_weights(setup.engine_params(state.params))
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


async def spo_advantages(state, trajs, tracker: spo.BetaTracker, compute_logprobs, pack,
                         metrics: dict[str, float]):
    """SPO: baseline v from the tracker before this batch, drift D of each prompt's stored
    response, tracker update, then batch-normalised advantages (rl.spo)."""
    scored = [t for t in trajs if not t.is_env_error and t.reward is not None]
    if not scored:
        return [], np.zeros(0)
    ids = [t.task_id for t in scored]
    rewards = np.array([t.reward for t in scored], np.float64)
    v_before = tracker.values(ids)
    pending = tracker.pending_d_requests(ids)
    scores = score_windows(compute_logprobs, pack, state.params,
                           [(r.ids, r.mask) for r in pending.values()])
    D = tracker.drift(ids, dict(zip(pending, scores, strict=True)))
    tracker.update(ids, rewards, D=D if tracker.rho_type == "kl" else None)
    metrics.update({"spo/v_mean": float(v_before.mean()), "spo/drift_mean": float(D.mean()),
                    "spo/rho_mean": float(tracker.rho(D).mean()), "spo/tracked": len(tracker)})
    return scored, spo.spo_advantages(rewards, v_before)


def score_windows(compute_logprobs, pack, params, windows) -> list[np.ndarray]:
    """Log-probs of each (ids, mask) window scored alone from position 0; the same
    function before and after an update, so SPO's drift D compares like with like."""
    if not windows:
        return []
    batch, info = pack([setup.window_trajectory(ids, mask) for ids, mask in windows],
                       np.zeros(len(windows)))
    return unpack(np.asarray(compute_logprobs(params, batch)), info)


if __name__ == "__main__":
    sys.exit(main())
