"""Sandbox factories of both backends for the env tests.

`backend_factory(request, backend)` returns `task -> Sandbox` (env.episode.sandbox_factory)
for "local", or for "docker" through the `docker_client` fixture with the sandbox image
(built by scripts/build_sandbox_image.sh when missing), so a missing engine skips, or
fails under REQUIRE_ALL=1, exactly as conftest decides.
"""

import os
import subprocess

import pytest

from env.sandbox import SandboxFactory
from env.sandbox.local import LocalLimits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = os.environ.get("SANDBOX_IMAGE", "swe-sandbox:test")
BACKENDS = [pytest.param("local"), pytest.param("docker", marks=pytest.mark.docker)]


def ensure_image(client) -> str:
    """The sandbox image, built with scripts/build_sandbox_image.sh when missing."""
    import docker.errors

    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        script = os.path.join(ROOT, "scripts", "build_sandbox_image.sh")
        subprocess.run([script, IMAGE], check=True, timeout=1200)
    return IMAGE


def docker_defaults(request) -> dict:
    """DockerSandbox arguments: the session's client and the sandbox image."""
    client = request.getfixturevalue("docker_client")
    return {"image": ensure_image(client), "client": client, "mem_limit": "512m"}


def backend_factory(request, backend: str):
    if backend == "docker":
        return SandboxFactory("docker", **docker_defaults(request))
    return SandboxFactory("local", limits=LocalLimits(memory_bytes=1 << 30))


def tree_hashes(sandbox) -> dict[str, str]:
    """path -> sha256 of every file outside .git, computed by sha256sum in the sandbox."""
    out = sandbox.run("find . -path ./.git -prune -o -type f -print0 | xargs -0 sha256sum").output
    return {line[66:].removeprefix("./"): line[:64] for line in out.splitlines()}


def world_readable(root: str) -> None:
    """Directories 0755 and files 0644 under `root`: a sandbox's own uid can read them."""
    for path, _, files in os.walk(root):
        os.chmod(path, 0o755)
        for name in files:
            os.chmod(os.path.join(path, name), 0o644)
