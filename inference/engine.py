"""The inference engine protocol: token ids in, token ids and their log-probs out.

Rollout code speaks only to `Engine`; the backends are the in-process JAX sampler
(`inference.embedded.EmbeddedEngine`) and an HTTP client of SGLang servers
(`inference.sglang.SGLangClient`). Log-probs follow SGLang: the log-softmax of
`logits / temperature` at the chosen token, before any top-p / top-k truncation
(temperature 0 means greedy, and its log-probs are reported at temperature 1).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """The engine could not serve a request (infrastructure, not the request's fault)."""


class ContextLengthError(EngineError):
    """prompt + max_new_tokens exceed the engine's context length (the trajectory is
    truncated there, not failed)."""


class BrokenSampleError(EngineError):
    """The engine produced a broken sample (SGLang's `"matched": "NaN happened"`); its
    tokens must never be trained on."""


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One prompt and how to continue it.

    prompt_ids: token ids of the whole context (at least one).
    max_new_tokens: most tokens to generate (>= 1).
    temperature: softmax temperature; 0 is greedy decoding.
    top_p: nucleus mass in (0, 1]; 1 keeps every token.
    top_k: keep the k most likely tokens; -1 keeps all.
    stop_token_ids: generation ends after emitting any of these (the id is kept in the output).
    seed: same seed and same prompt give the same sample; None draws a fresh one.
    return_logprob: False when the caller has no use for the log-probs (greedy
      evaluation): an engine may then leave them out of its work (the embedded one skips
      a greedy step's log-sum-exp over the vocabulary) and report NaN in their place.
    session: the episode this request is a turn of ("": none). An engine over several
      servers sends every request of a session to one server, which holds its prefix.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    return_logprob: bool = True
    session: str = ""

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not self.prompt_ids:
            raise ValueError("GenerateRequest.prompt_ids is empty; need at least one token")
        if min(self.prompt_ids) < 0:
            raise ValueError(f"GenerateRequest.prompt_ids has a negative id "
                             f"{min(self.prompt_ids)}")
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"GenerateRequest.max_new_tokens must be >= 1, "
                             f"got {self.max_new_tokens}")
        if not float(self.temperature) >= 0.0:
            raise ValueError(f"GenerateRequest.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"GenerateRequest.top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != -1 and int(self.top_k) < 1:
            raise ValueError(f"GenerateRequest.top_k must be -1 or >= 1, got {self.top_k}")


@dataclasses.dataclass
class GenerateResult:
    """What came out of one request.

    output_ids: generated ids (a matched stop id is the last one).
    logprobs: per output id, log_softmax(logits / temperature)[id] (temperature 1 when greedy).
    finish_reason: "stop" (a stop id), "length" (max_new_tokens) or "abort".
    timings: seconds; keys prefill_s, decode_s, queue_s.
    cached_tokens: leading prompt ids served from the engine's prefix cache.
    policy_version: the oldest weight version (count of `update_weights` the engine had
      applied) that produced any of the output ids; None when the engine does not track it.
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    cached_tokens: int = 0
    policy_version: int | None = None


class Engine(abc.ABC):
    """Async text-free generation service. Also an (async) context manager."""

    @abc.abstractmethod
    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Results in the order of `requests`."""

    @abc.abstractmethod
    async def update_weights(self, params_or_path: Any) -> None:
        """Serves new weights: a params pytree or a HF safetensors directory."""

    def abort(self, request: GenerateRequest) -> bool:
        """Ends `request` (an object passed to a `generate` call still running) soon: its
        result then has finish_reason "abort" and the tokens generated so far. False when
        this engine cannot (a caller that must stop it cancels the call instead)."""
        return False

    def flush_cache(self) -> None:
        """Drops every cached prompt prefix (SGLang's /flush_cache); a no-op without one."""
        return None

    def update_stats(self) -> dict[str, float]:
        """Metrics of the last `update_weights` (export and reload times, sizes); {} when
        the engine has none."""
        return {}

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine can serve requests now."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases resources; pending requests finish with reason "abort"."""

    async def aclose(self) -> None:
        """`close()` from async code, awaiting any asynchronous cleanup."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
