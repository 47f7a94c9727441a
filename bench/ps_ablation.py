"""GRPO + rejection sampling vs Prefix Sampling (fixed, adaptive) on the default config.

    python -m bench.ps_ablation [--seeds 0,1,2] [--arms baseline,ps_fixed,ps_adaptive]
        [--steps 12] [--root runs/experiments] [--out results] [--set KEY=VALUE ...]

Per seed, one SFT warm start is shared by every arm (bench.experiments), so the arms
differ only in how RL picks its rollouts; same steps, tasks per step and rollouts per
task. Writes `results/ps_ablation.json` (per arm and seed, the curves; the summary
figures) and the PNGs below. Runs already finished under --root are read back, not
repeated; an interrupted command resumes.

Summary figures (PS = ps_fixed, and ps_adaptive with the `_adaptive` suffix):
  step_speedup          steps the baseline needs to reach its best smoothed eval pass
                        rate / steps PS needs to reach it (seed-mean curves; >1: PS faster)
  solve_partial_gain    mean solve_partial per batch, PS / baseline
  prefix_pass_rate_mean, _std   over every PS step and seed (target 0.5)
  step_time_ratio       mean step wall time, baseline / PS (>1: PS steps are faster)
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from bench import experiments as ex
from bench.plot import arm_label, band_plot

KEYS = {"eval": "eval/pass_rate", "solve_partial": "rollout/solve_partial",
        "pass_rate": "rollout/pass_rate", "prefix_pass_rate": "ps/prefix_pass_rate",
        "step_time_s": "time/step_s", "entropy": "learner/entropy",
        "replayed_tokens": "ps/replayed_tokens", "generated_tokens": "ps/generated_tokens",
        "prefix_tasks_hard": "ps/prefix_tasks/too_hard",
        "prefix_tasks_easy": "ps/prefix_tasks/too_easy",
        "ratio_hard": "ps/ratio/too_hard", "ratio_easy": "ps/ratio/too_easy"}


def arm_curves(workdir: str) -> dict:
    rows = ex.read_metrics(workdir)
    out = {"eval": dict(zip(("steps", "values"), ex.curve(rows, KEYS["eval"]), strict=True))}
    for name, key in KEYS.items():
        if name != "eval":
            out[name] = dict(zip(("steps", "values"), ex.rl_curve(rows, key), strict=True))
    with open(os.path.join(workdir, "run.json")) as f:
        out["run"] = json.load(f)
    return out


def summarize(curves: dict, arm: str) -> dict:
    """PS arm `arm` against the baseline, both over the seeds they share."""
    seeds = sorted(set(curves["baseline"]) & set(curves[arm]))
    if not seeds:
        return {}

    def seed_mean(a, name):
        return ex.mean_curve([(curves[a][s][name]["steps"], curves[a][s][name]["values"])
                              for s in seeds])

    def pooled(a, name):
        return np.array([v for s in seeds for v in curves[a][s][name]["values"]])

    b_steps, b_eval, _ = seed_mean("baseline", "eval")
    p_steps, p_eval, _ = seed_mean(arm, "eval")
    b_s, p_s = ex.smooth(b_eval), ex.smooth(p_eval)
    target = float(b_s.max())
    b_reach = ex.steps_to_reach(b_steps, b_s, target)
    p_reach = ex.steps_to_reach(p_steps, p_s, target)
    # Undefined (None) when the baseline's best is its step-0 warm start; 0 when PS
    # never reaches it.
    speedup = b_reach / p_reach if b_reach > 0 else float("nan")
    ppr = pooled(arm, "prefix_pass_rate")
    replayed = pooled(arm, "replayed_tokens").sum()
    generated = pooled(arm, "generated_tokens").sum()
    return {
        "seeds": seeds,
        "baseline_best_smoothed_eval": target,
        "steps_baseline_to_best": ex.finite(b_reach),
        "steps_ps_to_baseline_best": ex.finite(p_reach),
        "step_speedup": ex.finite(speedup),
        "solve_partial_baseline": float(pooled("baseline", "solve_partial").mean()),
        "solve_partial_ps": float(pooled(arm, "solve_partial").mean()),
        "solve_partial_gain": float(pooled(arm, "solve_partial").mean()
                                    / max(pooled("baseline", "solve_partial").mean(), 1e-9)),
        "prefix_pass_rate_mean": float(ppr.mean()) if ppr.size else None,
        "prefix_pass_rate_std": float(ppr.std()) if ppr.size else None,
        "prefix_pass_rate_steps": int(ppr.size),
        "replayed_token_share": float(replayed / max(replayed + generated, 1)),
        "step_time_baseline_s": float(pooled("baseline", "step_time_s").mean()),
        "step_time_ps_s": float(pooled(arm, "step_time_s").mean()),
        "step_time_ratio": float(pooled("baseline", "step_time_s").mean()
                                 / pooled(arm, "step_time_s").mean()),
        "eval_final_baseline": float(b_eval[-1]),
        "eval_final_ps": float(p_eval[-1]),
        "eval_step0": float(b_eval[0]),
    }


def figures(curves: dict, out: str) -> list[str]:
    def series(name):
        res = {}
        for arm, by_seed in curves.items():
            pairs = [(c[name]["steps"], c[name]["values"]) for c in by_seed.values()
                     if c[name]["steps"]]
            if pairs:
                res[arm_label(arm, len(pairs))] = ex.mean_curve(pairs)
        return res

    return [
        band_plot(os.path.join(out, "ps_eval.png"), "Held-out pass rate (greedy)", "RL step",
                  "pass rate", series("eval")),
        band_plot(os.path.join(out, "ps_solve_partial.png"), "Tasks with 0 < pass < N per batch",
                  "RL step", "solve_partial", series("solve_partial")),
        band_plot(os.path.join(out, "ps_prefix_pass_rate.png"), "Prefix-task pass rate",
                  "RL step", "pass rate", {k: v for k, v in series("prefix_pass_rate").items()
                                           if not k.startswith("baseline")},
                  hline=0.5, hband=0.05),
        band_plot(os.path.join(out, "ps_step_time.png"), "Step wall time", "RL step", "seconds",
                  series("step_time_s")),
        band_plot(os.path.join(out, "ps_entropy.png"), "Policy entropy (trained tokens)",
                  "RL step", "nats / token", series("entropy")),
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default="baseline,ps_fixed,ps_adaptive")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--root", default="runs/experiments")
    p.add_argument("--out", default="results")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run (train.py --set)")
    p.add_argument("--no_run", action="store_true", help="only read finished runs back")
    p.add_argument("--final_eval_tasks", type=int, default=144,
                   help="env.eval_tasks of the larger held-out set every final checkpoint "
                        "and warm start is also evaluated on (0: skip)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    curves: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
    for seed in seeds:
        for arm in arms:
            workdir = os.path.join(args.root, f"seed{seed}", arm)
            if not args.no_run:
                ex.run_arm(args.root, arm, seed, args.steps, args.set)
            if os.path.exists(os.path.join(workdir, "run.json")):
                curves[arm][seed] = arm_curves(workdir)
    summary = {}
    if "baseline" in arms:
        for arm in arms:
            if arm.startswith("ps_") and curves[arm]:
                suffix = "" if arm == "ps_fixed" else "_" + arm.removeprefix("ps_")
                summary.update({k + suffix: v for k, v in summarize(curves, arm).items()})
    if args.final_eval_tasks:
        summary["final_eval"] = ex.final_evals(args.root, seeds, arms, args.final_eval_tasks,
                                               run=not args.no_run)
    os.makedirs(args.out, exist_ok=True)
    result = {"steps": args.steps, "seeds": seeds, "sets": args.set, "summary": summary,
              "figures": figures(curves, args.out),
              "curves": {arm: {str(s): c for s, c in by_seed.items()}
                         for arm, by_seed in curves.items()}}
    with open(os.path.join(args.out, "ps_ablation.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
