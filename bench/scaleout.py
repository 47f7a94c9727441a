"""Past one machine: sandboxes placed by Ray, episodes kept on one SGLang server.

    python -m bench.scaleout [--episodes 96] [--concurrency 4] [--sessions 8] [--turns 4]

Sandboxes (local backend, mini-SWE expert episodes, env.sandbox.cluster): episodes/s
with today's local placement and through Ray on one node of a loopback cluster, in
turn 5 times while the cluster runs (medians; `ray_vs_local_1node` is their ratio; the
idle cluster's CPU share beside it), then on new clusters of 2 and 3 nodes
(ray.cluster_utils; on one machine the extra nodes add no CPUs, so this measures the
Ray path's cost, not a speed-up); the per-call overhead (median `read_file` through
Ray minus direct); memory per sandbox of a host actor serving many (USS of the host
processes over their sandboxes) against an actor per sandbox (USS of 8 one-sandbox
actors, and the seconds they took to start).

Serving (two `inference.server` processes with a prefix cache): episodes of `turns`
turns, each turn's prompt the last one's plus its answer; prefix-cache hit rate of the
second and later turns (cached tokens over prompt tokens, as the servers report them)
and seconds per turn, with stickiness (GenerateRequest.session) and without.

Prints one JSON object; `load` is the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request

import psutil
import ray
from ray.cluster_utils import Cluster

from bench.env import measure
from configs import common
from env.miniswe import generate_tasks
from env.sandbox import SandboxFactory
from env.sandbox.cluster import ROOT, SLOT, RayFactory
from inference.engine import GenerateRequest
from inference.launcher import REPOSITORY, LauncherConfig, SGLangLauncher
from inference.sglang import SGLangClient, SGLangConfig

FILES = {"a.py": "x = 1\n"}


def median_ms(fn, *args, n: int = 100) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 3)


def uss_mib(pids) -> float:
    return sum(psutil.Process(p).memory_full_info().uss for p in pids) / 2**20


def host_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "SandboxHost" in " ".join(p.info["cmdline"] or [])]


def actor_per_sandbox(n: int = 8) -> dict:
    """USS and start time of `n` actors holding one local sandbox each."""
    @ray.remote(num_cpus=0, resources={SLOT: 1})
    class OneSandbox:
        def __init__(self):
            self.sandbox = SandboxFactory("local").create(repo_files=FILES)

        def pid(self) -> int:
            return os.getpid()

    t0 = time.perf_counter()
    actors = [OneSandbox.remote() for _ in range(n)]
    pids = ray.get([a.pid.remote() for a in actors])
    seconds = time.perf_counter() - t0
    mib = uss_mib(pids) / n
    for actor in actors:
        ray.kill(actor)
    return {"mib_per_sandbox": round(mib, 1), "start_s": round(seconds, 2)}


def timed(factory, tasks, concurrency: int) -> dict:
    """Episodes/s of `tasks`, after an untimed pass of `concurrency` of them (a new Ray
    node's workers start and import on first use: that is not the path's cost)."""
    measure(factory, tasks[:concurrency], concurrency)
    return measure(factory, tasks, concurrency)


def sandboxes(episodes: int, concurrency: int, rounds: int = 5) -> dict:
    """Local placement and Ray on one node of a running cluster, in turn `rounds` times:
    the median episodes/s of each and their ratio; then Ray on 2 and 3 nodes; the call
    overhead, memory, and the CPU the idle cluster takes during the local rounds."""
    tasks = generate_tasks(episodes, seed=0, difficulties=(0, 1))
    local = SandboxFactory("local")
    direct = local.create(repo_files=FILES)
    direct_ms = median_ms(direct.read_file, "a.py")
    direct.close()
    runs: dict[str, list[dict]] = {"local": [], "ray_1node": []}
    out: dict = {}
    with ray_cluster(1, concurrency) as factory:
        out["idle_cluster_cpu_per_s"] = idle_cpu(10.0)
        for _ in range(rounds):
            runs["local"].append(timed(local, tasks, concurrency))
            runs["ray_1node"].append(timed(factory, tasks, concurrency))
        out.update(call_and_memory(factory, direct_ms, concurrency))
        factory.close()  # its kept slots go back for the actors below
        out["actor_per_sandbox"] = actor_per_sandbox(concurrency)
    for name, results in runs.items():
        rates = [r["episodes_per_s"] for r in results]
        out[name] = {**results[rates.index(statistics.median(rates))], "rounds": rates}
    out["ray_vs_local_1node"] = round(
        out["ray_1node"]["episodes_per_s"] / out["local"]["episodes_per_s"], 3)
    for n in (2, 3):
        with ray_cluster(n, concurrency) as factory:
            out[f"ray_{n}node"] = timed(factory, tasks, concurrency)
    return out


def idle_cpu(seconds: float) -> float:
    """CPU-seconds per second the machine spends while this process sleeps (here: the
    idle Ray cluster's daemons)."""
    before = psutil.cpu_times()
    time.sleep(seconds)
    after = psutil.cpu_times()
    busy = lambda t: t.user + t.system + t.nice
    return round((busy(after) - busy(before)) / seconds, 3)


@contextlib.contextmanager
def ray_cluster(nodes: int, slots: int):
    """A RayFactory of the local backend on a new loopback cluster of `nodes` nodes (one
    CPU and `slots` sandbox slots each), shut down after."""
    cluster = Cluster()
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, resources={SLOT: slots}, object_store_memory=80 << 20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
        factory = RayFactory("local", wait_s=300)
        try:
            yield factory
        finally:
            factory.close()
    finally:
        ray.shutdown()
        cluster.shutdown()


def call_and_memory(factory, direct_ms: float, concurrency: int) -> dict:
    """A sandbox call through Ray against the direct one; USS of the host actor per
    sandbox it serves."""
    held = [factory.create(repo_files=FILES) for _ in range(concurrency)]
    try:
        ray_ms = median_ms(held[0].read_file, "a.py")
        mib = round(uss_mib(host_pids()) / len(held), 1)
    finally:
        for sandbox in held:
            sandbox.close()
    return {"ray_call_ms": ray_ms, "direct_call_ms": direct_ms,
            "ray_call_overhead_ms": round(ray_ms - direct_ms, 3),
            "host_actor_mib_per_sandbox": mib}


SERVER = ("{python} -m inference.server --preset tiny --seed 0 --port {port} --host {host} "
          "--max-batch 8 --max-len 512 --prefix-cache-tokens 8192")


async def episodes(urls, sessions: int, turns: int, sticky: bool) -> dict:
    """Hit rate and seconds per turn of `sessions` concurrent episodes."""
    cached = prompt = 0
    seconds = []

    async def one(i: int) -> None:
        nonlocal cached, prompt
        context = [1 + i, 2, 3, 4] * 8
        for turn in range(turns):
            t0 = time.perf_counter()
            [r] = await client.generate([GenerateRequest(
                context, 8, temperature=1.0, seed=i * 100 + turn,
                session=f"{sticky}-{i}" if sticky else "")])
            seconds.append(time.perf_counter() - t0)
            if turn:
                cached, prompt = cached + r.cached_tokens, prompt + len(context)
            context = context + list(r.output_ids) + [7, 8]

    cfg = SGLangConfig(**{**common.sglang_defaults(), "export_dir": ""})
    async with SGLangClient(urls, cfg) as client:
        await asyncio.gather(*(one(i) for i in range(sessions)))
    return {"second_turn_prefix_hit": round(cached / max(prompt, 1), 3),
            "s_per_turn": round(statistics.mean(seconds), 4)}


def flush_caches(urls) -> None:
    for url in urls:
        urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"),
                               timeout=60).close()


