"""Naive token log-probs: materialises [N, V] float32 logits. For tests and benchmarks."""

import jax
import jax.numpy as jnp


def token_logprobs_reference(hidden, lm_head, targets, mask, temperature=1.0):
    """(logp[N], entropy[N]) float32 of softmax(hidden @ lm_head / T); masked rows 0.

    logp = log p(targets), entropy = -sum_v p_v log p_v; differentiable by plain autodiff.
    """
    z = jnp.dot(hidden.astype(jnp.float32), lm_head.astype(jnp.float32)) / temperature
    log_p = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(log_p, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    valid = mask.astype(bool)
    return jnp.where(valid, logp, 0.0), jnp.where(valid, entropy, 0.0)
