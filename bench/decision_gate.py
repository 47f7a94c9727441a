"""The decision gate: does RL learn a decision in miniature?

    python -m bench.decision_gate warm --seeds 0,1          # the SFT warm starts
    python -m bench.decision_gate measure --seed 0          # histogram, prefix table, taxonomy
    python -m bench.decision_gate runs --seeds 0,1 [--steps 24]
    python -m bench.decision_gate report [--try NAME] [--note TEXT]
    python -m bench.decision_gate arms --arms ps_lr2e4,revisit_lr2e4   # against GRPO
    ... --setting budget                                    # the second setting (below)

The setting is the decision family (configs/default.py:decide, mini-SWE difficulty 4): the
fix of a one-line function is which operator gives the statement's expected value, and the
edit names its line by number, so a warm start's failures should be decisions rather
than slips of copying (`measure` classifies them with bench.taxonomy).

Pre-registered before any run of the family (results/gate.json, "decision", beside the
retired gate's record, which stays as it was): on the training tasks, GRPO (Prefix
Sampling off, 8 tasks x 8 rollouts per step) against the same run at learning rate 0,
from the same warm start with the same seed, so that both see the same tasks at every
step; 2 seeds x 24 steps. The gate passes when the paired difference of
`rollout/fresh_pass_rate` averaged over steps 13-24 is >= +0.05 in each seed with the
2.5th percentile of a bootstrap over those steps above 0, and the warm start meets the
histogram and prefix-table criteria of bench.seed_claims.GATE. Every try is recorded.

The second setting, `budget` (configs/default.py:budget; record "budget", registered
before any of its runs with the same criteria): the decision family under a 3-step
budget, half of the demonstrations exploring before they edit (the edit is their 4th
call), so that how to work is a decision the reward tells apart. Its GRPO arm is
`grpo_lr2e4`, the rate the decision family's second try used (5e-5 left its rollouts
as lr 0's at first).

The third, `budget0` (record "budget0", registered before any of its runs, same criteria
and arms): the same budget over difficulty 0, whose statement names the file, so that
the direct way (view, edit, test) is one the policy can carry out; three of four
demonstrations explore first. Its warm start is measured on difficulty-0 tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from collections import Counter
from collections.abc import Sequence

import numpy as np

from bench import experiments as ex
from bench import mechanism_claims as mc
from bench import seed_claims as sc
from bench import taxonomy as tx
from env.tools import ToolCallError, parse_tool_call


@dataclasses.dataclass(frozen=True)
class Setting:
    """A gate's task setting: its config option, its record in results/gate.json, its
    registered GRPO arm and where its runs live."""

    option: str
    record: str
    arm: str
    difficulty: int  # the mini-SWE difficulty of its tasks (the warm start's measure)

    @property
    def root(self) -> str:
        return os.path.join(ex.ROOT, "runs", self.record)

    @property
    def warm(self) -> str:
        return f"configs/default.py:{self.option},seed={{seed}}"

    @property
    def arms(self) -> dict[str, str]:
        """The gate's arms are the same config (Prefix Sampling off), only their `--set`s
        differ; the method arms turn Prefix Sampling on (ARM_OPTIONS)."""
        return {arm: f"configs/default.py:{self.option},{ARM_OPTIONS.get(arm, 'baseline,')}"
                     "seed={seed}" for arm in SETS}


# The registered GRPO arm is the default's learning rate (5e-5); "grpo_lr2e4" is the second
# try (2e-4: the highest rate the retired gate's tries showed to move this model without
# collapse), added after the first try's rollouts were seen to match lr 0's at first.
SETS = {"grpo": ["batch_tasks=8"], "grpo_lr2e4": ["batch_tasks=8", "learner.optim.lr=2e-4"],
        "lr0": ["batch_tasks=8", "learner.optim.lr=0.0"]}
# The method arms beside the gate's GRPO arm, on its warm start, rate and tasks (the
# same seed draws the same tasks at every step): Prefix Sampling at its default ratio,
# and the revisit control (skewed tasks re-run from the start instead of a prefix).
ARM_OPTIONS = {"ps_lr2e4": "", "revisit_lr2e4": "revisit,"}
SETS.update(dict.fromkeys(ARM_OPTIONS, SETS["grpo_lr2e4"]))
SETTINGS = {"decide": Setting("decide", "decision", "grpo", 4),
            "budget": Setting("budget", "budget", "grpo_lr2e4", 4),
            "budget0": Setting("budget0", "budget0", "grpo_lr2e4", 0),
            "budget0_whole": Setting("budget0,whole", "budget0_whole", "grpo_lr2e4", 0)}
CRITERIA = dict(seeds=2, steps=24, tasks_per_step=8, group_size=8, window=(13, 24),
                min_diff=0.05, ci=0.95, n_boot=2000)
KEY = "rollout/fresh_pass_rate"


def paired(grpo: dict[int, float], lr0: dict[int, float], window=CRITERIA["window"],
           n_boot: int = CRITERIA["n_boot"], seed: int = 0) -> dict:
    """GRPO minus lr 0 over the steps of `window` both runs have: the mean difference and
    its 95% bootstrap interval over steps."""
    steps = [s for s in range(window[0], window[1] + 1) if s in grpo and s in lr0]
    diffs = np.array([grpo[s] - lr0[s] for s in steps])
    if diffs.size == 0:
        return {"steps": [], "diff": None, "ci_low": None, "ci_high": None}
    rng = np.random.default_rng(seed)
    boot = [float(np.mean(rng.choice(diffs, diffs.size))) for _ in range(n_boot)]
    return {"steps": steps, "diff": float(diffs.mean()),
            "ci_low": float(np.percentile(boot, 2.5)), "ci_high": float(np.percentile(boot, 97.5)),
            "grpo": float(np.mean([grpo[s] for s in steps])),
            "lr0": float(np.mean([lr0[s] for s in steps]))}


def passes(per_seed: Sequence[dict], hist: dict | None, prefix: dict | None) -> bool:
    """The pre-registered verdict (every seed complete over the window)."""
    full = len(range(CRITERIA["window"][0], CRITERIA["window"][1] + 1))
    learned = len(per_seed) >= CRITERIA["seeds"] and all(
        len(p["steps"]) == full and p["diff"] >= CRITERIA["min_diff"] and p["ci_low"] > 0
        for p in per_seed)
    return bool(learned and hist and hist["pass"] and prefix and prefix["pass"])


def _config(setting: Setting, seed: int):
    from configs import common

    return common.apply_overrides(common.load_config(setting.warm.format(seed=seed)),
                                  common.parse_overrides(SETS["grpo"]))


def measure(setting: Setting, root: str, seed: int, prefix_rollouts: int = 8) -> dict:
    """The warm start's histogram, prefix table and the taxonomy of its failed rollouts
    (the histogram's), on training tasks of the family; the failed rollouts' calls go to
    `failed_rollouts.jsonl` beside it. prefix_rollouts 0 keeps the prefix table already
    measured (the histogram's rollouts are the same: seeded per task)."""
    path = os.path.join(root, f"seed{seed}", "measure.json")
    before = sc._read_json(path)
    workdir = ex.warm_start(root, seed, SETS["grpo"], setting.warm)
    agent, train_tasks = sc.load_agent(_config(setting, seed), workdir)
    try:
        out = asyncio.run(sc.measure_warm_start(agent, train_tasks, np.random.default_rng(
            [seed, 7]), prefix_rollouts, difficulty=setting.difficulty))
    finally:
        agent.close()
        agent.engine.close()
    groups = out.pop("groups")
    by_id = {t.instance_id: t for t in train_tasks}
    failed = [t for g in groups for t in g if t.is_scored and t.reward == 0]
    marks = [tx.first_mistake(t.turns, t.status, by_id[t.task_id].metadata["bugs"])
             for t in failed]
    with open(os.path.join(root, f"seed{seed}", "failed_rollouts.jsonl"), "w") as f:
        for t, (kind, _) in zip(failed, marks, strict=True):
            f.write(json.dumps({"task_id": t.task_id, "status": t.status, "class": kind,
                                "calls": [[turn.tool_call, (turn.observation or "")[:200]]
                                          for turn in t.turns]}) + "\n")
    if "prefix" not in out and "prefix" in before:
        out["prefix"] = {**before["prefix"], "from": "an earlier measure of the same warm start"}
        out["previous_histogram"] = before.get("histogram")
    out["taxonomy"] = {**tx.table([m[0] for m in marks]),
                       "examples": {c: next((e for k, e in marks if k == c), "")
                                    for c in tx.CLASSES}}
    out["load"] = sc.load_note()
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def run_all(setting: Setting, root: str, seeds: Sequence[int], steps: int,
            arms: Sequence[str]) -> None:
    for seed in seeds:
        for arm in arms:
            ex.run_arm(root, arm, seed, steps, SETS[arm], setting.arms, setting.warm)


def _curve(root: str, seed: int, arm: str) -> dict[int, float]:
    path = os.path.join(root, f"seed{seed}", arm)
    if not os.path.exists(os.path.join(path, "metrics.jsonl")):
        return {}
    steps, values = ex.rl_curve(ex.read_metrics(path), KEY)
    return dict(zip(steps, values, strict=True))


def first_calls(root: str, seed: int, arm: str, step: int) -> dict | None:
    """How the greedy held-out episodes at `step` began: the count of each first tool
    call (`file_editor/view` looks at the file first; `execute_bash` runs the tests
    first, the way that cannot reach its edit in the budget setting), and the passes by
    it. Read from the eval's transcripts; None where that eval was not run."""
    path = os.path.join(root, f"seed{seed}", arm, f"eval_{step}_transcripts.jsonl")
    if not os.path.exists(path):
        return None
    counts, passed = Counter(), Counter()
    with open(path) as f:
        for row in map(json.loads, f):
            first = row["text"].split("<|im_start|>assistant\n", 1)[-1].split("<|im_end|>")[0]
            try:
                call = parse_tool_call(first)
            except ToolCallError:
                name = "malformed"
            else:
                command = call["arguments"].get("command", "")
                name = call["name"] + (f"/{command}" if call["name"] == "file_editor" else "")
            counts[name] += 1
            passed[name] += row["reward"] == 1.0
    return {"first_call": dict(counts), "passed": dict(passed)}


# Legend labels; the first word picks the colour (bench.plot.COLORS).
LABELS = {"grpo": "GRPO lr 5e-5", "grpo_lr2e4": "GRPO lr 2e-4", "lr0": "lr 0 (frozen)",
          "ps_lr2e4": "GRPO+PS lr 2e-4", "revisit_lr2e4": "revisit lr 2e-4"}


def figure(setting: Setting, root: str, seeds: Sequence[int], arms: Sequence[str],
           out_dir: str, name: str = "") -> str:
    """The fresh pass rate per step of each arm (mean and SD over seeds), as
    `gate_<record><name>.png` in `out_dir`; returns its file name."""
    from bench.plot import arm_label, band_plot

    series = {}
    for arm in arms:
        curves = [_curve(root, s, arm) for s in seeds]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[x] for x in steps] for c in curves])
        series[arm_label(LABELS.get(arm, arm), len(seeds))] = (
            steps, values.mean(axis=0), values.std(axis=0))
    path = os.path.join(out_dir, f"gate_{setting.record}{name}.png")
    band_plot(path, f"{setting.option}: fresh pass rate by arm", "RL step", KEY, series)
    return os.path.basename(path)


