"""KL API: per-token estimators from log-probs, and exact KL from hidden states."""

import jax

from kernels.kl.estimators import kl_k1, kl_k2, kl_k3, kl_k3plus
from kernels.kl.reference import exact_kl_reference
from kernels.kl.xla import Chunks, exact_kl_chunked

__all__ = ["exact_kl", "kl_k1", "kl_k2", "kl_k3", "kl_k3plus"]

IMPLEMENTATIONS = ("reference", "xla")


def exact_kl(
    hidden: jax.Array,
    lm_head: jax.Array,
    ref_hidden: jax.Array,
    ref_lm_head: jax.Array,
    mask: jax.Array,
    *,
    temperature: float = 1.0,
    implementation: str | None = None,
    row_block: int = 1024,
    vocab_block: int = 4096,
) -> jax.Array:  # (the kernel's API: the two models' arrays and the mask, then options)
    """Per-token KL(pi || pi_ref) over the whole vocabulary, without [N, V] logits.

    pi = softmax(hidden @ lm_head / T), pi_ref = softmax(ref_hidden @ ref_lm_head / T).

    Args:
      hidden: [N, d] policy hidden states; lm_head: [d, V].
      ref_hidden: [N, d_ref] reference hidden states; ref_lm_head: [d_ref, V].
      mask: [N]; rows where mask == 0 return 0, get zero gradient and cost no FLOPs.
      temperature: static Python float > 0, applied to both models.
      implementation: None or "xla" (chunked), or "reference" (naive, for tests).

    Returns:
      kl[N] float32, differentiable in hidden and lm_head; the reference inputs are
      constants (zero gradient).
    """
    num_rows, vocab_size = hidden.shape[0], lm_head.shape[-1]
    if hidden.ndim != 2 or lm_head.shape[0] != hidden.shape[1]:
        raise ValueError(f"hidden [N, d] and lm_head [d, V] disagree: {hidden.shape}, "
                         f"{lm_head.shape}")
    if ref_hidden.ndim != 2 or ref_lm_head.shape != (ref_hidden.shape[1], vocab_size):
        raise ValueError(f"ref_hidden [N, d_ref] and ref_lm_head [d_ref, V={vocab_size}] "
                         f"disagree: {ref_hidden.shape}, {ref_lm_head.shape}")
    if ref_hidden.shape[0] != num_rows or mask.shape != (num_rows,):
        raise ValueError(f"ref_hidden and mask need N={num_rows} rows, got "
                         f"{ref_hidden.shape} and {mask.shape}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    implementation = implementation or "xla"
    if implementation == "reference":
        return exact_kl_reference(hidden, lm_head, ref_hidden, ref_lm_head, mask,
                                  float(temperature))
    if implementation != "xla":
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, "
                         f"got {implementation!r}")
    return exact_kl_chunked(hidden, lm_head, ref_hidden, ref_lm_head, mask,
                            Chunks(float(temperature), row_block, vocab_block))
