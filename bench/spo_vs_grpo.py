"""SPO vs GRPO at equal rollouts per step on the default config (mini-SWE).

    python -m bench.spo_vs_grpo [--seeds 0,1,2] [--steps 12] [--root runs/experiments]
        [--out results] [--set KEY=VALUE ...]

GRPO is the `baseline` arm of bench.ps_ablation (6 tasks x 8 rollouts, rejection of
all-pass / all-fail groups, no Prefix Sampling); SPO draws 48 prompts per step, one
rollout each, from the prioritised sampler with the Beta-tracker baseline. Both start
from the seed's shared SFT warm start (bench.experiments) and runs are shared with
bench.ps_ablation. Writes `results/spo_vs_grpo.json` and the held-out pass rate against
rollouts and against wall time as PNGs.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from bench import experiments as ex
from bench.plot import arm_label, band_plot

ROLLOUTS_PER_STEP = 48  # configs/default.py:planted: 6 x 8 for GRPO, 48 x 1 for SPO


def arm_curves(workdir: str) -> dict:
    rows = ex.read_metrics(workdir)
    ev_steps, ev = ex.curve(rows, "eval/pass_rate")
    t_steps, t = ex.rl_curve(rows, "time/step_s")
    clock = dict(zip(t_steps, np.cumsum(t).tolist(), strict=True))
    clock[0] = 0.0
    trained = dict(zip(*ex.rl_curve(rows, "train/trajectories"), strict=True))
    return {"eval_steps": ev_steps, "eval": ev,
            "rollouts": [s * ROLLOUTS_PER_STEP for s in ev_steps],
            "wall_s": [clock.get(s) for s in ev_steps],
            "step_time_s": t, "trained_per_step": [trained[s] for s in sorted(trained)],
            "pass_rate": ex.rl_curve(rows, "rollout/pass_rate")[1]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--root", default="runs/experiments")
    p.add_argument("--out", default="results")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no_run", action="store_true", help="only read finished runs back")
    p.add_argument("--final_eval_tasks", type=int, default=144,
                   help="env.eval_tasks of the larger held-out set the final checkpoints "
                        "are also evaluated on (0: skip)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = {"grpo": "baseline", "spo": "spo"}
    curves: dict[str, dict[int, dict]] = {name: {} for name in arms}
    for seed in seeds:
        for name, arm in arms.items():
            if not args.no_run:
                ex.run_arm(args.root, arm, seed, args.steps, args.set)
            workdir = os.path.join(args.root, f"seed{seed}", arm)
            if os.path.exists(os.path.join(workdir, "run.json")):
                curves[name][seed] = arm_curves(workdir)

    summary = {}
    for name, by_seed in curves.items():
        if not by_seed:
            continue
        evals = np.array([c["eval"] for c in by_seed.values()])
        summary[name] = {
            "seeds": sorted(by_seed),
            "eval_step0": float(evals[:, 0].mean()),
            "eval_final_mean": float(evals[:, -1].mean()),
            "eval_final_std": float(evals[:, -1].std()),
            "eval_best_mean": float(evals.max(1).mean()),
            "step_time_s": float(np.mean([np.mean(c["step_time_s"]) for c in by_seed.values()])),
            "trained_trajectories_per_step": float(np.mean(
                [np.mean(c["trained_per_step"]) for c in by_seed.values()])),
        }
    if len(summary) == 2:
        summary["step_time_ratio_grpo_over_spo"] = (summary["grpo"]["step_time_s"]
                                                    / summary["spo"]["step_time_s"])
    if args.final_eval_tasks:
        summary["final_eval"] = ex.final_evals(args.root, seeds, list(arms.values()),
                                               args.final_eval_tasks, run=not args.no_run)

    def series(x_key):
        res = {}
        for name, by_seed in curves.items():
            if by_seed:
                xs = np.array([c[x_key] for c in by_seed.values()], float).mean(0)
                ev = np.array([c["eval"] for c in by_seed.values()])
                res[arm_label(name, len(by_seed))] = (xs, ev.mean(0), ev.std(0))
        return res

    os.makedirs(args.out, exist_ok=True)
    figs = [band_plot(os.path.join(args.out, "spo_eval_vs_rollouts.png"),
                      "Held-out pass rate vs rollouts", "rollouts", "pass rate",
                      series("rollouts")),
            band_plot(os.path.join(args.out, "spo_eval_vs_time.png"),
                      "Held-out pass rate vs wall time (RL only)", "seconds", "pass rate",
                      series("wall_s"))]
    result = {"steps": args.steps, "seeds": seeds, "sets": args.set, "summary": summary,
              "figures": figs,
              "curves": {n: {str(s): c for s, c in b.items()} for n, b in curves.items()}}
    with open(os.path.join(args.out, "spo_vs_grpo.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
