"""Runs of `train.py` for the experiments, sharing one SFT warm start per seed.

Layout under a root directory (default `runs/experiments`):

    seed{S}/sft/          train.py on the default config with total_steps=0: demonstrations,
                          SFT, the step-0 checkpoint and the step-0 held-out eval
    seed{S}/{arm}/        a copy of sft/ that train.py resumes from step 0 with the arm's
                          config; `run.json` records the command and its wall time

Every arm of a seed starts from the same weights, tokenizer and step-0 eval. A run that
was stopped resumes from its last checkpoint when the experiment command is repeated,
and finished runs are not repeated, so the figures can be regenerated from the runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

from rl.metrics import drop_rows_after

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# arm name -> config spec (`{seed}` is filled in)
ARMS = {
    "baseline": "configs/default.py:planted,baseline,seed={seed}",   # GRPO + rejection sampling
    "ps_fixed": "configs/default.py:planted,seed={seed}",    # Prefix Sampling, fixed ratios
    "ps_adaptive": "configs/default.py:planted,adaptive,seed={seed}",
    "spo": "configs/default.py:planted,spo,seed={seed}",
}
# The warm start's config (and that of runs named otherwise, for their evaluations).
WARM = "configs/default.py:planted,seed={seed}"


def _train(config: str, workdir: str, sets: Sequence[str], log_path: str,
           timeout_s: float | None = None) -> float:
    """Runs train.py; returns its wall time. timeout_s: the run is stopped (killed) then,
    its checkpoints kept, and that is its end (e.g. an arm given another's wall clock)."""
    cmd = [sys.executable, "train.py", "--config", config, "--workdir", workdir]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"stopped after {timeout_s:.0f} s", file=log, flush=True)
            return time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}; "
                           f"see {log_path}")
    return time.perf_counter() - t0


def _record(workdir: str) -> dict | None:
    path = os.path.join(workdir, "run.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def warm_start(root: str, seed: int, sets: Sequence[str] = (),
               config: str = WARM) -> str:
    """The seed's SFT warm start directory, made if missing (`config`: its spec, `{seed}`
    filled in)."""
    workdir = os.path.join(root, f"seed{seed}", "sft")
    if _record(workdir) is None:
        os.makedirs(workdir, exist_ok=True)
        # A run has at least one RL step: the smallest one (one task, two rollouts), then
        # everything after the step-0 checkpoint is removed.
        wall = _train(config.format(seed=seed), workdir,
                      [*sets, "total_steps=1", "batch_tasks=1", "group_size=2"],
                      os.path.join(workdir, "log.txt"))
        truncate_to_step0(workdir)
        with open(os.path.join(workdir, "run.json"), "w") as f:
            json.dump({"wall_s": wall, "sets": list(sets)}, f)
    return workdir


def truncate_to_step0(workdir: str) -> None:
    """Leaves a run's workdir as at its step-0 checkpoint: later checkpoints, evals
    and metric rows removed (TensorBoard events stay)."""
    ckpt = os.path.join(workdir, "ckpt")
    for name in os.listdir(ckpt):
        if name.isdigit() and int(name) > 0:
            shutil.rmtree(os.path.join(ckpt, name))
    for name in os.listdir(workdir):
        if name.startswith("eval_") and not name.startswith("eval_0"):
            os.remove(os.path.join(workdir, name))
    drop_rows_after(os.path.join(workdir, "metrics.jsonl"), 0)


def run_arm(root: str, arm: str, seed: int, steps: int, sets: Sequence[str] = (),
            arms: dict[str, str] = ARMS, warm: str = WARM,
            timeout_s: float | None = None) -> str:
    """Runs (or resumes, or skips when finished) one arm of one seed; returns its workdir.
    arms: arm name -> config spec; warm: the warm start's spec (`{seed}` filled in);
    timeout_s: stop the run after that many seconds (see _train)."""
    workdir = os.path.join(root, f"seed{seed}", arm)
    record = _record(workdir)
    if record is not None and list(record.get("sets", sets)) != list(sets):
        raise ValueError(f"{workdir} was run with --set {record['sets']}, not {list(sets)}: "
                         "give this run another name or remove the directory")
    if record is not None and record.get("steps") == steps:
        return workdir
    sft = warm_start(root, seed, sets, warm)
    if not os.path.exists(workdir):
        shutil.copytree(sft, workdir, ignore=shutil.ignore_patterns(
            "run.json", "log.txt", "final_eval_*", "eval_only_*"))
    wall = _train(arms[arm].format(seed=seed), workdir, [*sets, f"total_steps={steps}"],
                  os.path.join(workdir, "log.txt"), timeout_s)
    with open(os.path.join(workdir, "run.json"), "w") as f:
        json.dump({"arm": arm, "seed": seed, "steps": steps, "wall_s": wall,
                   "sft_wall_s": _record(sft)["wall_s"], "sets": list(sets),
                   "resumed": record is not None}, f)
    return workdir


