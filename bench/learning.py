"""Does RL learn on the default? Warm start vs final checkpoint over seeds, with CIs.

    python -m bench.learning [--seeds 0,1,2] [--steps N] [--eval-tasks 400] [--run]
                             [--set KEY=VALUE ...]      # the planted family's experiments
    python -m bench.learning --root runs/budget0_whole --seeds 0,1 --arm ps_lr2e4 \
        --baseline grpo_lr2e4 --config "configs/default.py:budget0,whole,seed={seed}"
                                           # the default's runs (bench.decision_gate layout)

For every seed, the warm start (`seed{S}/sft`) and the final checkpoints of the Prefix
Sampling arm and the baseline arm (bench.experiments layout under --root) are
evaluated greedily on the same held-out tasks, those of env.eval_tasks=`--eval-tasks`
(400 give 260: generated tasks whose statement occurs in training are left out),
with train.py --eval_only, cached beside each run. Without --run only finished runs
are read; with it, missing runs and evals are made (bench.experiments.run_arm /
final_eval).

Gains are paired: the same task and seed under both checkpoints. Their 95% CI is a
paired bootstrap over seeds and tasks (`paired_bootstrap`). Writes
results/learning.json (seeds, eval_tasks, warm_start_pass, final_pass, gain_mean,
gain_ci_low, gain_ci_high, and `ps_vs_baseline` with the same figures for the PS arm
against the baseline arm) and results/learning.png: held-out pass rate (the runs' own
eval sets) against RL step, mean over seeds with a bootstrap 95% band, beside the
training rollout pass rate.

Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections.abc import Sequence

import numpy as np

from bench import experiments
from configs import common

RESULTS = os.path.join(experiments.ROOT, "results")


def bootstrap_means(rewards: Sequence[np.ndarray], n_boot: int = 2000,
                    seed: int = 0) -> np.ndarray:
    """Bootstrap replicates of the mean over seeds and tasks of per-task values.

    rewards: one array of per-task values per seed. Each replicate draws the seeds with
    replacement, then within each drawn seed its tasks with replacement, and averages
    all drawn values (a two-level bootstrap: seeds and tasks both vary). -> [n_boot].
    """
    rng = np.random.default_rng(seed)
    rows = [np.asarray(r, float) for r in rewards]
    out = np.empty(n_boot)
    for b in range(n_boot):
        picked = rng.integers(len(rows), size=len(rows))
        out[b] = np.mean(np.concatenate([
            rows[i][rng.integers(len(rows[i]), size=len(rows[i]))] for i in picked]))
    return out


def paired_bootstrap(before: Sequence[np.ndarray], after: Sequence[np.ndarray],
                     n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Mean gain of `after` over `before` and its 95% CI (2.5 / 97.5 percentiles).

    before, after: per seed, per-task rewards on the same tasks in the same order; the
    gain of task t of seed s is after[s][t] - before[s][t], resampled as pairs.
    """
    diffs = [np.asarray(a, float) - np.asarray(b, float)
             for b, a in zip(before, after, strict=True)]
    reps = bootstrap_means(diffs, n_boot, seed)
    return {"gain_mean": float(np.mean(np.concatenate(diffs))),
            "gain_ci_low": float(np.percentile(reps, 2.5)),
            "gain_ci_high": float(np.percentile(reps, 97.5))}


def _rewards(path: str) -> tuple[list[str], np.ndarray]:
    """(task ids, rewards) of an eval file, sorted by task id (an env error scores 0)."""
    with open(path) as f:
        rewards = json.load(f)["rewards"]
    tasks = sorted(rewards)
    return tasks, np.array([float(rewards[t] or 0.0) for t in tasks])


def final_rewards(root: str, seeds: Sequence[int], arm: str, eval_tasks: int,
                  run: bool, config: str = experiments.WARM) -> list[tuple[list[str], np.ndarray]]:
    """Per seed, (task ids, rewards) of `arm`'s last checkpoint ("sft": the warm start)
    on the large held-out set, sorted by task id."""
    out = []
    for seed in seeds:
        if run:
            experiments.final_eval(root, seed, arm, eval_tasks, config)
        out.append(_rewards(os.path.join(root, f"seed{seed}", arm,
                                         f"final_eval_{eval_tasks}.json")))
    return out


