"""The one place sandboxes are made: a task (or a backend's own arguments) -> a new
sandbox of the run's backend, on this machine or placed by Ray (env.sandbox.cluster).

Every factory has `metrics()` (scalars for the step's row: a Ray cluster's slots, local
sandboxes without a memory cgroup) and `close()` (removes what its sandboxes left); the
sandboxes themselves are bounded and closed by env.sandbox.pool.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping
from typing import Any

from env.config import EnvConfig
from env.sandbox.base import Sandbox, from_keywords
from env.sandbox.docker import (
    OWNER_LABEL,
    DockerSandbox,
    connect,
    owner_identity,
    reap_exited_owners,
    remove_containers,
)
from env.sandbox.local import LocalSandbox, reap_stale
from env.tasks import Task

log = logging.getLogger(__name__)

BACKENDS = ("local", "docker")
PLACEMENTS = ("local", "ray")
# Docker sandboxes carry {FACTORY_LABEL: factory.id}: close() removes what is left.
FACTORY_LABEL = "swe-rl.factory"


def sandbox_spec(task: Task, backend: str) -> dict[str, Any]:
    """The backend arguments that put `task`'s repository in place.

    local: `repo_files` or `repo_dir` (+ `base_commit`). docker: the task's `image`
    (when it has one; otherwise the factory's default image) at `workdir`, with
    `repo_files` written into it when given. Both: the task's `env_setup` (the image's
    environment activation), run before every command.
    """
    if backend == "local":
        if task.repo_files is None and task.repo_dir is None:
            raise ValueError(f"task {task.instance_id} has only an image ({task.image}); "
                             "the local backend needs repo_files or repo_dir")
        spec = {"repo_files": task.repo_files, "repo_dir": task.repo_dir,
                **({"env_setup": task.env_setup} if task.env_setup else {})}
        return {**spec, "base_commit": task.base_commit or None} if task.repo_dir else spec
    if backend == "docker":
        if task.repo_dir is not None and task.repo_files is None:
            raise ValueError(f"task {task.instance_id}: the docker backend takes an image or "
                             "repo_files, not repo_dir")
        spec: dict[str, Any] = {"workdir": task.workdir}
        if task.env_setup:
            spec["env_setup"] = task.env_setup
        if task.image:
            spec["image"] = task.image
        if task.repo_files is not None:
            spec["repo_files"] = task.repo_files
        elif task.base_commit:
            spec["base_commit"] = task.base_commit
        return spec
    raise ValueError(f"unknown sandbox backend {backend!r}")


class SandboxFactory:
    """task -> a new sandbox of `backend` ("local" | "docker") holding the task's
    repository. `defaults` are backend arguments (e.g. image=, client=, limits=); the
    task's own source (sandbox_spec) overrides them. Called with a mapping instead of
    a task, it takes the mapping as the backend's arguments.

    id: unique id of this factory; its Docker sandboxes carry {FACTORY_LABEL: id} and
      {OWNER_LABEL: this process} (the next run removes them if it was killed).
    """

    def __init__(self, backend: str, **defaults: Any):
        if backend not in BACKENDS:
            raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {BACKENDS}")
        check_keywords(backend, defaults)
        self.backend, self.defaults = backend, defaults
        self.id = uuid.uuid4().hex[:12]
        self.labels = {FACTORY_LABEL: self.id, OWNER_LABEL: owner_identity()}
        self._no_memory_cgroup = 0  # local sandboxes made since metrics() without one
        self._lock = threading.Lock()

    def __call__(self, source: Task | Mapping[str, Any] | None) -> Sandbox:
        spec = (sandbox_spec(source, self.backend) if isinstance(source, Task)
                else dict(source or {}))
        return self.create(**spec)

    def create(self, **spec: Any) -> Sandbox:
        """A sandbox from backend arguments: the defaults, overridden by `spec`."""
        kwargs = {**self.defaults, **spec}
        if self.backend == "local":
            sandbox = LocalSandbox(*from_keywords(LocalSandbox, kwargs))
            if sandbox.no_memory_cgroup:
                with self._lock:
                    self._no_memory_cgroup += 1
            return sandbox
        return DockerSandbox(*from_keywords(
            DockerSandbox, {**kwargs, "labels": {**kwargs.get("labels", {}), **self.labels}}))

    def metrics(self) -> dict[str, float]:
        """Scalars for the step's metrics row: for local sandboxes, how many made since
        the last row have no total memory bound (no memory cgroup could hold them)."""
        if self.backend != "local":
            return {}
        with self._lock:
            count, self._no_memory_cgroup = self._no_memory_cgroup, 0
        return {"env/no_memory_cgroup": float(count)}

    def close(self) -> None:
        """Removes any container of this factory still there (one whose creation was cut
        short, or whose sandbox was never closed); local sandboxes close themselves."""
        if self.backend == "docker":
            remove_containers(self.labels, self.defaults.get("client"))


def check_keywords(backend: str, defaults: Mapping[str, Any]) -> None:
    """Refuses, at construction, a default the backend's sandbox does not take (a typo
    would otherwise fail at the first episode, as an env error)."""
    try:
        from_keywords(LocalSandbox if backend == "local" else DockerSandbox, defaults)
    except TypeError as e:
        raise TypeError(f"SandboxFactory({backend!r}) got {e}") from None


def from_config(env_cfg: EnvConfig) -> SandboxFactory:
    """The `env` section's sandboxes: `env.backend`, placed on this machine or by Ray
    (`env.placement`, `env.ray_address`); tasks without an image of their own run in
    `env.image`. What exited runs left (containers, sandbox directories) goes first."""
    if env_cfg.backend not in BACKENDS:
        raise ValueError(f"env.backend must be one of {BACKENDS}, got {env_cfg.backend!r}")
    if env_cfg.placement not in PLACEMENTS:
        raise ValueError(f"env.placement must be one of {PLACEMENTS}, got {env_cfg.placement!r}")
    defaults: dict[str, Any] = {"image": env_cfg.image} if env_cfg.image else {}
    if env_cfg.backend == "local":
        defaults = {"allow_unisolated": env_cfg.local_allow_unisolated,
                    "read_only": tuple(env_cfg.local_read_only)}
    if env_cfg.placement == "ray":
        from env.sandbox.cluster import RayFactory  # (ray is imported only when placed by it)

        return RayFactory(env_cfg.backend, address=env_cfg.ray_address,
                          local_slots=env_cfg.max_concurrent, **defaults)
    if env_cfg.backend == "docker":
        client = connect()
        log.info("docker engine %s: removed %d containers of exited runs",
                 client.api.base_url, reap_exited_owners(client))
        return SandboxFactory("docker", client=client, **defaults)
    stale = reap_stale()
    if stale:
        log.info("removed %d sandbox directories of exited processes", len(stale))
    return SandboxFactory("local", **defaults)
