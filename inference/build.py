"""The `engine` config section's owner: the embedded JAX sampler, or a client of SGLang
servers (launched if the section asks), and where the learner's GPUs are."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from inference import launcher, sglang
from inference.embedded import EmbeddedEngine, EmbeddedOptions
from inference.engine import Engine

KINDS = ("embedded", "sglang")
Served = launcher.Served


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The `engine` section's owner: `kind`, the embedded engine's options and the SGLang
    client's (whose `launch` is off unless `kind` is "sglang": a run on the embedded
    engine launches nothing)."""

    kind: str
    embedded: EmbeddedOptions
    sglang: sglang.SGLangConfig

    @classmethod
    def from_section(cls, section) -> EngineConfig:
        sg = sglang.SGLangConfig(**section["sglang"])
        if section["kind"] != "sglang":
            sg = dataclasses.replace(sg, launch=False)
        return cls(section["kind"], EmbeddedOptions.from_section(section), sg)


def from_config(cfg: EngineConfig, served: Served, weights: Callable[[], Any],
                workdir: str) -> Engine:
    """The engine `cfg.kind` names, for the model `served` describes. weights: () ->
    (graphdef, params) on this process's devices, called only for the embedded engine
    (SGLang's servers load their own)."""
    if cfg.kind == "embedded":
        return EmbeddedEngine(weights(), cfg.embedded, seed=served.seed)
    if cfg.kind == "sglang":
        return launcher.connect(cfg.sglang, served, workdir)
    raise ValueError(f"engine.kind must be one of {KINDS}, got {cfg.kind!r}")


def placement(cfg: EngineConfig) -> dict[str, Any]:
    """Which of the host's GPUs launched servers and the learner use
    (inference.launcher.placement; with the embedded engine the learner has them all)."""
    return launcher.placement(cfg.sglang)


def restrict_learner_devices(cfg: EngineConfig) -> list[int]:
    """Before JAX starts its backend: the learner's GPU ids, this process's JAX devices
    limited to them when it launches servers beside itself."""
    return launcher.restrict_learner_devices(cfg.sglang)


def launch_commands(cfg: EngineConfig, served: Served,
                    workdir: str = "WORKDIR") -> list[list[str]]:
    """The server command lines `from_config` would run (SGLang engine), each prefixed
    with its environment; the model is `served.hf_path` or the export of a model trained
    from scratch under workdir."""
    model_path = served.hf_path or os.path.join(workdir, "sglang_weights", "init")
    return launcher.launch_commands(cfg.sglang, model_path, served.max_context)


def check_context(cfg: EngineConfig, served: Served) -> None:
    """An SGLang run's rollout.max_context fits the served model (refused up front)."""
    if cfg.kind == "sglang":
        launcher.check_context(served.max_context, served.model_config)
