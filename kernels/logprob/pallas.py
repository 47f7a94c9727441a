"""Pallas engine: forward statistics and both gradients as kernels (GPU/TPU; interpret on CPU).

Kernels (R = row_block, C = vocab_block, K = d_block; rows already compacted, padding rows
skipped). Every logit tile z[R, C] is accumulated in float32 over K-wide chunks of the
hidden dimension d, so no kernel holds a whole [R, d] or [d, C] tile: the shared memory a
kernel needs depends on R, C and K only, not on d (see `shared_memory_bytes`).
  stats: grid (row blocks, vocab blocks), every tile independent; each writes the partial
         online-softmax statistics (max, sum-exp, sum-exp * shifted logit) of its tile and a
         cheap XLA reduction combines the vocab blocks.
  dh:    grid (row blocks,), loops over vocab blocks, recomputing each logit tile, and adds
         dz @ w^T into its float32 output block K columns at a time.
  dw:    grid (vocab blocks,), loops over valid row blocks, recomputing each logit tile, and
         adds h^T @ dz into its float32 output block K rows at a time.
The backward pass therefore recomputes the logits twice (10 N d V FLOPs in all, against
8 N d V for the XLA engine) in exchange for needing no atomics or cross-program reduction;
the gradient blocks are accumulated in global memory (read and written once per
vocab block for dh, once per valid row block for dw), as they are too large for registers.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.logprob.rows import RowCompaction, RowGrads

F32 = jnp.float32
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # a[R, x], b[R, y] -> [x, y]
_CONTRACT_COLS = (((1,), (1,)), ((), ()))  # a[x, C], b[y, C] -> [x, y]
_NUM_STAGES = 2
# Triton, not Mosaic GPU (the default GPU backend of pallas_call, which these tiles do not
# fit); TPU ignores these parameters.
_TRITON = plgpu.CompilerParams(num_warps=4, num_stages=_NUM_STAGES)

# Shared memory one thread block may use (the opt-in maximum of the CUDA programming guide's
# "technical specifications per compute capability"; Triton compiles against it), bytes.
SHARED_MEMORY_BYTES = {"8.0": 166_912, "8.6": 101_376, "8.7": 166_912, "8.9": 101_376,
                       "9.0": 232_448, "10.0": 232_448, "12.0": 101_376}
DEFAULT_SHARED_MEMORY = SHARED_MEMORY_BYTES["9.0"]  # H100 / H200
_D_BLOCKS = (128, 64, 32, 16)  # d_block candidates, largest first (Triton dots need >= 16)


def shared_memory_bytes(row_block: int, vocab_block: int, d_block: int, itemsize: int,
                        num_stages: int = _NUM_STAGES) -> int:
    """Shared memory of the largest of the three kernels, by this model:

      num_stages * (R * K + K * C) * itemsize    the h and w chunks of the d loop, which
                                                 Triton's pipeliner keeps num_stages deep
      + R * C * itemsize                         dz, an operand of the gradient dot
      + R * C * 4                                the float32 logit tile, converted between
                                                 layouts for the row reductions

    R = row_block, C = vocab_block, K = d_block; itemsize of the matmul dtype. It does not
    depend on d. (Loading whole [R, d] and [d, C] tiles instead needed (R + C) * d *
    itemsize: 393,216 bytes at R, C, d = 64, 128, 1024 in bfloat16, more than an H200's
    232,448.) The model is checked against the compiler by `python -m bench.gpu_check`.
    """
    chunks = num_stages * (row_block * d_block + d_block * vocab_block) * itemsize
    return chunks + row_block * vocab_block * (itemsize + 4)


def shared_memory_budget(device=None) -> int:
    """SHARED_MEMORY_BYTES of a GPU's compute capability; DEFAULT_SHARED_MEMORY (sm_90)
    for other devices or an unknown capability."""
    device = device or jax.devices()[0]
    capability = str(getattr(device, "compute_capability", ""))
    return SHARED_MEMORY_BYTES.get(capability, DEFAULT_SHARED_MEMORY)


def choose_blocks(d: int, itemsize: int, row_block: int, vocab_block: int,
                  d_block: int | None, budget: int) -> tuple[int, int]:
    """(vocab_block, d_block) within `budget` bytes of shared memory by
    `shared_memory_bytes`: the largest d_block of _D_BLOCKS (at most d rounded up to a
    power of two, >= 16) unless one is given, then vocab_block halved (>= 16) until the
    tiles fit. row_block is kept (the row compaction was built with it)."""
    candidates = (d_block,) if d_block else tuple(
        k for k in _D_BLOCKS if k <= max(16, pl.next_power_of_2(d))) or (16,)
    while True:
        for k in candidates:
            if shared_memory_bytes(row_block, vocab_block, k, itemsize) <= budget:
                return vocab_block, k
        if vocab_block <= 16:
            raise ValueError(
                f"no logprob tiles fit {budget} bytes of shared memory: row_block="
                f"{row_block}, vocab_block=16 and d_block={candidates[-1]} need "
                f"{shared_memory_bytes(row_block, 16, candidates[-1], itemsize)}")
        vocab_block //= 2


def _logit_tile(h_ref, w_ref, rows, cols, d_block, inv_t):
    """z = h[rows, :] @ w[:, cols] * inv_t, float32, accumulated over d in d_block chunks
    (w's rows, the padded d, are a whole number of them)."""
    num_d_blocks = w_ref.shape[0] // d_block
    num_rows = h_ref.shape[0] if isinstance(rows, slice) else rows.size
    num_cols = w_ref.shape[1] if isinstance(cols, slice) else cols.size

    def body(k, z):
        chunk = pl.ds(pl.multiple_of(k * d_block, d_block), d_block)
        return z + jnp.dot(h_ref[rows, chunk], w_ref[chunk, cols], preferred_element_type=F32)

    z = lax.fori_loop(0, num_d_blocks, body, jnp.zeros((num_rows, num_cols), F32))
    return z * inv_t


def _tile_cotangent(z, start, per_row, inv_t, vocab_size, dtype):
    """dL/d(h @ w) on one [R, C] tile of logits z, zero on padding columns (chunked.py);
    per_row: the rows' (target, lse, entropy, g_logp, g_ent)."""
    t, lse, entropy, g_logp, g_ent = per_row
    cols = start + lax.broadcasted_iota(jnp.int32, z.shape, 1)
    p = jnp.where(cols < vocab_size, jnp.exp(z - lse[:, None]), 0.0)
    onehot = (cols == t[:, None]).astype(F32)
    dz = g_logp[:, None] * (onehot - p) + g_ent[:, None] * p * ((lse - entropy)[:, None] - z)
    return (dz * inv_t).astype(dtype)


def _zero_by_chunks(ref, axis, d_block, num_d_blocks):
    """ref[...] = 0, one d_block-wide chunk of `axis` at a time (no whole-tile constant)."""
    shape = list(ref.shape)
    shape[axis] = d_block

    @pl.loop(0, num_d_blocks)
    def _(k):
        chunk = pl.ds(pl.multiple_of(k * d_block, d_block), d_block)
        index = (slice(None), chunk) if axis == 1 else (chunk, slice(None))
        ref[index] = jnp.zeros(shape, ref.dtype)


def _stats_kernel(valid_ref, h_ref, w_ref, m_ref, s_ref, a_ref, *, inv_t, vocab_size,
                  vocab_block, d_block, num_d_blocks):
    # (the refs in pallas_call's order, then the kernel's static sizes)
    active = jnp.max(valid_ref[...]) > 0
    start = pl.program_id(1) * vocab_block  # read outside pl.when: interpret mode needs it

    @pl.when(active)
    def _():
        z = _logit_tile(h_ref, w_ref, slice(None), slice(None), d_block, inv_t)
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
               inv_t, vocab_size, vocab_block, num_vocab_blocks, d_block, num_d_blocks):
    # (the refs in pallas_call's order, then the kernel's static sizes)
    active = jnp.max(valid_ref[...]) > 0
    _zero_by_chunks(dh_ref, 1, d_block, num_d_blocks)

    @pl.when(active)
    def _():
        per_row = (t_ref[...], lse_ref[...], ent_ref[...], gl_ref[...], ge_ref[...])

        @pl.loop(0, num_vocab_blocks)
        def _(j):
            start = pl.multiple_of(j * vocab_block, vocab_block)
            cols = pl.ds(start, vocab_block)
            z = _logit_tile(h_ref, w_ref, slice(None), cols, d_block, inv_t)
            dz = _tile_cotangent(z, start, per_row, inv_t, vocab_size, h_ref.dtype)

            @pl.loop(0, num_d_blocks)
            def _(k):
                chunk = pl.ds(pl.multiple_of(k * d_block, d_block), d_block)
                dh_ref[:, chunk] += lax.dot_general(dz, w_ref[chunk, cols], _CONTRACT_COLS,
                                                    preferred_element_type=F32)