def paired(before, after, what: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The reward arrays of two final_rewards results, checked to cover the same tasks."""
    for seed, ((ids_b, _), (ids_a, _)) in enumerate(zip(before, after, strict=True)):
        if ids_b != ids_a:
            raise ValueError(f"{what}: seed #{seed} was evaluated on different tasks")
    return [r for _, r in before], [r for _, r in after]


def curve(root: str, seeds: Sequence[int], arm: str) -> dict[str, list[float]]:
    """Held-out pass rate per RL step (the runs' eval_<step>.json files), mean over
    seeds with a bootstrap 95% band over seeds and tasks."""
    steps: dict[int, list[np.ndarray]] = {}
    for seed in seeds:
        for path in glob.glob(os.path.join(root, f"seed{seed}", arm, "eval_*.json")):
            match = re.fullmatch(r"eval_(\d+)\.json", os.path.basename(path))
            if match:
                steps.setdefault(int(match.group(1)), []).append(_rewards(path)[1])
    out: dict[str, list[float]] = {"step": [], "mean": [], "low": [], "high": []}
    for step in sorted(s for s, r in steps.items() if len(r) == len(seeds)):
        reps = bootstrap_means(steps[step])
        out["step"].append(step)
        out["mean"].append(float(np.mean(np.concatenate(steps[step]))))
        out["low"].append(float(np.percentile(reps, 2.5)))
        out["high"].append(float(np.percentile(reps, 97.5)))
    return out


def rollout_curve(root: str, seeds: Sequence[int], arm: str) -> dict[str, list[float]]:
    """Training rollout pass rate per RL step (metrics.jsonl), mean and std over the
    seeds whose run has one."""
    runs = [os.path.join(root, f"seed{seed}", arm) for seed in seeds]
    curves = [experiments.rl_curve(experiments.read_metrics(r), "rollout/pass_rate")
              for r in runs if os.path.exists(os.path.join(r, "metrics.jsonl"))]
    steps, mean, std = experiments.mean_curve(curves)
    return {"step": list(steps), "mean": mean.tolist(), "std": std.tolist()}


def plot(path: str, curves: dict[str, dict[str, list[float]]],
         rollouts: dict[str, dict[str, list[float]]], seeds: int) -> str:
    """Held-out pass rate (95% bootstrap band) and training rollout pass rate (+-std over
    seeds) against RL step, one line per arm."""
    from bench.plot import COLORS, arm_label, plt

    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
    for arm, c in curves.items():
        color = COLORS.get(arm)
        ax.plot(c["step"], c["mean"], marker="o", ms=3, color=color, label=arm_label(arm, seeds))
        ax.fill_between(c["step"], c["low"], c["high"], alpha=0.2, color=color)
    for arm, c in rollouts.items():
        mean, std = np.asarray(c["mean"]), np.asarray(c["std"])
        ax_r.plot(c["step"], mean, marker="o", ms=3, color=COLORS.get(arm),
                  label=arm_label(arm, seeds))
        ax_r.fill_between(c["step"], mean - std, mean + std, alpha=0.2, color=COLORS.get(arm))
    ax.set(title="held-out greedy pass rate (95% band, seeds x tasks)", xlabel="RL step",
           ylabel="pass rate")
    ax_r.set(title="training rollout pass rate (+-std over seeds)", xlabel="RL step",
             ylabel="pass rate")
    for a in (ax, ax_r):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=os.path.join(experiments.ROOT, "runs", "experiments"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=0, help="RL steps (0: the default config's)")
    p.add_argument("--eval-tasks", type=int, default=400,
                   help="env.eval_tasks of the final evals (400 leave 260 held-out tasks)")
    p.add_argument("--arm", default="ps_fixed")
    p.add_argument("--baseline", default="baseline")
    p.add_argument("--run", action="store_true", help="make missing runs and evals")
    p.add_argument("--config", default=experiments.WARM,
                   help="config of the runs whose arm is not in bench.experiments.ARMS, for "
                        "their evaluations ({seed} is filled in)")
    p.add_argument("--out", default=RESULTS, help="folder of NAME.json and NAME.png")
    p.add_argument("--name", default="learning", help="file name of the results (no suffix)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run made with --run (repeatable)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    args.steps = args.steps or common.load_config(args.config.format(seed=0)).total_steps
    if args.run:
        for seed in seeds:
            for arm in (args.arm, args.baseline):
                experiments.run_arm(args.root, arm, seed, args.steps, args.set)
    runs = {arm: final_rewards(args.root, seeds, arm, args.eval_tasks, args.run, args.config)
            for arm in ("sft", args.arm, args.baseline)}
    warm, final = paired(runs["sft"], runs[args.arm], f"sft vs {args.arm}")
    base, final = paired(runs[args.baseline], runs[args.arm], f"{args.baseline} vs {args.arm}")
    result = {"seeds": len(seeds), "eval_tasks": int(min(len(r) for r in warm)),
              "arm": args.arm, "baseline_arm": args.baseline,
              "warm_start_pass": float(np.mean(np.concatenate(warm))),
              "final_pass": float(np.mean(np.concatenate(final))),
              **paired_bootstrap(warm, final),
              "ps_vs_baseline": {"baseline_pass": float(np.mean(np.concatenate(base))),
                                 **paired_bootstrap(base, final)}}
    os.makedirs(args.out, exist_ok=True)
    arms = (args.arm, args.baseline)
    curves = {arm: curve(args.root, seeds, arm) for arm in arms}
    rollouts = {arm: rollout_curve(args.root, seeds, arm) for arm in arms}
    figure = plot(os.path.join(args.out, f"{args.name}.png"), curves, rollouts, len(seeds))
    result["figure"] = os.path.relpath(figure, experiments.ROOT)  # (the repo moves)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({**result, "curves": curves, "rollout_curves": rollouts}, f, indent=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
