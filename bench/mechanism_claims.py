"""The seeds' three mechanism claims, measured on a frozen warm start (no learning needed).

    python -m bench.mechanism_claims runs [--seeds 0,1,2,3] [--steps 12] [--root DIR]
    python -m bench.mechanism_claims stream [--reps 20] [--sigmas 0,0.5,1,1.5,2] [--median-s 0.25]
    python -m bench.mechanism_claims report [--out results]

The warm start is the graded family's (configs/default.py:graded) with SFT 256 steps and
rollouts at T=0.4: the recipe that passed the gate's histogram and prefix criteria
(results/gate.json, try sft256_t04), made once per seed (bench.experiments layout under
--root). Every run has learning rate 0, so its arms differ only by how they collect.

1. Prefix-task pass rate (seed 000: 0.529 +- 0.078). GRPO + Prefix Sampling with the
   adaptive controller (starting at the gate's ps.remaining_ratio), `--steps` steps of
   8 tasks x 8 per seed: the pass rate of every prefix group (train.py's per-step
   `rollout/groups` record), its mean and SD over groups, and its mean per step.
2. solve_partial (seed 000: 25.9 -> 36.5 of 64 groups, 1.41x). Mixed-outcome groups per
   step of GRPO, GRPO + PS and the revisit control (skewed tasks re-run from the start)
   on the same seeds (so the same fresh tasks at step 1); the ratio of each to GRPO with
   a seed-paired bootstrap CI.
3. Stream against groups under a long tail (seed 002, Figure 5: groups, 6 in flight
   taking the fastest 3, need 486 s for 24 samples; a stream of 48 taking the first 24
   needs 112 s; 4.35x). The real collectors (rl.rollout.StreamCollector) over the warm
   start's real rollouts in real sandboxes, with env.latency's sleep before every tool
   call: 6 groups of 8 in flight until 3 are complete, against 48 single rollouts in
   flight until 24 are done; wall time to 24 scored samples, both arms on the same
   repetitions (seeds), over the per-call spread sigma. The seed's Figure 5 gives no
   distribution; if episode durations are log-normal, 24 of a 48 stream finish at about
   the median and the 3rd of 6 groups of 8 at about the median of a group's maximum
   (quantile 0.5 ** (1/8): z = 1.38), so 4.35x means a log-SD of episode durations of
   ln(4.35) / 1.38 = 1.06. The setting reported as `stream_speedup` is the one whose
   measured log-SD of episode durations is nearest 1.06 (fixed before the runs).

Writes the keys prefix_pass_rate_mean, prefix_pass_rate_sd, solve_partial_ratio,
solve_partial_ratio_ci_low, stream_speedup, stream_speedup_curve (and details under
"mechanism") into results/seed_claims.json, keeping its other keys.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import time
from collections.abc import Sequence

import numpy as np

from bench import experiments as ex
from bench import seed_claims as sc

ROOT = os.path.join(ex.ROOT, "runs", "mechanism")
GATE_TRY = "sft256_t04"  # results/gate.json: the try whose warm start passed
WARM_SETS = ["env.eval_tasks=24", "rollout.temperature=0.4", "sft.steps=256"]
FROZEN = ["learner.optim.lr=0", *sc.RUN_SETS, "env.eval_tasks=1"]
ARMS = ("grpo", "ps", "revisit")
SEED_TAIL_LOG_SD = math.log(486 / 112) / 1.38  # the spread behind the seed's 4.35x
STREAM = dict(groups_in_flight=6, group_size=8, groups_needed=3, stream_in_flight=48,
              samples_needed=24)


# ------------------------------------------------------------------ 1, 2: frozen runs


def arm_sets(arm: str, ps_ratio: float) -> list[str]:
    """The `--set`s of one frozen arm: 8 tasks x 8, lr 0; PS adaptive from the gate's ratio."""
    extra = ["ps.adaptive=True"] if arm == "ps" else []
    return [*WARM_SETS, *sc.arm_sets(arm, [*FROZEN, *extra], ps_ratio)]


