"""Causal (packed, grouped-query) attention without materialising [T, S] scores."""

from kernels.attention.api import attention

__all__ = ["attention"]
