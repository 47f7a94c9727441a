"""The seeds' three mechanism claims, measured on a frozen warm start (no learning needed).

    python -m bench.mechanism_claims all [--seeds 0,1,2,3] [--steps 12] [--reps 20]
        [--sigmas 0,0.5,1,1.5,2] [--median-s 0.25] [--root DIR]   (or: runs, stream, report)

The warm start is the graded family's (configs/default.py:graded) with SFT 256 steps and
rollouts at T=0.4: the recipe that passed the gate's histogram and prefix criteria
(results/gate.json, try sft256_t04), made for the first seed (bench.experiments layout
under --root). The policy is frozen: every arm and seed runs in this one process on
that warm start's engine and sandboxes, through the algorithm's own collect and
bookkeeping (rl.algos: the task sampler of the seed, prefix tasks, the controller)
with no update, so arms differ only by how they collect and seeds by their tasks and
samples. Runs and settings are cached under --root and skipped when repeated.

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
import contextlib
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
ARMS = ("grpo", "ps", "revisit")
SEED_TAIL_LOG_SD = math.log(486 / 112) / 1.38  # the spread behind the seed's 4.35x
STREAM = dict(groups_in_flight=6, group_size=8, groups_needed=3, stream_in_flight=48,
              samples_needed=24)


# ------------------------------------------------------------------ 1, 2: frozen runs


def arm_config(arm: str, seed: int, ps_ratio: float):
    """One frozen arm's config: the warm start's settings, 8 tasks x 8 per step, the arm's
    options (PS: adaptive, from the gate's ratio) and the seed."""
    from configs import common

    sets = [*WARM_SETS, *sc.arm_sets(arm, ["ps.adaptive=True"] if arm == "ps" else [],
                                     ps_ratio)]
    return common.apply_overrides(common.load_config(sc.ARMS[arm].format(seed=seed)),
                                  common.parse_overrides(sets))


def gate_ratio(gate_json: dict) -> float:
    """The ps.remaining_ratio the prefix table of the gate's passing warm start picked."""
    tried = {t["try"]: t for t in gate_json["tries"]}
    return float(tried[GATE_TRY]["prefix"]["ps_remaining_ratio"])


async def frozen_run(agent, train_tasks, config, steps: int) -> tuple[dict, list]:
    """`steps` steps of the algorithm `config` names on the frozen policy: its collection
    and its bookkeeping (prefix tasks, the controller), no update. Returns step -> its
    groups as train.py records them (rl.metrics.group_outcomes), and [task, class] of
    every failed rollout of a fresh task (bench.taxonomy)."""
    from bench.taxonomy import first_mistake
    from rl import algos
    from rl.metrics import group_outcomes
    from train import owners

    algo = algos.build(algos.Context(owners(config).algo, agent, train_tasks, score=None))
    by_id = {t.instance_id: t for t in train_tasks}
    records, failures = {}, []
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            groups = await algo.collect(step)
            algo.advantages(step, groups)
            records[step] = json.loads(group_outcomes(groups))
            failures += [[t.task_id, *first_mistake(t.turns, t.status,
                                                    by_id[t.task_id].metadata["bugs"])]
                         for g in groups for t in g
                         if t.is_scored and t.reward == 0 and t.prefix is None]
            print(f"{time.strftime('%H:%M:%S')} step {step}: {time.perf_counter() - t0:.0f} s,"
                  f" {[r[1:] for r in records[step]]}", flush=True)
    finally:
        await algo.close()
    return records, failures


async def run_frozen(root: str, agent, train_tasks, seeds: Sequence[int], steps: int,
                     ps_ratio: float, tag: str) -> None:
    """Every arm of every seed: GRPO and PS seed by seed, then the revisit control (so
    that a run cut short leaves paired seeds of the main comparison); each run cached as
    root/frozen/{arm}_seed{seed}_{tag}.json."""
    plan = [(arm, seed) for seed in seeds for arm in ("grpo", "ps")]
    for arm, seed in [*plan, *((a, s) for s in seeds for a in ARMS if (a, s) not in plan)]:
        path = os.path.join(root, "frozen", f"{arm}_seed{seed}_{tag}.json")
        if os.path.exists(path):
            continue
        print(f"{time.strftime('%H:%M:%S')} {arm}, seed {seed}", flush=True)
        t0 = time.perf_counter()
        records, failures = await frozen_run(agent, train_tasks,
                                             arm_config(arm, seed, ps_ratio), steps)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"arm": arm, "seed": seed, "steps": steps, "ps_ratio": ps_ratio,
                       "wall_s": time.perf_counter() - t0, "load": sc.load_note(),
                       "records": records, "failures": failures}, f)
        os.replace(path + ".tmp", path)


