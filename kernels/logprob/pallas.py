"""Pallas engine: forward statistics and both gradients as kernels (GPU/TPU; interpret on CPU).

Kernels (R = row_block, C = vocab_block; rows already compacted, padding rows skipped):
  stats: grid (row blocks, vocab blocks), every tile independent; each writes the partial
         online-softmax statistics (max, sum-exp, sum-exp * shifted logit) of its tile and a
         cheap XLA reduction combines the vocab blocks.
  dh:    grid (row blocks,), loops over vocab blocks, recomputing each logit tile.
  dw:    grid (vocab blocks,), loops over valid row blocks, recomputing each logit tile.
The backward pass therefore recomputes the logits twice (10 N d V FLOPs in all, against
8 N d V for the XLA engine) in exchange for needing no atomics or cross-program reduction.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.logprob.rows import RowCompaction

F32 = jnp.float32
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # a[R, x], b[R, y] -> [x, y]
_CONTRACT_COLS = (((1,), (1,)), ((), ()))  # a[x, C], b[y, C] -> [x, y]
# Triton, not Mosaic GPU (the default GPU backend of pallas_call, which these tiles do not
# fit); TPU ignores these parameters.
_TRITON = plgpu.CompilerParams(num_warps=4, num_stages=2)


def _tile_cotangent(h, w_j, start, t, lse, entropy, g_logp, g_ent, inv_t, vocab_size):
    """dL/d(h @ w) on one [R, C] tile, zero on padding columns (see chunked.py)."""
    z = jnp.dot(h, w_j, preferred_element_type=F32) * inv_t
    cols = start + lax.broadcasted_iota(jnp.int32, z.shape, 1)
    p = jnp.where(cols < vocab_size, jnp.exp(z - lse[:, None]), 0.0)
    onehot = (cols == t[:, None]).astype(F32)
    dz = g_logp[:, None] * (onehot - p) + g_ent[:, None] * p * ((lse - entropy)[:, None] - z)
    return (dz * inv_t).astype(h.dtype)


def _stats_kernel(valid_ref, h_ref, w_ref, m_ref, s_ref, a_ref, *, inv_t, vocab_size,
                  vocab_block):
    active = jnp.max(valid_ref[...]) > 0
    start = pl.program_id(1) * vocab_block  # read outside pl.when: interpret mode needs it

    @pl.when(active)
    def _():
        z = jnp.dot(h_ref[...], w_ref[...], preferred_element_type=F32) * inv_t
        cols = start + lax.broadcasted_iota(jnp.int32, z.shape, 1)
        in_vocab = cols < vocab_size
        z = jnp.where(in_vocab, z, -jnp.inf)
        m = z.max(axis=1)
        shifted = jnp.where(in_vocab, z - m[:, None], 0.0)
        e = jnp.where(in_vocab, jnp.exp(shifted), 0.0)
        m_ref[...] = m[None]
        s_ref[...] = e.sum(axis=1)[None]
        a_ref[...] = (e * shifted).sum(axis=1)[None]

    @pl.when(jnp.logical_not(active))
    def _():
        m_ref[...] = jnp.zeros(m_ref.shape, F32)
        s_ref[...] = jnp.ones(s_ref.shape, F32)
        a_ref[...] = jnp.zeros(a_ref.shape, F32)


def _dh_kernel(valid_ref, h_ref, w_ref, t_ref, lse_ref, ent_ref, gl_ref, ge_ref, dh_ref, *,
               inv_t, vocab_size, vocab_block, num_vocab_blocks):
    active = jnp.max(valid_ref[...]) > 0
    dh_ref[...] = jnp.zeros(dh_ref.shape, F32)

    @pl.when(active)
    def _():
        h = h_ref[...]
        per_row = (t_ref[...], lse_ref[...], ent_ref[...], gl_ref[...], ge_ref[...])

        def body(j, acc):
            start = pl.multiple_of(j * vocab_block, vocab_block)
            w_j = w_ref[:, pl.ds(start, vocab_block)]
            dz = _tile_cotangent(h, w_j, start, *per_row, inv_t, vocab_size)
            return acc + lax.dot_general(dz, w_j, _CONTRACT_COLS, preferred_element_type=F32)

        dh_ref[...] = lax.fori_loop(0, num_vocab_blocks, body, jnp.zeros(dh_ref.shape, F32))


def _dw_kernel(valid_ref, h_ref, w_ref, t_ref, lse_ref, ent_ref, gl_ref, ge_ref, dw_ref, *,
               inv_t, vocab_size, vocab_block, row_block, num_row_blocks):
    w_j = w_ref[...]
    start = pl.program_id(0) * vocab_block

    def body(i, acc):
        rows = pl.ds(pl.multiple_of(i * row_block, row_block), row_block)

        def tile():
            h_i = h_ref[rows, :]
            per_row = (t_ref[rows], lse_ref[rows], ent_ref[rows], gl_ref[rows], ge_ref[rows])
            dz = _tile_cotangent(h_i, w_j, start, *per_row, inv_t, vocab_size)
            return acc + lax.dot_general(h_i, dz, _CONTRACT_ROWS, preferred_element_type=F32)

        return lax.cond(jnp.max(valid_ref[rows]) > 0, tile, lambda: acc)

    dw = lax.fori_loop(0, num_row_blocks, body, jnp.zeros(dw_ref.shape, F32))
    dw_ref[...] = dw.astype(dw_ref.dtype)


def _pad_vocab(w, vocab_block):
    """[d, V] -> [d, V_pad], zero columns up to a whole number of vocab blocks."""
    pad = -w.shape[1] % vocab_block
    return jnp.pad(w, ((0, 0), (0, pad))) if pad else w


@dataclasses.dataclass(frozen=True)
class PallasEngine:
    """Blocked passes as Pallas kernels. Block sizes are powers of two (Triton tiles)."""

    row_block: int = 64
    vocab_block: int = 128
    interpret: bool = False

    def rows_per_block(self, num_rows: int) -> int:
        return min(self.row_block, max(16, pl.next_power_of_2(num_rows)))

    def _vocab_block(self, vocab_size: int) -> int:
        return min(self.vocab_block, max(16, pl.next_power_of_2(vocab_size)))

    def stats(self, h_c, w, rows: RowCompaction, row_block: int, inv_t: float):
        """(lse, entropy) [N_pad] float32 for compacted hidden states h_c[N_pad, d]."""
        vocab_size, vocab_block = w.shape[1], self._vocab_block(w.shape[1])
        w = _pad_vocab(w, vocab_block)
        num_pad, d = h_c.shape
        grid = (num_pad // row_block, w.shape[1] // vocab_block)
        partial_spec = pl.BlockSpec((1, row_block), lambda i, j: (j, i))
        partial = jax.ShapeDtypeStruct((grid[1], num_pad), F32)
        kernel = lambda *refs: _stats_kernel(*refs, inv_t=inv_t, vocab_size=vocab_size,
                                             vocab_block=vocab_block)
        m, s, a = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[pl.BlockSpec((row_block,), lambda i, j: (i,)),
                      pl.BlockSpec((row_block, d), lambda i, j: (i, 0)),
                      pl.BlockSpec((d, vocab_block), lambda i, j: (0, j))],
            out_specs=[partial_spec] * 3,
            out_shape=[partial] * 3,
            interpret=self.interpret,
            compiler_params=_TRITON,
        )(rows.valid.astype(jnp.int32), h_c, w)
        # Combine vocab blocks: re-base each block's sums from its own max to the global one.
        m_all = m.max(axis=0)
        scale = jnp.exp(m - m_all)
        s_all = (s * scale).sum(axis=0)
        a_all = ((a + s * (m - m_all)) * scale).sum(axis=0)
        lse, entropy = m_all + jnp.log(s_all), jnp.log(s_all) - a_all / s_all
        visited = jnp.arange(num_pad) < rows.num_blocks * row_block
        return jnp.where(visited, lse, 0.0), jnp.where(visited, entropy, 0.0)

    def grads(self, h_c, w, rows: RowCompaction, row_block, inv_t, t_c, lse, entropy,
              g_logp, g_ent):
        """(dh_c[N_pad, d] float32, dw[d, V] in w's dtype)."""
        vocab_size, vocab_block = w.shape[1], self._vocab_block(w.shape[1])
        mm_dtype = jnp.promote_types(h_c.dtype, w.dtype)
        h_c, w_pad = h_c.astype(mm_dtype), _pad_vocab(w, vocab_block).astype(mm_dtype)
        num_pad, d = h_c.shape
        num_row_blocks, num_vocab_blocks = num_pad // row_block, w_pad.shape[1] // vocab_block
        operands = (rows.valid.astype(jnp.int32), h_c, w_pad, t_c, lse, entropy, g_logp, g_ent)
        common = dict(inv_t=inv_t, vocab_size=vocab_size, vocab_block=vocab_block)

        row_spec = pl.BlockSpec((row_block,), lambda i: (i,))
        dh_c = pl.pallas_call(
            lambda *refs: _dh_kernel(*refs, **common, num_vocab_blocks=num_vocab_blocks),
            grid=(num_row_blocks,),
            in_specs=[row_spec, pl.BlockSpec((row_block, d), lambda i: (i, 0)),
                      pl.BlockSpec(w_pad.shape, lambda i: (0, 0))] + [row_spec] * 5,
            out_specs=pl.BlockSpec((row_block, d), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((num_pad, d), F32),
            interpret=self.interpret,
            compiler_params=_TRITON,
        )(*operands)

        all_rows = pl.BlockSpec((num_pad,), lambda j: (0,))
        dw = pl.pallas_call(
            lambda *refs: _dw_kernel(*refs, **common, row_block=row_block,
                                     num_row_blocks=num_row_blocks),
            grid=(num_vocab_blocks,),
            in_specs=[all_rows, pl.BlockSpec((num_pad, d), lambda j: (0, 0)),
                      pl.BlockSpec((d, vocab_block), lambda j: (0, j))] + [all_rows] * 5,
            out_specs=pl.BlockSpec((d, vocab_block), lambda j: (0, j)),
            out_shape=jax.ShapeDtypeStruct((d, w_pad.shape[1]), w.dtype),
            interpret=self.interpret,
            compiler_params=_TRITON,
        )(*operands)
        return dh_c, dw[:, :vocab_size] if dw.shape[1] != vocab_size else dw
