"""Sandboxes: isolated working copies of a task repository (see base.Sandbox).

Backends: "local" (env.sandbox.local.LocalSandbox) and "docker"
(env.sandbox.docker.DockerSandbox), on this machine or placed by Ray on the hosts of a
cluster (env.sandbox.cluster); env.sandbox.factory makes every one of them,
env.sandbox.pool bounds and tracks them.
"""

from env.sandbox.base import ExecResult, Sandbox, SandboxError
from env.sandbox.factory import (
    BACKENDS,
    FACTORY_LABEL,
    SandboxFactory,
    from_config,
    sandbox_spec,
)

__all__ = ["BACKENDS", "FACTORY_LABEL", "ExecResult", "Sandbox", "SandboxError",
           "SandboxFactory", "from_config", "sandbox_spec"]