def gate_ratio(gate_json: dict) -> float:
    """The ps.remaining_ratio the prefix table of the gate's passing warm start picked."""
    tried = {t["try"]: t for t in gate_json["tries"]}
    return float(tried[GATE_TRY]["prefix"]["ps_remaining_ratio"])


def run_frozen(root: str, seeds: Sequence[int], steps: int, ps_ratio: float) -> None:
    """Every arm of every seed from the seed's warm start (finished runs are kept)."""
    for seed in seeds:
        ex.warm_start(root, seed, WARM_SETS, sc.WARM)
        for arm in ARMS:
            ex.run_arm(root, arm, seed, steps, arm_sets(arm, ps_ratio), sc.ARMS, sc.WARM)


def group_records(workdir: str) -> dict[int, list[list]]:
    """RL step -> its groups [task, prefix kind or None, k, successes, scored], read from
    the run's TensorBoard text `rollout/groups` (the last record of a step wins: a
    resumed run rewrites the steps after its checkpoint)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2

    out: dict[int, list[list]] = {}
    for path in sorted(glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))):
        for record in RawEventFileLoader(path).Load():
            event = event_pb2.Event.FromString(record)
            for v in event.summary.value:
                if v.tag == "rollout/groups":
                    out[event.step] = json.loads(v.tensor.string_val[0].decode())
    return out


def prefix_group_rates(records: dict[int, list[list]], kinds=("too_hard", "too_easy")
                       ) -> dict[int, list[float]]:
    """RL step -> pass rate of each prefix group (k >= 1) with a scored rollout."""
    return {step: [s / m for _, kind, k, s, m in groups if kind in kinds and k >= 1 and m]
            for step, groups in sorted(records.items())}


def solve_partial(records: dict[int, list[list]]) -> list[int]:
    """Mixed-outcome groups (0 < successes < scored) per step."""
    return [sum(0 < s < m for *_, s, m in groups) for _, groups in sorted(records.items())]


def frozen_figures(root: str, seeds: Sequence[int]) -> dict:
    """Claims 1 and 2 from the runs that exist for every arm."""
    recs = {arm: {s: group_records(os.path.join(root, f"seed{s}", arm)) for s in seeds}
            for arm in ARMS}
    seeds = [s for s in seeds if all(recs[a][s] for a in ARMS)]
    rates = {s: prefix_group_rates(recs["ps"][s]) for s in seeds}
    pooled = np.array([r for s in seeds for rs in rates[s].values() for r in rs])
    by_step: dict[int, list[float]] = {}
    for s in seeds:
        for step, rs in rates[s].items():
            by_step.setdefault(step, []).extend(rs)
    partial = {arm: {s: solve_partial(recs[arm][s]) for s in seeds} for arm in ARMS}
    mean_partial = {arm: np.array([np.mean(partial[arm][s]) for s in seeds]) for arm in ARMS}
    return {
        "seeds": seeds,
        "prefix_groups": int(pooled.size),
        "prefix_pass_rate_mean": float(pooled.mean()) if pooled.size else None,
        "prefix_pass_rate_sd": float(pooled.std(ddof=1)) if pooled.size > 1 else None,
        "prefix_pass_rate_by_step": {str(k): {"mean": float(np.mean(v)), "groups": len(v)}
                                     for k, v in sorted(by_step.items()) if v},
        "prefix_pass_rate_by_kind": {kind: _pooled([prefix_group_rates(recs["ps"][s], (kind,))
                                                    for s in seeds])
                                     for kind in ("too_hard", "too_easy")},
        "solve_partial_per_step": {arm: {str(s): partial[arm][s] for s in seeds}
                                   for arm in ARMS},
        "solve_partial_mean": {arm: float(mean_partial[arm].mean()) for arm in ARMS},
        "solve_partial_ratio": {arm: sc.ratio_ci(mean_partial[arm], mean_partial["grpo"])
                                for arm in ("ps", "revisit")},
        "fresh_pass_rate": {arm: float(np.mean([s_ / m for s in seeds for g in
                                                recs[arm][s].values()
                                                for _, kind, _, s_, m in g
                                                if kind is None and m]))
                            for arm in ARMS},
    }


def _pooled(per_seed: Sequence[dict[int, list[float]]]) -> dict:
    values = [r for rates in per_seed for rs in rates.values() for r in rs]
    return {"groups": len(values), "mean": float(np.mean(values)) if values else None}


# ------------------------------------------------------------------ 3: stream vs groups


async def time_to_samples(agent, jobs: Sequence, in_flight: int, group_size: int,
                          groups_needed: int) -> dict:
    """Seconds until `groups_needed` groups of `group_size` are complete with
    `in_flight` groups running (the rest cancelled then), and the durations of the
    episodes that finished."""
    from rl.rollout import StreamCollector

    queue = list(jobs)
    collector = StreamCollector(agent, lambda: queue.pop(0) if queue else None, in_flight,
                                group_size=group_size)
    t0 = time.perf_counter()
    try:
        groups = await collector.collect(groups_needed)
    finally:
        await collector.close()
    seconds = time.perf_counter() - t0
    trajs = [t for g in groups for t in g]
    return {"seconds": seconds, "scored": sum(t.is_scored for t in trajs),
            "durations": [sum(t.timings.values()) for t in trajs]}  # generate, env, grade


def rep_jobs(train_tasks, rep: int, tasks: int) -> list:
    """`tasks` distinct training tasks of repetition `rep` (seeded by it), one job each."""
    from rl.rollout import RolloutJob

    rng = np.random.default_rng([rep, 1009])
    picks = rng.choice(len(train_tasks), size=tasks, replace=False)
    return [RolloutJob(train_tasks[i], seed=rep * 100_000 + j) for j, i in enumerate(picks)]


async def stream_setting(agent, train_tasks, reps: int, first_rep: int) -> list[dict]:
    """Both arms on each repetition (the order alternating): GRPO's groups on the
    repetition's first 6 tasks (x 8 each, then 6 more groups as they free up), SPO's
    stream on 48 tasks (then more)."""
    p = STREAM
    rows = []
    for rep in range(first_rep, first_rep + reps):
        row = {"rep": rep}
        arms = [("groups", rep_jobs(train_tasks, rep, 4 * p["groups_in_flight"]),
                 p["groups_in_flight"], p["group_size"], p["groups_needed"]),
                ("stream", rep_jobs(train_tasks, rep, 2 * p["stream_in_flight"]),
                 p["stream_in_flight"], 1, p["samples_needed"])]
        for name, jobs, in_flight, size, needed in (arms if rep % 2 else arms[::-1]):
            row[name] = await time_to_samples(agent, jobs, in_flight, size, needed)
        rows.append(row)
        print(f"{time.strftime('%H:%M:%S')} rep {rep}: groups {row['groups']['seconds']:.1f}"
              f" s, stream {row['stream']['seconds']:.1f} s", flush=True)
    return rows


def summarize_setting(rows: Sequence[dict], latency: dict) -> dict:
    """Mean seconds of each arm, their ratio with a repetition-paired bootstrap CI, and the
    log-SD of the finished episodes' durations (the tail's heaviness as measured)."""
    g = np.array([r["groups"]["seconds"] for r in rows])
    s = np.array([r["stream"]["seconds"] for r in rows])
    durations = np.array([d for r in rows for arm in ("groups", "stream")
                          for d in r[arm]["durations"] if d > 0])
    return {"latency": latency, "reps": len(rows), "groups_s": float(g.mean()),
            "stream_s": float(s.mean()), "speedup": sc.ratio_ci(g, s),
            "episode_log_sd": float(np.log(durations).std(ddof=1)),
            "episode_median_s": float(np.median(durations)),
            "load": sc.load_note()}


def run_stream(root: str, seed: int, sigmas: Sequence[float], median_s: float,
               reps: int) -> list[dict]:
    """Every latency setting (cached per setting under root/stream/)."""
    from configs import common
    from env.latency import LatencyConfig, LatencyModel

    workdir = ex.warm_start(root, seed, WARM_SETS, sc.WARM)
    config = common.apply_overrides(common.load_config(sc.WARM.format(seed=seed)),
                                    common.parse_overrides(WARM_SETS))
    agent, train_tasks = sc.load_agent(config, workdir)
    out = []
    try:
        for sigma in sigmas:
            latency = dict(median_s=median_s, sigma=sigma, slow_share=0.0, slow_factor=1.0)
            path = os.path.join(root, "stream", f"m{median_s}_s{sigma}_r{reps}.json")
            if not os.path.exists(path):
                agent.latency = LatencyModel(LatencyConfig(**latency), seed)
                rows = asyncio.run(stream_setting(agent, train_tasks, reps, 0))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    json.dump({"rows": rows, **summarize_setting(rows, latency)}, f)
            out.append({k: v for k, v in sc._read_json(path).items() if k != "rows"})
    finally:
        agent.close()
        agent.engine.close()
    return out


def stream_figures(settings: Sequence[dict]) -> dict:
    """The curve (speedup against the measured tail) and the setting nearest the seed's."""
    curve = [{"sigma": s["latency"]["sigma"], "episode_log_sd": s["episode_log_sd"],
              "groups_s": s["groups_s"], "stream_s": s["stream_s"], **s["speedup"]}
             for s in settings]
    near = min(settings, key=lambda s: abs(s["episode_log_sd"] - SEED_TAIL_LOG_SD))
    return {"curve": curve, "chosen": near, "seed_tail_log_sd": SEED_TAIL_LOG_SD}


