"""Multi-host runs as several JAX processes on this machine (a local coordinator, gloo
collectives between fake CPU devices): the rl.distributed helpers against plain Python,
and train.py as 2 processes x 4 devices against 1 process x 8 devices."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from configs import common
from rl import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, port: int | None = None, index: int = 0, count: int = 1) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(key, None)
    if port is not None:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(count),
                   JAX_PROCESS_ID=str(index))
    return env


def _spawn(args: list[str], count: int, devices: int, **kw) -> list[subprocess.Popen]:
    port = _free_port()
    return [subprocess.Popen(args, cwd=ROOT, env=_env(devices, port, i, count),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, **kw) for i in range(count)]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, err[-3000:]
        outs.append((out, err))
    return outs


# Each process: its share of 7 items squared (gather_map), an all-gather of a dict, the
# digest check on equal and on differing state, and a parameter sharded over both
# processes gathered whole.
HELPERS = """
import asyncio, json
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from configs import common
from rl import distributed

assert distributed.initialize(common.ConfigDict(common.distributed_defaults()))
me = jax.process_index()
seen = []
async def square(xs):
    seen.extend(xs)
    return [x * x for x in xs]
gathered = asyncio.run(distributed.gather_map(square, list(range(7))))
objects = distributed.allgather_objects({"p": me, "a": np.arange(me + 1)})
same = distributed.check_consistent({"step": 3, "x": np.ones(2)}, "equal state")
try:
    distributed.check_consistent({"step": me}, "step 9")
    differing = ""
except RuntimeError as e:
    differing = str(e)
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
x = np.arange(24, dtype=np.float32).reshape(8, 3)
params = {"w": jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp", None)))}
local = distributed.local_params(params)["w"]
print(json.dumps({"seen": seen, "gathered": gathered,
                  "objects": [[o["p"], o["a"].tolist()] for o in objects],
                  "same": same, "differing": differing,
                  "local_equal": bool(np.array_equal(np.asarray(local), x)),
                  "local_addressable": local.is_fully_addressable,
                  "layout": distributed.layout()}))
"""


def test_share_is_a_partition():
    for n in range(0, 11):
        for count in (1, 2, 3, 8):
            parts = [list(distributed.share(n, p, count)) for p in range(count)]
            assert sorted(i for part in parts for i in part) == list(range(n))


def test_helpers_over_two_processes():
    outs = _finish(_spawn([sys.executable, "-c", HELPERS], count=2, devices=4), timeout=300)
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["seen"] for r in results] == [[0, 2, 4, 6], [1, 3, 5]]
    for me, r in enumerate(results):
        assert r["gathered"] == [x * x for x in range(7)]
        assert r["objects"] == [[0, [0]], [1, [0, 1]]]
        assert r["same"] == distributed.digest({"step": 3, "x": np.ones(2)})
        assert "step 9" in r["differing"] and "process 1" in r["differing"]
        assert r["local_equal"] and r["local_addressable"]
        assert r["layout"]["process_index"] == me and r["layout"]["process_count"] == 2
        by_process = r["layout"]["devices_by_process"]
        assert sorted(by_process) == ["0", "1"] and by_process == results[0]["layout"][
            "devices_by_process"]
        assert [len(ds) for ds in by_process.values()] == [4, 4]
        assert len(set(by_process["0"]) | set(by_process["1"])) == 8


def test_coordinator_without_process_count_is_named(monkeypatch):
    cfg = common.ConfigDict(dict(common.distributed_defaults(), coordinator="127.0.0.1:1"))
    for key in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="num_processes"):
        distributed.initialize(cfg)
