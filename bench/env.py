"""Environment throughput: expert episodes on mini-SWE, local vs Docker sandboxes.

    python -m bench.env [--levels 1,4,8,16,32] [--per_slot 2] [--image swe-sandbox:test]
    python -m bench.env --backends local --old 3277056
    python -m bench.env --levels 4 --per_slot 4 --old ''    # fresh vs in-place grading only

The local backend runs twice at each level: this tree's, and the one of `--old` (a
commit, read from git: its env/sandbox/local.py, supervisor program and supervisor.py,
imported beside this tree's; the default, 3277056, started a supervisor process per
command). `local_new_over_old` is the ratio of their episodes/s; `load` is the load
average before and after the run.

Each episode is a whole expert demonstration: a fresh sandbox, every tool call with
its per-step patch, the reward run of the tests, and teardown. For each backend and
concurrency level c, `c * per_slot` episodes run on c threads; a level counts as
clean when every episode ends `finished` with the reward its demo should earn and
no container outlives the run. Prints one JSON object: episodes/s per level, the
largest clean Docker concurrency, and the Docker/local ratio at each level.

Grading: `local` and `docker` rows grade fresh (each episode's patch in a new sandbox,
the default); `local_in_place` and `docker_in_place` grade the same episodes in the
episode's own sandbox, and `fresh_over_in_place` is the ratio of their episodes/s per
backend and level (the cost of fresh grading). `--old ''` leaves out the old local
backend.

Sandboxes over several machines (Ray): bench/scaleout.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

from env.episode import Episode, EpisodeOptions
from env.miniswe import expert_demo, generate_tasks
from env.sandbox import SandboxFactory


def run_episode(factory, task, grading: str = "fresh") -> str:
    """'' when the expert episode ended as it should, else what went wrong."""
    demo = expert_demo(task)
    with Episode(factory, task, EpisodeOptions(grading=grading)) as episode:
        episode.reset()
        episode.play(demo.calls)
        reward = episode.reward()
        if episode.status != "finished" or reward != 1.0:
            return f"{task.instance_id}: {episode.status} reward={reward} {episode.error}"
    return ""


def measure(factory, tasks, concurrency: int, grading: str = "fresh") -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda t: _guarded(factory, t, grading), tasks))
    seconds = time.perf_counter() - start
    errors = [o for o in outcomes if o]
    return {"concurrency": concurrency, "episodes": len(tasks), "seconds": round(seconds, 2),
            "episodes_per_s": round(len(tasks) / seconds, 3), "errors": len(errors),
            "first_error": errors[0] if errors else ""}


def _guarded(factory, task, grading: str) -> str:
    try:
        return run_episode(factory, task, grading)
    except Exception as e:  # noqa: BLE001 - a crash is a benchmark error to report
        return f"{task.instance_id}: {type(e).__name__}: {e}"


def old_local_factory(old: str, root: str):
    """task -> a LocalSandbox of commit `old`, imported as package `sandbox_old` under
    `root`: its local.py, its supervisor's program (supervise.py or supervisor_main.py)
    and (where it has one) supervisor.py side by side, local.py importing that
    supervisor.py, not this tree's."""
    package = os.path.join(root, "sandbox_old")
    os.makedirs(package, exist_ok=True)
    open(os.path.join(package, "__init__.py"), "w").close()
    # The supervisor's program was supervise.py before it was supervisor_main.py; each
    # file keeps its commit's name, by which that commit's supervisor.py starts it.
    for name in ("local", "supervise", "supervisor_main", "supervisor"):
        shown = subprocess.run(["git", "show", f"{old}:env/sandbox/{name}.py"],
                               capture_output=True, text=True)
        if shown.returncode and name != "local":
            continue  # older commits: no supervisor.py (local.py started supervise.py)
        shown.check_returncode()
        src = shown.stdout.replace("from env.sandbox.supervisor import",
                                   "from sandbox_old.supervisor import")
        with open(os.path.join(package, f"{name}.py"), "w") as f:
            f.write(src)
    sys.path.insert(0, root)
    cls = importlib.import_module("sandbox_old.local").LocalSandbox
    if "errors" not in inspect.signature(cls.read_file).parameters:
        cls = _with_read_errors(cls)

    class OldLocal(SandboxFactory):
        def create(self, **spec):
            return cls(**spec)

    return OldLocal("local")