def read_frozen(root: str, arm: str, seed: int, tag: str) -> dict[int, list[list]]:
    path = os.path.join(root, "frozen", f"{arm}_seed{seed}_{tag}.json")
    records = sc._read_json(path).get("records", {})
    return {int(k): v for k, v in records.items()}


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


def prefix_figures(ps: dict[int, dict[int, list[list]]]) -> dict:
    """Claim 1 from the PS arm's records (seed -> step -> groups)."""
    rates = {s: prefix_group_rates(r) for s, r in ps.items()}
    pooled = np.array([r for by_step in rates.values() for rs in by_step.values() for r in rs])
    steps: dict[int, list[float]] = {}
    for by_step in rates.values():
        for step, rs in by_step.items():
            steps.setdefault(step, []).extend(rs)
    return {
        "seeds": sorted(ps), "prefix_groups": int(pooled.size),
        "prefix_pass_rate_mean": float(pooled.mean()) if pooled.size else None,
        "prefix_pass_rate_sd": float(pooled.std(ddof=1)) if pooled.size > 1 else None,
        "prefix_pass_rate_by_step": {str(k): {"mean": float(np.mean(v)), "groups": len(v)}
                                     for k, v in sorted(steps.items()) if v},
        "prefix_pass_rate_by_kind": {kind: _pooled([prefix_group_rates(r, (kind,))
                                                    for r in ps.values()])
                                     for kind in ("too_hard", "too_easy")}}


def partial_figures(recs: dict[str, dict[int, dict]], arm: str) -> dict:
    """Claim 2 for `arm` against GRPO on the seeds both ran: mixed-outcome groups per
    step, the ratio of the seed means with a seed-paired bootstrap CI."""
    seeds = sorted(s for s in recs[arm] if s in recs["grpo"])
    per_step = {a: {s: solve_partial(recs[a][s]) for s in seeds} for a in ("grpo", arm)}
    means = {a: np.array([np.mean(v[s]) for s in seeds]) for a, v in per_step.items()}
    return {**sc.ratio_ci(means[arm], means["grpo"]), "seed_list": seeds,
            "per_step": {a: {str(s): v[s] for s in seeds} for a, v in per_step.items()},
            "mean": {a: float(m.mean()) if m.size else None for a, m in means.items()}}


def frozen_figures(root: str, seeds: Sequence[int], tag: str) -> dict:
    """Claims 1 and 2 from the runs there are (a seed's arm counts once it finished)."""
    recs = {arm: {s: r for s in seeds if (r := read_frozen(root, arm, s, tag))}
            for arm in ARMS}
    fresh = {arm: [s_ / m for by_step in recs[arm].values() for g in by_step.values()
                   for _, kind, _, s_, m in g if kind is None and m] for arm in ARMS}
    return {"seeds": sorted(recs["ps"]), "runs": tag, **prefix_figures(recs["ps"]),
            "solve_partial": {arm: partial_figures(recs, arm) for arm in ("ps", "revisit")},
            "fresh_pass_rate": {arm: float(np.mean(v)) if v else None
                                for arm, v in fresh.items()}}


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
    spread of the finished episodes' log durations (the tail's heaviness as measured):
    within each repetition and arm (the machine's load drifts between repetitions, and
    that drift is no tail), and pooled. A process's first repetition compiles the
    engine's shapes and is left out."""
    rows = [r for r in rows if not r.get("warmup")]
    g = np.array([r["groups"]["seconds"] for r in rows])
    s = np.array([r["stream"]["seconds"] for r in rows])
    logs = [np.log([d for d in r[arm]["durations"] if d > 0]) for r in rows
            for arm in ("groups", "stream")]
    within = np.concatenate([x - x.mean() for x in logs if x.size])
    return {"latency": latency, "reps": len(rows), "groups_s": float(g.mean()),
            "stream_s": float(s.mean()), "speedup": sc.ratio_ci(g, s),
            "episode_log_sd": float(within.std(ddof=1)),
            "episode_log_sd_pooled": float(np.concatenate(logs).std(ddof=1)),
            "episode_median_s": float(np.exp(np.median(np.concatenate(logs)))),
            "load": sc.load_note()}


