"""Config conventions shared by every file in `configs/`.

Each config file defines `get_config(arg=None) -> ConfigDict` (big_vision style).
`arg` is the text after the colon in `--config configs/default.py:smoke,seed=3`;
`parse_arg` turns it into a ConfigDict of typed options. Configs are returned
locked: setting a key that does not exist raises an error naming the key, so a
typo in a sweep or on the command line never passes silently. Sweeps are
`get_hyper(h)` functions returning a list of override dicts (`h.product`, `h.sweep`
style, without the dependency: see `product` and `sweep` below).
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import os
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections

ConfigDict = ml_collections.ConfigDict


def parse_arg(arg: str | None, **defaults: Any) -> ConfigDict:
    """Parses `"smoke,seed=3,name=x"` into a ConfigDict over `defaults`.

    A bare word sets a boolean default to True. Values are converted to the type
    of the default; an option that is not in `defaults` is an error naming it.
    """
    out = ConfigDict(dict(defaults))
    if not arg:
        return out
    for item in arg.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, raw = item.partition("=")
        if key not in defaults:
            raise KeyError(f"unknown config option {key!r}; known: {sorted(defaults)}")
        if not eq:
            if not isinstance(defaults[key], bool):
                raise ValueError(f"config option {key!r} needs a value ({key}=...)")
            out[key] = True
            continue
        out[key] = _convert(raw, defaults[key], key)
    return out


def _convert(raw: str, default: Any, key: str) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"config option {key!r} expects a boolean, got {raw!r}")
    if isinstance(default, str) or default is None:
        return raw
    try:
        return type(default)(ast.literal_eval(raw))
    except (ValueError, SyntaxError) as e:
        expected = type(default).__name__
        raise ValueError(f"config option {key!r} expects {expected}, got {raw!r}") from e


def lock(config: ConfigDict) -> ConfigDict:
    """Locks the config so unknown keys raise (ml_collections names the key)."""
    config.lock()
    return config


def apply_overrides(config: ConfigDict, overrides: dict[str, Any]) -> ConfigDict:
    """Sets dotted keys (`"rl.lr": 1e-6`); an unknown key raises naming it."""
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for p in parents:
            if p not in node:
                raise KeyError(f"unknown config key {dotted!r} (no {p!r})")
            node = node[p]
        if leaf not in node:
            raise KeyError(f"unknown config key {dotted!r}")
        node[leaf] = value
    return config


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`["learner.optim.lr=1e-4", "env.backend=docker"]` -> {dotted key: value}; a value
    is a Python literal where it parses as one, else the string."""
    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"override {item!r} is not KEY=VALUE")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def load_config(spec: str) -> ConfigDict:
    """Loads `path/to/file.py[:arg]` by calling its `get_config(arg)`."""
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    name = "config_" + os.path.splitext(os.path.basename(path))[0]
    spec_ = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module.get_config(arg or None)


def product(*axes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cartesian product of sweep axes: each axis a list of override dicts."""
    return [dict(itertools.chain.from_iterable(d.items() for d in combo))
            for combo in itertools.product(*axes)]


def sweep(key: str, values: Sequence[Any]) -> list[dict[str, Any]]:
    """One sweep axis: `sweep("rl.lr", [1e-6, 3e-6])`."""
    return [{key: v} for v in values]


# ------------------------------------------------------------------ shared sections


def sglang_defaults() -> dict[str, Any]:
    """The `engine.sglang` section: client of running servers, or servers to launch.

    urls: servers already running; when empty and `launch` is true, one server per
      entry of `ports` is started with `python -m sglang.launch_server` (see
      inference.sglang.SGLangLauncher) and torn down at exit.
    export_dir: where weights are written as HF safetensors for /update_weights_from_disk.
    """
    return dict(urls=(), launch=False, ports=(30000,), host="127.0.0.1", tp_size=1,
                mem_fraction_static=0.85, extra_args=(), timeout_s=600.0, max_retries=5,
                export_dir="", health_timeout_s=900.0)


def prefix_defaults(enabled: bool = True, adaptive: bool = False) -> ConfigDict:
    """The `ps` section: rl.prefix.PrefixConfig fields (seed 000 values) + `enabled`."""
    return ConfigDict(dict(
        enabled=enabled, low=0.3, high=0.7, remaining_ratio=0.25, prefix_ratio=0.25,
        remaining_cap=0, prefix_cap=0,  # 0 = uncapped
        max_share=0.5, max_age=2, reprefix=False, adaptive=adaptive, ema_alpha=0.05,
        target=0.5, band=0.03, step_size=0.05, cooldown=5, ratio_min=0.05, ratio_max=0.95))


def spo_defaults() -> ConfigDict:
    """The `spo` section (seed 002 values). See rl.spo for the maths.

    in_flight: rollouts kept running at once by the single-stream collector (more
      than batch_tasks; the surplus carries over to the next step).
    init_samples: n0 offline samples per prompt before training (0 = start from prior).
    init_form: "reference" (alpha0 = N0 (s+0.5)/(n0+1), the default) or "paper".
    """
    return ConfigDict(dict(
        rho_type="kl", d_half=0.06, rho_min=0.875, rho_max=0.96, prior=(1.0, 1.0),
        max_stored_tokens=512, sampler_eps=0.05, pool_size=0, in_flight=96,
        init_samples=0, init_form="reference"))


def distributed_defaults() -> dict[str, Any]:
    """The `distributed` section: one JAX process per host (see rl.distributed).

    coordinator: "host:port" of process 0's coordination service; with num_processes
      and process_id (each may come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
      JAX_PROCESS_ID instead). All empty: one process.
    auto: let JAX detect the cluster (TPU pod slices, SLURM, Open MPI, Kubernetes).
    """
    return dict(coordinator="", num_processes=0, process_id=-1, auto=False)
