"""Sandboxes placed by Ray: every host of a Ray cluster advertises `sandbox_slot`
resources and runs the local or Docker backend against its own engine.

    ray start --head --resources='{"sandbox_slot": 64}'               # first host
    ray start --address=HEAD_IP:6379 --resources='{"sandbox_slot": 64}'  # every other
    factory = RayFactory("docker", address="auto", image="swe-sandbox:test")

Placement: each sandbox holds one slot through a one-bundle placement group
{"sandbox_slot": 1} that Ray's scheduler puts on a node with a free slot; while none
has one, `create` waits (up to `wait_s`, then SandboxError naming the cluster's
slots). A closed sandbox's slot stays with the factory for its next `create` (no
round trip to Ray's scheduler) unless a `create` is waiting for one or it has been
idle IDLE_SLOT_S; then it goes back to the cluster. The sandbox itself lives in its
node's host: one threaded SandboxHost actor per node and factory, serving every sandbox
of the factory on that node. (An actor per sandbox costs a Ray worker process per
sandbox: ~55 MiB each, and seconds to start on a loaded machine; one per node costs
~26-31 MiB per sandbox it serves, for the same ~1.5 ms per call: bench/scaleout.py.)

Failures: when a node (or its host) dies, every call of its sandboxes raises HostLost, a
SandboxError (an env_error for their episodes, never a reward). An exception raised
inside a sandbox (FileNotFoundError, ValueError, PatchTooLarge, ...) reaches the caller
with its own type.

Leftovers: a host that starts removes what exited runs left on its node: for Docker,
the containers whose owner (OWNER_LABEL: the trainer's host, pid and start time) ran on
the trainer's host and has exited (a trainer killed with SIGKILL; owners are judged
by the trainer, the only one that sees its own host's processes); for local, the
sandbox directories of exited processes.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, NamedTuple

import ray
import ray.exceptions
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from env.grading import Grade, grade_patch
from env.sandbox import base, docker, local
from env.sandbox.factory import FACTORY_LABEL, SandboxFactory
from env.tasks import Task

log = logging.getLogger(__name__)

SLOT = "sandbox_slot"
# Every module of the project is importable on every host: the hosts share the checkout
# (the same path, as a cluster's shared filesystem gives).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Calls a host serves at once (threads of the actor): past every sandbox a node holds.
HOST_CONCURRENCY = 1024
# A slot a closed sandbox left is kept this long for the factory's next sandbox, then
# returned to the cluster (for other runs sharing it).
IDLE_SLOT_S = 10.0


class SandboxHost:
    """The sandboxes of one factory on one node (a Ray actor): made by a SandboxFactory
    of the node's backend carrying the trainer's factory labels."""

    def __init__(self, backend: str, defaults: dict[str, Any], labels: dict[str, str]):
        self.factory = SandboxFactory(backend, **defaults)
        self.factory.id, self.factory.labels = labels[FACTORY_LABEL], labels
        self.live: dict[int, base.Sandbox] = {}

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def leftovers(self) -> list[str]:
        """Removes the sandbox directories of exited processes (local); returns the
        owners of this node's containers (docker), for the trainer to judge."""
        if self.factory.backend == "local":
            local.reap_stale()
            return []
        return sorted(docker.container_owners(docker.connect()))

    def metrics(self) -> dict[str, float]:
        return self.factory.metrics()

    def remove_owned(self, owners: list[str]) -> int:
        return docker.remove_owned(docker.connect(), owners)

    def create(self, key: int, spec: dict[str, Any]) -> None:
        self.live[key] = self.factory.create(**spec)

    def grade(self, task: Task, patch: str, timeout: float) -> Grade:
        return grade_patch(task, patch, self.factory, timeout)

    def call(self, key: int, method: str, *args: Any) -> Any:
        sandbox = self.live.get(key)
        if sandbox is None:
            raise base.SandboxError("sandbox is closed")
        return getattr(sandbox, method)(*args)

    def close(self, key: int) -> None:
        sandbox = self.live.pop(key, None)
        if sandbox is not None:
            sandbox.close()

    def shutdown(self) -> None:
        """Closes every sandbox of the factory on this node and removes its containers."""
        for key in list(self.live):
            self.close(key)
        self.factory.close()


class Slot(NamedTuple):
    """One `sandbox_slot`, held by a one-bundle placement group on `node`."""

    group: PlacementGroup
    node: str
    idle_since: float = 0.0
    lost: bool = False  # a call to its node failed: not to be kept


class HostLost(base.SandboxError):
    """The node or host actor that was to serve a call is gone."""


