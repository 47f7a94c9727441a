"""Config owners for tests (they have no defaults of their own): the default config's
section with the values a test sets."""

from configs import default
from inference.embedded import EmbeddedOptions
from inference.sglang import SGLangConfig
from rl.rollout import RolloutConfig

SECTION = default.get_config().rollout
# The embedded engine at its smallest: one-row and 16-token buckets, a window of any
# length, no prefix cache (tests choose what they exercise).
ENGINE = dict(max_batch=32, max_len=2048, min_batch=1, min_len=16, min_cache_len=1,
              prefix_cache_tokens=0, chunk_steps=32, min_chunk_steps=0)
# A client that gives up after 3 retries (tests count attempts), exports to a fresh
# temporary directory.
SGLANG = {**default.get_config().engine.sglang, "max_retries": 3, "export_dir": ""}


def rollout_config(**values) -> RolloutConfig:
    return RolloutConfig(**{**SECTION, **values})


def engine_options(**values) -> EmbeddedOptions:
    return EmbeddedOptions(**{**ENGINE, **values})


def sglang_config(**values) -> SGLangConfig:
    return SGLangConfig(**{**SGLANG, **values})
