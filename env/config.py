"""The `env` config section's owner: the run's tasks, its sandboxes and their pace
(configs/default.py and configs.common.sandbox_defaults document each key)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from env.latency import LatencyConfig


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The `env` section: which tasks (env.splits), which sandboxes (env.sandbox), how
    many at once, whether the prompt lists the tools, and the tool calls' latency."""

    backend: str
    tasks: str
    train_tasks: int
    eval_tasks: int
    difficulties: tuple[int, ...]
    task_seed: int
    eval_seed: int
    image: str
    image_template: str
    max_concurrent: int
    tools_in_prompt: bool
    latency: LatencyConfig
    placement: str
    ray_address: str
    local_allow_unisolated: bool
    local_read_only: tuple[str, ...]

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> EnvConfig:
        """The owner of an `env` section and its `latency` subsection."""
        return cls(**{**section, "latency": LatencyConfig(**section["latency"]),
                      **{k: tuple(section[k]) for k in ("difficulties", "local_read_only")}})
