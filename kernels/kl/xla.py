"""Exact per-token KL(pi || pi_ref) over the whole vocabulary, chunked like token_logprobs.

With z = h @ w / T (policy), y = h_ref @ w_ref / T (reference), p = softmax(z),
q = softmax(y) and delta = z - y:

  KL = sum_v p_v (log p_v - log q_v) = E_p[delta] - lse(z) + lse(y),
  dKL/dz_v = p_v (delta_v - E_p[delta]).

The forward pass keeps online statistics per row (max and sum-exp of z, sum-exp weighted
delta, max and sum-exp of y); the backward pass recomputes both logit tiles.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels.logprob.rows import compact_rows
from kernels.logprob.xla import logits, row_loop, vocab_loop, weight_grad, weight_layout

F32 = jnp.float32
_CONTRACT_COLS = (((1,), (1,)), ((), ()))


class Chunks(NamedTuple):
    """The static options of one call (hashable: a custom_vjp's non-differentiable
    argument): the softmax temperature, rows and vocabulary columns per tile."""

    temperature: float
    row_block: int
    vocab_block: int


def _merge(stats, z, y):
    """Online update of (m, s, a, m_ref, s_ref) with tiles z, y [R, C].

    s = sum exp(z - m), a = sum exp(z - m) (z - y), s_ref = sum exp(y - m_ref).
    """
    m, s, a, m_ref, s_ref = stats
    m_new = jnp.maximum(m, z.max(axis=-1))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    m_ref_new = jnp.maximum(m_ref, y.max(axis=-1))
    s_ref_new = s_ref * jnp.exp(m_ref - m_ref_new) + jnp.exp(y - m_ref_new[:, None]).sum(-1)
    return (m_new, s * scale + e.sum(-1), a * scale + (e * (z - y)).sum(-1), m_ref_new,
            s_ref_new)


def _rows(x, start, size):
    return lax.dynamic_slice_in_dim(x, start, size, axis=0)


def _stats(h_c, w, hr_c, wr, num_blocks, chunks):
    """(lse[N_pad], mean_delta[N_pad], kl[N_pad]) over compacted rows."""
    row_block, vocab_block, inv_t = chunks.row_block, chunks.vocab_block, 1.0 / chunks.temperature
    num_pad = h_c.shape[0]
    low = jnp.full((num_pad,), jnp.finfo(F32).min)
    zero = jnp.zeros((num_pad,), F32)

    def vocab_body(stats, start, width):
        w_j = lax.dynamic_slice_in_dim(w, start, width, axis=1)
        wr_j = lax.dynamic_slice_in_dim(wr, start, width, axis=1)

        def row_body(stats, r0):
            z = logits(_rows(h_c, r0, row_block), w_j, inv_t)
            y = logits(_rows(hr_c, r0, row_block), wr_j, inv_t)
            block = _merge(tuple(_rows(x, r0, row_block) for x in stats), z, y)
            return tuple(lax.dynamic_update_slice_in_dim(x, b, r0, 0)
                         for x, b in zip(stats, block, strict=True))

        return row_loop(row_body, stats, num_blocks, row_block)

    m, s, a, m_ref, s_ref = vocab_loop(vocab_body, (low, zero, zero, low, zero), w.shape[1],
                                       vocab_block)
    lse, mean_delta = m + jnp.log(s), a / s
    kl = mean_delta - lse + m_ref + jnp.log(s_ref)
    visited = jnp.arange(num_pad) < num_blocks * row_block
    return tuple(jnp.where(visited, x, 0.0) for x in (lse, mean_delta, kl))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def exact_kl_chunked(hidden, lm_head, ref_hidden, ref_lm_head, mask, chunks: Chunks):
    """kl[N] float32, masked rows 0; gradient in hidden and lm_head only."""
    return _forward(hidden, lm_head, ref_hidden, ref_lm_head, mask, chunks)[0]


def _blocks(hidden, lm_head, chunks: Chunks) -> Chunks:
    """The tiles of these shapes: at most the rows and columns there are."""
    return chunks._replace(row_block=min(chunks.row_block, hidden.shape[0]),
                           vocab_block=min(chunks.vocab_block, lm_head.shape[1]))


def _forward(hidden, lm_head, ref_hidden, ref_lm_head, mask, chunks: Chunks):
    chunks = _blocks(hidden, lm_head, chunks)
    rows = compact_rows(mask, chunks.row_block)
    lse, mean_delta, kl = _stats(rows.gather(hidden), lm_head, rows.gather(ref_hidden),
                                 ref_lm_head, rows.num_blocks, chunks)
    residuals = (hidden, lm_head, ref_hidden, ref_lm_head, rows, lse, mean_delta)
    return rows.scatter(kl, hidden.shape[0]), residuals


def _backward(chunks: Chunks, residuals, g_kl):
    hidden, lm_head, ref_hidden, ref_lm_head, rows, lse, mean_delta = residuals
    chunks = _blocks(hidden, lm_head, chunks)
    row_block, vocab_block = chunks.row_block, chunks.vocab_block
    inv_t = 1.0 / chunks.temperature
    h_c, hr_c = rows.gather(hidden), rows.gather(ref_hidden)
    g_c = rows.gather(g_kl.astype(F32))
    mm_dtype = jnp.promote_types(hidden.dtype, lm_head.dtype)
    h_pass = weight_layout(h_c)

    def vocab_body(carry, start, width):
        dh_c, dw = carry
        w_j = lax.dynamic_slice_in_dim(lm_head, start, width, axis=1)
        wr_j = lax.dynamic_slice_in_dim(ref_lm_head, start, width, axis=1)

        def row_body(inner, r0):
            dh_c, dw_j = inner
            row = lambda x: _rows(x, r0, row_block)
            h_i = row(h_c)
            z = logits(h_i, w_j, inv_t)
            delta = z - logits(row(hr_c), wr_j, inv_t)
            p = jnp.exp(z - row(lse)[:, None])
            dz = (row(g_c)[:, None] * p * (delta - row(mean_delta)[:, None]) * inv_t)
            dz = dz.astype(mm_dtype)
            dh_i = lax.dot_general(dz, w_j, _CONTRACT_COLS, preferred_element_type=F32)
            dh_c = lax.dynamic_update_slice_in_dim(dh_c, row(dh_c) + dh_i, r0, 0)
            dw_j = dw_j + weight_grad(h_pass, r0, row_block, dz)
            return dh_c, dw_j

        dw_j = jnp.zeros((lm_head.shape[0], width), F32)
        dh_c, dw_j = row_loop(row_body, (dh_c, dw_j), rows.num_blocks, row_block)
        return dh_c, lax.dynamic_update_slice_in_dim(dw, dw_j.astype(dw.dtype), start, 1)

    init = (jnp.zeros(h_c.shape, F32), jnp.zeros_like(lm_head))
    dh_c, dw = vocab_loop(vocab_body, init, lm_head.shape[1], vocab_block)
    dh = rows.scatter(dh_c, hidden.shape[0]).astype(hidden.dtype)
    return dh, dw, None, None, None


exact_kl_chunked.defvjp(_forward, _backward)
