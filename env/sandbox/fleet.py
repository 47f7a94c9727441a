"""Docker sandboxes spread over several engines: a fleet of Docker hosts.

    fleet = DockerFleet(["unix:///var/run/docker.sock", "ssh://user@gpu-host-2"],
                        slots_per_engine=32, image="swe-sandbox:test")
    sandbox = fleet.create(repo_files={...})      # on the engine with most free slots
    ...
    fleet.close()                                 # removes every container it made

Placement: each sandbox goes to the reachable engine with the most free slots; when
none has one, `create` waits for a slot (up to `wait_s`). An engine that stops
answering (its probe, every `probe_s`, fails or times out; or a creation cannot reach
it) is marked down: its live sandboxes fail at their next call (env_error for their
episodes), new ones go elsewhere. The probe keeps trying it and brings it back when it
answers, after removing the containers the fleet left on it.

Ownership: every container carries OWNER_LABEL = "<hostname>:<pid>:<process start
time>" of the process that made it. At startup (and when an engine comes back) the
containers of owners on this host that no longer run are removed, on every engine:
a trainer killed with SIGKILL leaves none behind once the next one starts.

Each state change is logged with every engine's slots, live sandboxes, errors and
state; `metrics()` returns the same as scalars.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import docker

from env.sandbox import base
from env.sandbox.docker import DockerSandbox, _remove_container, docker_errors
from env.sandbox.local import _process_identity

log = logging.getLogger(__name__)

OWNER_LABEL = "swe-rl.owner"


def owner_identity(pid: int | None = None) -> str:
    """"<hostname>:<pid>:<start time>" of a running process (default: this one)."""
    return f"{socket.gethostname()}:{_process_identity(pid or os.getpid())}"


def reap_exited_owners(client: docker.DockerClient) -> int:
    """Removes the containers whose owner (OWNER_LABEL) ran on this host and has exited;
    returns how many. Containers of other hosts' processes are left alone."""
    host = socket.gethostname()
    with docker_errors("listing sandbox containers"):
        containers = client.api.containers(all=True, filters={"label": OWNER_LABEL})
    removed = 0
    for c in containers:
        owner = c["Labels"].get(OWNER_LABEL, "")
        owner_host, _, identity = owner.partition(":")
        if owner_host != host or not identity:
            continue
        pid = int(identity.split(":")[0]) if identity.split(":")[0].isdigit() else 0
        if pid and _process_identity(pid) == identity:
            continue  # its owner still runs
        _remove_container(client, c["Id"])
        removed += 1
    return removed


@dataclasses.dataclass(eq=False)
class DockerEngine:
    """One Docker engine of the fleet and what the fleet knows of it."""

    url: str
    slots: int
    client: docker.DockerClient | None = None
    up: bool = False
    errors: int = 0
    created: int = 0  # sandboxes made on it so far
    live: dict[int, DockerSandbox | None] = dataclasses.field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.slots - len(self.live)


