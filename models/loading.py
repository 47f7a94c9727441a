"""The `model` config section's owner: the Qwen3Config a run trains, and its model.

A checkpoint's config.json (`model.hf_path`) or a preset of models.qwen3 with the
section's overrides; the runtime fields a checkpoint does not hold (dtype, remat,
attention) come from the section. train.py and inference.server build through here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from models import hf_io, qwen3

_MODEL_KEYS = {f.name for f in dataclasses.fields(qwen3.Qwen3Config)}
# Qwen3Config fields a checkpoint's config.json does not hold: the run config sets them.
_RUNTIME_KEYS = ("dtype", "param_dtype", "remat", "attention")
# The keys every model section has; the rest are optional Qwen3Config overrides.
SECTION_KEYS = frozenset({"preset", "hf_path"})


def model_config(model_cfg: Mapping[str, Any], vocab_size: int | None = None,
                 dry_run: bool = False) -> qwen3.Qwen3Config:
    """The checkpoint's config.json, or the preset with the config's overrides (also for a
    dry run on a machine without the checkpoint); from-scratch models take the
    tokenizer's vocabulary, rounded up to a multiple of 64 (ids past it are never
    produced).

    The section holds `preset` and `hf_path` ("" to train from scratch), and overrides
    of Qwen3Config fields: their defaults are the preset's (models.qwen3.PRESETS), so a
    config names only what it changes. Any other key is an error."""
    unknown = set(model_cfg) - SECTION_KEYS - _MODEL_KEYS
    if unknown:
        raise KeyError(f"model: unknown key(s) {sorted(unknown)}; a model section holds "
                       f"{sorted(SECTION_KEYS)} and Qwen3Config fields")
    hf_path = model_cfg["hf_path"]
    if hf_path and not (dry_run and not os.path.exists(hf_path)):
        runtime = {k: model_cfg[k] for k in _RUNTIME_KEYS if k in model_cfg}
        return hf_io.load_config(hf_path, **runtime)
    preset = model_cfg["preset"]
    if preset not in qwen3.PRESETS:
        raise KeyError(f"unknown model preset {preset!r}; known: {sorted(qwen3.PRESETS)}")
    overrides = {k: v for k, v in model_cfg.items() if k in _MODEL_KEYS}
    if vocab_size is not None and not hf_path:
        overrides["vocab_size"] = -(-vocab_size // 64) * 64
    return dataclasses.replace(qwen3.PRESETS[preset], **overrides)


def build_model(model_cfg: Mapping[str, Any], cfg: qwen3.Qwen3Config,
                mesh: jax.sharding.Mesh | None, seed: int) -> qwen3.Qwen3:
    """Loads HF weights straight into their shardings, or initialises from `seed`."""
    if model_cfg["hf_path"]:
        return hf_io.load_hf(model_cfg["hf_path"], mesh=mesh, dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype, remat=cfg.remat,
                             attention=cfg.attention)[1]
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=4)
def abstract_model(cfg: qwen3.Qwen3Config) -> qwen3.Qwen3:
    """The model with abstract parameters (nothing allocated); cached because tracing a
    large preset takes seconds, and the dry runs of a config's options share it."""
    return nnx.eval_shape(lambda: qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)))
