"""Blockwise attention as Pallas kernels (Triton on GPU; interpret mode on CPU).

Same maths and block ranges as xla.py (see its docstring). Kernels, one program per
(block, row, query head); kv head = query head // G:
  forward: grid (query blocks, B, H); loops over key blocks [lo[i], hi[i]).
  dq:      grid (query blocks, B, H); loops over key blocks [lo[i], hi[i]).
  dk, dv:  grid (key blocks, B, H); loops over query blocks [q_lo[j], q_hi[j]), giving
           per-query-head gradients that XLA sums over each group of G heads.
Recomputing the scores in two backward kernels needs no atomics. Block sizes and head_dim
are powers of two (Triton tiles); `api` checks that the kernels compile and otherwise
falls back to xla.py, logging why.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.attention.blocks import BlockRanges, Layout, block_ranges

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a[x, D], b[y, D] -> [x, y]
_TN = (((0,), (0,)), ((), ()))  # a[R, x], b[R, y] -> [x, y]


def _mask(qs, ks, qp, kp):
    return (qs[:, None] == ks[None, :]) & (qs != 0)[:, None] & (kp[None, :] <= qp[:, None])


def _masked_scores(q, k, mask, scale):
    s = lax.dot_general(q, k, _NT, preferred_element_type=F32) * scale
    return jnp.where(mask, s, -jnp.inf)


def _fwd_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref,
                o_ref, lse_ref, *, scale, block_k):
    # (the refs in pallas_call's order: its in_specs, then its out_specs)
    q, qs, qp = q_ref[...], qs_ref[...], qp_ref[...]
    block_q, d = q.shape

    def body(j, carry):
        m, total, acc = carry
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        s = _masked_scores(q, k_ref[keys, :], _mask(qs, ks_ref[keys], qp, kp_ref[keys]), scale)
        m_new = jnp.maximum(m, s.max(axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift[:, None])
        corr = jnp.exp(m - shift)
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[keys, :], preferred_element_type=F32)
        return m_new, total * corr + p.sum(axis=1), acc * corr[:, None] + pv

    init = (jnp.full((block_q,), -jnp.inf, F32), jnp.zeros((block_q,), F32),
            jnp.zeros((block_q, d), F32))
    m, total, acc = lax.fori_loop(lo_ref[0], hi_ref[0], body, init)
    safe_l = jnp.where(total > 0, total, 1.0)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(total > 0, m + jnp.log(safe_l), 0.0)


def _dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, scale, block_k):
    # (the refs in pallas_call's order: its in_specs, then its out_specs)
    q, qs, qp, do = q_ref[...], qs_ref[...], qp_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(j, dq):
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _masked_scores(q, k, _mask(qs, ks_ref[keys], qp, kp_ref[keys]), scale)
        p = jnp.exp(s - lse[:, None])
        dp = lax.dot_general(do, v, _NT, preferred_element_type=F32)
        ds = (p * (dp - delta[:, None]) * scale).astype(k.dtype)
        return dq + jnp.dot(ds, k, preferred_element_type=F32)

    dq = lax.fori_loop(lo_ref[0], hi_ref[0], body, jnp.zeros(q.shape, F32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, scale, block_q):
    # (the refs in pallas_call's order: its in_specs, then its out_specs)
    k, v, ks, kp = k_ref[...], v_ref[...], ks_ref[...], kp_ref[...]

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]
        s = _masked_scores(q, k, _mask(qs_ref[rows], ks, qp_ref[rows], kp), scale)
        p = jnp.exp(s - lse_ref[rows][:, None])
        dv = dv + lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=F32)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=F32)
        ds = (p * (dp - delta_ref[rows][:, None]) * scale).astype(q.dtype)
        return dk + lax.dot_general(ds, q, _TN, preferred_element_type=F32), dv

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = lax.fori_loop(lo_ref[0], hi_ref[0], body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Specs:
    """BlockSpecs over q [B, T, H, D], k/v [B, S, K, D], ids [B, T|S], stats [B, H, T]."""

    t: int
    s: int
    d: int
    group: int
    block: int          # the gridded block (query block, or key block for dk/dv)
    over_keys: bool     # grid runs over key blocks (dk/dv kernel)

    def range_spec(self):
        return pl.BlockSpec((1,), lambda n, b, h: (n,))

    def q_like(self):
        if self.over_keys:
            return pl.BlockSpec((None, self.t, None, self.d), lambda n, b, h: (b, 0, h, 0))
        return pl.BlockSpec((None, self.block, None, self.d), lambda n, b, h: (b, n, h, 0))

    def kv_like(self):
        group = self.group
        if self.over_keys:
            return pl.BlockSpec((None, self.block, None, self.d),
                                lambda n, b, h: (b, n, h // group, 0))
        return pl.BlockSpec((None, self.s, None, self.d), lambda n, b, h: (b, 0, h // group, 0))

    def q_ids(self):
        if self.over_keys:
            return pl.BlockSpec((None, self.t), lambda n, b, h: (b, 0))
        return pl.BlockSpec((None, self.block), lambda n, b, h: (b, n))

    def kv_ids(self):
        if self.over_keys:
            return pl.BlockSpec((None, self.block), lambda n, b, h: (b, n))
        return pl.BlockSpec((None, self.s), lambda n, b, h: (b, 0))

    def stats(self):
        if self.over_keys:
            return pl.BlockSpec((None, None, self.t), lambda n, b, h: (b, h, 0))
        return pl.BlockSpec((None, None, self.block), lambda n, b, h: (b, h, n))

    def inputs(self):
        return [self.range_spec(), self.range_spec(), self.q_like(), self.kv_like(),
                self.kv_like(), self.q_ids(), self.kv_ids(), self.q_ids(), self.kv_ids()]


# Triton, not Mosaic GPU (pallas_call's default GPU backend, which these tiles do not fit).
_TRITON = plgpu.CompilerParams(num_warps=4, num_stages=2)


def _call(kernel, specs, grid, out_specs, out_shape, interpret):
    return pl.pallas_call(kernel, grid=grid, in_specs=specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=interpret, compiler_params=_TRITON)


def _forward(q, k, v, ids, ranges, tiles):
    """tiles: (block_q, block_k, interpret), the static options."""
    (block_q, block_k, interpret), (b, t, h, d) = tiles, q.shape
    sp = _Specs(t, k.shape[1], d, h // k.shape[2], block_q, over_keys=False)
    kernel = functools.partial(_fwd_kernel, scale=d ** -0.5, block_k=block_k)
    return _call(kernel, sp.inputs(), (t // block_q, b, h), [sp.q_like(), sp.stats()],
                 [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), F32)],
                 interpret)(ranges.lo, ranges.hi, q, k, v, *ids)


def _backward(residuals, do, tiles):
    """residuals: _attention_fwd's; tiles: (block_q, block_k, interpret)."""
    q, k, v, ids, ranges, o, lse = residuals
    ranges, (block_q, block_k, interpret), (b, t, h, d) = BlockRanges(*ranges), tiles, q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    scale = d ** -0.5
    delta = jnp.einsum("bthd,bthd->bht", do.astype(F32), o.astype(F32))
    sq = _Specs(t, s, d, h // kv_heads, block_q, over_keys=False)
    dq = _call(functools.partial(_dq_kernel, scale=scale, block_k=block_k),
               sq.inputs() + [sq.q_like(), sq.stats(), sq.stats()], (t // block_q, b, h),
               sq.q_like(), jax.ShapeDtypeStruct(q.shape, q.dtype), interpret,
               )(ranges.lo, ranges.hi, q, k, v, *ids, do, lse, delta)
    sk = _Specs(t, s, d, h // kv_heads, block_k, over_keys=True)
    per_head = jax.ShapeDtypeStruct((b, s, h, d), F32)
    out_spec = pl.BlockSpec((None, block_k, None, d), lambda n, bb, hh: (bb, n, hh, 0))
    dk, dv = _call(functools.partial(_dkv_kernel, scale=scale, block_q=block_q),
                   sk.inputs() + [sk.q_like(), sk.stats(), sk.stats()], (s // block_k, b, h),
                   [out_spec, out_spec], [per_head, per_head], interpret,
                   )(ranges.q_lo, ranges.q_hi, q, k, v, *ids, do, lse, delta)
    group_sum = lambda x, like: x.reshape(b, s, kv_heads, h // kv_heads, d).sum(3).astype(
        like.dtype)
    return dq, group_sum(dk, k), group_sum(dv, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, ids: Layout, tiles):
    return _attention_fwd(q, k, v, ids, tiles)[0]


def _attention_fwd(q, k, v, ids: Layout, tiles):
    ranges = block_ranges(*ids, *tiles[:2])
    o, lse = _forward(q, k, v, ids, ranges, tiles)
    return o, (q, k, v, ids, ranges, o, lse)


def _attention_bwd(tiles, residuals, do):
    return (*_backward(residuals, do, tiles), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention_pallas(q, k, v, ids: Layout, tiles: tuple[int, int, bool]):
    """q [B, T, H, D], k/v [B, S, K, D] (T, S multiples of the blocks) -> o like q;
    ids: who may read whom (blocks.Layout); tiles: (block_q, block_k, interpret)."""
    return _attention(q, k, v, Layout(*ids), tuple(tiles))