class DockerFleet:
    """Creates DockerSandboxes over `hosts` (DOCKER_HOST-style URLs: unix://, tcp://,
    ssh://), at most `slots_per_engine` alive on each; `sandbox_defaults` are
    DockerSandbox keywords (its Source's and DockerOptions' fields: image=, mem_limit=,
    ...; base.from_keywords)."""

    def __init__(self, hosts: Sequence[str], slots_per_engine: int, *, probe_s: float = 5.0,
                 timeout_s: float = 60.0, wait_s: float = 600.0, **sandbox_defaults: Any):
        if not hosts:
            raise ValueError("a docker fleet needs at least one engine URL")
        if slots_per_engine < 1:
            raise ValueError(f"slots_per_engine must be >= 1, got {slots_per_engine}")
        self.engines = [DockerEngine(url, slots_per_engine) for url in hosts]
        self.owner = owner_identity()
        self._defaults = sandbox_defaults
        self._timeout_s, self._wait_s, self._probe_s = timeout_s, wait_s, probe_s
        self._cond = threading.Condition()
        self._tokens = itertools.count()
        self._closed = threading.Event()
        for engine in self.engines:
            self._probe(engine)
        if not any(e.up for e in self.engines):
            raise base.SandboxError(f"no docker engine of {list(hosts)} answers")
        log.info("docker fleet: %s", self._summary())
        self._prober = threading.Thread(target=self._probe_loop, daemon=True,
                                        name="docker-fleet-probe")
        self._prober.start()

    # -- sandboxes --------------------------------------------------------------------

    def create(self, **kwargs: Any) -> DockerSandbox:
        """A sandbox on the engine with the most free slots (waits for a free slot). A
        creation that fails because its engine went down is tried on another one."""
        for attempt in range(len(self.engines)):
            engine, token = self._reserve()
            release = functools.partial(self._release, engine, token)
            try:
                source, options = base.from_keywords(DockerSandbox, {**self._defaults, **kwargs})
                options = dataclasses.replace(
                    options, client=engine.client, engine=engine.url,
                    labels={**kwargs.get("labels", {}), OWNER_LABEL: self.owner})
                sandbox = DockerSandbox(source, options, on_close=release)
                break
            except base.SandboxError as e:
                release()
                self._failed(engine, e)
                if engine.up or attempt == len(self.engines) - 1:
                    raise
            except BaseException:
                release()
                raise
        with self._cond:
            engine.created += 1
            if token in engine.live:
                engine.live[token] = sandbox
            down = not engine.up
        if down:  # the engine went down while this one was being made
            sandbox.lost = f"docker engine {engine.url} is down"
        return sandbox

    def _reserve(self) -> tuple[DockerEngine, int]:
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            while True:
                if self._closed.is_set():
                    raise base.SandboxError("the docker fleet is closed")
                ready = [e for e in self.engines if e.up and e.free > 0]
                if ready:
                    engine = max(ready, key=lambda e: e.free)  # first of equals: hosts order
                    token = next(self._tokens)
                    engine.live[token] = None
                    return engine, token
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise base.SandboxError(
                        f"no docker engine had a free slot within {self._wait_s:.0f}s "
                        f"({self._summary()})")
                self._cond.wait(min(remaining, self._probe_s))

    def _release(self, engine: DockerEngine, token: int, failure: Exception | None = None) -> None:
        """Frees a slot (once per token). A sandbox that could not be removed counts as
        an error of its engine, which is marked down (the sandbox `lost`) if silent."""
        if failure is not None:
            self._failed(engine, failure)
        with self._cond:
            if engine.live.pop(token, False) is not False:
                self._cond.notify()

    def _failed(self, engine: DockerEngine, error: Exception) -> None:
        """Counts a failed creation; the engine is down if it no longer answers."""
        with self._cond:
            engine.errors += 1
        if not self._ping(engine):
            self._set_state(engine, up=False, why=str(error))

    # -- engine states ----------------------------------------------------------------

    def _ping(self, engine: DockerEngine) -> bool:
        try:
            with docker_errors("probing", engine.url):
                ssh = engine.url.startswith("ssh://")  # through the ssh binary, no paramiko
                if engine.client is None:
                    engine.client = docker.DockerClient(base_url=engine.url, use_ssh_client=ssh,
                                                        timeout=self._timeout_s)
                probe = docker.APIClient(base_url=engine.url, use_ssh_client=ssh,
                                         timeout=self._probe_s)
                try:
                    probe.ping()
                finally:
                    probe.close()
            return True
        except base.SandboxError:
            return False

    def _probe(self, engine: DockerEngine) -> None:
        """Pings one engine and moves it up or down accordingly."""
        answers = self._ping(engine)
        if answers and not engine.up:
            try:  # what this fleet left on it, and what exited owners left
                stale = self._remove_own_stale(engine) + reap_exited_owners(engine.client)
            except base.SandboxError as e:
                self._set_state(engine, up=False, why=str(e))
                return
            self._set_state(engine, up=True, why=f"answers; removed {stale} stale containers")
        elif not answers and engine.up:
            self._set_state(engine, up=False, why="does not answer its probe")

    def _remove_own_stale(self, engine: DockerEngine) -> int:
        """Removes this fleet's containers on `engine` that belong to no live sandbox."""
        with docker_errors("listing containers", engine.url):
            ours = engine.client.api.containers(
                all=True, filters={"label": f"{OWNER_LABEL}={self.owner}"})
        with self._cond:
            live = {sb.container_id for sb in engine.live.values() if sb is not None}
        stale = [c["Id"] for c in ours if c["Id"] not in live]
        for container_id in stale:
            _remove_container(engine.client, container_id, engine=engine.url)
        return len(stale)

    def _set_state(self, engine: DockerEngine, up: bool, why: str) -> None:
        with self._cond:
            if engine.up == up:
                return
            engine.up = up
            if not up:
                for sandbox in engine.live.values():
                    if sandbox is not None:
                        sandbox.lost = f"docker engine {engine.url} is down ({why})"
            self._cond.notify_all()
        level = logging.INFO if up else logging.WARNING
        log.log(level, "docker engine %s is %s: %s; %s", engine.url, "up" if up else "down",
                why, self._summary())

    def _probe_loop(self) -> None:
        while not self._closed.wait(self._probe_s):
            for engine in self.engines:
                self._probe(engine)

    # -- reporting and teardown -------------------------------------------------------

    def _summary(self) -> str:
        return ", ".join(f"{e.url}: {'up' if e.up else 'DOWN'} {len(e.live)}/{e.slots} "
                         f"slots, {e.errors} errors" for e in self.engines)

    def metrics(self) -> dict[str, float]:
        """Per engine (by index in `hosts`): slots, live sandboxes, sandboxes created,
        errors, up (1/0)."""
        out = {}
        with self._cond:
            for i, e in enumerate(self.engines):
                out.update({f"env/engine{i}/slots": e.slots, f"env/engine{i}/live": len(e.live),
                            f"env/engine{i}/created": e.created,
                            f"env/engine{i}/errors": e.errors, f"env/engine{i}/up": float(e.up)})
        return out

    def close(self) -> None:
        """Stops the probe and removes every container of this fleet on every engine
        that answers (sandboxes being made included). Idempotent."""
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        for engine in self.engines:
            if engine.client is None:
                continue
            try:
                with docker_errors("listing containers", engine.url):
                    ours = engine.client.api.containers(
                        all=True, filters={"label": f"{OWNER_LABEL}={self.owner}"})
                for c in ours:
                    _remove_container(engine.client, c["Id"], engine=engine.url)
            except base.SandboxError as e:
                log.warning("docker engine %s: containers left to the next start: %s",
                            engine.url, e)
