"""Training algorithms behind one interface (rl.algos.base.Algorithm), by `config.algo`."""

from rl import prefix, tracker
from rl.algos.base import Algorithm, Context
from rl.algos.grpo_ps import GRPOPrefix
from rl.algos.spo import SPO

ALGORITHMS: dict[str, type[Algorithm]] = {"grpo": GRPOPrefix, "spo": SPO}


def get(name: str) -> type[Algorithm]:
    """The algorithm class `config.algo` names."""
    if name not in ALGORITHMS:
        raise ValueError(f"algo must be 'grpo' or 'spo', got {name!r}")
    return ALGORITHMS[name]


def check_config(config) -> None:
    """`config.algo` names an algorithm and the config suits it."""
    get(config.algo).check_config(config)


def check_sections(config) -> None:
    """Builds what the algorithms build from their sections (Prefix Sampling's controller,
    SPO's tracker) whichever `algo` runs: a dry run checks every section."""
    prefix.AdaptiveController(prefix.PrefixConfig(**config.ps))
    tracker.BetaTracker(tracker.SPOConfig(**config.spo))


def build(ctx: Context) -> Algorithm:
    """The algorithm `ctx.config.algo` names."""
    return get(ctx.config.algo)(ctx)


__all__ = ["ALGORITHMS", "Algorithm", "Context", "build", "check_config", "check_sections", "get"]
