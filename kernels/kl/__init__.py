"""KL penalties: per-token estimators from log-probs, and exact KL over the vocabulary."""

from kernels.kl.api import exact_kl, kl_k1, kl_k2, kl_k3, kl_k3plus

__all__ = ["exact_kl", "kl_k1", "kl_k2", "kl_k3", "kl_k3plus"]
