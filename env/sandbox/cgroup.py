"""A memory cgroup per local sandbox: one bound on everything its processes hold.

An rlimit bounds one process's address space; three processes under it can still hold
three times as much. A cgroup bounds their sum (and the tmpfs pages they write): past
it the kernel's OOM killer ends a process of the group. The sandbox's supervisor
joins the group before it forks anything (supervisor_main.py, config key `cgroup`), so every
command's process is in it; each command runs at an `oom_score_adj` of 1000, so the
killer picks a command's process, not the supervisor.

Both cgroup hierarchies are served: v2 (`memory.max`, `memory.swap.max`) where the
memory controller is enabled for the trainer's own cgroup's children, else v1 (the
`memory` hierarchy: `memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes` where
swap is accounted). Where neither can be written (no root, a read-only cgroupfs, a
v2 parent that does not delegate memory), `MemoryGroup.create` returns None: the
sandbox runs with its per-process limits only, and `available()` says so.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os

CGROUP_ROOT = "/sys/fs/cgroup"
PARENT = "rl-sandboxes"  # the groups' parent, beneath the trainer's own cgroup


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in the v2 hierarchy (controller None) or v1's
    `controller` hierarchy, from /proc/self/cgroup."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (controller is None and controllers == "") or controller in controllers.split(","):
                return path
    return None


def _v2_parent() -> str | None:
    path = _own_path(None)
    if path is None or not os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
        return None
    own = os.path.join(CGROUP_ROOT, path.lstrip("/"))
    with open(os.path.join(own, "cgroup.subtree_control")) as f:
        delegated = "memory" in f.read().split()
    if not delegated:
        # Enabling it would move nothing but needs an own cgroup without processes
        # (cgroup v2's no-internal-process rule): only the root cgroup is exempt.
        if path != "/":
            return None
        with open(os.path.join(own, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
    return os.path.join(own, PARENT)


def _v1_parent() -> str | None:
    path = _own_path("memory")
    hierarchy = os.path.join(CGROUP_ROOT, "memory")
    if path is None or not os.path.exists(os.path.join(hierarchy, "memory.limit_in_bytes")):
        return None
    return os.path.join(hierarchy, path.lstrip("/"), PARENT)


@functools.cache
def parent() -> tuple[str, int] | None:
    """(the directory sandbox groups are made in, cgroup version), or None where no
    memory cgroup can be made here. Probed once per process."""
    if os.geteuid() != 0:
        return None
    for version, find in ((2, _v2_parent), (1, _v1_parent)):
        with contextlib.suppress(OSError):
            directory = find()
            if directory is not None:
                os.makedirs(directory, exist_ok=True)
                if version == 2:  # the groups beneath get the memory controller's files
                    with open(os.path.join(directory, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory")
                return directory, version
    return None


def available() -> bool:
    return parent() is not None


class MemoryGroup:
    """One sandbox's memory cgroup: `procs` is the file a process joins it by."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version
        self.procs = os.path.join(path, "cgroup.procs")

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryGroup | None:
        """A new group `name` bounded at `limit_bytes` (swap included), or None where
        memory cgroups are not available here."""
        found = parent()
        if found is None:
            return None
        directory, version = found
        group = cls(os.path.join(directory, name), version)
        os.mkdir(group.path)
        try:
            group._limit(limit_bytes)
        except BaseException:
            group.remove()
            raise
        return group

    def _limit(self, limit: int) -> None:
        files = (("memory.max", "memory.swap.max") if self.version == 2 else
                 ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))
        values = (str(limit), "0" if self.version == 2 else str(limit))
        for name, value in zip(files, values, strict=True):
            path = os.path.join(self.path, name)
            if name == files[1] and not os.path.exists(path):
                continue  # swap not accounted on this host
            with open(path, "w") as f:
                f.write(value)

    def oom_kills(self) -> int:
        """Processes the kernel killed for the group's bound so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError), open(os.path.join(self.path, name)) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> bool:
        """Removes the group (its processes must have ended); False if it cannot be."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            raise
        return True


def remove_stale(names: set[str]) -> None:
    """Removes the groups of sandboxes whose directories were reaped (env.sandbox.local
    reap_stale): a killed trainer leaves them behind, empty."""
    found = parent()
    if found is None:
        return
    for name in names:
        MemoryGroup(os.path.join(found[0], name), found[1]).remove()