def _dw_kernel(valid_ref, h_ref, w_ref, t_ref, lse_ref, ent_ref, gl_ref, ge_ref, dw_ref, *,
               inv_t, vocab_size, vocab_block, row_block, num_row_blocks, d_block,
               num_d_blocks):
    # (the refs in pallas_call's order, then the kernel's static sizes)
    start = pl.program_id(0) * vocab_block
    _zero_by_chunks(dw_ref, 0, d_block, num_d_blocks)

    @pl.loop(0, num_row_blocks)
    def _(i):
        rows = pl.ds(pl.multiple_of(i * row_block, row_block), row_block)

        @pl.when(jnp.max(valid_ref[rows]) > 0)
        def _():
            per_row = (t_ref[rows], lse_ref[rows], ent_ref[rows], gl_ref[rows], ge_ref[rows])
            z = _logit_tile(h_ref, w_ref, rows, slice(None), d_block, inv_t)
            dz = _tile_cotangent(z, start, per_row, inv_t, vocab_size, h_ref.dtype)

            @pl.loop(0, num_d_blocks)
            def _(k):
                chunk = pl.ds(pl.multiple_of(k * d_block, d_block), d_block)
                dw_ref[chunk, :] += lax.dot_general(h_ref[rows, chunk], dz, _CONTRACT_ROWS,
                                                    preferred_element_type=F32)


