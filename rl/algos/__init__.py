"""Training algorithms behind one interface (rl.algos.base.Algorithm), by `AlgoConfig.name`."""

from rl import prefix, tracker
from rl.algos.base import AlgoConfig, Algorithm, Context
from rl.algos.grpo_ps import GRPOPrefix
from rl.algos.spo import SPO

ALGORITHMS: dict[str, type[Algorithm]] = {"grpo": GRPOPrefix, "spo": SPO}


def get(name: str) -> type[Algorithm]:
    """The algorithm class `name` names."""
    if name not in ALGORITHMS:
        raise ValueError(f"algo must be 'grpo' or 'spo', got {name!r}")
    return ALGORITHMS[name]


def check_config(cfg: AlgoConfig) -> None:
    """`cfg.name` names an algorithm and the config suits it."""
    get(cfg.name).check_config(cfg)


def check_sections(cfg: AlgoConfig) -> None:
    """Builds what the algorithms build from their sections (Prefix Sampling's controller,
    SPO's tracker) whichever algorithm runs: a dry run checks every section."""
    prefix.AdaptiveController(cfg.ps)
    tracker.BetaTracker(cfg.spo)


def build(ctx: Context) -> Algorithm:
    """The algorithm `ctx.cfg.name` names."""
    return get(ctx.cfg.name)(ctx)


__all__ = ["ALGORITHMS", "AlgoConfig", "Algorithm", "Context", "build", "check_config",
           "check_sections", "get"]
