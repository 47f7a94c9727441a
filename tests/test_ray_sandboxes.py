"""Sandboxes placed by Ray over a real 3-node cluster on loopback (ray.cluster_utils),
each node running the Docker backend against its own engine: nodes 0 and 2 the default
engine, node 1 the second dockerd of scripts/start_second_dockerd.sh; 3 + 3 + 2 slots.

References: each engine's own container list, the Ray nodes the sandboxes report, the
expert demonstrations' rewards (every mini-SWE demo earns 1), a node removed without
grace (its raylet and workers killed), a driver process killed with SIGKILL.
"""

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time

import docker
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table
from sandbox_backends import ensure_image

import env.sandbox.cluster
from env.episode import Episode
from env.grading import grade_patch
from env.miniswe import expert_demo, generate_tasks
from env.sandbox import SandboxError, SandboxFactory
from env.sandbox.cluster import SLOT, RayFactory
from env.sandbox.docker import OWNER_LABEL, docker_host, owner_identity
from env.sandbox.pool import SandboxPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECOND = os.path.join(ROOT, "scripts", "start_second_dockerd.sh")
SLOTS = (3, 3, 2)
FILES = {"a.py": "x = 1\n"}
pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def cluster(docker_client):
    """(cluster, its nodes, engine URL per node id, image)."""
    image = ensure_image(docker_client)
    second = subprocess.run([SECOND], check=True, capture_output=True, text=True,
                            timeout=600).stdout.strip()
    engines = (docker_host(), second, docker_host())
    cluster = Cluster()
    nodes = [cluster.add_node(num_cpus=1, resources={SLOT: slots},
                              object_store_memory=80 << 20, include_dashboard=False,
                              env_vars={"DOCKER_HOST": engine})
             for slots, engine in zip(SLOTS, engines, strict=True)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        yield cluster, nodes, {n.node_id: e for n, e in zip(nodes, engines, strict=True)}, image
    finally:
        ray.shutdown()
        cluster.shutdown()


def containers(url: str, labels: dict) -> list[str]:
    client = docker.DockerClient(base_url=url, timeout=30)
    try:
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        return [c["Id"] for c in client.api.containers(all=True, filters=filters)]
    finally:
        client.close()


def test_placement_spreads_waits_for_a_slot_and_keeps_exception_types(cluster):
    _, nodes, engines, image = cluster
    factory = RayFactory("docker", image=image, mem_limit="512m", wait_s=120)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            sandboxes = list(pool.map(lambda _: factory.create(repo_files=FILES), range(8)))
        per_node = {n.node_id: [s for s in sandboxes if s.node == n.node_id] for n in nodes}
        assert sorted(len(v) for v in per_node.values()) == sorted(SLOTS), per_node
        assert factory.metrics()["env/slots_free"] == 0
        for node, held in per_node.items():  # each on its own node's engine
            ids = containers(engines[node], factory.labels)
            assert len(ids) >= len(held)
        assert len(containers(engines[nodes[1].node_id], factory.labels)) == SLOTS[1]
        assert all(s.run("cat a.py").output == "x = 1\n" for s in sandboxes)

        # Exceptions raised inside a sandbox keep their types.
        with pytest.raises(FileNotFoundError):
            sandboxes[0].read_file("missing.py")
        with pytest.raises(ValueError):
            sandboxes[0].read_file("../outside.py")
        with pytest.raises(ValueError):
            sandboxes[0].apply_patch("not a patch\n")

        # The 9th waits for a slot, and runs once one is freed.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ninth = pool.submit(factory.create, repo_files=FILES)
            time.sleep(3)
            assert not ninth.done()
            freed = sandboxes.pop()
            freed.close()
            ninth = ninth.result(timeout=60)
        assert ninth.node == freed.node and ninth.run("echo ok").output == "ok\n"
        sandboxes.append(ninth)

        # A full cluster fails clearly past wait_s.
        factory.wait_s = 1.0
        with pytest.raises(SandboxError, match=r"no Ray node had a free sandbox_slot within 1s"):
            factory.create(repo_files=FILES)
        for sandbox in sandboxes:
            sandbox.close()
        with pytest.raises(SandboxError, match="closed"):
            sandboxes[0].run("true")
    finally:
        factory.close()
    for url in set(engines.values()):
        assert containers(url, factory.labels) == []


def test_local_backend_over_the_nodes(cluster, monkeypatch):
    _, nodes, _, _ = cluster
    # Long enough that no kept slot expires before the reuse is checked on a loaded machine.
    monkeypatch.setattr(env.sandbox.cluster, "IDLE_SLOT_S", 10.0)
    factory = RayFactory("local", wait_s=120)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            sandboxes = list(pool.map(lambda _: factory.create(repo_files=FILES), range(8)))
        assert {s.node for s in sandboxes} == {n.node_id for n in nodes}
        sandboxes[0].write_file("b.py", "y = 2\n")
        assert "b.py" in sandboxes[0].patch()
        assert sandboxes[1].run("python3 -c 'import a; print(a.x)'").output == "1\n"
        assert sandboxes[2].real_root() == sandboxes[2].run("pwd -P").output.strip()
        for sandbox in sandboxes:
            sandbox.close()
        # The freed slots stay with the factory for its next sandboxes (no new placement
        # group), and go back to the cluster once idle IDLE_SLOT_S.
        groups = set(placement_group_table())
        assert factory.metrics()["env/slots_kept"] == 8
        again = factory.create(repo_files=FILES)
        assert again.node == sandboxes[-1].node and set(placement_group_table()) <= groups
        assert factory.metrics()["env/slots_kept"] == 7
        again.close()
        wait_for(lambda: factory.metrics()["env/slots_free"] == 8, timeout=60)
        assert factory.metrics()["env/slots_kept"] == 0
        # Sandboxes made without a total memory bound are counted on their nodes and
        # reported by the trainer's factory, as this machine's own factory counts them.
        direct = SandboxFactory("local")
        for _ in range(len(sandboxes)):
            direct.create(repo_files=FILES).close()
        assert factory.metrics()["env/no_memory_cgroup"] == direct.metrics()[
            "env/no_memory_cgroup"]
        # Fresh grading runs on a node in one call (the host's own grade_patch), with the
        # grades this machine's sandboxes give, and gives its slot back.
        task = generate_tasks(1, seed=3)[0]
        episode_sandbox = factory(task)
        monkeypatch.setattr(factory, "create", lambda **_: pytest.fail("graded from here"))
        for patch, reward in ((task.gold_patch, 1.0), ("", 0.0)):
            graded, here = (grade_patch(task, patch, f, 60) for f in (factory, direct))
            assert (graded.reward, graded.error) == (here.reward, here.error) == (reward, "")
        # In a rollout: the episode's sandbox closes first, its pool slot kept for grading.
        pool = SandboxPool(factory, 1)
        assert grade_patch(task, task.gold_patch, pool.grader(episode_sandbox), 60).reward == 1
        with pytest.raises(SandboxError, match="closed"):
            episode_sandbox.run("true")
        assert factory.metrics()["env/slots_free"] + factory.metrics()["env/slots_kept"] == 8
    finally:
        factory.close()


DRIVER = """
import sys, time
import ray
ray.init(address=sys.argv[1], logging_level="WARNING")
from env.sandbox.cluster import RayFactory
factory = RayFactory("docker", image=sys.argv[2], mem_limit="512m")
held = [factory.create(repo_files={"a.py": ""}) for _ in range(3)]
print("ready", flush=True)
time.sleep(600)
"""


def test_sigkilled_trainer_containers_go_when_the_next_one_starts(cluster):
    ray_cluster, _, engines, image = cluster
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, ray_cluster.address, image], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        owner = owner_identity(proc.pid)
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    urls = set(engines.values())
    assert sum(len(containers(url, {OWNER_LABEL: owner})) for url in urls) == 3
    RayFactory("docker", image=image).close()  # the next run: its hosts start on every node
    assert all(containers(url, {OWNER_LABEL: owner}) == [] for url in urls)