def report(setting: Setting, root: str, seeds: Sequence[int], name: str, note: str,
           out: str, arm: str) -> dict:
    """The try's record (`arm` against lr0, appended to the setting's tries in `out`) and
    the verdict."""
    path = os.path.join(root, f"seed{seeds[0]}", "measure.json")
    warm = sc._read_json(path)
    per_seed = [{"seed": s, **paired(_curve(root, s, arm), _curve(root, s, "lr0")),
                 "eval_first_calls": {a: {step: first_calls(root, s, a, step)
                                          for step in (0, CRITERIA["steps"])}
                                      for a in (arm, "lr0")}}
                for s in seeds]
    record = {"try": name, "note": note, "arm": arm, "sets": SETS[arm], "seeds": list(seeds),
              "per_seed": per_seed, "histogram": warm.get("histogram"),
              "prefix": {k: v for k, v in (warm.get("prefix") or {}).items()
                         if k not in ("rows",)}, "taxonomy": warm.get("taxonomy"),
              "gate_pass": passes(per_seed, warm.get("histogram"), warm.get("prefix")),
              "load": sc.load_note()}
    record["figure"] = figure(setting, root, seeds, [arm, "lr0"], os.path.dirname(out))
    gate = sc._read_json(out)
    criteria = {**CRITERIA, **sc.GATE, "difficulty": setting.difficulty}
    section = gate.setdefault(setting.record, {"criteria": criteria, "tries": []})
    section["tries"] = [t for t in section["tries"] if t["try"] != name] + [record]
    section["gate_pass"] = any(t["gate_pass"] for t in section["tries"])
    with open(out, "w") as f:
        json.dump(gate, f, indent=1)
    return record