# ------------------------------------------------------------------ report, entry


def write_results(out: str, frozen: dict | None, stream: dict | None) -> dict:
    """Merges the claims' keys into out/seed_claims.json (other keys kept)."""
    path = os.path.join(out, "seed_claims.json")
    result = sc._read_json(path)
    mech = result.setdefault("mechanism", {})
    if frozen is not None:
        mech["frozen"] = frozen
        result.update(prefix_pass_rate_mean=frozen["prefix_pass_rate_mean"],
                      prefix_pass_rate_sd=frozen["prefix_pass_rate_sd"],
                      solve_partial_ratio=frozen["solve_partial_ratio"]["ps"]["ratio"],
                      solve_partial_ratio_ci_low=frozen["solve_partial_ratio"]["ps"]["ci_low"])
    if stream is not None:
        mech["stream"] = stream
        result.update(stream_speedup=stream["chosen"]["speedup"]["ratio"],
                      stream_speedup_curve=[[c["episode_log_sd"], c["ratio"]]
                                            for c in stream["curve"]])
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("runs", "stream", "report"))
    p.add_argument("--root", default=ROOT)
    p.add_argument("--out", default=sc.RESULTS)
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sigmas", default="0,0.5,1,1.5,2")
    p.add_argument("--median-s", type=float, default=0.25)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    sigmas = [float(s) for s in args.sigmas.split(",")]
    if args.stage == "runs":
        gate_json = sc._read_json(os.path.join(args.out, "gate.json"))
        run_frozen(args.root, seeds, args.steps, gate_ratio(gate_json))
    if args.stage == "stream":
        run_stream(args.root, seeds[0], sigmas, args.median_s, args.reps)
    frozen = frozen_figures(args.root, seeds) if args.stage != "stream" else None
    stream = None
    if args.stage != "runs":
        cached = sorted(glob.glob(os.path.join(args.root, "stream", f"m{args.median_s}_*.json")))
        settings = [{k: v for k, v in sc._read_json(c).items() if k != "rows"} for c in cached]
        stream = stream_figures(settings) if settings else None
    result = write_results(args.out, frozen if frozen and frozen["seeds"] else None, stream)
    print(json.dumps({k: v for k, v in result.items() if k != "mechanism"}, indent=1))
    return result


if __name__ == "__main__":
    main()
