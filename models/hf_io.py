"""Qwen3 checkpoints in the HF layout: config.json + safetensors (single or sharded).

Tensor names and orientation are HF's (`model.layers.0.self_attn.q_proj.weight`, [out, in]),
so transformers and SGLang load what `save_hf` writes, and `load_hf` reads released Qwen3
checkpoints. The model stacks its layers ([num_layers, ...] parameters); each layer is still
one HF tensor per parameter: stacked on load, unstacked on save. Loading never
materialises the model on one device: the model is built abstractly (`nnx.eval_shape`) and
each device reads only its own slice of each tensor from the memory-mapped files.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from models.qwen3 import Qwen3, Qwen3Config
from models.sharding import param_path, param_shardings

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def hf_name(path: tuple[str | int, ...]) -> tuple[str, bool]:
    """Our parameter path -> (HF tensor name, whether HF stores it transposed). A layer
    parameter's path names its layer: ('layers', 3, 'mlp', ...) -> model.layers.3.mlp..."""
    if path == ("lm_head_proj", "kernel"):
        return "lm_head.weight", True
    if path == ("embed_tokens", "embedding"):
        return "model.embed_tokens.weight", False
    if path[-1] not in ("kernel", "scale"):
        raise KeyError(f"no HF name for parameter {'.'.join(map(str, path))}")
    name = "model." + ".".join(str(p) for p in path[:-1]) + ".weight"
    return name, path[-1] == "kernel"


def is_stacked(path: tuple[str | int, ...]) -> bool:
    """Whether the parameter at `path` holds every layer ([num_layers, ...] leading axis)."""
    return path[0] == "layers" and not isinstance(path[1], int)


def hf_names(path: tuple[str | int, ...], num_layers: int) -> list[tuple[str, bool]]:
    """(HF name, transposed) of each slice of a parameter: one per layer when stacked."""
    if is_stacked(path):
        return [hf_name(("layers", i, *path[1:])) for i in range(num_layers)]
    return [hf_name(path)]


def _tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict


def load_config(path: str, **overrides) -> Qwen3Config:
    with open(os.path.join(path, "config.json")) as f:
        return Qwen3Config.from_hf(json.load(f), **overrides)


def load_hf(path: str, mesh: jax.sharding.Mesh | None = None, dtype: str = "float32",
            param_dtype: str | None = None, **overrides) -> tuple[Qwen3Config, Qwen3]:
    """Reads an HF Qwen3 directory into a model whose parameters live on `mesh`
    (sharded by models.sharding rules) or, without a mesh, on the default device.
    `overrides` set Qwen3Config fields that are not in config.json (e.g. remat="full")."""
    cfg = load_config(path, dtype=dtype, param_dtype=param_dtype or dtype, **overrides)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        shardings = param_shardings(abstract, mesh)
    files = _tensor_files(path)
    expected = set()
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="numpy"))
                   for f in sorted(set(files.values()))}

        def tensor(name, want):
            expected.add(name)
            if name not in files:
                raise KeyError(f"{path}: tensor {name} missing from the checkpoint")
            t = handles[files[name]].get_slice(name)
            if tuple(t.get_shape()) != tuple(want):
                raise ValueError(f"{path}: tensor {name} has shape {tuple(t.get_shape())}, "
                                 f"config implies {tuple(want)}")
            return t

        def load(keypath, leaf, sharding):
            stacked = is_stacked(param_path(keypath))
            names = hf_names(param_path(keypath), cfg.num_layers)
            shape = leaf.shape[1:] if stacked else leaf.shape
            transposed = names[0][1]
            tensors = [tensor(name, shape[::-1] if transposed else shape) for name, _ in names]

            def read_one(t, index):
                if transposed:
                    return np.asarray(t[index[1], index[0]]).T.astype(leaf.dtype)
                return np.asarray(t[index]).astype(leaf.dtype)

            def read(index):
                if not stacked:
                    return read_one(tensors[0], index)
                layers = range(cfg.num_layers)[index[0]]
                return np.stack([read_one(tensors[i], index[1:]) for i in layers])

            return jax.make_array_from_callback(leaf.shape, sharding, read)

        state = jax.tree_util.tree_map_with_path(load, abstract, shardings)
    unused = set(files) - expected - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if unused:
        raise ValueError(f"{path}: tensors not part of a Qwen3 model: {sorted(unused)[:5]}")
    return cfg, nnx.merge(graphdef, state)


def _to_host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


@jax.jit
def _layer(stacked: jax.Array, index) -> jax.Array:
    """One layer of a stacked parameter, kept on its devices (gathered per layer later)."""
    return jax.lax.dynamic_index_in_dim(stacked, index, axis=0, keepdims=False)


def save_hf(model_or_params: Qwen3 | Any, cfg: Qwen3Config, path: str,
            max_shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> None:
    """Writes config.json and safetensors (sharded with an index when larger than
    `max_shard_bytes`) in HF layout; tensors are stored in `dtype` (default cfg.param_dtype).
    Every process must call it (sharded arrays are gathered); process 0 writes."""
    params = model_or_params
    if isinstance(model_or_params, nnx.Module):
        params = nnx.state(model_or_params, nnx.Param)
    dtype = jnp.dtype(dtype or cfg.param_dtype)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    tensors = []  # (HF name, transposed, array, layer index into a stacked array or None)
    for kp, x in leaves:
        stacked = is_stacked(param_path(kp))
        for i, name in enumerate(hf_names(param_path(kp), cfg.num_layers)):
            tensors.append((*name, x, i if stacked else None))
    shards, size = [[]], 0
    for entry in tensors:
        shape = entry[2].shape[1:] if entry[3] is not None else entry[2].shape
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else \
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {}
        for name, transposed, x, layer in shard:
            host = _to_host(x if layer is None else _layer(x, layer)).astype(dtype)
            arrays[name] = np.ascontiguousarray(host.T if transposed else host)
            weight_map[name] = file
            total += arrays[name].nbytes
        if writer:
            save_file(arrays, os.path.join(path, file), metadata={"format": "pt"})
    if not writer:
        return
    if len(shards) > 1:
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config = cfg.to_hf() | {"torch_dtype": dtype.name}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