async def run_stream(root: str, agent, train_tasks, seed: int, sigmas: Sequence[float],
                     median_s: float, reps: int) -> None:
    """Every latency setting, cached as root/stream/m{median_s}_s{sigma}_r{reps}.json."""
    from env.latency import LatencyConfig, LatencyModel

    warm = False  # the engine's shapes compiled: the first repetition in a process compiles
    try:
        for sigma in sigmas:
            latency = dict(median_s=median_s, sigma=sigma, slow_share=0.0, slow_factor=1.0)
            path = os.path.join(root, "stream", f"m{median_s}_s{sigma}_r{reps}.json")
            if os.path.exists(path):
                continue
            agent.latency = LatencyModel(LatencyConfig(**latency), seed)
            rows = await stream_setting(agent, train_tasks, reps + (not warm), 0)
            rows[0]["warmup"] = not warm
            warm = True
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump({"rows": rows, **summarize_setting(rows, latency)}, f)
    finally:
        agent.latency = None


@contextlib.contextmanager
def frozen_agent(root: str, seed: int):
    """(agent, training tasks) of the seed's warm start (made if missing), closed after."""
    from configs import common

    workdir = ex.warm_start(root, seed, WARM_SETS, sc.WARM)
    config = common.apply_overrides(common.load_config(sc.WARM.format(seed=seed)),
                                    common.parse_overrides(WARM_SETS))
    agent, train_tasks = sc.load_agent(config, workdir)
    try:
        yield agent, train_tasks
    finally:
        agent.close()
        agent.engine.close()


def stream_figures(settings: Sequence[dict]) -> dict:
    """The curve (speedup against the measured tail) and the setting nearest the seed's."""
    curve = [{"sigma": s["latency"]["sigma"], "episode_log_sd": s["episode_log_sd"],
              "episode_log_sd_pooled": s.get("episode_log_sd_pooled"),
              "groups_s": s["groups_s"], "stream_s": s["stream_s"], **s["speedup"]}
             for s in settings]
    near = min(settings, key=lambda s: abs(s["episode_log_sd"] - SEED_TAIL_LOG_SD))
    return {"curve": curve, "chosen": near, "seed_tail_log_sd": SEED_TAIL_LOG_SD}


# ------------------------------------------------------------------ report, entry


def taxonomy(root: str, seeds: Sequence[int], tag: str) -> dict:
    """bench.taxonomy's table of the GRPO arm's failed rollouts (fresh tasks of the frozen
    warm start), in all and by difficulty (the task id's `-d<k>` suffix)."""
    from bench.taxonomy import table

    fails = [f for s in seeds for f in sc._read_json(os.path.join(
        root, "frozen", f"grpo_seed{s}_{tag}.json")).get("failures", [])]
    out = {"warm_start": GATE_TRY, "arm": "grpo (frozen)", "runs": tag, "seeds": list(seeds),
           "all": table([f[1] for f in fails])}
    for d in sorted({f[0].rsplit("-d", 1)[-1] for f in fails}):
        out[f"difficulty_{d}"] = table([f[1] for f in fails if f[0].endswith(f"-d{d}")])
    out["examples"] = {c: [f[2] for f in fails if f[1] == c and len(f) > 2][:3]
                       for c in sorted({f[1] for f in fails})}
    return out


def figures(out: str, frozen: dict | None, stream: dict | None) -> list[str]:
    """One figure per claim (PNG under out/): the prefix groups' pass rate per step, the
    mixed-outcome groups per step of each arm, the stream's speedup against the tail."""
    from bench.plot import band_plot

    paths = []
    if frozen and frozen.get("prefix_pass_rate_by_step"):
        by = frozen["prefix_pass_rate_by_step"]
        x = [int(k) for k in by]
        paths.append(band_plot(os.path.join(out, "claims_prefix_pass_rate.png"),
                               "Prefix groups' pass rate (frozen warm start)", "RL step",
                               "pass rate of prefix groups",
                               {f"ps (groups pooled over {len(frozen['seeds'])} seeds)":
                                (x, [by[k]["mean"] for k in by], [0.0] * len(x))},
                               hline=0.5, hband=0.1))
    if frozen and frozen.get("solve_partial"):
        series = {}
        for arm, fig in [("grpo", frozen["solve_partial"]["ps"]), *frozen["solve_partial"].items()]:
            runs = np.array(list(fig["per_step"].get(arm, {}).values()), float)
            if runs.size:
                series[f"{arm} ({len(runs)} seeds)"] = (np.arange(1, runs.shape[1] + 1),
                                                       runs.mean(0), runs.std(0))
        paths.append(band_plot(os.path.join(out, "claims_solve_partial.png"),
                               "Mixed-outcome groups per step (of 8)", "RL step",
                               "solve_partial", series))
    if stream:
        curve = sorted(stream["curve"], key=lambda c: c["episode_log_sd"])
        paths.append(band_plot(os.path.join(out, "claims_stream_speedup.png"),
                               "Time to 24 samples: groups / stream", "log-SD of episode time",
                               "speedup", {"spo stream vs grpo groups": (
                                   [c["episode_log_sd"] for c in curve],
                                   [c["ratio"] for c in curve],
                                   [0.0] * len(curve))},  # CIs: seed_claims.json
                               hline=486 / 112))
    return paths


