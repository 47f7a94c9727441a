"""Per-token log-probabilities and entropies from hidden states and the LM head."""

from kernels.logprob.api import token_logprobs

__all__ = ["token_logprobs"]