def _ray_call(ref: ray.ObjectRef, what: str, timeout: float | None = None) -> Any:
    """The value of `ref`: an exception raised in the sandbox with its own type; a lost
    node, host or reply as HostLost."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, Exception):
            raise e.cause from None
        raise base.SandboxError(f"{what}: {e}") from e
    except (ray.exceptions.RayError, TimeoutError) as e:
        raise HostLost(f"{what}: its ray node or host was lost ({e!r})") from e


class RaySandbox(base.Sandbox):
    """A sandbox in the host actor of the node its slot is on."""

    def __init__(self, host, key: int, slot: Slot, on_close):
        self._host, self._key, self._slot, self._on_close = host, key, slot, on_close
        self.node = slot.node

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self._slot is None:
            raise base.SandboxError("sandbox is closed")
        return _ray_call(self._host.call.remote(self._key, method, *args),
                         f"sandbox {method} on node {self.node[:12]}", timeout)

    def run(self, cmd: str, timeout: float = 60.0) -> base.ExecResult:
        return self._call("run", cmd, timeout, timeout=timeout + docker.HOST_GRACE_S)

    def read_file(self, path: str, errors: str = "replace") -> str:
        return self._call("read_file", path, errors)

    def write_file(self, path: str, content: str) -> None:
        self._call("write_file", path, content)

    def patch(self) -> str:
        return self._call("patch")

    def apply_patch(self, patch: str) -> None:
        self._call("apply_patch", patch)

    def snapshot(self) -> tuple[str, list[str]]:
        return self._call("snapshot")

    def real_root(self) -> str:
        return self._call("real_root")

    def close(self) -> None:
        """Closes the sandbox on its node (a lost node took it along) and frees the slot."""
        slot, self._slot = self._slot, None
        if slot is None:
            return
        try:
            _ray_call(self._host.close.remote(self._key), f"closing a sandbox on {self.node[:12]}")
        except base.SandboxError as e:
            log.warning("%s; what it left goes when its node's host next starts", e)
            slot = slot._replace(lost=True)
        finally:
            self._on_close(slot)


class RayFactory(SandboxFactory):
    """task -> a sandbox of `backend` placed by Ray on a node with a free `sandbox_slot`.

    address: the cluster ("auto": the one `ray start` joined this host to; "" starts a
    single-node Ray here with `local_slots` slots). `defaults` are backend arguments as
    for SandboxFactory, sent to every node (so no client objects).
    """

    def __init__(self, backend: str, address: str = "auto", *, local_slots: int = 8,
                 wait_s: float = 600.0, **defaults: Any):
        super().__init__(backend, **defaults)
        if "client" in defaults:
            raise ValueError("a Ray-placed sandbox uses its node's own docker engine: no client=")
        if not ray.is_initialized():
            runtime_env = {"env_vars": {"PYTHONPATH": ROOT}}
            if address:
                ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
            else:
                ray.init(resources={SLOT: local_slots}, runtime_env=runtime_env,
                         include_dashboard=False, logging_level=logging.WARNING)
        self.wait_s = wait_s
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._hosts: dict[str, Any] = {}
        self._live: dict[str, int] = {}  # node id -> live sandboxes
        self._idle: list[Slot] | None = []  # free slots kept; None once closed
        self._waiting = 0  # creates waiting for Ray to place a slot
        self._expiry: threading.Timer | None = None  # returns kept slots IDLE_SLOT_S on
        self._remote_host = ray.remote(SandboxHost)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(SLOT)]
        if not nodes:
            raise base.SandboxError(f"no node of the Ray cluster at {address or 'local'!r} "
                                    f"offers {SLOT!r} resources (ray start --resources=...)")
        for node in nodes:  # each host removes what exited runs left on its node
            self._host(node)
        log.info("ray sandboxes: %d nodes, %d slots", len(nodes), self.metrics()["env/slots"])

    def _host(self, node: str):
        """The node's host actor, started (and its node's leftovers removed) on first use."""
        with self._lock:
            host = self._hosts.get(node)
            if host is not None:
                return host
            host = self._remote_host.options(
                num_cpus=0, max_concurrency=HOST_CONCURRENCY, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(self.backend, self.defaults, self.labels)
            self._hosts[node] = host
        what = f"starting the sandbox host of node {node[:12]}"
        owners = _ray_call(host.leftovers.remote(), what)
        exited = sorted(docker.exited_owners(owners))
        if exited:
            removed = _ray_call(host.remove_owned.remote(exited), what)
            log.info("node %s: removed %d containers of exited runs", node[:12], removed)
        return host

    def create(self, **spec: Any) -> RaySandbox:
        """A sandbox on the node Ray gives a free slot (waits up to `wait_s` for one)."""
        key = next(self._keys)
        _, host, slot = self._on_a_slot(lambda host: host.create.remote(key, spec),
                                        "creating a sandbox")
        with self._lock:
            self._live[slot.node] = self._live.get(slot.node, 0) + 1
        return RaySandbox(host, key, slot, self._closed)

    def grade_patch(self, task: Task, patch: str, timeout: float) -> Grade:
        """env.grading.grade_patch, run by the host of a node with a free slot in a new
        sandbox there: one round trip, where grading through a RaySandbox makes one per
        command (the grader's sandbox holds the slot while it grades)."""
        result, _, slot = self._on_a_slot(
            lambda host: host.grade.remote(task, patch, timeout), "grading a patch")
        self._give_back(slot)
        return result

    def _on_a_slot(self, submit, what: str) -> tuple[Any, Any, Slot]:
        """(the value of submit(host), host, slot) on the host of a free slot's node (see
        create); on failure the slot goes back. A kept slot whose node is gone is removed,
        and another one taken."""
        while True:
            slot, kept = self._take_slot()
            try:
                host = self._host(slot.node)
                return _ray_call(submit(host), f"{what} on node {slot.node[:12]}"), host, slot
            except HostLost:
                remove_placement_group(slot.group)
                if kept:
                    continue
                raise
            except BaseException:
                self._give_back(slot)
                raise

    def _take_slot(self) -> tuple[Slot, bool]:
        """(a slot, whether it was kept from a closed sandbox): a kept one if any, else one
        Ray's scheduler places on a node with a free slot."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
            self._waiting += 1
        group = placement_group([{SLOT: 1}])
        try:
            _ray_call(group.ready(), "placing a sandbox", timeout=self.wait_s)
        except base.SandboxError:
            remove_placement_group(group)
            m = self.metrics()
            raise base.SandboxError(
                f"no Ray node had a free {SLOT} within {self.wait_s:.0f}s ({m['env/slots']:.0f} "
                f"slots on {m['env/nodes']:.0f} nodes, {m['env/slots_free']:.0f} free)") from None
        finally:
            with self._lock:
                self._waiting -= 1
        return Slot(group, placement_group_table(group)["bundles_to_node_id"][0]), False

    def _closed(self, slot: Slot) -> None:
        with self._lock:
            self._live[slot.node] -= 1
        self._give_back(slot)

    def _give_back(self, slot: Slot) -> None:
        """Keeps a free slot for the next create, or returns it to the cluster when a
        create waits for one (Ray then places that one here), its node failed, or the
        factory is closed."""
        with self._lock:
            if self._waiting or slot.lost or self._idle is None:
                remove_placement_group(slot.group)
                return
            self._idle.append(slot._replace(idle_since=time.monotonic()))
            if self._expiry is None:
                self._arm_expiry(IDLE_SLOT_S)

    def _arm_expiry(self, delay: float) -> None:
        """Runs _expire in `delay` seconds (lock held)."""
        self._expiry = threading.Timer(delay, self._expire)
        self._expiry.daemon = True
        self._expiry.start()

    def _expire(self) -> None:
        """Returns the slots kept IDLE_SLOT_S to the cluster; comes back while any is kept."""
        with self._lock:
            self._expiry = None
            if not self._idle:
                return
            self._release_idle(time.monotonic() - IDLE_SLOT_S)
            if self._idle:
                self._arm_expiry(max(self._idle[0].idle_since + IDLE_SLOT_S - time.monotonic(),
                                     0.01))

    def _release_idle(self, before: float) -> None:
        """Returns the slots kept since before `before` to the cluster (lock held)."""
        for slot in [s for s in self._idle if s.idle_since < before]:
            remove_placement_group(slot.group)
        self._idle = [s for s in self._idle if s.idle_since >= before]

    def metrics(self) -> dict[str, float]:
        """The cluster's sandbox nodes, slots and free slots; this factory's live sandboxes
        and the free slots it keeps."""
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(SLOT)]
        with self._lock:
            live, kept = sum(self._live.values()), len(self._idle or ())
        return {"env/nodes": float(len(nodes)),
                "env/slots": float(sum(n["Resources"][SLOT] for n in nodes)),
                "env/slots_free": float(ray.available_resources().get(SLOT, 0.0)),
                "env/live": float(live), "env/slots_kept": float(kept),
                **self._host_metrics()}

    def _host_metrics(self) -> dict[str, float]:
        """The node factories' own counters (local sandboxes made without a memory bound),
        summed over the hosts that answer."""
        with self._lock:
            hosts = list(self._hosts.items())
        total: dict[str, float] = {}
        for node, host in hosts:
            try:
                m = _ray_call(host.metrics.remote(), f"metrics of node {node[:12]}", timeout=30)
            except base.SandboxError:
                continue  # a lost node: its episodes are env errors already
            for key, value in m.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def close(self) -> None:
        """Closes this factory's sandboxes and containers on every node that answers."""
        with self._lock:
            hosts, self._hosts = dict(self._hosts), {}
            if self._idle is not None:
                self._release_idle(float("inf"))
            self._idle = None
            if self._expiry is not None:
                self._expiry.cancel()
        for node, host in hosts.items():
            try:
                _ray_call(host.shutdown.remote(), f"closing the sandboxes of node {node[:12]}")
            except base.SandboxError as e:
                log.warning("%s; what it left goes when its node's host next starts", e)
            ray.kill(host)
