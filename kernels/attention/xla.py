"""Blockwise attention in plain XLA: online softmax forward, recomputing backward.

Forward (per query block i, key blocks j in [lo[i], hi[i]) as a dynamic loop):
  s = q_i k_j^T / sqrt(D) masked, m' = max(m, max_j s), l' = l e^(m - m') + sum_j e^(s - m'),
  acc' = acc e^(m - m') + e^(s - m') v_j;  o_i = acc / l,  lse_i = m + log l.
Backward (per key block j, query blocks i in [q_lo[j], q_hi[j])), with p = e^(s - lse),
delta = rowsum(dO * O):
  dv_j += p^T dO_i,  ds = p (dO_i v_j^T - delta) / sqrt(D),  dk_j += ds^T q_i,  dq_i += ds k_j.
Only [B, H, block_q, block_k] scores exist at a time, so memory is O(T x block) both ways,
and the backward pass stores nothing but o and lse. Statistics are float32.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.attention.blocks import BlockRanges, Layout, block_ranges

F32 = jnp.float32


def _blocks(x, block):
    """[B, N, ...] -> [B, N / block, block, ...]."""
    return x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])


def _take(x, i):
    """Block i of a [B, n, ...] array (dynamic index on the block axis)."""
    return lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)


def _scores(q_i, k_j, mask, scale):
    """[B, bq, K, G, D] x [B, bk, K, D] -> masked [B, K, G, bq, bk] float32 scores."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=F32) * scale
    return jnp.where(mask[:, None, None], s, -jnp.inf)


def _mask(qs_i, ks_j, qp_i, kp_j):
    """[B, bq, bk] element mask of one block pair."""
    same = qs_i[:, :, None] == ks_j[:, None, :]
    return same & (qs_i != 0)[:, :, None] & (kp_j[:, None, :] <= qp_i[:, :, None])


def _forward(q, k, v, ids: Layout, ranges, blocks):
    """q [B, T, K, G, D] (T a multiple of block_q) -> (o like q, lse [B, K, G, T] f32)."""
    (q_seg, kv_seg, q_pos, kv_pos), (block_q, block_k) = ids, blocks
    b, t, kh, g, d = q.shape
    scale = d ** -0.5
    qb, qsb, qpb = (_blocks(x, block_q) for x in (q, q_seg, q_pos))
    kb, vb, ksb, kpb = (_blocks(x, block_k) for x in (k, v, kv_seg, kv_pos))

    def q_block(i):
        q_i, qs_i, qp_i = _take(qb, i), _take(qsb, i), _take(qpb, i)

        def body(j, carry):
            m, total, acc = carry
            s = _scores(q_i, _take(kb, j), _mask(qs_i, _take(ksb, j), qp_i, _take(kpb, j)),
                        scale)
            m_new = jnp.maximum(m, s.max(-1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            corr = jnp.exp(m - shift)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), _take(vb, j),
                            preferred_element_type=F32)
            return m_new, total * corr + p.sum(-1), acc * corr[..., None] + pv

        init = (jnp.full((b, kh, g, block_q), -jnp.inf, F32),
                jnp.zeros((b, kh, g, block_q), F32), jnp.zeros((b, kh, g, block_q, d), F32))
        m, total, acc = lax.fori_loop(ranges.lo[i], ranges.hi[i], body, init)
        o = acc / jnp.where(total > 0, total, 1.0)[..., None]
        lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), 0.0)
        return o.astype(q.dtype), lse

    o, lse = lax.map(q_block, jnp.arange(t // block_q))   # [nq, B, K, G, bq, (D)]
    o = jnp.transpose(o, (1, 0, 4, 2, 3, 5)).reshape(b, t, kh, g, d)
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(b, kh, g, t)
    return o, lse


def _backward(residuals, do, blocks):
    """(dq, dk, dv) in the dtypes of q, k, v; residuals: _attention_fwd's."""
    q, k, v, (q_seg, kv_seg, q_pos, kv_pos), ranges, o, lse = residuals
    ranges, (block_q, block_k) = BlockRanges(*ranges), blocks
    b, t, kh, g, d = q.shape
    scale = d ** -0.5
    delta = jnp.einsum("btkgd,btkgd->bkgt", do.astype(F32), o.astype(F32))
    qb, dob, qsb, qpb = (_blocks(x, block_q) for x in (q, do, q_seg, q_pos))
    lseb, deltab = (x.reshape(b, kh, g, t // block_q, block_q) for x in (lse, delta))
    kb, vb, ksb, kpb = (_blocks(x, block_k) for x in (k, v, kv_seg, kv_pos))

    def k_block(dq, j):
        k_j, v_j, ks_j, kp_j = _take(kb, j), _take(vb, j), _take(ksb, j), _take(kpb, j)

        def body(i, carry):
            dq, dk, dv = carry
            q_i, do_i = _take(qb, i), _take(dob, i)
            lse_i = lax.dynamic_index_in_dim(lseb, i, axis=3, keepdims=False)
            delta_i = lax.dynamic_index_in_dim(deltab, i, axis=3, keepdims=False)
            s = _scores(q_i, k_j, _mask(_take(qsb, i), ks_j, _take(qpb, i), kp_j), scale)
            p = jnp.exp(s - lse_i[..., None])
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), do_i,
                                 preferred_element_type=F32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j, preferred_element_type=F32)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, q_i, preferred_element_type=F32)
            dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds, k_j, preferred_element_type=F32)
            dq = lax.dynamic_update_index_in_dim(dq, _take(dq, i) + dq_i, i, axis=1)
            return dq, dk, dv

        init = (dq, jnp.zeros(k_j.shape, F32), jnp.zeros(v_j.shape, F32))
        dq, dk, dv = lax.fori_loop(ranges.q_lo[j], ranges.q_hi[j], body, init)
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = jnp.zeros((b, t // block_q, block_q, kh, g, d), F32)
    dq, (dk, dv) = lax.scan(k_block, dq0, jnp.arange(k.shape[1] // block_k))
    unblock = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, k.shape[1], kh, d)
    return dq.reshape(q.shape).astype(q.dtype), unblock(dk), unblock(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, ids: Layout, blocks):
    return _forward(q, k, v, ids, block_ranges(*ids, *blocks), blocks)[0]


def _attention_fwd(q, k, v, ids: Layout, blocks):
    ranges = block_ranges(*ids, *blocks)
    o, lse = _forward(q, k, v, ids, ranges, blocks)
    return o, (q, k, v, ids, ranges, o, lse)


def _attention_bwd(blocks, residuals, do):
    return (*_backward(residuals, do, blocks), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention_xla(q, k, v, ids: Layout, block_q: int, block_k: int):
    """q [B, T, K, G, D], k/v [B, S, K, D] (T, S multiples of the blocks) -> o like q;
    ids: who may read whom (blocks.Layout)."""
    return _attention(q, k, v, Layout(*ids), (block_q, block_k))
