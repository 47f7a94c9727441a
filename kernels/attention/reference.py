"""Dense attention: the [B, T, S] mask and [B, H, T, S] scores, materialised."""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions) -> jax.Array:
    """[B, T, S] bool: same nonzero segment and kv_positions[s] <= q_positions[t]."""
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    return same & causal & (q_segment_ids != 0)[:, :, None]


def attention_reference(q, k, v, layout):
    """o[t] = sum_s softmax_s(q[t] . k[s] / sqrt(D) over allowed s) v[s], grouped heads.

    q: [B, T, H, D], k/v: [B, S, K, D] with H = K * G (query head h reads kv head h // G);
    layout: (q_segment_ids, kv_segment_ids, q_positions, kv_positions), blocks.Layout.
    Scores and softmax in float32; the probabilities are cast to v's dtype for the value
    matmul. A query with no allowed key (padding) gets exactly 0 and no gradient.
    """
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    mask = attention_mask(*layout)
    q = q.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=F32) * (d ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = (weights / jnp.where(total > 0, total, 1.0)).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=F32)
    return out.reshape(b, t, h, d).astype(q.dtype)
