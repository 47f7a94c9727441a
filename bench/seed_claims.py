"""Do the seeds' claims show in miniature? A gate, then compute-matched arms, then metrics.

    python -m bench.seed_claims gate [--seed 0] [--try NAME] [--set KEY=VALUE ...]
    python -m bench.seed_claims arms --seeds 10,11,12,13 [--steps 48] [--set ...]
    python -m bench.seed_claims metrics --seeds 10,11,12,13 [--eval-tasks 600]

Everything runs on the graded task family (configs/default.py:graded: two-bug tasks,
difficulty 3, mixed with one-bug ones of difficulty 1; a warm start on correct
demonstrations only), one SFT warm start per seed shared by every arm
(bench.experiments layout under --root).

1. gate (training tasks only; results/gate.json). On the warm start:
   - the per-task pass-rate histogram of 64 difficulty-3 training tasks x 8 rollouts at
     the rollout temperature; passes with a mean in [0.05, 0.25], at least 30% of the
     tasks at 1-2 of 8 and at most 50% at 0 of 8;
   - the pass rate of prefix rollouts against prefix length for up to 24 of them that
     are too hard (1-2 of 8), each replayed from one of its own successes for every
     k = 1 .. steps - 1; passes when a length that leaves the policy 2 or more steps
     gives 0.3-0.7 (and names the ps.remaining_ratio that picks it);
   - the wall time of 3 steps of each arm (with the machine's load average: other
     processes share the cores);
   - the least-squares slope of rollout/fresh_pass_rate over 12 GRPO steps (>= 0.005
     per step).
   Every try is appended to runs/.../gate_tries.json and copied into results/gate.json
   with what it changed (`--set`, `--note`, `--tasks-per-step`), so the tuning is on
   record.
2. arms (each alone on the machine): GRPO (8 tasks x 8 unless the passing try chose
   more tasks per step, 48 steps); GRPO + PS at the gate's ratio; the revisit control
   (ps.revisit: skewed tasks re-run from the start); SPO as a stream (as many prompts x
   1, offline start of 2 samples per prompt on its clock), stopped
   at GRPO's wall time; SPO with a barrier (spo.in_flight = batch). Checkpoints every
   `--ckpt-every-s` seconds as well as at the end.
3. metrics (fixed before the runs; results/seed_claims.json, one figure per question):
   steps for the fresh-task pass rate to reach 90% of GRPO's gain at step 40 (per-run
   curve fit, trailing mean as a check) as a GRPO/PS ratio with a seed-paired bootstrap
   CI; solve_partial per batch; prefix pass rate mean and SD; held-out difficulty-3 and
   difficulty-1 pass rates (fresh eval seed, checkpoints evaluated afterwards, off the
   clock: train.py --eval_only --eval_step) at the last step and at equal wall clock
   (10, 20, 30 min and GRPO's end), paired with GRPO; trained samples per second;
   policy lag; Var(r - v) / Var(r) of SPO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Sequence

import numpy as np

from bench import experiments as ex

RESULTS = os.path.join(ex.ROOT, "results")
WARM = "configs/default.py:graded,seed={seed}"
TASKS, GROUP = 8, 8  # GRPO's tasks per step (tunable at the gate) x rollouts per task
ARMS = {
    "grpo": "configs/default.py:graded,baseline,seed={seed}",
    "ps": "configs/default.py:graded,seed={seed}",
    "revisit": "configs/default.py:graded,revisit,seed={seed}",
    "spo": "configs/default.py:graded,spo,seed={seed}",
    "spo_barrier": "configs/default.py:graded,spo,seed={seed}",
}
GATE = dict(hist_tasks=64, hist_rollouts=8, mean_low=0.05, mean_high=0.25,
            share_1_2_min=0.30, share_0_max=0.50, prefix_tasks=24, prefix_low=0.3,
            prefix_high=0.7, timing_steps=3, slope_steps=12, slope_min=0.005)


# ------------------------------------------------------------------ gate: pure parts


def histogram(successes: Sequence[int], scored: Sequence[int], n: int) -> dict:
    """Per-task pass counts -> the histogram (tasks at 0..n of n), the mean pass rate,
    the shares at 1-2 of n and at 0 of n, and whether they meet the gate's criteria.
    Tasks with an unscored rollout count over their scored ones (their k is rescaled
    to n, rounded), and tasks with none are left out."""
    ks = [round(n * s / m) for s, m in zip(successes, scored, strict=True) if m]
    rates = [s / m for s, m in zip(successes, scored, strict=True) if m]
    if not ks:
        raise ValueError("no task has a scored rollout")
    counts = [ks.count(j) for j in range(n + 1)]
    out = {"tasks": len(ks), "rollouts_per_task": n, "counts": counts,
           "mean": float(np.mean(rates)),
           "share_1_2": sum(1 <= k <= 2 for k in ks) / len(ks),
           "share_0": counts[0] / len(ks)}
    out["pass"] = bool(GATE["mean_low"] <= out["mean"] <= GATE["mean_high"]
                       and out["share_1_2"] >= GATE["share_1_2_min"]
                       and out["share_0"] <= GATE["share_0_max"])
    return out


def prefix_table(rows: Sequence[tuple[int, int, int, int]]) -> dict:
    """rows of (source steps, k replayed, successes, scored) -> pass rate by steps left to
    the policy (source steps - k; 1 is the final length: only the last call is left),
    pooled over tasks, and the gate's verdict: some length leaving >= 2 steps in
    [prefix_low, prefix_high]."""
    by_left: dict[int, list[int]] = {}
    for total, k, s, m in rows:
        acc = by_left.setdefault(total - k, [0, 0])
        acc[0], acc[1] = acc[0] + s, acc[1] + m
    table = {str(left): {"pass_rate": s / m if m else None, "rollouts": m}
             for left, (s, m) in sorted(by_left.items())}
    good = [int(left) for left, v in table.items() if int(left) >= 2 and v["pass_rate"]
            is not None and GATE["prefix_low"] <= v["pass_rate"] <= GATE["prefix_high"]]
    best = min(good, key=lambda left: abs(table[str(left)]["pass_rate"] - 0.5), default=None)
    return {"by_steps_left": table, "steps_left_in_band": good, "best_steps_left": best,
            "pass": bool(good)}


def remaining_ratio_for(steps_left: int, source_steps: Sequence[int]) -> float:
    """The ps.remaining_ratio that leaves `steps_left` steps of a source of the median
    length (rl.prefix.prefix_k floors total * ratio), in the middle of its interval."""
    total = int(np.median(source_steps))
    return round(min(1.0, (steps_left + 0.5) / total), 4)


def slope(steps: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of values against steps."""
    x, y = np.asarray(steps, float), np.asarray(values, float)
    if x.size < 2:
        return float("nan")
    return float(np.polyfit(x, y, 1)[0])


