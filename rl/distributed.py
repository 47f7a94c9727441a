"""Multi-host runs: one JAX process per host, every host running the same train.py.

A TPU pod slice or a multi-node GPU cluster runs one process per host; the mesh spans
the devices of all of them and every jitted step is one program over all processes.

The design, and why:
- Rollouts are split: host p runs the jobs i with i % num_processes == p (a strided
  share, so prefix and fresh jobs spread evenly), with its own engine client and
  sandboxes. At 64 tasks x 8 rollouts over 8 hosts that is 8 groups (64 sandboxes) per
  host instead of 512 on one.
- The finished trajectories are all-gathered (`gather_map`), so every host holds the
  whole batch in job order, exactly as one process would. A whole gather is needed
  anyway: Prefix Sampling builds prefix tasks from any group's rare success or
  failure, and SPO's tracker stores every response. Token arrays are small next to
  a step's rollouts: 512 trajectories of 16k tokens pickle to under 100 MB, gathered
  in about a second over the data-centre network against minutes of rollouts (the
  gather runs on the devices: each holds the whole step's bytes for its duration).
- Host state (the algorithm's state_dict: task sampler, PS queue and controller,
  NumPy RNG) is replicated deterministically: every host starts from the same seed
  (or reads the same checkpoint) and applies the same updates to the same gathered
  trajectories. `check_consistent` compares a digest of it across processes at
  every checkpoint, so a divergence is an error naming the step, not silent drift.
- Every host packs the same batch (identical row layout to one process, so losses
  match it) and `jax.device_put` onto the mesh's data sharding copies only the rows
  of its own devices: with a host-identical NumPy value it is the
  `make_array_from_callback` of each host's addressable shards. (Contributing only
  its own rollouts' rows through `make_array_from_process_local_data` would save the
  gather of token arrays but not the gather host state needs, and would pack rows
  differently from one process.)
- Held-out evaluation and the warm start's demonstrations are split and gathered the
  same way; process 0 writes files and metrics; every process calls the Orbax
  checkpointer (it writes each array shard from the host that holds it, and the
  host-state JSON once, from process 0).
- Weight sync gathers the parameters one leaf at a time into host memory (one
  parameter in device memory at a time): an embedded engine of each host loads them
  there; SGLang servers shared by all hosts get one export and one update per
  version, from process 0, and the others wait at a barrier.
- SPO's stream (rl.algos.spo) draws its prompts in chunks at fixed steps, not as
  rollouts finish: every host draws every chunk alike from the replicated prioritised
  sampler and runs its share of it, a step gathers each host's first finished share of
  the batch (as below) in draw order, and every host updates the tracker from that
  same batch (the drift D scored over all processes' devices).
- Rollouts ahead of the learner (rollout.max_staleness > 0): every host draws the same
  chunks of jobs at the same steps and runs its share of each; a step takes each
  host's first finished share of the batch and gathers them (`gather_lists`). Which
  groups those are depends on each host's timing, but every host trains on the same
  gathered batch, so host state stays replicated; the jobs still in flight are
  gathered into the checkpoint, each host re-running its own on resume.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import pickle
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from models import sharding
from rl import rollout
from rl.checkpoint import encode_host

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# ------------------------------------------------------------------ runtime


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The `distributed` section (configs.common.distributed_defaults documents each key)."""

    coordinator: str
    num_processes: int
    process_id: int
    auto: bool