def run_episode(factory, task, where: dict) -> tuple[str, float | None, str]:
    """(status, reward, node) of the task's expert demonstration (for a sandbox that
    could not be made, the error, which names its node); `where` holds (node, calls still
    to make) under the task's id while it runs."""
    with Episode(factory, task) as episode:
        episode.reset()
        node = episode.sandbox.node if episode.sandbox is not None else episode.error
        calls = expert_demo(task).calls
        for i, call in enumerate(calls):
            where[task.instance_id] = (node, len(calls) - i)
            if episode.done:
                break
            episode.step(call)
        where[task.instance_id] = (node, 0)
        return episode.status, episode.reward(), node


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_killed_node_turns_its_episodes_into_env_errors(cluster):
    """12 expert episodes, 8 at a time; node 1 is killed (no grace) once 4 have ended and
    one on it has at least 2 calls to make. Its episodes (and a sandbox being made on it
    then) end env_error with no reward; the others, and those that start after, finish
    with reward 1 on the other nodes."""
    ray_cluster, nodes, engines, image = cluster
    victim = nodes[1].node_id
    factory = RayFactory("docker", image=image, mem_limit="512m", wait_s=120)
    tasks = generate_tasks(12, seed=7, difficulties=(0, 1))
    where: dict = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(run_episode, factory, t, where) for t in tasks]
            wait_for(lambda: sum(f.done() for f in futures) >= 4
                     and any(n == victim and k >= 2 for n, k in list(where.values())))
            ray_cluster.remove_node(nodes[1], allow_graceful=False)
            results = [f.result() for f in futures]  # no episode raises
    finally:
        factory.close()
        for container in containers(engines[victim], factory.labels):  # the dead node's
            with contextlib.suppress(docker.errors.NotFound):
                docker.DockerClient(base_url=engines[victim]).api.remove_container(
                    container, force=True)
    failed = [r for r in results if r[0] == "env_error"]
    assert failed and all(victim[:12] in r[2] and r[1] is None for r in failed), results
    rest = [r for r in results if r[0] != "env_error"]
    assert len(rest) + len(failed) == 12
    assert all(r[:2] == ("finished", 1.0) for r in rest), rest
