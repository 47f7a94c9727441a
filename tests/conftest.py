"""Shared test setup.

Eight fake CPU devices are configured before JAX is imported, so sharding tests run
on a mesh without special invocation. `REQUIRE_ALL=1` (set by `.ci/run`) turns a
missing reference (torch/transformers) or a missing Docker engine into a failure:
in CI nothing skips silently.

One persistent JAX compilation cache serves the whole run: this process and every
`train.py` (or other Python) subprocess a test starts, which inherit the environment,
so a tiny model's programs compile once per run, not once per test and process. It
lives in a temporary directory removed at exit: nothing carries over between runs.
"""

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Cache every program, however fast it compiled (the default skips those under 1 s).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import pytest  # noqa: E402

STRICT = os.environ.get("REQUIRE_ALL", "") == "1"


def _missing(what: str, why: str):
    msg = f"{what} unavailable: {why}"
    if STRICT:
        pytest.fail(msg + " (REQUIRE_ALL=1: this must not skip)", pytrace=False)
    pytest.skip(msg)


HF_REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_reference.py")


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory):
    """A function running one request of tests/hf_reference.py (transformers as the
    reference) in a process of its own, or skip/fail when torch or transformers is absent.

    transformers is never imported here: in a process with the repository root on
    sys.path the project's `kernels` package shadows the `kernels` library transformers
    5 imports. The reference runs isolated (`-I`: neither the script's directory nor
    PYTHONPATH on sys.path) from a directory outside the repository."""
    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            _missing("torch/transformers", f"no module named {name!r}")
    cwd = tmp_path_factory.mktemp("hf_reference")

    def run(request: dict) -> dict:
        proc = subprocess.run([sys.executable, "-I", HF_REFERENCE, json.dumps(request)],
                              cwd=cwd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"hf_reference.py failed:\n{proc.stderr[-4000:]}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session")
def docker_client():
    """A connected docker SDK client, or skip/fail when no engine answers."""
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as e:  # noqa: BLE001 - any failure means no usable engine
        _missing("Docker engine", repr(e))
    return client


@pytest.fixture(scope="session")
def isolated():
    """Skip/fail unless the local sandbox isolates commands here (root, namespaces)."""
    from env.sandbox.local import isolation_available

    if not isolation_available():
        _missing("local sandbox isolation", "needs root and mount/PID/network namespaces")


@pytest.fixture(scope="session")
def memory_cgroups(isolated):
    """Skip/fail unless isolated local sandboxes get a memory cgroup here."""
    from env.sandbox import cgroup

    if not cgroup.available():
        _missing("memory cgroups", "root cannot make a memory cgroup here")