def first_fix_k(traj) -> int | None:
    """Steps of `traj` through its first edit (str_replace or replace_lines), or None."""
    for i, turn in enumerate(traj.turns):
        call = turn.tool_call or {}
        if call.get("arguments", {}).get("command") in ("str_replace", "replace_lines"):
            return i + 1
    return None


def load_note() -> dict:
    """The 1/5/15-minute load averages (2 cores shared with other work)."""
    return dict(zip(("load_1m", "load_5m", "load_15m"), os.getloadavg(), strict=True))


# ------------------------------------------------------------------ gate: rollouts


def load_agent(config, workdir: str):
    """(agent, training tasks) of the warm start in `workdir` (its step-0 checkpoint and
    tokenizer), sampling as the run's rollouts do, for measurements outside train.py."""
    from env import sandbox, splits
    from env.sandbox.pool import SandboxPool
    from inference import build as engines
    from models import loading, sharding
    from rl import learner, sft
    from rl.checkpoint import Checkpointer
    from rl.rollout import Agent
    from train import owners, served

    cfg = owners(config)
    mesh = sharding.make_mesh(**config.mesh)
    train_tasks, _ = splits.splits(cfg.env)
    tokenizer = sft.build_tokenizer(cfg.tokenizer, workdir, train_tasks)
    model_cfg = loading.model_config(dict(config.model), tokenizer.vocab_size)
    model = loading.build_model(dict(config.model), model_cfg, mesh, seed=config.seed)
    graphdef, abstract = learner.abstract_train_state(model, cfg.learner, mesh)
    ckpt = Checkpointer(workdir, keep=config.ckpt_keep)
    try:
        state, _ = ckpt.restore(0, abstract)
    finally:
        ckpt.close()
    engine = engines.from_config(cfg.engine, served(config, model_cfg),
                                 lambda: (graphdef, state.params), workdir)
    agent = Agent(engine, tokenizer,
                  SandboxPool(sandbox.from_config(cfg.env), cfg.env.max_concurrent),
                  cfg.algo.rollout, tools_in_prompt=cfg.env.tools_in_prompt)
    return agent, train_tasks


def _counts(groups) -> tuple[list[int], list[int]]:
    scored = [[t for t in g if t.is_scored] for g in groups]
    return [int(sum(t.reward for t in g)) for g in scored], [len(g) for g in scored]


async def measure_warm_start(agent, train_tasks, rng: np.random.Generator,
                             prefix_rollouts: int = 8, difficulty: int = 3) -> dict:
    """The histogram of 64 training tasks of `difficulty` x 8, then prefix rollouts of
    every length for up to 24 of the too-hard ones (one own success each as the source).
    The histogram's rollouts are kept under "groups" (not JSON: pop it before writing)."""
    from rl.rollout import RolloutJob, collect_groups

    n = GATE["hist_rollouts"]
    tasks = [t for t in train_tasks if t.difficulty == difficulty][:GATE["hist_tasks"]]
    t0 = time.perf_counter()
    groups = await collect_groups(agent, [RolloutJob(t, seed=i) for i, t in enumerate(tasks)], n,
                                  _progress("histogram", len(tasks) * n))
    out = {"histogram": histogram(*_counts(groups), n),
           "histogram_s": time.perf_counter() - t0, "histogram_load": load_note()}
    if prefix_rollouts:
        out["prefix"] = await prefix_rates(agent, groups, tasks, rng, prefix_rollouts)
    out["groups"] = groups
    return out


