"""The `engine` config section's owner: the embedded JAX sampler, or a client of SGLang
servers (launched if the section asks), and where the learner's GPUs are."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from inference import sglang
from inference.embedded import EmbeddedEngine, EmbeddedOptions
from inference.engine import Engine
from models.qwen3 import Qwen3Config

KINDS = ("embedded", "sglang")


def _sglang(config) -> sglang.SGLangConfig:
    """The section's SGLangConfig; a run whose engine is not SGLang launches nothing."""
    sg = sglang.SGLangConfig(**config.engine.sglang)
    return sg if config.engine.kind == "sglang" else dataclasses.replace(sg, launch=False)


def from_config(config, weights: Callable[[], Any], workdir: str,
                model_config: Qwen3Config) -> Engine:
    """The engine `config.engine.kind` names. weights: () -> (graphdef, params) on this
    process's devices, called only for the embedded engine (SGLang's servers load their
    own); model_config: the served model's."""
    kind = config.engine.kind
    if kind == "embedded":
        return EmbeddedEngine(weights(), EmbeddedOptions.from_section(config.engine),
                              seed=config.seed)
    if kind == "sglang":
        served = sglang.Served(hf_path=config.model.hf_path, model_config=model_config,
                               max_context=int(config.rollout.max_context),
                               seed=int(config.seed))
        return sglang.connect(_sglang(config), served, workdir)
    raise ValueError(f"engine.kind must be one of {KINDS}, got {kind!r}")


def placement(config) -> dict[str, Any]:
    """Which of the host's GPUs launched servers and the learner use
    (inference.sglang.placement; with the embedded engine the learner has them all)."""
    return sglang.placement(_sglang(config))


def restrict_learner_devices(config) -> list[int]:
    """Before JAX starts its backend: the learner's GPU ids, this process's JAX devices
    limited to them when it launches servers beside itself."""
    return sglang.restrict_learner_devices(_sglang(config))


def launch_commands(config, workdir: str = "WORKDIR") -> list[list[str]]:
    """The server command lines `from_config` would run (SGLang engine), each prefixed
    with its environment; the model is `model.hf_path` or the export of a model trained
    from scratch under workdir."""
    model_path = config.model.hf_path or os.path.join(workdir, "sglang_weights", "init")
    return sglang.launch_commands(_sglang(config), model_path, int(config.rollout.max_context))


def check_context(config, model_config: Qwen3Config) -> None:
    """An SGLang run's rollout.max_context fits the served model (refused up front)."""
    if config.engine.kind == "sglang":
        sglang.check_context(int(config.rollout.max_context), model_config)
