"""Config owners for tests (they have no defaults of their own): the default config's
section, in its planted family (the one-bug tasks the tests were written for), with the
values a test sets."""

import dataclasses

from configs import common, default
from env.config import EnvConfig
from inference.embedded import SMALLEST, EmbeddedOptions
from inference.launcher import LauncherConfig
from inference.sglang import SGLangConfig
from rl.algos import AlgoConfig
from rl.learner import LearnerConfig
from rl.prefix import PrefixConfig
from rl.rollout import RolloutConfig
from rl.tracker import SPOConfig

PLANTED = default.get_config("planted")
SECTION = PLANTED.rollout
# A client that gives up after 3 retries (tests count attempts), exports to a fresh
# temporary directory.
SGLANG = {**PLANTED.engine.sglang, "max_retries": 3, "export_dir": ""}


def rollout_config(**values) -> RolloutConfig:
    return RolloutConfig(**{**SECTION, **values})


def engine_options(**values) -> EmbeddedOptions:
    """The embedded engine at its smallest (inference.embedded.SMALLEST) with the values a
    test sets."""
    return dataclasses.replace(SMALLEST, **values)


def sglang_config(**values) -> SGLangConfig:
    return SGLangConfig(**{**SGLANG, **values})


def launcher_config(**values) -> LauncherConfig:
    """One server of the default config's engine.sglang section (seeded, its flag
    included), on a free port, with no GPUs and the default rollout.max_context, with the
    values a test sets."""
    section = LauncherConfig.from_section(sglang_config(), model_path="", port=0,
                                          context_length=SECTION.max_context)
    return dataclasses.replace(section, **values)


def learner_config(optim=None, loss=None, **values) -> LearnerConfig:
    """The learner section's documented defaults (configs.common.learner_defaults; the
    default config's row_buckets) with the values a test sets, `optim` and `loss` as dicts
    of their subsections' keys."""
    section = common.learner_defaults()
    return LearnerConfig.from_section({
        **section, "row_buckets": PLANTED.learner.row_buckets, **values,
        "optim": {**section.optim, **(optim or {})}, "loss": {**section.loss, **(loss or {})}})


def algo_config(ps=None, spo=None, **values) -> AlgoConfig:
    """The algorithm's config: seed 0, grpo advantages with degenerate groups rejected,
    the `ps` and `spo` sections' documented defaults (configs.common) and the default
    config's rollout section, with the values a test sets (`ps`, `spo` as dicts)."""
    top = dict(name="grpo", advantage="grpo", reject_degenerate=True, seed=0)
    return AlgoConfig(**{**top, **values},
                      ps=PrefixConfig(**{**common.prefix_defaults(), **(ps or {})}),
                      spo=SPOConfig(**{**common.spo_defaults(), **(spo or {})}),
                      rollout=rollout_config())


def env_config(**values) -> EnvConfig:
    """The default config's env section with the values a test sets."""
    return EnvConfig.from_section({**PLANTED.env, **values})
