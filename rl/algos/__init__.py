"""Training algorithms behind one interface (rl.algos.base.Algorithm), by `config.algo`."""

from rl.algos.base import Algorithm, Context
from rl.algos.grpo_ps import GRPOPrefix
from rl.algos.spo import SPO

ALGORITHMS: dict[str, type[Algorithm]] = {"grpo": GRPOPrefix, "spo": SPO}


def build(ctx: Context) -> Algorithm:
    """The algorithm `ctx.config.algo` names."""
    name = ctx.config.algo
    if name not in ALGORITHMS:
        raise ValueError(f"algo must be one of {sorted(ALGORITHMS)}, got {name!r}")
    return ALGORITHMS[name](ctx)


__all__ = ["ALGORITHMS", "Algorithm", "Context", "build"]