def serving(sessions: int, turns: int) -> dict:
    logs = tempfile.mkdtemp(prefix="scaleout_")
    section = LauncherConfig.from_section(
        SGLangConfig(**{**common.sglang_defaults(), "export_dir": ""}), "", 0, 512)
    servers = [SGLangLauncher(dataclasses.replace(
        section, command=SERVER, env={"PYTHONPATH": REPOSITORY},
        log_path=os.path.join(logs, f"s{i}.log"), startup_timeout=300)) for i in range(2)]
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_healthy()
        urls = [s.url for s in servers]
        asyncio.run(episodes(urls, sessions, turns, sticky=True))  # compiles every shape
        flush_caches(urls)  # each pass finds no prefix of the last one's (same prompts)
        sticky = asyncio.run(episodes(urls, sessions, turns, sticky=True))
        flush_caches(urls)
        loose = asyncio.run(episodes(urls, sessions, turns, sticky=False))
    finally:
        for server in servers:
            server.close()
    return {"second_turn_prefix_hit_sticky": sticky["second_turn_prefix_hit"],
            "second_turn_prefix_hit_not_sticky": loose["second_turn_prefix_hit"],
            "s_per_turn_sticky": sticky["s_per_turn"],
            "s_per_turn_not_sticky": loose["s_per_turn"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--parts", default="sandboxes,serving")
    args = parser.parse_args()
    # SIGTERM unwinds as an exception does: the servers and the Ray cluster started here go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    result: dict = {"cpus": os.cpu_count(), "load": {"before": os.getloadavg()}}
    if "serving" in args.parts:
        print("serving", file=sys.stderr)
        result.update(serving(args.sessions, args.turns))
    if "sandboxes" in args.parts:
        print("sandboxes", file=sys.stderr)
        result.update(sandboxes(args.episodes, args.concurrency))
    result["load"]["after"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