def final_eval(root: str, seed: int, arm: str, eval_tasks: int, config: str = WARM) -> dict:
    """The last checkpoint of `arm` ("sft" for the warm start) evaluated on a held-out set
    generated with env.eval_tasks=`eval_tasks` (train.py --eval_only), larger than the
    one the runs evaluate on along the way; cached in the workdir. `config`: that of an
    arm not in ARMS ({seed} filled in)."""
    workdir = os.path.join(root, f"seed{seed}", arm)
    path = os.path.join(workdir, f"final_eval_{eval_tasks}.json")
    if not _fresh(path, workdir):
        spec = ARMS.get(arm, config).format(seed=seed)
        cmd = [sys.executable, "train.py", "--config", spec, "--workdir", workdir, "--eval_only",
               "--set", f"env.eval_tasks={eval_tasks}", "--eval_out", path]
        with open(os.path.join(workdir, "log.txt"), "a") as log:
            print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
            subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    with open(path) as f:
        ev = json.load(f)
    return {"step": ev["step"], "tasks": len(ev["rewards"]), "pass_rate": ev["eval/pass_rate"]}


def latest_checkpoint(workdir: str) -> int | None:
    """The highest finished checkpoint step under workdir/ckpt (Orbax names a finished
    step's directory by the bare number)."""
    ckpt = os.path.join(workdir, "ckpt")
    steps = [int(n) for n in os.listdir(ckpt) if n.isdigit()] if os.path.isdir(ckpt) else []
    return max(steps, default=None)


def _fresh(path: str, workdir: str) -> bool:
    """Whether the cached final eval at `path` is of the workdir's latest checkpoint."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return int(json.load(f)["step"]) == latest_checkpoint(workdir)


def final_evals(root: str, seeds: Sequence[int], arms: Sequence[str], eval_tasks: int,
                run: bool = True) -> dict:
    """`final_eval` of the warm start and of every finished arm, per seed, with means and
    each arm's mean gain over the warm start. run=False reads cached results only."""
    out: dict = {"eval_tasks_setting": eval_tasks}
    for arm in ["sft", *arms]:
        per_seed = {}
        for seed in seeds:
            workdir = os.path.join(root, f"seed{seed}", arm)
            # (a result for another step, e.g. copied with a warm start, is stale)
            cached = _fresh(os.path.join(workdir, f"final_eval_{eval_tasks}.json"), workdir)
            if os.path.exists(os.path.join(workdir, "run.json")) and (run or cached):
                per_seed[str(seed)] = final_eval(root, seed, arm, eval_tasks)
        if per_seed:
            out["tasks"] = next(iter(per_seed.values()))["tasks"]
            rates = {s: r["pass_rate"] for s, r in per_seed.items()}
            out[arm] = {"pass_rate": rates, "mean": float(np.mean(list(rates.values())))}
    for arm in arms:
        if arm in out and "sft" in out:
            gains = [r - out["sft"]["pass_rate"][s] for s, r in out[arm]["pass_rate"].items()
                     if s in out["sft"]["pass_rate"]]
            out[arm]["gain_over_sft_mean"] = float(np.mean(gains)) if gains else None
    return out


# ------------------------------------------------------------------ reading runs back


def read_metrics(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def curve(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one scalar; the last write of a step wins (a resumed run
    repeats the steps after its last checkpoint)."""
    by_step = {int(r["step"]): float(r[key]) for r in rows if key in r}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def rl_curve(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """A curve restricted to RL steps (>= 1); SFT scalars share the step axis."""
    steps, values = curve(rows, key)
    keep = [i for i, s in enumerate(steps) if s >= 1]
    return [steps[i] for i in keep], [values[i] for i in keep]


def smooth(values: Sequence[float], window: int = 2) -> np.ndarray:
    """Trailing mean over `window` points."""
    v = np.asarray(values, float)
    return np.array([v[max(0, i - window + 1):i + 1].mean() for i in range(len(v))])


def steps_to_reach(steps: Sequence[int], values: Sequence[float], target: float) -> float:
    """The first step whose value is >= target (inf when never)."""
    for s, v in zip(steps, values, strict=True):
        if v >= target - 1e-12:
            return float(s)
    return float("inf")


def mean_curve(curves: Sequence[tuple[list[int], list[float]]]) -> tuple[list[int], np.ndarray,
                                                                         np.ndarray]:
    """Mean and std over seeds on the steps every seed has."""
    common = sorted(set.intersection(*(set(s) for s, _ in curves))) if curves else []
    table = np.array([[dict(zip(s, v, strict=True))[x] for x in common] for s, v in curves])
    if not common:
        return [], np.zeros(0), np.zeros(0)
    return common, table.mean(0), table.std(0)


def finite(x: float) -> float | None:
    """JSON has no inf/nan: None stands for 'not reached' / 'not defined'."""
    return float(x) if np.isfinite(x) else None
