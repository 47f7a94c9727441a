"""Checkpoints: the device TrainState (sharded) plus a host-state dict, via Orbax.

Layout: workdir/ckpt/<step>/{state,host}. `host` is a JSON-able dict whose
leaves may also be NumPy arrays (SPO tracker, PS queue and controller, data
position); arrays are stored exactly (dtype, shape and raw bytes, base64) inside
the JSON, so they round-trip bit for bit without knowing the structure ahead.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

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


class Checkpointer:
    """Saves and restores (TrainState, host dict) pairs under workdir/ckpt.

    keep: how many most recent checkpoints survive. async_save: saves return
    once the arrays are copied off the device; call `wait()` before reading the
    files or exiting.
    """

    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(os.path.join(workdir, "ckpt"))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "host"))

    def save(self, step: int, state: Any, host: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Saves at `step`; returns whether a save was started."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  host=ocp.args.JsonSave(encode_host(host or {})))
        return self._manager.save(int(step), args=args, force=force)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """(state, host) at `step`, the state laid out like `abstract_state`.

        abstract_state: a pytree of jax.ShapeDtypeStruct with `sharding` set (e.g.
        from `rl.learner.abstract_train_state`), so arrays land directly in the
        sharded layout.
        """
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"have {self.all_steps()}")
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                  host=ocp.args.JsonRestore())
        restored = self._manager.restore(int(step), args=args)
        return restored["state"], decode_host(restored["host"])

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