def _renamed(d: dict, names: dict[str, str], **extra) -> dict:
    return {**extra, **{names.get(k, k): v for k, v in d.items()}}


def compare_arms(root: str, seeds: Sequence[int], grpo: str, arms: Sequence[str]) -> dict:
    """Each arm against `grpo` on the seeds both finished, paired by seed (the same tasks
    at every step): the metrics of bench.seed_claims (`_against`)."""
    done = lambda arm: {s for s in seeds if os.path.exists(os.path.join(
        root, f"seed{s}", arm, "metrics.jsonl"))}
    return {"grpo_arm": grpo, **{arm: _against(root, sorted(done(arm) & done(grpo)), grpo, arm)
                                 for arm in arms}}


def _against(root: str, seeds: Sequence[int], grpo: str, arm: str) -> dict:
    """Mixed-outcome groups per step (solve_partial) as a ratio with a seed-paired CI,
    the arm's prefix groups' pass rate, the fresh pass rate's paired difference over the
    gate's window, the steps each needs to GRPO's fitted target, and wall times."""
    run = lambda s, a: os.path.join(root, f"seed{s}", a)
    pair = (("grpo", grpo), (arm, arm))
    recs = {name: {s: mc.group_records(run(s, a)) for s in seeds} for name, a in pair}
    curves = lambda a: [ex.rl_curve(ex.read_metrics(run(s, a)), KEY) for s in seeds]
    walls = lambda a: [sc._read_json(os.path.join(run(s, a), "run.json")).get("wall_s")
                       for s in seeds]
    fresh = [_renamed(paired(_curve(root, s, arm), _curve(root, s, grpo)),
                      {"grpo": arm, "lr0": grpo}, seed=s) for s in seeds]
    return {"seeds": list(seeds), **mc.prefix_figures(recs[arm]),
            "solve_partial": mc.partial_figures(recs, arm), "fresh_window": fresh,
            "steps_to_target": sc.steps_ratio(curves(grpo), curves(arm), at=CRITERIA["steps"]),
            "wall_s": {name: walls(a) for name, a in pair}}


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("warm", "measure", "runs", "report", "arms"))
    p.add_argument("--setting", choices=tuple(SETTINGS), default="decide")
    p.add_argument("--root", default=None, help="default: runs/<the setting's record>")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=CRITERIA["steps"])
    p.add_argument("--prefix-rollouts", type=int, default=8,
                   help="rollouts per prefix length (0: keep the table already measured)")
    p.add_argument("--try", dest="name", default="decide_sft256_t04")
    p.add_argument("--arms", default=None, help="runs: the arms to run; report: the first "
                   "is the GRPO arm of the try (default: the setting's registered arm, lr0)")
    p.add_argument("--note", default="")
    p.add_argument("--out", default=os.path.join(sc.RESULTS, "gate.json"))
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    setting = SETTINGS[args.setting]
    root = args.root or setting.root
    arms = (args.arms or f"{setting.arm},lr0").split(",")
    if args.stage == "warm":
        for seed in seeds:
            print(ex.warm_start(root, seed, SETS["grpo"], setting.warm))
        return None
    if args.stage == "measure":
        result = measure(setting, root, args.seed, args.prefix_rollouts)
    elif args.stage == "runs":
        run_all(setting, root, seeds, args.steps, arms)
        return None
    elif args.stage == "arms":
        result = compare_arms(root, seeds, setting.arm, arms)
        result["figure"] = figure(setting, root, seeds, [setting.arm, *arms, "lr0"],
                                  sc.RESULTS, "_arms")
        with open(os.path.join(sc.RESULTS, f"arms_{setting.record}.json"), "w") as f:
            json.dump(result, f, indent=1)
    else:
        result = report(setting, root, seeds, args.name, args.note, args.out, arms[0])
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
