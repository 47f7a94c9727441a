"""Naive exact KL: materialises both models' [N, V] logits. For tests."""

import jax
import jax.numpy as jnp


def exact_kl_reference(hidden, lm_head, ref_hidden, ref_lm_head, mask, temperature=1.0):
    """kl[N] = sum_v p_v (log p_v - log q_v), p and q the tempered softmaxes; masked rows 0.

    Differentiable in hidden and lm_head by autodiff; the reference model is held constant.
    """
    f32 = jnp.float32
    log_p = jax.nn.log_softmax(hidden.astype(f32) @ lm_head.astype(f32) / temperature, axis=-1)
    ref_z = jax.lax.stop_gradient(ref_hidden.astype(f32) @ ref_lm_head.astype(f32))
    log_q = jax.nn.log_softmax(ref_z / temperature, axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    return jnp.where(mask.astype(bool), kl, 0.0)
