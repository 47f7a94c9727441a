"""A RolloutConfig for tests: the default config's rollout section with the values a test
sets (RolloutConfig has no defaults of its own)."""

from configs import default
from rl.rollout import RolloutConfig

SECTION = default.get_config().rollout


def rollout_config(**values) -> RolloutConfig:
    return RolloutConfig(**{**SECTION, **values})