async def prefix_rates(agent, groups, tasks, rng: np.random.Generator,
                       prefix_rollouts: int) -> dict:
    """The prefix table: up to 24 too-hard tasks of `groups`, each replayed from one of
    its own successes for every length, `prefix_rollouts` rollouts per length."""
    from rl.prefix import make_prefix_task, select_source
    from rl.rollout import RolloutJob, collect_groups

    hard = [g for g, (s, m) in zip(groups, zip(*_counts(groups), strict=True), strict=True)
            if m and 0 < s / m < GATE["prefix_low"]][:GATE["prefix_tasks"]]
    sources = [select_source(g, "too_hard", rng) for g in hard]
    sources = [s for s in sources if s is not None]
    by_id = {t.instance_id: t for t in tasks}
    jobs, meta = [], []
    for source in sources:
        for k in range(1, source.num_steps):
            jobs.append(RolloutJob(by_id[source.task_id], seed=10_000 + len(jobs),
                                   prefix=make_prefix_task(source, k, "too_hard", 0)))
            meta.append((source.num_steps, k, k == first_fix_k(source)))
    t0 = time.perf_counter()
    pgroups = await collect_groups(agent, jobs, prefix_rollouts,
                                   _progress("prefix rollouts", len(jobs) * prefix_rollouts))
    succ, scored_n = _counts(pgroups)
    rows = [(total, k, s, m) for (total, k, _), s, m in zip(meta, succ, scored_n, strict=True)]
    fix = [(s, m) for (_, _, is_fix), s, m in zip(meta, succ, scored_n, strict=True) if is_fix]
    out = {**prefix_table(rows), "tasks": len(sources), "rollouts_per_length": prefix_rollouts,
           "source_steps": [s.num_steps for s in sources],
           "through_first_fix": {"pass_rate": (sum(s for s, _ in fix) / max(
               1, sum(m for _, m in fix))), "rollouts": sum(m for _, m in fix)},
           "seconds": time.perf_counter() - t0, "load": load_note()}
    if out["best_steps_left"] is not None:
        out["ps_remaining_ratio"] = remaining_ratio_for(out["best_steps_left"],
                                                        out["source_steps"])
    return out


