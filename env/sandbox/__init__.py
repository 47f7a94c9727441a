"""Sandboxes: isolated working copies of a task repository (see base.Sandbox).

Backends: "local" (env.sandbox.local.LocalSandbox) and "docker"
(env.sandbox.docker.DockerSandbox); env.sandbox.pool bounds and tracks them.
"""

from env.sandbox.base import ExecResult, Sandbox, SandboxError

BACKENDS = ("local", "docker")


def make_sandbox(backend: str, **kwargs) -> Sandbox:
    """Creates a sandbox of `backend` ("local" | "docker") from the backend's kwargs."""
    if backend == "local":
        from env.sandbox.local import LocalSandbox

        return LocalSandbox(**kwargs)
    if backend == "docker":
        from env.sandbox.docker import DockerSandbox

        return DockerSandbox(**kwargs)
    raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {BACKENDS}")


__all__ = ["BACKENDS", "ExecResult", "Sandbox", "SandboxError", "make_sandbox"]
