"""Synchronous vs asynchronous RL (rollout.max_staleness) under a long-tailed environment.

    python -m bench.async_rl [--steps 8] [--staleness 0,1,2,4] [--root runs/async_rl]
        [--out results/async_rl.json] [--set KEY=VALUE ...]

The smoke model (configs/default.py:smoke) with the latency model on: every tool call
sleeps a log-normal delay (median 0.5 s, sigma 1.0), and 1 task in 8 is 6x slower on
every call (env.latency). Each arm runs train.py for the same number of steps, hence
the same number of trained samples: GRPO + Prefix Sampling on 4 tasks x 4 rollouts a
step, every group trained on (reject_degenerate off, so the learner runs every step),
and SPO on 16 prompts a step with (k + 1) x 16 rollouts in flight (16 for the
synchronous arm). max_staleness 0 is the synchronous loop (GRPO: collect, learn,
sync; SPO: its stream with one batch in flight).

Per arm, over RL steps 2.. (step 1 compiles the learner): trained samples per second of
step time, the learner's idle share (waiting for rollouts), the inference engine's idle
share (no request outstanding: waiting on tools or on the learner), the lag of the
trained trajectories in policy versions, stale groups dropped, and the held-out pass
rate at the end. Prints one JSON object with the summary keys speedup_grpo_ps_s{k} and
speedup_spo_s{k} (samples/s at max_staleness=k over the synchronous arm's) and the
machine's load average (`os.getloadavg`) before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATENCY = ["env.latency.median_s=0.5", "env.latency.sigma=1.0", "env.latency.slow_share=0.125",
           "env.latency.slow_factor=6.0"]
ALGOS = {
    "grpo_ps": ("configs/default.py:smoke", ["batch_tasks=4", "group_size=4",
                                             "reject_degenerate=False"]),
    "spo": ("configs/default.py:smoke,spo", ["batch_tasks=16"]),
}


def arm_sets(algo: str, staleness: int, steps: int) -> list[str]:
    """The overrides of one arm: the latency model, the algorithm's batch, the bound, and
    evaluation and checkpoint only at the last step (so every arm's step times are RL)."""
    sets = [*LATENCY, *ALGOS[algo][1], f"rollout.max_staleness={staleness}",
            f"total_steps={steps}", f"eval_every={steps}", f"ckpt_every={steps}",
            "env.max_concurrent=96"]
    if algo == "spo":
        sets.append(f"spo.in_flight={16 * (staleness + 1)}")
    return sets


def run_arm(root: str, algo: str, staleness: int, steps: int, extra: list[str]) -> str:
    """train.py for one arm in a fresh workdir; returns the workdir."""
    workdir = os.path.join(root, f"{algo}_s{staleness}")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    sets = [a for kv in [*arm_sets(algo, staleness, steps), *extra] for a in ("--set", kv)]
    cmd = [sys.executable, "train.py", "--config", ALGOS[algo][0], "--workdir", workdir, *sets]
    with open(os.path.join(workdir, "log.txt"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return workdir


def summarize(workdir: str) -> dict:
    """The arm's throughput, idle shares, lags and final pass rate from metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rl = [r for r in rows if "time/rollout_s" in r and r["step"] >= 2]
    step_s = sum(r["time/step_s"] for r in rl)
    samples = sum(r["rollout/trajectories"] for r in rl)
    lags: dict[str, float] = {}
    for r in rl:
        for k, v in r.items():
            if k.startswith("async/lag_") and k[len("async/lag_"):].isdigit():
                lags[k[len("async/lag_"):]] = lags.get(k[len("async/lag_"):], 0) + v
    evals = [r["eval/pass_rate"] for r in rows if r.get("eval/pass_rate") is not None]
    return {"steps_timed": len(rl), "samples": samples, "step_s": step_s,
            "samples_per_s": samples / step_s,
            "learner_idle_frac": sum(r["time/rollout_s"] for r in rl) / step_s,
            "inference_idle_frac": sum(r["time/inference_idle_s"] for r in rl) / step_s,
            "lag_counts": dict(sorted(lags.items(), key=lambda kv: int(kv[0]))),
            "lag_mean": sum(r["async/lag_mean"] * r["rollout/trajectories"] for r in rl)
            / max(samples, 1),
            "dropped_stale": sum(r.get("async/dropped_stale", 0) for r in rl),
            "heldout_pass_rate": evals[-1] if evals else None}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--staleness", default="0,1,2,4")
    p.add_argument("--root", default="runs/async_rl")
    p.add_argument("--out", default="", help="also write the JSON object here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    bounds = [int(s) for s in args.staleness.split(",")]
    if bounds[0] != 0:
        raise ValueError("--staleness starts with 0 (the synchronous arm the others are "
                         "compared with)")
    load_before, t0 = os.getloadavg(), time.time()
    arms = {f"{algo}_s{k}": summarize(run_arm(args.root, algo, k, args.steps, args.set))
            for algo in ALGOS for k in bounds}
    out: dict = {"steps": args.steps, "latency": LATENCY, "arms": arms}
    for algo in ALGOS:
        sync = arms[f"{algo}_s0"]["samples_per_s"]
        for k in bounds[1:]:
            out[f"speedup_{algo}_s{k}"] = arms[f"{algo}_s{k}"]["samples_per_s"] / sync
    out.update(wall_s=time.time() - t0, loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
