"""Per-row token sampling: temperature, top-k, top-p, greedy; SGLang-convention log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def truncation_mask(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Tokens kept by top-k then top-p (nucleus), per row.

    scaled[B,V] f32 logits / temperature; top_p[B] in (0, 1]; top_k[B] (-1 = all).
    Top-k keeps the k largest; top-p then keeps the smallest prefix of the sorted
    renormalised top-k distribution whose mass before the token is < top_p:
      keep_j  <=>  sum_{i<j} p_sorted_i < top_p.
    Returns keep[B,V] bool (ties at the threshold are all kept).
    """
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k < 1, vocab, jnp.minimum(top_k, vocab))
    rank = jnp.arange(vocab)[None, :]
    in_k = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    count = jnp.sum(in_k & (mass_before < top_p[:, None]), axis=-1)
    threshold = jnp.take_along_axis(desc, jnp.maximum(count, 1)[:, None] - 1, axis=-1)
    return scaled >= threshold


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row.

    logits[B,V] f32; temperature[B] (0 = greedy); top_p[B]; top_k[B]; keys[B] PRNG keys.
    Sampling is Gumbel-max over the truncated logits / temperature. The log-prob is
    log_softmax(logits / t)[token] over the full vocabulary (t = 1 when greedy),
    which is what SGLang reports and what the learner recomputes.
    Returns (tokens[B] int32, logp[B] f32).
    """
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    truncate = jnp.any((top_p < 1.0) | (top_k > 0))
    keep = jax.lax.cond(truncate, truncation_mask, lambda s, p, k: jnp.ones(s.shape, bool),
                        scaled, top_p, top_k)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, scaled.shape[-1:]))(keys)
    sampled = jnp.argmax(jnp.where(keep, scaled + gumbel, -jnp.inf), axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    logp = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, logp
