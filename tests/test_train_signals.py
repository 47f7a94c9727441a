"""A Docker-backend train.py stopped mid-rollout leaves no container behind: SIGTERM
closes every sandbox before the process exits; after SIGKILL the next run removes
the dead run's containers when it starts.

References: the Docker engine's own container list, filtered by the owner label the
sandbox factory puts on every container (hostname, pid and start time of the trainer).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from sandbox_backends import ensure_image

from env.sandbox.docker import OWNER_LABEL, owner_identity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.docker


def start(workdir: str, image: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """train.py's smoke run on the docker backend; (process, its owner label value)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "train.py", "--config", "configs/default.py:smoke", "--workdir",
             workdir, "--set", "env.backend=docker", "--set", f"env.image={image}"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, owner_identity(proc.pid)


def containers_of(client, owner: str) -> list[str]:
    """Ids of the owner's containers (one listing call: no race with their removal)."""
    found = client.api.containers(all=True, filters={"label": f"{OWNER_LABEL}={owner}"})
    return [c["Id"] for c in found]


def logged(path: str, text: str) -> bool:
    with open(path) as f:
        return text in f.read()


def tail(path: str) -> str:
    with open(path) as f:
        return f.read()[-3000:]


def wait_until(condition, proc: subprocess.Popen, log_path: str, timeout: float = 400.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"train.py exited or timed out first:\n{tail(log_path)}")
        time.sleep(0.1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_stopped_trainer_leaves_no_container(signum, docker_client, tmp_path):
    image = ensure_image(docker_client)
    log_path = str(tmp_path / "first.log")
    proc, owner = start(str(tmp_path / "run"), image, log_path)
    try:  # mid-rollout: its sandboxes are alive
        wait_until(lambda: containers_of(docker_client, owner), proc, log_path)
        os.killpg(proc.pid, signum)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if signum == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM
        assert containers_of(docker_client, owner) == []
        return

    assert containers_of(docker_client, owner)  # SIGKILL: nothing could clean up
    rerun_log = str(tmp_path / "rerun.log")
    rerun, rerun_owner = start(str(tmp_path / "run"), image, rerun_log)
    try:  # the rerun's sandbox factory logs what it removed once it is made
        wait_until(lambda: logged(rerun_log, "containers of exited runs"), rerun, rerun_log)
        assert containers_of(docker_client, owner) == []
        assert rerun.wait(timeout=600) == 0, tail(rerun_log)
    finally:
        if rerun.poll() is None:
            os.killpg(rerun.pid, signal.SIGKILL)
    assert containers_of(docker_client, rerun_owner) == []  # a run that ends closes its own