def initialize(dist_cfg: DistributedConfig) -> bool:
    """Starts JAX's distributed runtime when the config or the environment asks for it;
    returns whether it did. Must run before anything touches a JAX device.

    dist_cfg (configs.common.distributed_defaults): `coordinator` "host:port" with
    `num_processes` and `process_id`, each falling back to JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; or `auto` for JAX's own detection (TPU pod
    slices, SLURM, Open MPI, Kubernetes). Neither: one process.
    """
    coordinator = dist_cfg.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    if not coordinator and not dist_cfg.auto:
        return False
    # Collectives between processes on CPU devices (tests, CPU clusters) go through
    # gloo; the option only concerns the CPU backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if dist_cfg.auto and not coordinator:
        jax.distributed.initialize()
    else:
        count = dist_cfg.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", 0))
        index = (dist_cfg.process_id if dist_cfg.process_id >= 0
                 else int(os.environ.get("JAX_PROCESS_ID", -1)))
        if count < 1 or not 0 <= index < count:
            raise ValueError(
                f"distributed: coordinator {coordinator!r} needs num_processes >= 1 and "
                f"0 <= process_id < num_processes, got {count} and {index} (set "
                "distributed.num_processes / process_id or JAX_NUM_PROCESSES / JAX_PROCESS_ID)")
        jax.distributed.initialize(coordinator, count, index)
    log.info("distributed: process %d of %d, %d local of %d devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def layout(mesh_cfg=None) -> dict[str, Any]:
    """Process and device layout (for --dry_run and the log): this process, the devices
    of each process and, with `mesh_cfg` (config.mesh), the mesh over all of them, or
    why these devices cannot hold it."""
    by_process: dict[int, list[str]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(f"{d.platform}:{d.id}")
    out: dict[str, Any] = {
        "process_index": jax.process_index(), "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(), "global_devices": jax.device_count(),
        "devices_by_process": {str(p): ds for p, ds in sorted(by_process.items())}}
    if mesh_cfg is not None:
        try:
            out["mesh"] = dict(sharding.make_mesh(**mesh_cfg).shape)
        except ValueError as e:  # e.g. a pod config dry-run on a laptop
            out["mesh"] = f"not on these devices: {e}"
    return out


def is_primary() -> bool:
    """Whether this process writes files, metrics and console lines."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (no-op in one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------ host objects


def share(n: int, index: int | None = None, count: int | None = None) -> range:
    """Indices of `n` items that process `index` (default: this one) of `count` works on:
    i with i % count == index."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    return range(index, n, count)


def process_count() -> int:
    return jax.process_count()


def process_index() -> int:
    return jax.process_index()


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's picklable `obj`, in process order (a blocking collective: all
    processes must call it)."""
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([payload.size], np.int32))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:payload.size] = payload
    parts = multihost_utils.process_allgather(padded)
    return [pickle.loads(parts[p, :int(sizes[p, 0])].tobytes()) for p in range(len(parts))]


async def gather_map(fn: Callable[[list[T]], Awaitable[Sequence[R]]],
                     items: Sequence[T]) -> list[R]:
    """`fn` (one result per item, in order) over this process's `share` of `items`; the
    results of all processes come back to every process in item order."""
    if jax.process_count() == 1:
        return list(await fn(list(items)))
    mine = share(len(items))
    results = list(await fn([items[i] for i in mine]))
    if len(results) != len(mine):
        raise ValueError(f"gather_map: {len(results)} results for {len(mine)} items")
    # The collective blocks until the slowest host is done; in a thread, the event loop
    # (HTTP sessions, sandbox slots) keeps running meanwhile.
    parts = await asyncio.to_thread(allgather_objects, results)
    out: list[Any] = [None] * len(items)
    for p, part in enumerate(parts):
        for i, result in zip(share(len(items), p, len(parts)), part, strict=True):
            out[i] = result
    return out


async def gather_lists(items: Sequence[T]) -> list[T]:
    """Every process's `items`, concatenated in process order (a collective, run in a
    thread so the event loop goes on)."""
    if jax.process_count() == 1:
        return list(items)
    parts = await asyncio.to_thread(allgather_objects, list(items))
    return [x for part in parts for x in part]


def digest(state: Any) -> str:
    """A short hash of a host-state dict (the JSON the checkpointer writes, keys sorted)."""
    text = json.dumps(encode_host(state), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_consistent(state: Any, what: str) -> str:
    """The digest of `state`, checked equal on every process; a mismatch is an error
    naming `what` and each process's digest."""
    mine = digest(state)
    digests = allgather_objects(mine)
    if len(set(digests)) > 1:
        raise RuntimeError(f"host state differs across processes at {what}: "
                           + ", ".join(f"process {p}: {d}" for p, d in enumerate(digests)))
    return mine


# ------------------------------------------------------------------ parameters


def _gather_leaf(x) -> np.ndarray:
    """One parameter as a host array (a collective when it is sharded over processes)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return multihost_utils.process_allgather(x, tiled=True)


def local_params(params: Any) -> Any:
    """The parameters as arrays on this process's devices, for its own inference engine.

    One process: a device copy (train_step donates its state). Several: each leaf
    gathered in turn (a collective, all processes call it) and put on this process's
    first device, so the gather holds at most one whole parameter per device.
    """
    if jax.process_count() == 1:
        return jax.tree.map(jnp.copy, params)
    device = jax.local_devices()[0]
    return jax.tree.map(lambda x: jax.device_put(_gather_leaf(x), device), params)


async def sync_weights(engine, params: Any, shared_servers: bool) -> None:
    """Loads `params` into the engine after an update.

    shared_servers (SGLang servers that every process's client talks to): over several
    processes, one export and one update per version, by process 0, from host memory
    (every process takes part in each leaf's gather; only process 0 keeps them), while
    the others wait at a barrier until the new version is served. Otherwise each
    process's engine loads `local_params`.
    """
    if not shared_servers or jax.process_count() == 1:
        await engine.update_weights(local_params(params))
        return
    leaves, treedef = jax.tree.flatten(params)
    gathered = [_gather_leaf(x) for x in leaves] if is_primary() else None
    if gathered is None:
        for x in leaves:  # each gather is a collective: take part, keep nothing
            _gather_leaf(x)
    else:
        await engine.update_weights(jax.tree.unflatten(treedef, gathered))
    await asyncio.to_thread(barrier, "weights_loaded")


# ------------------------------------------------------------------ rollouts


async def collect_groups(agent, jobs: Sequence[Any], n: int,
                         progress: Callable[[int], None] | None = None) -> list[list[Any]]:
    """rl.rollout.collect_groups over this process's share of `jobs` (with its own
    engine client and sandboxes); every process gets all groups, in job order."""
    return await gather_map(lambda mine: rollout.collect_groups(agent, mine, n, progress), jobs)
