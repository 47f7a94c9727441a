"""Sandboxes: isolated working copies of a task repository (see base.Sandbox).

Backends: "local" (env.sandbox.local.LocalSandbox) and "docker"
(env.sandbox.docker.DockerSandbox, over one engine or a fleet, env.sandbox.fleet);
env.sandbox.factory makes every one of them, env.sandbox.pool bounds and tracks them.
"""

from env.sandbox.base import ExecResult, Sandbox, SandboxError
from env.sandbox.factory import (
    BACKENDS,
    FACTORY_LABEL,
    FleetFactory,
    SandboxFactory,
    from_config,
    sandbox_spec,
)

__all__ = ["BACKENDS", "FACTORY_LABEL", "ExecResult", "FleetFactory", "Sandbox", "SandboxError",
           "SandboxFactory", "from_config", "sandbox_spec"]
