"""Sandboxes over two real Docker engines: the default one and a second dockerd that
scripts/start_second_dockerd.sh starts with its own socket, data root and exec root.

References: each engine's own container list, the expert demonstrations' rewards
(every mini-SWE demo earns 1), SIGKILL of the second engine's dockerd.
"""

import concurrent.futures
import contextlib
import os
import subprocess
import time

import docker
import pytest
from sandbox_backends import ensure_image

from env.episode import Episode
from env.miniswe import expert_demo, generate_tasks
from env.sandbox import FleetFactory
from env.sandbox.docker import docker_host
from env.sandbox.fleet import OWNER_LABEL, reap_exited_owners

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "start_second_dockerd.sh")
pytestmark = pytest.mark.docker


def start_second() -> str:
    return subprocess.run([SCRIPT], check=True, capture_output=True, text=True,
                          timeout=600).stdout.strip()


@pytest.fixture(scope="module")
def engines(docker_client):
    image = ensure_image(docker_client)
    second = start_second()
    yield [docker_host(), second], image
    subprocess.run([SCRIPT, "--stop"], check=True, timeout=120)


def run_episode(factory, task, left: dict | None = None) -> tuple[str, float | None, str]:
    """(status, reward, engine URL) of the task's expert demonstration; `left`, if given,
    holds (engine, calls still to make) under the task's id while it runs."""
    with Episode(factory, task) as episode:
        episode.reset()
        engine = episode.sandbox.engine if episode.sandbox is not None else ""
        calls = expert_demo(task).calls
        for i, call in enumerate(calls):
            if left is not None:
                left[task.instance_id] = (engine, len(calls) - i)
            if episode.done:
                break
            episode.step(call)
        if left is not None:
            left[task.instance_id] = (engine, 0)
        return episode.status, episode.reward(), engine


def ours(url: str, owner: str) -> list:
    client = docker.DockerClient(base_url=url, timeout=30)
    try:
        return client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={owner}"})
    finally:
        client.close()


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_episodes_over_two_engines_survive_losing_one(engines):
    """24 episodes, 8 at a time, over two engines of 4 sandboxes; the second engine is
    killed once it holds an episode in progress and 6 have ended; then 8 more after its
    restart."""
    (first, second), image = engines
    factory = FleetFactory([first, second], 4, probe_s=0.5, image=image, mem_limit="512m")
    fleet = factory.fleet
    tasks = generate_tasks(32, seed=5, difficulties=(0, 1))
    results = []
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            left = {}
            futures = [pool.submit(run_episode, factory, t, left) for t in tasks[:24]]
            # Kill the second engine once 6 episodes have ended and one on it still has
            # at least 2 calls to make (so it meets the dead engine, however fast it runs).
            wait_for(lambda: sum(f.done() for f in futures) >= 6
                     and any(e == second and n >= 2 for e, n in list(left.values())))
            subprocess.run([SCRIPT, "--stop"], check=True, timeout=120)
            results = [f.result() for f in futures]  # no episode raises
        failed = [r for r in results if r[0] == "env_error"]
        assert failed, "the killed engine held live episodes"
        assert all(r[2] == second and r[1] is None for r in failed), failed
        on_first = [r for r in results if r[2] == first]
        assert len(on_first) >= 12 and all(r[:2] == ("finished", 1.0) for r in on_first)
        assert {r[2] for r in results} == {first, second}
        assert fleet.metrics()["env/engine1/up"] == 0.0
        assert fleet.metrics()["env/engine1/errors"] >= 0

        # Restarted, the engine is probed back, its stale containers removed, and used.
        start_second()
        wait_for(lambda: fleet.metrics()["env/engine1/up"] == 1.0)
        assert ours(second, fleet.owner) == []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            again = list(pool.map(lambda t: run_episode(factory, t), tasks[24:]))
        assert all(r[:2] == ("finished", 1.0) for r in again)
        assert {r[2] for r in again} == {first, second}
    finally:
        factory.close()
    assert ours(first, fleet.owner) == [] and ours(second, fleet.owner) == []


def test_containers_of_exited_owners_are_removed_on_every_engine(engines):
    """A container labelled with a process of this host that has exited (a trainer
    killed with SIGKILL) goes at the next start; a live owner's stays."""
    (first, second), image = engines
    start_second()
    exited = subprocess.run(["python3", "-c", "from env.sandbox.fleet import owner_identity; "
                             "print(owner_identity())"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    clients = [docker.DockerClient(base_url=url, timeout=30) for url in (first, second)]
    made = []
    try:
        for client in clients:
            for owner in (exited, "another-host:1:1"):
                made.append(client.containers.create(image, ["true"],
                                                     labels={OWNER_LABEL: owner}))
        FleetFactory([first, second], 2, image=image).close()
        left = {c.id for client in clients
                for c in client.containers.list(all=True, filters={"label": OWNER_LABEL})}
        assert made[0].id not in left and made[2].id not in left  # exited owner: removed
        assert made[1].id in left and made[3].id in left  # not an owner of this host
        assert reap_exited_owners(clients[0]) == 0
    finally:
        for container in made:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        for client in clients:
            client.close()
