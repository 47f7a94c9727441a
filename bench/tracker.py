"""SPO tracker update latency at scale: 1,000,000 tracked prompts, a 4096-sample batch.

    python -m bench.tracker [--prompts 1000000] [--batch 4096] [--dup_frac 0.1] [--reps 100]

update() is timed end to end (index lookup, duplicate passes, rho from D, Eq. 5), next to
values() and to a plain per-sample Python loop doing the same update on the same state.
Wall and CPU time are both reported; on a loaded machine (see load_avg_1min) the CPU
time is the cost of the call itself.
Prints one JSON object; progress goes to stderr.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from configs import common
from rl.tracker import BetaTracker, SPOConfig


def batch_ids(rng, ids, batch, dup_frac):
    """batch ids: distinct prompts plus dup_frac repeats of some of them, shuffled."""
    n_dup = int(batch * dup_frac)
    distinct = rng.choice(len(ids), batch - n_dup, replace=False)
    picks = np.concatenate([distinct, rng.choice(distinct, n_dup)])
    return [ids[i] for i in rng.permutation(picks)]


def loop_update(tracker, ids, rewards, D):
    """The same update, one sample at a time."""
    index, alpha, beta = tracker._index, tracker.alpha, tracker.beta
    for t, r, d in zip(ids, rewards.tolist(), D.tolist(), strict=True):
        row = index[t]
        rho = min(max(2.0 ** (-d / tracker.d_half), tracker.rho_min), tracker.rho_max)
        alpha[row] = rho * alpha[row] + r
        beta[row] = rho * beta[row] + (1.0 - r)


def timed(fn, reps):
    """(wall_ms[reps], cpu_ms[reps]); CPU time excludes time the process sat descheduled,
    which dominates wall time on a shared machine."""
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    return np.array(wall), np.array(cpu)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dup_frac", type=float, default=0.1)
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args()
    rng = np.random.default_rng(0)

    t0 = time.perf_counter()
    ids = [f"task-{i:07d}" for i in range(args.prompts)]
    tracker = BetaTracker(SPOConfig(**common.spo_defaults()))
    tracker.init_offline(ids, rng.integers(0, 9, args.prompts), n0=8, form="paper")
    init_s = time.perf_counter() - t0
    print(f"tracked {len(tracker)} prompts in {init_s:.1f}s", file=sys.stderr)

    batches = [(batch_ids(rng, ids, args.batch, args.dup_frac),
                rng.integers(0, 2, args.batch), rng.exponential(0.05, args.batch))
               for _ in range(8)]
    it = iter(range(10**9))

    def step():
        b = batches[next(it) % len(batches)]
        tracker.update(b[0], b[1], D=b[2])

    def read():
        tracker.values(batches[next(it) % len(batches)][0])

    def loop():
        b = batches[next(it) % len(batches)]
        loop_update(tracker, *b)

    for fn in (step, read, loop):  # warm-up
        fn()
    update_ms, update_cpu = timed(step, args.reps)
    values_ms, values_cpu = timed(read, args.reps)
    loop_ms, loop_cpu = timed(loop, args.reps)
    med = lambda x: round(float(np.median(x)), 3)
    print(f"update median {med(update_ms)} ms wall, {med(update_cpu)} ms cpu", file=sys.stderr)
    out = {
        "prompts": args.prompts,
        "batch": args.batch,
        "duplicates": int(args.batch * args.dup_frac),
        "reps": args.reps,
        "update_ms": med(update_ms),
        "update_ms_min": round(float(update_ms.min()), 3),
        "update_ms_p90": round(float(np.percentile(update_ms, 90)), 3),
        "update_cpu_ms": med(update_cpu),
        "values_ms": med(values_ms),
        "values_cpu_ms": med(values_cpu),
        "python_loop_update_ms": med(loop_ms),
        "python_loop_update_cpu_ms": med(loop_cpu),
        "speedup_vs_loop_cpu": round(float(np.median(loop_cpu) / np.median(update_cpu)), 2),
        "target_ms": 5.0,
        "meets_target_wall": bool(np.median(update_ms) < 5.0),
        "meets_target_cpu": bool(np.median(update_cpu) < 5.0),
        "init_s": round(init_s, 2),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
