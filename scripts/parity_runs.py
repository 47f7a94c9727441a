"""Past one machine, the same numbers: short train.py runs placed and routed as a pod
would be, against the same run on one machine with the same seed.

    python scripts/parity_runs.py --out results/scaleout_parity.json [--steps 3]

Pairs (each side `configs/default.py:smoke,steps=N` with COMMON's settings, one CPU
device, a run at a time):
  ray     sandboxes placed by Ray (`env.placement=ray`) on a 3-node loopback cluster
          (ray.cluster_utils, 2 `sandbox_slot`s per node), against local placement;
  router  generation from two launched `inference.server` processes behind SGLang's
          gateway (`:server`, two ports, `engine.sglang.router=start`), against one
          launched server.
For each pair: every logged step's pass rates and losses side by side, the largest
difference, and the SHA-256 digests of the last checkpoint's train state and host state.
Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("sft/loss", "rollout/pass_rate", "rollout/fresh_pass_rate", "learner/loss",
        "learner/pg_loss", "eval/pass_rate")
SLOTS = 2
# Every run: a warm start long enough that some rollouts pass, and the SFT loss on every
# group (degenerate ones too), so that the weights move at every step whatever the rewards.
COMMON = ["sft.steps=60", "reject_degenerate=False", "learner.loss.name=sft"]


def train(workdir: str, config: str, sets: list[str], steps: int) -> dict:
    """One train.py run; its logged rows of KEYS by step, digests and seconds."""
    cmd = [sys.executable, "train.py", "--config", f"configs/default.py:{config},steps={steps}",
           "--workdir", workdir, *[a for s in COMMON + sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            kept = {k: row[k] for k in KEYS if k in row}
            if kept:
                rows.setdefault(row["step"], {}).update(kept)
    sys.path.insert(0, ROOT)
    from rl.checkpoint import saved_digests

    train_sha, host_sha, _ = saved_digests(workdir, steps)
    return {"rows": rows, "train_state": train_sha, "host_state": host_sha,
            "seconds": round(seconds, 1)}


def compare(one: dict, other: dict) -> dict:
    """The largest difference of a metric both runs logged at a step, and the (step, key)
    pairs only one of them logged."""
    a, b = one["rows"], other["rows"]
    pairs = {(s, k) for rows in (a, b) for s, row in rows.items() for k in row}
    both = sorted(p for p in pairs if p[1] in a.get(p[0], {}) and p[1] in b.get(p[0], {}))
    diffs = [abs(a[s][k] - b[s][k]) for s, k in both]
    return {"max_abs_diff": max(diffs) if diffs else None,
            "logged_by_one_only": [list(p) for p in sorted(pairs.difference(both))],
            "rows_identical": a == b,
            "train_state_equal": one["train_state"] == other["train_state"],
            "host_state_equal": one["host_state"] == other["host_state"]}


def ray_pair(tmp: str, steps: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from env.sandbox.cluster import SLOT

    local = train(os.path.join(tmp, "local"), "smoke", [], steps)
    cluster = Cluster()
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1, resources={SLOT: SLOTS}, include_dashboard=False,
                             object_store_memory=80 << 20)
        cluster.wait_for_nodes()
        placed = train(os.path.join(tmp, "ray"), "smoke",
                       ["env.placement=ray", f"env.ray_address={cluster.address}"], steps)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"one_machine": local, "ray_3_nodes": placed, **compare(local, placed)}


def router_pair(tmp: str, steps: int) -> dict:
    one = train(os.path.join(tmp, "server1"), "smoke,server",
                ["engine.sglang.ports=(31000,)"], steps)
    two = train(os.path.join(tmp, "server2"), "smoke,server",
                ["engine.sglang.ports=(31000,31001)", "engine.sglang.router=start"], steps)
    return {"one_server": one, "two_servers_router": two, **compare(one, two)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pairs", default="ray,router")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    out = {"steps": args.steps, "load_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.pairs.split(","):
            out[name] = {"ray": ray_pair, "router": router_pair}[name](tmp, args.steps)
    out["load_end"] = os.getloadavg()
    text = json.dumps(out, indent=1, sort_keys=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