def write_results(out: str, frozen: dict | None, stream: dict | None) -> dict:
    """Merges the claims' keys into out/seed_claims.json (other keys kept)."""
    path = os.path.join(out, "seed_claims.json")
    result = sc._read_json(path)
    mech = result.setdefault("mechanism", {})
    if frozen is not None:
        mech[f"frozen_{frozen['runs']}"] = frozen
        result.update(prefix_pass_rate_mean=frozen["prefix_pass_rate_mean"],
                      prefix_pass_rate_sd=frozen["prefix_pass_rate_sd"],
                      solve_partial_ratio=frozen["solve_partial"]["ps"]["ratio"],
                      solve_partial_ratio_ci_low=frozen["solve_partial"]["ps"]["ci_low"])
    if stream is not None:
        mech["stream"] = stream
        result.update(stream_speedup=stream["chosen"]["speedup"]["ratio"],
                      stream_speedup_curve=[[c["episode_log_sd"], c["ratio"]]
                                            for c in stream["curve"]])
    os.makedirs(out, exist_ok=True)
    mech["figures"] = [os.path.relpath(p, out) for p in figures(out, frozen, stream)]
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def run_tag(args) -> str:
    """The name of a set of frozen runs: its steps, and the task pool when restricted."""
    return f"steps{args.steps}" + (f"_d{args.difficulty}" if args.difficulty else "")


async def measure(args, agent, train_tasks, seeds: Sequence[int], ps_ratio: float) -> None:
    """The stage's runs, in one event loop (the agent's)."""
    if args.stage in ("runs", "all"):
        pool = [t for t in train_tasks if t.difficulty == args.difficulty or not args.difficulty]
        await run_frozen(args.root, agent, pool, seeds, args.steps, ps_ratio, run_tag(args))
    if args.stage in ("stream", "all"):
        await run_stream(args.root, agent, train_tasks, seeds[0],
                         [float(s) for s in args.sigmas.split(",")], args.median_s, args.reps)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("runs", "stream", "all", "report"))
    p.add_argument("--root", default=ROOT)
    p.add_argument("--out", default=sc.RESULTS)
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--difficulty", type=int, default=0,
                   help="runs: draw training tasks of this difficulty only (0: the config's mix)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sigmas", default="0,0.5,1,1.5,2")
    p.add_argument("--median-s", type=float, default=0.25)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.stage != "report":
        ratio = gate_ratio(sc._read_json(os.path.join(args.out, "gate.json")))
        with frozen_agent(args.root, seeds[0]) as (agent, train_tasks):
            asyncio.run(measure(args, agent, train_tasks, seeds, ratio))
    frozen = frozen_figures(args.root, seeds, run_tag(args))
    cached = sorted(glob.glob(os.path.join(args.root, "stream", f"m{args.median_s}_*.json")))
    settings = [summarize_setting(d["rows"], d["latency"]) | {"load": d["load"]}
                for d in map(sc._read_json, cached)]
    result = write_results(args.out, frozen if frozen["seeds"] else None,
                           stream_figures(settings) if settings else None)
    if frozen["seeds"]:
        path = os.path.join(args.out, "taxonomy.json")
        tables = {**sc._read_json(path),
                  f"{GATE_TRY}_{run_tag(args)}": taxonomy(args.root, seeds, run_tag(args))}
        with open(path, "w") as f:
            json.dump(tables, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "mechanism"}, indent=1))
    return result


if __name__ == "__main__":
    main()