def _pad(x, multiples):
    """Zero-pads each axis of x up to a multiple of `multiples[axis]` (a no-op when whole)."""
    pad = [(0, -n % m) for n, m in zip(x.shape, multiples, strict=True)]
    return jnp.pad(x, pad) if any(p for _, p in pad) else x


@dataclasses.dataclass(frozen=True)
class PallasEngine:
    """Blocked passes as Pallas kernels. Block sizes are powers of two (Triton tiles).

    row_block, vocab_block: tile sizes; vocab_block is lowered to fit `shared_memory`.
    d_block: width of the chunks of the hidden dimension; None takes the largest that fits.
    shared_memory: bytes of shared memory per thread block; None takes the device's
      (`shared_memory_budget`).
    """

    row_block: int = 64
    vocab_block: int = 128
    d_block: int | None = None
    shared_memory: int | None = None
    interpret: bool = False

    def rows_per_block(self, num_rows: int) -> int:
        return min(self.row_block, max(16, pl.next_power_of_2(num_rows)))

    def blocks(self, row_block: int, d: int, vocab_size: int, dtype) -> tuple[int, int]:
        """(vocab_block, d_block) of these kernels for [*, d] @ [d, vocab_size] in dtype."""
        vocab_block = min(self.vocab_block, max(16, pl.next_power_of_2(vocab_size)))
        budget = self.shared_memory or shared_memory_budget()
        return choose_blocks(d, jnp.dtype(dtype).itemsize, row_block, vocab_block,
                             self.d_block, budget)

    def stats(self, h_c, w, rows: RowCompaction, row_block: int, inv_t: float):
        """(lse, entropy, None): [N_pad] float32 for compacted hidden states h_c[N_pad, d];
        the logits are not kept (the backward recomputes them in its tiles)."""
        (d, vocab_size), num_pad = w.shape, h_c.shape[0]
        mm_dtype = jnp.promote_types(h_c.dtype, w.dtype)
        vocab_block, d_block = self.blocks(row_block, d, vocab_size, mm_dtype)
        h_c, w = _pad(h_c, (1, d_block)), _pad(w, (d_block, vocab_block))
        d_pad = w.shape[0]
        grid = (num_pad // row_block, w.shape[1] // vocab_block)
        partial_spec = pl.BlockSpec((1, row_block), lambda i, j: (j, i))
        partial = jax.ShapeDtypeStruct((grid[1], num_pad), F32)
        kernel = lambda *refs: _stats_kernel(*refs, inv_t=inv_t, vocab_size=vocab_size,
                                             vocab_block=vocab_block, d_block=d_block,
                                             num_d_blocks=d_pad // d_block)
        m, s, a = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[pl.BlockSpec((row_block,), lambda i, j: (i,)),
                      pl.BlockSpec((row_block, d_pad), lambda i, j: (i, 0)),
                      pl.BlockSpec((d_pad, vocab_block), lambda i, j: (0, j))],
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
        return jnp.where(visited, lse, 0.0), jnp.where(visited, entropy, 0.0), None

    def grads(self, h_c, w, rows: RowCompaction, row_block, inv_t, terms: RowGrads):
        """(dh_c[N_pad, d] float32, dw[d, V] in w's dtype); terms.kept is always None
        here."""
        (d, vocab_size), num_pad = w.shape, h_c.shape[0]
        mm_dtype = jnp.promote_types(h_c.dtype, w.dtype)
        vocab_block, d_block = self.blocks(row_block, d, vocab_size, mm_dtype)
        h_c = _pad(h_c.astype(mm_dtype), (1, d_block))
        w_pad = _pad(w.astype(mm_dtype), (d_block, vocab_block))
        d_pad, v_pad = w_pad.shape
        num_row_blocks, num_vocab_blocks = num_pad // row_block, v_pad // vocab_block
        operands = (rows.valid.astype(jnp.int32), h_c, w_pad, terms.t, terms.lse, terms.entropy,
                    terms.g_logp, terms.g_ent)
        common = dict(inv_t=inv_t, vocab_size=vocab_size, vocab_block=vocab_block,
                      d_block=d_block, num_d_blocks=d_pad // d_block)

        row_spec = pl.BlockSpec((row_block,), lambda i: (i,))
        dh_c = pl.pallas_call(
            lambda *refs: _dh_kernel(*refs, **common, num_vocab_blocks=num_vocab_blocks),
            grid=(num_row_blocks,),
            in_specs=[row_spec, pl.BlockSpec((row_block, d_pad), lambda i: (i, 0)),
                      pl.BlockSpec(w_pad.shape, lambda i: (0, 0))] + [row_spec] * 5,
            out_specs=pl.BlockSpec((row_block, d_pad), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((num_pad, d_pad), F32),
            interpret=self.interpret,
            compiler_params=_TRITON,
        )(*operands)

        all_rows = pl.BlockSpec((num_pad,), lambda j: (0,))
        dw = pl.pallas_call(
            lambda *refs: _dw_kernel(*refs, **common, row_block=row_block,
                                     num_row_blocks=num_row_blocks),
            grid=(num_vocab_blocks,),
            in_specs=[all_rows, pl.BlockSpec((num_pad, d_pad), lambda j: (0, 0)),
                      pl.BlockSpec((d_pad, vocab_block), lambda j: (0, j))] + [all_rows] * 5,
            out_specs=pl.BlockSpec((d_pad, vocab_block), lambda j: (0, j)),
            out_shape=jax.ShapeDtypeStruct((d_pad, v_pad), F32),
            interpret=self.interpret,
            compiler_params=_TRITON,
        )(*operands)
        return dh_c[:, :d], dw[:d, :vocab_size].astype(w.dtype)
