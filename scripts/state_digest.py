"""Digests of what a short run leaves behind, to show a change keeps the numbers.

    python scripts/state_digest.py --out /tmp/digests.json            # smoke runs
    python scripts/state_digest.py --dry_runs --out /tmp/dry.json     # every config

For each run (RUNS): 3 RL steps of the smoke config (`:smoke,steps=3`, the same trained
with the SFT loss on every group so the weights move whatever the rewards, and
`:spo,smoke,steps=3`, also with one rollout in flight), then the SHA-256 of the
step-3 checkpoint's train state (every array's path, dtype and bytes) and of its host
state (the algorithm's tracker or Prefix Sampling state, the task loader, the job
seeds). Runs go one at a time, on one CPU device. With --dry_runs: the `--dry_run`
output of every config in configs/ and of default.py's options.

The digests are rl.checkpoint.saved_digests of this script's repository, which leaves out
a train state's `rng` entry (older train states carried one): `--root` runs another
checkout's train.py (e.g. an older commit's worktree) under the same digest, so the
numbers of old and new code compare.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "smoke": ["--config", "configs/default.py:smoke,steps=3"],
    "smoke_sft_loss": ["--config", "configs/default.py:smoke,steps=3",
                       "--set", "reject_degenerate=False", "--set", "learner.loss.name=sft"],
    "spo_smoke": ["--config", "configs/default.py:spo,smoke,steps=3"],
    # SPO's stream takes the first rollouts to finish and starts the next ones at once,
    # so which rollouts a step trains on (and under which weights they ran) depends on
    # thread timing: two runs of spo_smoke differ. With one rollout per step and one in
    # flight, each rollout starts only when the step asks for it: the same every run.
    "spo_smoke_in_flight_1": ["--config", "configs/default.py:spo,smoke,steps=3",
                              "--set", "batch_tasks=1", "--set", "spo.in_flight=1"],
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device
    return env


def state_digests(workdir: str, step: int) -> dict[str, object]:
    """sha256 of checkpoint `step`'s train state and of its host-state JSON."""
    # Here, not at the top: JAX only for a run's digests (not --dry_runs), and the
    # repository's packages on the path of a script run as a file.
    sys.path.insert(0, ROOT)
    from rl.checkpoint import saved_digests

    train, host, keys = saved_digests(workdir, step)
    return {"train_state": train, "host_state": host, "host_keys": keys}


def run(name: str, args: list[str], workdir: str, root: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "train.py", *args, "--workdir", workdir], cwd=root,
                         env=_env(), capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return state_digests(workdir, 3)


VARIANTS = ["configs/default.py:smoke", "configs/default.py:spo", "configs/default.py:baseline",
            "configs/default.py:adaptive,seed=2", "configs/default.py:server",
            "configs/default.py:smoke,spo,server"]


def dry_runs(root: str) -> dict[str, str]:
    out = {}
    configs = [os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "configs", "*.py"))
               if os.path.basename(p) not in ("common.py", "__init__.py")]
    for rel in sorted(configs) + VARIANTS:
        proc = subprocess.run([sys.executable, "train.py", "--config", rel, "--dry_run",
                               "--workdir", "/tmp/unused"], cwd=root, env=_env(),
                              capture_output=True, text=True)
        # (The launched server's PYTHONPATH names the checkout: the same for any clone.)
        out[rel] = (proc.stdout.replace(root, "<repository>") if proc.returncode == 0
                    else f"rc {proc.returncode}: {proc.stderr[-2000:]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--dry_runs", action="store_true")
    p.add_argument("--root", default=ROOT, help="the checkout whose train.py runs")
    args = p.parse_args()
    root = os.path.abspath(args.root)
    if args.dry_runs:
        result = dry_runs(root)
    else:
        result = {}
        for name in args.runs.split(","):
            with tempfile.TemporaryDirectory() as workdir:
                result[name] = run(name, RUNS[name], workdir, root)
                print(name, json.dumps(result[name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
