"""mini-SWE acceptance sweep: every generated task through real sandboxes of each backend.

    python -m bench.miniswe [--tasks 200] [--seed 2024] [--backends local,docker]
                            [--threads 8] [--image swe-sandbox:test]

Per task, in the expert's sandbox: the untouched repo grades 0, the expert's
demonstration finishes with reward 1, then, reset to the base tree, the gold patch
grades 1; every 5th task also runs an imperfect demonstration (reward 0) in a sandbox
of its own. Prints one JSON object (tasks, seconds and problems per backend) and
exits 1 when any task went wrong. tests/test_miniswe.py runs the same checks on a
stratified sample of these tasks.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import time

from env.episode import Episode
from env.grading import grade
from env.miniswe import expert_demo, generate_tasks
from env.sandbox import SandboxFactory


def run_demo(factory, task, demo, checks=None) -> list[str]:
    """Runs a demo in a fresh episode; `checks(sandbox, before)` runs before the demo in
    the episode's sandbox, and after a demo that scored as it should in a new one of the
    same task. Returns what went wrong."""
    with Episode(factory, task) as episode:
        episode.reset()
        if episode.status == "env_error":
            return [f"env_error at reset: {episode.error}"]
        problems = checks(episode.sandbox, before=True) if checks else []
        episode.play(demo.calls)
        reward = episode.reward()
        demo_ok = episode.status == "finished" and reward == float(demo.correct)
        if not demo_ok:
            problems.append(f"demo correct={demo.correct} ({demo.mistake}): "
                            f"{episode.status} reward={reward} {episode.error}")
    if checks and demo_ok:  # in a new sandbox: fresh grading closed the episode's
        with factory(task) as sandbox:
            problems += checks(sandbox, before=False)
    return problems


def check_task(factory, task, index: int, imperfect: bool) -> list[str]:
    """Untouched -> 0, expert -> 1 (graded fresh), then in a new sandbox reset to the base
    tree: gold -> 1; with `imperfect`, also the imperfect demo of rng seed `index` -> 0
    in a sandbox of its own. Returns what went wrong, each prefixed by the task id."""

    def gold_and_untouched(sandbox, before):
        if before:
            return [] if grade(task, sandbox)[0] == 0.0 else ["untouched repo passes"]
        sandbox.run("git reset -q --hard && git clean -fdq")
        if sandbox.patch() != "":
            return ["reset to the base tree failed"]
        sandbox.apply_patch(task.gold_patch)
        return [] if grade(task, sandbox)[0] == 1.0 else ["gold patch fails"]

    problems = run_demo(factory, task, expert_demo(task), gold_and_untouched)
    if imperfect:
        problems += run_demo(factory, task, expert_demo(task, True, random.Random(index)))
    return [f"{task.instance_id}: {p}" for p in problems]


def sweep(factory, tasks, indices, imperfect, threads: int = 8) -> list[str]:
    """check_task of each `tasks[i]` for i in `indices` on `threads` threads, with an
    imperfect demo where `imperfect(i)`; every problem found."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        results = pool.map(lambda i: check_task(factory, tasks[i], i, imperfect(i)), indices)
        return [p for r in results for p in r]


def main() -> None:
    from bench.env import docker_factory

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--backends", default="local,docker")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--image", default="swe-sandbox:test")
    args = parser.parse_args()
    tasks = generate_tasks(args.tasks, seed=args.seed)
    result: dict = {"tasks": args.tasks, "seed": args.seed}
    failed = False
    for backend in args.backends.split(","):
        if backend == "docker":
            factory, why = docker_factory(args.image, args.threads)
            if factory is None:
                result["docker"] = {"unavailable": why}
                failed = True
                continue
        else:
            factory = SandboxFactory(backend)
        print(f"{backend}: {args.tasks} tasks", file=sys.stderr)
        start = time.perf_counter()
        problems = sweep(factory, tasks, range(len(tasks)), lambda i: i % 5 == 0, args.threads)
        result[backend] = {"seconds": round(time.perf_counter() - start, 1),
                           "problems": len(problems), "first_problems": problems[:5]}
        failed |= bool(problems)
    print(json.dumps(result))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
