"""Chunked XLA engine: vocabulary blocks (static scan) x valid row blocks (dynamic loop).

Any backend; the default on CPU. Peak extra memory is a few [row_block, vocab_block]
float32 tiles instead of [N, V] logits, unless the logits fit `keep_bytes`: then the
forward keeps them for the backward, which skips recomputing them. The logit matmul is a
quarter of the work (forward, recompute, two gradient matmuls: 8 N d V FLOPs, 6 when kept),
and at N=4096 d=512 V=32768 the kept logits are 0.5 GiB.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels.logprob.rows import RowCompaction, RowGrads

F32 = jnp.float32
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # a[R, x], b[R, y] -> [x, y]
_CONTRACT_COLS = (((1,), (1,)), ((), ()))  # a[x, C], b[y, C] -> [x, y]


def vocab_loop(body, carry, vocab_size: int, vocab_block: int):
    """carry = body(carry, start, width) over vocabulary blocks; width is static.

    Whole blocks run under lax.scan; a remainder block (vocab_size % vocab_block) runs once
    more with its own static width, so no padded copy of the LM head is made.
    """
    num_full, tail = divmod(vocab_size, vocab_block)
    if num_full:
        step = lambda c, j: (body(c, j * vocab_block, vocab_block), None)
        carry, _ = lax.scan(step, carry, jnp.arange(num_full))
    if tail:
        carry = body(carry, num_full * vocab_block, tail)
    return carry


def row_loop(body, carry, num_blocks: jax.Array, row_block: int):
    """carry = body(carry, start) for the first num_blocks row blocks (a dynamic trip count)."""
    return lax.fori_loop(0, num_blocks, lambda i, c: body(c, i * row_block), carry)


def logits(h_rows: jax.Array, w_cols: jax.Array, inv_t: float) -> jax.Array:
    """z = h @ w * inv_t with float32 accumulation: [R, d], [d, C] -> [R, C]."""
    return jnp.dot(h_rows, w_cols, preferred_element_type=F32) * inv_t


def _reads_transposed(dtype) -> bool:
    """Whether weight_grad reads h from a transposed copy: in float32; in narrower dtypes
    XLA:CPU cannot run the dot with the transpose folded in ("Unsupported element type
    for DotThunk::Execute: BF16 x BF16 = F32"), so they keep the row contraction."""
    return dtype == F32


def weight_layout(h: jax.Array) -> jax.Array:
    """h [N_pad, d] as weight_grad reads it for a whole pass (transposed once, or as is)."""
    return h.T if _reads_transposed(h.dtype) else h


def weight_grad(h_pass: jax.Array, r0, row_block: int, dz: jax.Array) -> jax.Array:
    """h[r0:r0+row_block].T @ dz, float32, from h_pass = weight_layout(h) and dz[row_block, C].

    In float32 the rows come from the transposed copy: a dot contracting both operands'
    leading (row) axis takes CPU dots about twice as long (3.9 s against 1.9 s of CPU at
    [4096, 512] x [4096, 32768]).
    """
    if _reads_transposed(h_pass.dtype):
        h_rows_t = lax.dynamic_slice_in_dim(h_pass, r0, row_block, axis=1)
        return jnp.dot(h_rows_t, dz, preferred_element_type=F32)
    h_rows = lax.dynamic_slice_in_dim(h_pass, r0, row_block, axis=0)
    return lax.dot_general(h_rows, dz, _CONTRACT_ROWS, preferred_element_type=F32)


def merge_stats(m, s, a, z):
    """Online softmax statistics, updated with a block of logits z[R, C].

    m: running max; s = sum_v exp(z_v - m); a = sum_v exp(z_v - m) (z_v - m).
    Re-basing from m to m' multiplies both by exp(m - m') and shifts a by s (m - m').
    """
    m_new = jnp.maximum(m, z.max(axis=-1))
    scale = jnp.exp(m - m_new)
    shifted = z - m_new[:, None]
    e = jnp.exp(shifted)
    s_new = s * scale + e.sum(axis=-1)
    a_new = (a + s * (m - m_new)) * scale + (e * shifted).sum(axis=-1)
    return m_new, s_new, a_new


def finish_stats(m, s, a):
    """(lse, entropy) from online statistics: lse = m + log s, H = lse - E_p[z] = log s - a/s."""
    return m + jnp.log(s), jnp.log(s) - a / s


def logit_cotangent(z, cols, rows: RowGrads, inv_t):
    """dL/d(h @ w) for one tile: inv_t * [g_logp (1[v=t] - p) + g_ent p (E_p[z] - z)].

    z[R, C] tempered logits, cols[C] vocabulary ids; rows: the tile's [R] vectors (its
    `kept` is not read).
    """
    p = jnp.exp(z - rows.lse[:, None])
    mean_z = (rows.lse - rows.entropy)[:, None]
    onehot = (cols[None, :] == rows.t[:, None]).astype(F32)
    dz = rows.g_logp[:, None] * (onehot - p) + rows.g_ent[:, None] * p * (mean_z - z)
    return dz * inv_t


def _slice_rows(x, start, size):
    return lax.dynamic_slice_in_dim(x, start, size, axis=0)


@dataclasses.dataclass(frozen=True)
class XlaEngine:
    """Blocked passes in plain XLA. Block sizes trade tile memory for matmul efficiency."""

    row_block: int = 1024
    vocab_block: int = 4096
    keep_bytes: int = 1 << 30  # largest float32 [N_pad, V] logits kept for the backward

    def rows_per_block(self, num_rows: int) -> int:
        return min(self.row_block, num_rows)

    def keeps_logits(self, num_pad: int, vocab_size: int) -> bool:
        return num_pad * vocab_size * F32.dtype.itemsize <= self.keep_bytes

    def stats(self, h_c, w, rows: RowCompaction, row_block: int, inv_t: float):
        """(lse, entropy, kept) for compacted hidden states h_c[N_pad, d]: [N_pad] float32
        and the tempered logits [N_pad, V] float32 (visited row blocks only) or None."""
        num_pad, vocab_size = h_c.shape[0], w.shape[1]
        keep = self.keeps_logits(num_pad, vocab_size)
        init = (jnp.full((num_pad,), jnp.finfo(F32).min), jnp.zeros((num_pad,), F32),
                jnp.zeros((num_pad,), F32), jnp.zeros((num_pad, vocab_size) if keep else (), F32))

        def vocab_body(carry, start, width):
            w_j = lax.dynamic_slice_in_dim(w, start, width, axis=1)

            def row_body(carry, r0):
                *stats, kept = carry
                z = logits(_slice_rows(h_c, r0, row_block), w_j, inv_t)
                block = merge_stats(*(_slice_rows(x, r0, row_block) for x in stats), z)
                if keep:
                    kept = lax.dynamic_update_slice(kept, z, (r0, start))
                return (*(lax.dynamic_update_slice_in_dim(x, y, r0, 0)
                          for x, y in zip(stats, block, strict=True)), kept)

            return row_loop(row_body, carry, rows.num_blocks, row_block)

        m, s, a, kept = vocab_loop(vocab_body, init, vocab_size,
                                   min(self.vocab_block, vocab_size))
        # Rows beyond the valid blocks were never visited; give them finite values.
        visited = jnp.arange(num_pad) < rows.num_blocks * row_block
        lse, entropy = (jnp.where(visited, x, 0.0) for x in finish_stats(m, s, a))
        return lse, entropy, kept if keep else None

    def grads(self, h_c, w, rows: RowCompaction, row_block, inv_t, terms: RowGrads):
        """(dh_c[N_pad, d] float32, dw[d, V] in w's dtype); terms.kept: the logits from
        stats, or None to recompute them."""
        kept, vectors = terms.kept, terms._replace(kept=None)
        mm_dtype = jnp.promote_types(h_c.dtype, w.dtype)
        h_pass = weight_layout(h_c)

        def vocab_body(carry, start, width):
            dh_c, dw = carry
            w_j = lax.dynamic_slice_in_dim(w, start, width, axis=1)
            cols = start + jnp.arange(width)

            def row_body(inner, r0):
                dh_c, dw_j = inner
                h_i = _slice_rows(h_c, r0, row_block)
                row = lambda x: _slice_rows(x, r0, row_block)
                z = (logits(h_i, w_j, inv_t) if kept is None
                     else lax.dynamic_slice(kept, (r0, start), (row_block, width)))
                dz = logit_cotangent(z, cols, jax.tree.map(row, vectors), inv_t)
                dz = dz.astype(mm_dtype)
                dh_i = lax.dot_general(dz, w_j, _CONTRACT_COLS, preferred_element_type=F32)
                dh_c = lax.dynamic_update_slice_in_dim(dh_c, row(dh_c) + dh_i, r0, 0)
                dw_j = dw_j + weight_grad(h_pass, r0, row_block, dz)
                return dh_c, dw_j

            dw_j = jnp.zeros((w.shape[0], width), F32)
            dh_c, dw_j = row_loop(row_body, (dh_c, dw_j), rows.num_blocks, row_block)
            dw = lax.dynamic_update_slice_in_dim(dw, dw_j.astype(dw.dtype), start, 1)
            return dh_c, dw

        init = (jnp.zeros(h_c.shape, F32), jnp.zeros_like(w))
        return vocab_loop(vocab_body, init, w.shape[1], min(self.vocab_block, w.shape[1]))
