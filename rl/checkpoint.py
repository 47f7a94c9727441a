"""Checkpoints: the device TrainState (sharded) plus a host-state dict, via Orbax.

Layout: workdir/ckpt/<step>/{state,host}. `host` is a JSON-able dict whose
leaves may also be NumPy arrays (SPO tracker, PS queue and controller, data
position); arrays are stored exactly (dtype, shape and raw bytes, base64) inside
the JSON, so they round-trip bit for bit without knowing the structure ahead.
A step that does not read back (a truncated file, a missing item) is moved aside
to <step>.damaged when resuming falls back past it.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import multihost

log = logging.getLogger(__name__)

_ARRAY_TAG = "__ndarray__"


def encode_host(value: Any) -> Any:
    """JSON-able copy of `value` with NumPy arrays and scalars tagged."""
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype == object:
            raise TypeError("host state: object arrays cannot be checkpointed")
        return {_ARRAY_TAG: base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(),
                "dtype": array.dtype.str, "shape": list(array.shape),
                "scalar": isinstance(value, np.generic)}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"host state: dict keys must be str, got {key!r}")
        return {k: encode_host(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_host(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"host state: cannot checkpoint a {type(value).__name__}")


def decode_host(value: Any) -> Any:
    """Inverse of `encode_host` (tuples come back as lists)."""
    if isinstance(value, dict):
        if _ARRAY_TAG in value:
            raw = base64.b64decode(value[_ARRAY_TAG])
            array = np.frombuffer(raw, np.dtype(value["dtype"])).reshape(value["shape"]).copy()
            return array[()] if value["scalar"] else array
        return {k: decode_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_host(v) for v in value]
    return value


def saved_digests(workdir: str, step: int) -> tuple[str, str, list[str]]:
    """(sha256 of checkpoint `step`'s train state: every array's path, dtype and bytes;
    sha256 of its host-state JSON, keys sorted; the host state's keys), read from
    workdir/ckpt as saved, without a model to restore into: to show two runs end in the
    same state. A train state's `rng` entry (a key that older train states carried and
    never read) is left out, so the digests of old and new checkpoints compare."""
    path = os.path.join(workdir, "ckpt", str(step))
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(os.path.join(path, "state")).item_metadata.tree
    restored = checkpointer.restore(os.path.join(path, "state"), restore_args=jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    restored.pop("rng", None)
    h = hashlib.sha256()
    for key, value in jax.tree_util.tree_leaves_with_path(restored):
        value = np.ascontiguousarray(value)
        h.update(jax.tree_util.keystr(key).encode() + value.dtype.str.encode())
        h.update(value.tobytes())
    with open(os.path.join(path, "host", "metadata")) as f:
        host = json.load(f)
    host_sha = hashlib.sha256(json.dumps(host, sort_keys=True).encode()).hexdigest()
    return h.hexdigest(), host_sha, sorted(host)


def _with_old_rng(abstract_state: Any) -> dict[str, Any]:
    """The fields of a TrainState as a dict, with the uint32 [2] `rng` key older train
    states carried (replicated, like the step), to restore such a state whole."""
    fields = {f.name: getattr(abstract_state, f.name) for f in dataclasses.fields(abstract_state)}
    rng = jax.ShapeDtypeStruct((2,), np.uint32, sharding=abstract_state.step.sharding)
    return {**fields, "rng": rng}


class Checkpointer:
    """Saves and restores (TrainState, host dict) pairs under workdir/ckpt.

    keep: how many most recent checkpoints survive. A save returns once the
    checkpoint is complete on disk, so a failed write (a full disk, a lost bucket)
    is raised by the `save` of that step, not by a later one. The price: the write
    does not overlap the next step (for Qwen3-14B, float32 parameters and Adam
    moments are ~170 GB per checkpoint, every `ckpt_every` steps).
    """

    def __init__(self, workdir: str, keep: int = 3):
        self.directory = os.path.abspath(os.path.join(workdir, "ckpt"))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "host"))

    def save(self, step: int, state: Any, host: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Saves at `step` and returns True once it is on disk; raises what failed, and
        when `step` already holds a checkpoint (Orbax would skip the save silently)."""
        if int(step) in self._manager.all_steps():
            raise FileExistsError(f"checkpoint step {step} already exists in {self.directory}")
        self._check_room(step)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  host=ocp.args.JsonSave(encode_host(host or {})))
        if not self._manager.save(int(step), args=args, force=force):
            raise RuntimeError(f"checkpoint step {step} was not saved in {self.directory}")
        self._manager.wait_until_finished()
        return True

    def _check_room(self, step: int) -> None:
        """Refuses a save that cannot fit on a local disk before anything is written:
        Orbax's writer threads, failing one array after another, would bury the cause
        under a traceback each. The estimate is the newest checkpoint's size on disk
        (the same arrays; Orbax compresses them, so their byte count would overstate it)."""
        steps = self.all_steps()
        if not steps or not os.path.isdir(self.directory):
            return  # nothing to measure yet, or a bucket (gs://...)
        newest = os.path.join(self.directory, str(max(steps)))
        needed = sum(os.path.getsize(os.path.join(root, name))
                     for root, _, names in os.walk(newest) for name in names)
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            raise OSError(errno.ENOSPC, f"no room for the checkpoint of step {step}: the "
                          f"last one ({max(steps)}) takes {needed / 2**20:.1f} MiB and "
                          f"{self.directory} has {free / 2**20:.1f} MiB free")

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """(state, host) at `step`, the state laid out like `abstract_state`.

        abstract_state: a pytree of jax.ShapeDtypeStruct with `sharding` set (e.g.
        from `rl.learner.abstract_train_state`), so arrays land directly in the
        sharded layout. A train state saved with an `rng` entry (older TrainStates
        carried one and never read it) restores into a TrainState without one, the
        entry read and dropped; any other difference from `abstract_state` raises.
        """
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"have {self.all_steps()}")
        target = abstract_state
        if self._has_old_rng(step, abstract_state):
            target = _with_old_rng(abstract_state)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                  host=ocp.args.JsonRestore())
        restored = self._manager.restore(int(step), args=args)
        state = restored["state"]
        if target is not abstract_state:
            state = abstract_state.replace(**{k: v for k, v in state.items() if k != "rng"})
        return state, decode_host(restored["host"])

    def _has_old_rng(self, step: int, abstract_state: Any) -> bool:
        """Whether step's saved train state has an `rng` entry that `abstract_state` (a
        TrainState) lacks."""
        if not dataclasses.is_dataclass(abstract_state) or hasattr(abstract_state, "rng"):
            return False
        path = os.path.join(self.directory, str(step), "state")
        saved = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
        return isinstance(saved, dict) and "rng" in saved

    def restore_latest(self, abstract_state: Any,
                       set_aside: bool = True) -> tuple[int, Any, dict[str, Any]]:
        """(step, state, host) of the newest step that reads back whole.

        A newer step that fails to restore is skipped with a warning naming it and the
        error; once an older step restores, the failed ones are renamed <step>.damaged
        (kept for inspection; the run saves those steps again) unless `set_aside` is
        False (a reader that leaves the directory as it is). Raises, naming every
        step's error, when none restores: a run never silently starts over.
        """
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        failed = []
        for step in steps:
            try:
                state, host = self.restore(step, abstract_state)
            except Exception as e:  # noqa: BLE001 - any failure to read means a damaged step
                failed.append((step, f"{type(e).__name__}: {e}"))
                log.warning("checkpoint step %d in %s cannot be restored (%s); trying the "
                            "previous step", step, self.directory, failed[-1][1])
                continue
            if set_aside:
                self._set_aside([s for s, _ in failed])
            return step, state, host
        raise RuntimeError(f"no checkpoint in {self.directory} can be restored: "
                           + "; ".join(f"step {s}: {why}" for s, why in failed))

    def _set_aside(self, steps: list[int]) -> None:
        """Renames damaged steps (on process 0; every process then re-lists the steps)."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                path = os.path.join(self.directory, str(step))
                target, n = path + ".damaged", 1
                while os.path.exists(target):
                    target, n = f"{path}.damaged{n}", n + 1
                os.rename(path, target)
                log.warning("moved damaged checkpoint %s to %s", path, target)
        multihost.sync_global_processes("checkpoint_set_aside")
        self._manager.reload()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