def _progress(what: str, total: int):
    """A callback printing every 10% of `total` rollouts to stderr."""
    import sys

    done = [0]

    def update(n: int) -> None:
        done[0] += n
        if done[0] % max(1, total // 10) == 0 or done[0] == total:
            print(f"{time.strftime('%H:%M:%S')} {what}: {done[0]}/{total}", file=sys.stderr,
                  flush=True)

    return update


def warm_start_gate(root: str, seed: int, sets: Sequence[str], prefix_rollouts: int) -> dict:
    """The warm start (made if missing) and its two gate measurements, in this process."""
    from configs import common

    workdir = ex.warm_start(root, seed, sets, WARM)
    config = common.load_config(WARM.format(seed=seed))
    config = common.apply_overrides(config, common.parse_overrides(sets))
    agent, train_tasks = load_agent(config, workdir)
    try:
        out = asyncio.run(measure_warm_start(agent, train_tasks,
                                             np.random.default_rng([seed, 7]), prefix_rollouts))
        out.pop("groups")
        return out
    finally:
        agent.close()
        agent.engine.close()


# ------------------------------------------------------------------ gate: train.py runs


def arm_sets(arm: str, extra: Sequence[str] = (), ps_ratio: float | None = None,
             tasks: int = TASKS) -> list[str]:
    """The `--set`s of one arm: its batch shape (GRPO-like arms `tasks` x GROUP; SPO the
    same number of rollouts, one per prompt; the barrier waits for all of them), the
    gate's PS ratio (PS arm), `extra`."""
    if arm.startswith("spo"):
        stream = tasks * GROUP
        sets = [f"batch_tasks={stream}", "group_size=1", "spo.init_samples=2"]
        sets += [f"spo.in_flight={stream}"] if arm == "spo_barrier" else []
    else:
        sets = [f"batch_tasks={tasks}", f"group_size={GROUP}"]
    sets += extra
    if arm == "ps" and ps_ratio is not None:
        sets.append(f"ps.remaining_ratio={ps_ratio}")
    return sets


def timing_and_slope(root: str, seed: int, name: str, sets: Sequence[str],
                     ps_ratio: float | None, arms: Sequence[str] = tuple(ARMS),
                     slope_steps: int | None = None, tasks: int = TASKS) -> dict:
    """3 steps of every arm and 12 GRPO steps (slope_steps), each from the seed's warm
    start, in runs named `{name}_{arm}` (tries sharing a warm start keep their own);
    mean seconds per step (time/step_s) and the slope of the GRPO run's fresh pass
    rate."""
    slope_steps = slope_steps or GATE["slope_steps"]
    # No held-out evals on the clock; SPO's offline start on a 64-prompt pool (the arms
    # run it on every training prompt: its start_s is scaled there).
    quiet = ["eval_every=1000", "env.eval_tasks=1"]
    out: dict = {"step_s": {}, "load": {}}
    for arm in arms:
        steps = slope_steps if arm == "grpo" else GATE["timing_steps"]
        run = f"{name}_{arm}"
        out["load"][arm] = load_note()
        pool = ["spo.pool_size=64"] if arm.startswith("spo") else []
        workdir = ex.run_arm(root, run, seed, steps, [*sets, *quiet,
                                                     *arm_sets(arm, pool, ps_ratio, tasks)],
                             arms={run: ARMS[arm]}, warm=WARM)
        rows = ex.read_metrics(workdir)
        step_s = ex.rl_curve(rows, "time/step_s")[1][:GATE["timing_steps"]]
        start = ex.curve(rows, "time/start_s")[1]
        out["step_s"][arm] = {"mean": float(np.mean(step_s)), "steps": step_s,
                              "start_s": start[-1] if start else 0.0}
        if arm == "grpo":
            fresh_steps, fresh = ex.rl_curve(rows, "rollout/fresh_pass_rate")
            out["fresh_pass_rate"] = {"steps": fresh_steps, "values": fresh,
                                      "slope": slope(fresh_steps, fresh)}
    out["slope_pass"] = bool(slope_steps >= GATE["slope_steps"] and set(arms) == set(ARMS)
                             and out["fresh_pass_rate"]["slope"] >= GATE["slope_min"])
    out["arms_timed"], out["slope_steps"] = list(arms), slope_steps
    return out


def gate(root: str, seed: int, name: str, sets: Sequence[str], note: str, out: str,
         prefix_rollouts: int = 8, skip_runs: bool = False, warm: str = "",
         reuse: str = "", force_runs: bool = False, arms: Sequence[str] = tuple(ARMS),
         slope_steps: int | None = None, tasks: int = TASKS) -> dict:
    """One try of the gate under root/`warm` (default root/name: its own warm start; a
    try that changes only what runs after SFT names an earlier try's), appended to the
    record of tries and written with all of them to out/gate.json. reuse: take the
    warm-start figures of that earlier try (same warm start and sets) and run the rest.
    force_runs: make the train.py runs even when the warm start fails its criteria
    (their figures for the record). arms, slope_steps: a shorter plan (fewer arms timed,
    fewer GRPO steps), which can never pass the gate. tasks: GRPO's tasks per step (the
    arms take it from the passing try)."""
    t0 = time.time()
    base = os.path.join(root, warm or name)
    result: dict = {"try": name, "warm_start": warm or name, "seed": seed, "sets": list(sets),
                    "tasks_per_step": tasks, "note": note,
                    "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
                    "load_start": load_note(), "uptime": _uptime()}
    earlier = {t["try"]: t for t in _read_json_list(os.path.join(root, "gate_tries.json"))}
    if reuse:  # that try's warm-start figures (same warm start and sets), runs to come
        result.update({k: earlier[reuse][k] for k in ("histogram", "histogram_s",
                                                       "histogram_load", "prefix")})
        result["warm_figures_from"] = reuse
    else:
        result.update(warm_start_gate(base, seed, sets, prefix_rollouts))
    warm_ok = result["histogram"]["pass"] and result["prefix"]["pass"]
    result["gate_pass"] = False
    # Recorded now: the train.py runs below take longest, and a try stopped during them
    # keeps its warm-start figures.
    run = (warm_ok or force_runs) and not skip_runs
    result["runs"] = {"pending": run}
    record_try(root, out, {**result, "wall_s": time.time() - t0})
    if run:
        result["runs"] = timing_and_slope(base, seed, name, sets,
                                          result["prefix"].get("ps_remaining_ratio"), arms,
                                          slope_steps, tasks)
    result["gate_pass"] = bool(warm_ok and result["runs"].get("slope_pass", False))
    result["wall_s"] = time.time() - t0
    result["load_end"] = load_note()
    return record_try(root, out, result)


def _uptime() -> str:
    import subprocess

    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def record_try(root: str, out: str, result: dict) -> dict:
    """Appends `result` to root/gate_tries.json and writes out/gate.json: the last try's
    figures at the top, every try's settings and verdicts below."""
    path = os.path.join(root, "gate_tries.json")
    tries = []
    if os.path.exists(path):
        with open(path) as f:
            tries = json.load(f)
    tries = [t for t in tries if t["try"] != result["try"]] + [result]
    os.makedirs(root, exist_ok=True)
    with open(path, "w") as f:
        json.dump(tries, f, indent=1)
    passed = [t for t in tries if t["gate_pass"]]
    summary = {"gate_pass": bool(passed), "criteria": GATE,
               "chosen": (passed or tries)[-1]["try"],
               "tuned": [{k: t.get(k) for k in ("try", "sets", "note", "gate_pass")}
                         | {"tasks_per_step": t.get("tasks_per_step", TASKS),
                            "hist_mean": t["histogram"]["mean"],
                            "hist_share_1_2": t["histogram"]["share_1_2"],
                            "hist_share_0": t["histogram"]["share_0"],
                            "prefix_in_band": t["prefix"]["steps_left_in_band"],
                            "fresh_slope": t.get("runs", {}).get("fresh_pass_rate", {}).get(
                                "slope")} for t in tries],
               "result": (passed or tries)[-1], "tries": tries}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gate.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


# ------------------------------------------------------------------ arms


RUN_SETS = ["eval_every=100000", "ckpt_every=100000", "ckpt_keep=100000"]


def run_arms(root: str, seeds: Sequence[int], steps: int, sets: Sequence[str], gate_json: dict,
             ckpt_every_s: float) -> dict:
    """Every arm of every seed (finished runs are kept, stopped ones resume): GRPO first,
    its wall time then bounds both SPO arms. The gate's settings and PS ratio apply."""
    chosen = gate_json.get("result", {})
    ps_ratio = chosen.get("prefix", {}).get("ps_remaining_ratio")
    tasks = chosen.get("tasks_per_step", TASKS)
    base = [*chosen.get("sets", []), *sets, *RUN_SETS, f"ckpt_every_s={ckpt_every_s}"]
    done: dict = {}
    for seed in seeds:
        grpo = ex.run_arm(root, "grpo", seed, steps, arm_sets("grpo", base, tasks=tasks), ARMS,
                          WARM)
        wall = _read_json(os.path.join(grpo, "run.json"))["wall_s"]
        for arm in ("ps", "revisit"):
            ex.run_arm(root, arm, seed, steps, arm_sets(arm, base, ps_ratio, tasks), ARMS, WARM)
        for arm in ("spo", "spo_barrier"):  # as many steps as GRPO's wall clock allows
            ex.run_arm(root, arm, seed, 100 * steps, arm_sets(arm, base, tasks=tasks), ARMS, WARM,
                       timeout_s=wall)
        done[seed] = {arm: os.path.join(root, f"seed{seed}", arm) for arm in ARMS}
    return done


# ------------------------------------------------------------------ metrics: pure parts


def clock(rows: Sequence[dict]) -> dict[int, float]:
    """RL step -> seconds of the run's own clock at its end: the offline start
    (time/start_s) plus every step's time/step_s; held-out evals are off it. Step 0: the
    start."""
    start = ex.curve(rows, "time/start_s")[1]
    steps, step_s = ex.rl_curve(rows, "time/step_s")
    out = {0: float(start[-1]) if start else 0.0}
    for s, t in zip(steps, np.cumsum(step_s) + out[0], strict=True):
        out[s] = float(t)
    return out


def fit_saturating(steps: Sequence[float], values: Sequence[float]):
    """Least-squares fit of y = a + b (1 - exp(-s / tau)): tau on a log grid (0.5 to 2000
    steps), refined on a finer grid around the best, (a, b) by linear least squares at
    each tau; returns the fitted function."""
    x, y = np.asarray(steps, float), np.asarray(values, float)

    def fit(tau):
        basis = np.stack([np.ones_like(x), 1.0 - np.exp(-x / tau)], 1)
        coef, *_ = np.linalg.lstsq(basis, y, rcond=None)
        return float(np.sum((basis @ coef - y) ** 2)), tau, coef

    coarse = np.geomspace(0.5, 2000.0, 120)
    best = min((fit(t) for t in coarse), key=lambda r: r[0])
    ratio = coarse[1] / coarse[0]
    fine = np.geomspace(best[1] / ratio, best[1] * ratio, 101)
    _, tau, (a, b) = min((fit(t) for t in fine), key=lambda r: r[0])
    return lambda s: a + b * (1.0 - np.exp(-np.asarray(s, float) / tau))


def steps_to_target(fn, target: float, last: float, resolution: float = 0.1) -> float:
    """The first step in [0, last] (on a `resolution` grid) where fn >= target; inf if none."""
    grid = np.arange(0.0, last + resolution / 2, resolution)
    hit = np.nonzero(fn(grid) >= target - 1e-12)[0]
    return float(grid[hit[0]]) if hit.size else float("inf")


def steps_ratio(grpo: Sequence[tuple[list, list]], ps: Sequence[tuple[list, list]],
                at: int = 40, share: float = 0.9) -> dict:
    """Per seed (paired), steps each arm's fresh pass rate needs to reach `share` of
    GRPO's fitted gain at step `at`, by the fitted curves and by a trailing mean (window
    4) as a check; the GRPO/PS ratio of the seed means with a seed-paired bootstrap CI."""
    per_seed = []
    for (gs, gv), (ps_s, ps_v) in zip(grpo, ps, strict=True):
        g_fit = fit_saturating(gs, gv)
        gain = float(g_fit(at) - g_fit(0))
        target = float(g_fit(0)) + share * gain
        last = float(max(max(gs), max(ps_s)))
        row = {"gain_at": gain, "target": target,
               "grpo_fit": steps_to_target(g_fit, target, last),
               "ps_fit": steps_to_target(fit_saturating(ps_s, ps_v), target, last),
               "grpo_trailing": ex.steps_to_reach(gs, ex.smooth(gv, 4), target),
               "ps_trailing": ex.steps_to_reach(ps_s, ex.smooth(ps_v, 4), target)}
        per_seed.append(row)
    usable = [r for r in per_seed if r["gain_at"] > 0]
    out = {"per_seed": [{k: ex.finite(v) for k, v in r.items()} for r in per_seed]}
    for kind in ("fit", "trailing"):
        g = np.array([r[f"grpo_{kind}"] for r in usable])
        p = np.array([r[f"ps_{kind}"] for r in usable])
        out[kind] = ratio_ci(g, p)
    return out


def ratio_ci(num: np.ndarray, den: np.ndarray, n_boot: int = 2000, seed: int = 0) -> dict:
    """mean(num) / mean(den) over seeds and its 95% CI from resampling seeds (pairs kept);
    an infinite denominator (never reached) gives 0, an empty input None."""
    def ratio(idx):
        d = float(np.mean(den[idx]))
        return 0.0 if np.isinf(d) else float(np.mean(num[idx])) / max(d, 1e-9)

    if num.size == 0:
        return {"ratio": None, "ci_low": None, "ci_high": None, "seeds": 0}
    rng = np.random.default_rng(seed)
    reps = [ratio(rng.integers(num.size, size=num.size)) for _ in range(n_boot)]
    return {"ratio": ratio(np.arange(num.size)), "ci_low": float(np.percentile(reps, 2.5)),
            "ci_high": float(np.percentile(reps, 97.5)), "seeds": int(num.size)}


def checkpoint_at(ckpt_clock: dict[int, float], seconds: float) -> int | None:
    """The last checkpoint whose clock is <= seconds (None: none yet)."""
    steps = [s for s, t in ckpt_clock.items() if t <= seconds + 1e-9]
    return max(steps) if steps else None


# ------------------------------------------------------------------ metrics: runs


EQUAL_TIMES_S = (600.0, 1200.0, 1800.0)  # and GRPO's end, per seed
DIFFICULTIES = (3, 1)


def eval_path(workdir: str, step: int, difficulty: int, eval_seed: int, tasks: int) -> str:
    return os.path.join(workdir, f"heldout_d{difficulty}_seed{eval_seed}_n{tasks}_step{step}.json")


def evaluate_checkpoint(workdir: str, spec: str, step: int, difficulty: int, eval_seed: int,
                        tasks: int) -> str:
    """Checkpoint `step` greedily on held-out tasks of one difficulty (train.py
    --eval_only --eval_step, off the run's clock); cached beside the run."""
    import subprocess
    import sys

    path = eval_path(workdir, step, difficulty, eval_seed, tasks)
    if not os.path.exists(path):
        cmd = [sys.executable, "train.py", "--config", spec, "--workdir", workdir,
               "--eval_only", "--eval_step", str(step), "--eval_out", path,
               "--set", f"env.eval_tasks={tasks}", "--set", f"env.eval_seed={eval_seed}",
               "--set", f"env.difficulties=({difficulty},)"]
        with open(os.path.join(workdir, "log.txt"), "a") as log:
            subprocess.run(cmd, cwd=ex.ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return path


def checkpoints(workdir: str) -> list[int]:
    ckpt = os.path.join(workdir, "ckpt")
    return sorted(int(n) for n in os.listdir(ckpt) if n.isdigit()) if os.path.isdir(ckpt) else []


def eval_points(runs: dict[str, str]) -> dict[str, dict[str, int]]:
    """arm -> {point name: checkpoint step}: "last", and at equal wall clock (10, 20, 30
    min and GRPO's end) the last checkpoint within it (left out when the arm has none)."""
    grpo_end = max(clock(ex.read_metrics(runs["grpo"])).values())
    out = {}
    for arm, workdir in runs.items():
        run_clock = clock(ex.read_metrics(workdir))
        ckpt_clock = {s: run_clock[s] for s in checkpoints(workdir) if s in run_clock}
        points = {"last": max(ckpt_clock)} if ckpt_clock else {}
        for name, t in [*((f"{int(t // 60)}min", t) for t in EQUAL_TIMES_S),
                        ("grpo_end", grpo_end)]:
            step = checkpoint_at(ckpt_clock, t)
            if step is not None and (name == "grpo_end" or t <= grpo_end):
                points[name] = step
        out[arm] = points
    return out


def heldout(root: str, seeds: Sequence[int], eval_seed: int, tasks: int, run: bool) -> dict:
    """seed -> arm -> point -> difficulty -> (task ids, rewards) of the checkpoints
    eval_points names (evaluated when run, else read where present)."""
    from bench.learning import _rewards

    out: dict = {}
    for seed in seeds:
        runs = {arm: os.path.join(root, f"seed{seed}", arm) for arm in ARMS}
        if not all(os.path.exists(os.path.join(w, "metrics.jsonl")) for w in runs.values()):
            continue
        for arm, points in eval_points(runs).items():
            for point, step in points.items():
                for d in DIFFICULTIES:
                    path = eval_path(runs[arm], step, d, eval_seed, tasks)
                    if run:
                        evaluate_checkpoint(runs[arm], ARMS[arm].format(seed=seed), step, d,
                                            eval_seed, tasks)
                    if os.path.exists(path):
                        out.setdefault(seed, {}).setdefault(arm, {}).setdefault(point, {})[
                            str(d)] = _rewards(path)
    return out


def paired_vs_grpo(evals: dict, arm: str, point: str, difficulty: str) -> dict | None:
    """`arm` minus GRPO at one eval point, over the seeds having both, paired by task
    (bench.learning.paired_bootstrap: seeds and tasks resampled)."""
    from bench.learning import paired_bootstrap

    pairs = [(by_arm["grpo"][point][difficulty], by_arm[arm][point][difficulty])
             for by_arm in evals.values()
             if point in by_arm.get("grpo", {}) and point in by_arm.get(arm, {})]
    pairs = [(g, a) for g, a in pairs if g[0] == a[0]]  # same tasks
    if not pairs:
        return None
    grpo, other = [g[1] for g, _ in pairs], [a[1] for _, a in pairs]
    return {"seeds": len(pairs), "tasks": int(len(grpo[0])),
            "grpo": float(np.mean(np.concatenate(grpo))),
            arm: float(np.mean(np.concatenate(other))), **paired_bootstrap(grpo, other)}


def run_stats(workdir: str) -> dict:
    """Per-run figures from metrics.jsonl: the fresh pass-rate curve, solve_partial and
    prefix pass rates per batch, trained samples per second of the run's clock, policy
    lag, SPO's Var(r - v) / Var(r)."""
    rows = ex.read_metrics(workdir)
    run_clock = clock(rows)
    mean = lambda key: (float(np.mean(v)) if (v := ex.rl_curve(rows, key)[1]) else None)  # noqa: E731
    trained = sum(ex.rl_curve(rows, "train/trajectories")[1])
    return {"fresh": ex.rl_curve(rows, "rollout/fresh_pass_rate"),
            "solve_partial": mean("rollout/solve_partial"),
            "prefix_pass_rate": ex.rl_curve(rows, "ps/prefix_pass_rate")[1],
            "clock_s": max(run_clock.values()), "steps": max(run_clock),
            "trained_per_s": trained / max(max(run_clock.values()), 1e-9),
            "lag_mean": mean("async/lag_mean"),
            "residual_var_ratio": mean("spo/residual_var_ratio")}


def metrics(root: str, seeds: Sequence[int], eval_seed: int, eval_tasks: int, out: str,
            gate_json: dict, run: bool = True) -> dict:
    """results/seed_claims.json and its figures from the finished arms (stage 3)."""
    stats = {arm: {s: run_stats(os.path.join(root, f"seed{s}", arm)) for s in seeds
                   if os.path.exists(os.path.join(root, f"seed{s}", arm, "metrics.jsonl"))}
             for arm in ARMS}
    paired = [s for s in seeds if all(s in stats[a] for a in ARMS)]
    evals = heldout(root, paired, eval_seed, eval_tasks, run)
    steps = {arm: steps_ratio([stats["grpo"][s]["fresh"] for s in paired],
                              [stats[arm][s]["fresh"] for s in paired])
             for arm in ("ps", "revisit")}
    partial = {arm: ratio_ci(np.array([stats[arm][s]["solve_partial"] for s in paired]),
                             np.array([stats["grpo"][s]["solve_partial"] for s in paired]))
               for arm in ("ps", "revisit")}
    ppr = np.array([v for s in paired for v in stats["ps"][s]["prefix_pass_rate"]])
    comparisons = {f"{arm}_minus_grpo": {f"d{d}": {point: paired_vs_grpo(evals, arm, point, str(d))
                                                   for point in POINTS}
                                         for d in DIFFICULTIES}
                   for arm in ARMS if arm != "grpo"}
    per_arm = {arm: {k: _mean_over(stats[arm], paired, k)
                     for k in ("solve_partial", "clock_s", "steps", "trained_per_s", "lag_mean",
                               "residual_var_ratio")} for arm in ARMS}
    spo_end = comparisons["spo_minus_grpo"]["d3"]["grpo_end"] or {}
    d3 = next((c["tasks"] for c in comparisons["ps_minus_grpo"]["d3"].values() if c), 0)
    summary = {"seeds": len(paired), "eval_tasks_d3": d3,
               "ps_steps_ratio": steps["ps"]["fit"]["ratio"],
               "ps_steps_ratio_ci_low": steps["ps"]["fit"]["ci_low"],
               "ps_steps_ratio_ci_high": steps["ps"]["fit"]["ci_high"],
               "ps_steps_ratio_trailing": steps["ps"]["trailing"]["ratio"],
               "solve_partial_ratio": partial["ps"]["ratio"],
               "solve_partial_ratio_ci_low": partial["ps"]["ci_low"],
               "prefix_pass_rate_mean": float(ppr.mean()) if ppr.size else None,
               "prefix_pass_rate_sd": float(ppr.std()) if ppr.size else None,
               "spo_minus_grpo_equal_time": spo_end.get("gain_mean"),
               "spo_minus_grpo_equal_time_ci_low": spo_end.get("gain_ci_low"),
               "gate_pass": bool(gate_json.get("gate_pass", False))}
    os.makedirs(out, exist_ok=True)
    result = {"summary": summary, "steps_to_target": steps, "solve_partial": partial,
              "heldout": comparisons, "per_arm": per_arm, "eval_seed": eval_seed,
              "figures": figures(stats, evals, paired, out)}
    with open(os.path.join(out, "seed_claims.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


POINTS = ("last", *(f"{int(t // 60)}min" for t in EQUAL_TIMES_S), "grpo_end")


def _mean_over(by_seed: dict, seeds: Sequence[int], key: str) -> float | None:
    values = [by_seed[s][key] for s in seeds if by_seed[s][key] is not None]
    return float(np.mean(values)) if values else None


def figures(stats: dict, evals: dict, seeds: Sequence[int], out: str) -> list[str]:
    """The PS question (fresh pass rate against step) and the SPO one (held-out
    difficulty-3 pass rate against the run's clock), mean +- std over seeds."""
    from bench.plot import arm_label, band_plot

    def fresh(arm):
        return ex.mean_curve([stats[arm][s]["fresh"] for s in seeds])

    def heldout_vs_time(arm):
        xs, ys = [], []
        for point in POINTS[1:]:
            vals = [np.mean(evals[s][arm][point]["3"][1]) for s in seeds
                    if point in evals.get(s, {}).get(arm, {})]
            if len(vals) == len(seeds) and vals:
                t = [stats[arm][s]["clock_s"] if point == "grpo_end" else
                     EQUAL_TIMES_S[POINTS.index(point) - 1] for s in seeds]
                xs.append(float(np.mean(t)) / 60)
                ys.append(vals)
        return xs, np.mean(ys, 1) if ys else [], np.std(ys, 1) if ys else []

    n = len(seeds)
    return [band_plot(os.path.join(out, "seed_claims_ps.png"),
                      "Fresh-task rollout pass rate (PS question)", "RL step", "pass rate",
                      {arm_label(a, n): fresh(a) for a in ("grpo", "ps", "revisit")}),
            band_plot(os.path.join(out, "seed_claims_spo.png"),
                      "Held-out d3 pass rate at equal wall clock (SPO question)",
                      "minutes of the run's clock", "pass rate",
                      {arm_label(a, n): heldout_vs_time(a)
                       for a in ("grpo", "spo", "spo_barrier")})]


# ------------------------------------------------------------------ entry


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("gate", "arms", "metrics"))
    p.add_argument("--root", default=os.path.join(ex.ROOT, "runs", "seed_claims"))
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override of every run (train.py --set), e.g. sft.steps=96")
    p.add_argument("--seed", type=int, default=0, help="gate: the training seed")
    p.add_argument("--try", dest="try_name", default="try0", help="gate: this try's name")
    p.add_argument("--note", default="", help="gate: what this try changed and why")
    p.add_argument("--prefix-rollouts", type=int, default=8,
                   help="gate: rollouts per prefix task and length")
    p.add_argument("--warm-from", default="",
                   help="gate: reuse this earlier try's warm start (same SFT settings)")
    p.add_argument("--reuse", default="",
                   help="gate: take this earlier try's warm-start figures, run the rest")
    p.add_argument("--force-runs", action="store_true",
                   help="gate: make the train.py runs even if the warm start fails")
    p.add_argument("--timing-arms", default=",".join(ARMS),
                   help="gate: the arms timed (all of them for a passing gate)")
    p.add_argument("--slope-steps", type=int, default=None,
                   help="gate: GRPO steps of the slope run (12 for a passing gate)")
    p.add_argument("--tasks-per-step", type=int, default=TASKS,
                   help="gate: GRPO's tasks per step (x 8 rollouts; SPO streams as many)")
    p.add_argument("--warm-only", action="store_true",
                   help="gate: the warm start's measurements only (no train.py runs)")
    p.add_argument("--seeds", default="10,11,12,13", help="arms, metrics: training seeds")
    p.add_argument("--steps", type=int, default=48, help="arms: GRPO steps")
    p.add_argument("--ckpt-every-s", type=float, default=120.0)
    p.add_argument("--eval-seed", type=int, default=9001, help="metrics: held-out tasks' seed")
    p.add_argument("--eval-tasks", type=int, default=600,
                   help="metrics: env.eval_tasks per difficulty (duplicates of training "
                        "statements are left out)")
    p.add_argument("--no-run", action="store_true",
                   help="metrics: read the evaluations already made, run none")
    args = p.parse_args(argv)
    if args.stage == "gate":
        result = gate(args.root, args.seed, args.try_name, args.set, args.note, args.out,
                      args.prefix_rollouts, args.warm_only, args.warm_from, args.reuse,
                      args.force_runs, args.timing_arms.split(","), args.slope_steps,
                      args.tasks_per_step)
        print(json.dumps({k: result[k] for k in ("gate_pass", "chosen", "tuned")}, indent=1))
        return result
    seeds = [int(s) for s in args.seeds.split(",")]
    gate_json = _read_json(os.path.join(args.out, "gate.json"))
    if args.stage == "arms":
        return run_arms(args.root, seeds, args.steps, args.set, gate_json, args.ckpt_every_s)
    result = metrics(args.root, seeds, args.eval_seed, args.eval_tasks, args.out, gate_json,
                     run=not args.no_run)
    print(json.dumps(result["summary"], indent=1))
    return result


def _read_json_list(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    main()
