"""Differentiable token log-probs over compacted rows, generic in the blocked engine.

An engine (XlaEngine, PallasEngine) supplies two blocked passes over the vocabulary:

  stats(h_c, w, rows, row_block, inv_t) -> (lse[N_pad], entropy[N_pad], kept)
  grads(h_c, w, rows, row_block, inv_t, RowGrads(t_c, lse, entropy, g_logp, g_ent, kept))
    -> (dh_c f32, dw)

with z = h @ w * inv_t, p = softmax(z), lse = log sum_v exp(z_v), entropy = lse - E_p[z].
The gradient with respect to the logits, given cotangents g_logp and g_ent, is

  dL/dz_v = g_logp * (1[v = t] - p_v) + g_ent * p_v * (E_p[z] - z_v),

and the backward pass recomputes z block by block from the saved lse and entropy, so
no [N, V] array is stored, unless the engine's stats kept z (`kept`, None otherwise): then
the backward reads it instead of recomputing it.
"""

import functools

import jax
import jax.numpy as jnp

from kernels.logprob.rows import RowGrads, compact_rows


def target_logits(h_c: jax.Array, w: jax.Array, t_c: jax.Array, inv_t: float) -> jax.Array:
    """z_t = h . w[:, t] * inv_t per row, float32: [N_pad, d], [d, V], [N_pad] -> [N_pad]."""
    w_t = jnp.take(w, t_c, axis=1).T.astype(jnp.float32)
    return jnp.sum(h_c.astype(jnp.float32) * w_t, axis=-1) * inv_t


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def token_logprobs_chunked(hidden, lm_head, targets, mask, temperature, engine):
    """(logp[N], entropy[N]) float32; masked rows 0. See module docstring."""
    outputs, _ = _forward(hidden, lm_head, targets, mask, temperature, engine)
    return outputs


def _forward(hidden, lm_head, targets, mask, temperature, engine):
    num_rows = hidden.shape[0]
    row_block = engine.rows_per_block(num_rows)
    inv_t = 1.0 / temperature
    rows = compact_rows(mask, row_block)
    h_c = rows.gather(hidden)
    t_c = rows.gather(targets.astype(jnp.int32))
    lse, entropy, kept = engine.stats(h_c, lm_head, rows, row_block, inv_t)
    logp = target_logits(h_c, lm_head, t_c, inv_t) - lse
    outputs = (rows.scatter(logp, num_rows), rows.scatter(entropy, num_rows))
    return outputs, (hidden, lm_head, rows, t_c, lse, entropy, kept)


def _backward(temperature, engine, residuals, cotangents):
    hidden, lm_head, rows, t_c, lse, entropy, kept = residuals
    g_logp, g_ent = (rows.gather(g.astype(jnp.float32)) for g in cotangents)
    row_block = engine.rows_per_block(hidden.shape[0])
    h_c = rows.gather(hidden)
    dh_c, dw = engine.grads(h_c, lm_head, rows, row_block, 1.0 / temperature,
                            RowGrads(t_c, lse, entropy, g_logp, g_ent, kept))
    dh = rows.scatter(dh_c, hidden.shape[0]).astype(hidden.dtype)
    return dh, dw, None, None


token_logprobs_chunked.defvjp(_forward, _backward)
