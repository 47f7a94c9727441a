"""The `engine` config section's owner: the embedded JAX sampler, or a client of SGLang
servers (launched if the section asks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inference import sglang
from inference.embedded import EmbeddedEngine, options_from_config
from inference.engine import Engine
from models.qwen3 import Qwen3Config


def from_config(config, weights: Callable[[], Any], workdir: str,
                model_config: Qwen3Config) -> Engine:
    """The engine `config.engine.kind` names. weights: () -> (graphdef, params) on this
    process's devices, called only for the embedded engine (SGLang's servers load their
    own); model_config: the served model's."""
    kind = config.engine.kind
    if kind == "embedded":
        return EmbeddedEngine(weights(), seed=config.seed, **options_from_config(config.engine))
    if kind == "sglang":
        return sglang.from_config(config, workdir, model_config=model_config)
    raise ValueError(f"engine.kind must be 'embedded' or 'sglang', got {kind!r}")
