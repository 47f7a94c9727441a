"""Device mesh and parameter / batch shardings for Qwen3.

Mesh axes ("data", "fsdp", "tensor"): batches are split over data x fsdp; parameters are
split over fsdp on the model width (ZeRO-3 style, gathered per matmul by XLA) and over
tensor on heads / SwiGLU width / vocab (Megatron style). Each parameter gets *logical*
axes by its name; RULES maps logical axes to mesh axes. A mesh axis that does not divide
a dimension is dropped for that dimension (the parameter is replicated along it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")

# Logical axes of each parameter, keyed by (module name, variable name); kernels are [in, out].
PARAM_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head_proj", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "q_heads"),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("q_heads", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("input_layernorm", "scale"): ("norm",),
    ("post_attention_layernorm", "scale"): ("norm",),
    ("q_norm", "scale"): ("norm",),
    ("k_norm", "scale"): ("norm",),
    ("norm", "scale"): ("norm",),
}

# Logical axis -> mesh axis (None = replicated).
RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "layers": None,
}


def make_mesh(data: int, fsdp: int, tensor: int,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over all devices; one size may be -1 (= the rest)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    named = dict(zip(AXES, sizes, strict=True))
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh size may be -1, got {named}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if known <= 0 or len(devices) % known:
            raise ValueError(f"{len(devices)} devices cannot fill mesh {named}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices) or min(sizes) < 1:
        raise ValueError(f"mesh {dict(zip(AXES, sizes, strict=True))} needs "
                         f"{int(np.prod(sizes))} devices, have {len(devices)}")
    grid = mesh_utils.create_device_mesh(sizes, devices=devices)
    return Mesh(grid, AXES)


def param_path(keypath) -> tuple[str | int, ...]:
    """jax key path of a parameter leaf -> its module path, e.g. ('layers', 0, 'mlp', ...)."""
    out = []
    for key in keypath:
        if isinstance(key, jax.tree_util.DictKey):
            out.append(key.key)
        elif isinstance(key, jax.tree_util.SequenceKey):
            out.append(key.idx)
    return tuple(out)


def logical_axes(path: tuple[str | int, ...]) -> tuple[str, ...]:
    """Logical axes of the parameter at `path`; unknown parameters are an error. The
    stacked decoder layers (path 'layers', <module>, ...) add a leading "layers" axis."""
    key = tuple(str(p) for p in path[-2:])
    if key not in PARAM_AXES:
        raise KeyError(f"no sharding rule for parameter {'.'.join(map(str, path))}")
    stacked = len(path) > 1 and path[0] == "layers" and not isinstance(path[1], int)
    return ("layers", *PARAM_AXES[key]) if stacked else PARAM_AXES[key]


def partition_spec(path: tuple[str | int, ...], shape: tuple[int, ...],
                   mesh: Mesh) -> PartitionSpec:
    """PartitionSpec of one parameter: RULES applied, non-dividing mesh axes dropped."""
    axes = logical_axes(path)
    if len(axes) != len(shape):
        raise ValueError(f"parameter {'.'.join(map(str, path))} has shape {shape}, "
                         f"rule {axes} expects rank {len(axes)}")
    spec = []
    for axis, dim in zip(axes, shape, strict=True):
        mesh_axis = RULES[axis]
        keep = mesh_axis is not None and dim % mesh.shape[mesh_axis] == 0
        spec.append(mesh_axis if keep and mesh.shape[mesh_axis] > 1 else None)
    return PartitionSpec(*spec)


def param_shardings(abstract_params: Any, mesh: Mesh) -> Any:
    """Tree of NamedSharding matching `abstract_params` (an nnx.State or dict of arrays or
    ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(mesh, partition_spec(param_path(kp), x.shape, mesh)),
        abstract_params)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Moves every parameter onto its sharding over `mesh`."""
    return jax.device_put(params, param_shardings(params, mesh))


def constrain_rows(x: jax.Array) -> jax.Array:
    """x [B, ...] kept split by rows over data x fsdp when a mesh is set (`jax.set_mesh`);
    unchanged otherwise. Without it XLA may gather the activations of every row onto each
    device (instead of the weights) for an FSDP-sharded matmul."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"data", "fsdp"} <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(("data", "fsdp")))


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of [B, T] batches: rows over data x fsdp, time replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