def _with_read_errors(old_cls):
    """A sandbox class that predates read_file's `errors` argument (it always decoded
    with errors="replace"), taking it: the mini-SWE files are UTF-8, which any `errors`
    reads alike."""

    class LocalSandbox(old_cls):
        def read_file(self, path: str, errors: str = "replace") -> str:
            return old_cls.read_file(self, path)

    return LocalSandbox


def measure_local(tasks, levels: list[int], per_slot: int, old: str) -> dict:
    """New local sandboxes graded fresh and in place, and (with `old`) the old ones, one
    after the other at each level."""
    rows: dict = {"local": [], "local_in_place": [], **({"local_old": []} if old else {})}
    with tempfile.TemporaryDirectory() as root:
        factories = {"local": SandboxFactory("local")}
        if old:
            factories["local_old"] = old_local_factory(old, root)
        for c in levels:
            for name, factory in factories.items():
                print(f"{name} c={c}", file=sys.stderr)
                rows[name].append(measure(factory, tasks[:c * per_slot], c))
            print(f"local in place c={c}", file=sys.stderr)
            rows["local_in_place"].append(measure(factories["local"], tasks[:c * per_slot], c,
                                                  "in_place"))
    if old:
        rows["local_new_over_old"] = {
            str(new["concurrency"]): round(new["episodes_per_s"] / was["episodes_per_s"], 2)
            for new, was in zip(rows["local"], rows["local_old"], strict=True)}
    return rows


def fresh_over_in_place(fresh: list[dict], in_place: list[dict]) -> dict[str, float]:
    """episodes/s graded fresh / graded in place, per concurrency level."""
    return {str(f["concurrency"]): round(f["episodes_per_s"] / i["episodes_per_s"], 3)
            for f, i in zip(fresh, in_place, strict=True)}


def docker_factory(image: str, max_concurrency: int):
    """(factory, count of live sandbox containers) or (None, reason) without an engine."""
    try:
        import docker

        from env.sandbox.docker import LABEL

        client = docker.from_env(timeout=120, max_pool_size=2 * max_concurrency)
        client.ping()
        client.images.get(image)
    except Exception as e:  # noqa: BLE001 - no usable engine or image: report, do not crash
        return None, f"{type(e).__name__}: {e}"
    live = lambda: len(client.containers.list(all=True, filters={"label": f"{LABEL}=1"}))
    return SandboxFactory("docker", image=image, client=client, mem_limit="512m"), live


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="1,4,8,16,32")
    parser.add_argument("--per_slot", type=int, default=2)
    parser.add_argument("--image", default="swe-sandbox:test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default="local,docker")
    parser.add_argument("--old", default="3277056",
                        help="commit of the local backend to compare with (per-command "
                             "supervisor)")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    backends = args.backends.split(",")
    tasks = generate_tasks(max(levels) * args.per_slot, seed=args.seed)

    result: dict = {"levels": levels, "per_slot": args.per_slot, "cpus": os.cpu_count(),
                    "load": {"before": os.getloadavg()}, "local": [], "docker": [],
                    "fresh_over_in_place": {}}
    if "local" in backends:
        result.update(measure_local(tasks, levels, args.per_slot, args.old))
        result["fresh_over_in_place"]["local"] = fresh_over_in_place(
            result["local"], result["local_in_place"])

    factory, live = docker_factory(args.image, max(levels)) if "docker" in backends else (
        None, "not asked for (--backends)")
    if factory is None:
        result["docker_unavailable"] = live
    else:
        before = live()
        result["docker_in_place"] = []
        for c in levels:
            for grading, key in (("fresh", "docker"), ("in_place", "docker_in_place")):
                print(f"docker {grading} c={c}", file=sys.stderr)
                row = measure(factory, tasks[:c * args.per_slot], c, grading)
                row["leaked_containers"] = live() - before
                result[key].append(row)
        result["fresh_over_in_place"]["docker"] = fresh_over_in_place(
            result["docker"], result["docker_in_place"])
        pairs = zip(result["docker"], result["docker_in_place"], strict=True)
        clean = [f["concurrency"] for f, i in pairs
                 if not any(r["errors"] or r["leaked_containers"] for r in (f, i))]
        result["docker_max_clean_concurrency"] = max(clean, default=0)
        if result["local"]:
            result["docker_over_local_throughput"] = {
                str(d["concurrency"]): round(d["episodes_per_s"] / lo["episodes_per_s"], 3)
                for d, lo in zip(result["docker"], result["local"], strict=True)}
    result["load"]["after"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
