"""Which (query block, key block) pairs can hold an allowed (query, key) pair.

A token t may attend to key s when both carry the same nonzero segment id and
kv_position[s] <= q_position[t]. Per block we keep the range of nonzero segment ids and
the extreme positions; a pair of blocks is live when the segment ranges overlap and the
earliest key is not after the latest query. The test is conservative (a live pair may
still be fully masked, the element mask inside a block is exact), and for packed rows,
whose segments are contiguous, it drops exactly the future blocks and the blocks of other
segments. Liveness is a union over the batch, so every row of a batch shares one range of
key blocks per query block: [lo[i], hi[i]).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max


class Layout(NamedTuple):
    """Who may read whom: q_seg [B, T], kv_seg [B, S] segment ids (0: padding) and
    q_pos [B, T], kv_pos [B, S] positions, int32."""

    q_seg: jax.Array
    kv_seg: jax.Array
    q_pos: jax.Array
    kv_pos: jax.Array


class BlockRanges(NamedTuple):
    """lo, hi: [num_q_blocks] int32, the live key blocks of query block i are [lo, hi);
    q_lo, q_hi: [num_kv_blocks] int32, the live query blocks of key block j."""

    lo: jax.Array
    hi: jax.Array
    q_lo: jax.Array
    q_hi: jax.Array


def _block_stats(segment_ids, positions, block):
    """Per block of `block` tokens: (min nonzero segment, max segment, min pos, max pos)
    over non-padding tokens; an all-padding block gets an empty segment range."""
    b, n = segment_ids.shape
    seg = segment_ids.reshape(b, n // block, block)
    pos = positions.reshape(b, n // block, block)
    real = seg != 0
    return (jnp.min(jnp.where(real, seg, _BIG), -1), jnp.max(jnp.where(real, seg, -1), -1),
            jnp.min(jnp.where(real, pos, _BIG), -1), jnp.max(jnp.where(real, pos, -1), -1))


def live_blocks(q_segment_ids, kv_segment_ids, q_positions, kv_positions, block_q, block_k):
    """[num_q_blocks, num_kv_blocks] bool: some row of the batch may use this pair."""
    q_seg_lo, q_seg_hi, _, q_pos_hi = _block_stats(q_segment_ids, q_positions, block_q)
    k_seg_lo, k_seg_hi, k_pos_lo, _ = _block_stats(kv_segment_ids, kv_positions, block_k)
    live = ((q_seg_lo[:, :, None] <= k_seg_hi[:, None, :])
            & (k_seg_lo[:, None, :] <= q_seg_hi[:, :, None])
            & (k_pos_lo[:, None, :] <= q_pos_hi[:, :, None]))
    return jnp.any(live, axis=0)


def _first_last(live):
    """Per row of a bool matrix: [first true, last true + 1), or [0, 0) when none."""
    n = live.shape[1]
    any_live = jnp.any(live, axis=1)
    first = jnp.argmax(live, axis=1)
    last = n - jnp.argmax(live[:, ::-1], axis=1)
    return (jnp.where(any_live, first, 0).astype(jnp.int32),
            jnp.where(any_live, last, 0).astype(jnp.int32))


def block_ranges(q_segment_ids, kv_segment_ids, q_positions, kv_positions, block_q, block_k):
    """BlockRanges of the live pairs (see module docstring)."""
    live = live_blocks(q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                       block_q, block_k)
    lo, hi = _first_last(live)
    q_lo, q_hi = _first_last(live.T)
    return BlockRanges(lo, hi, q_lo, q_hi)


def visited_pairs(ranges: BlockRanges) -> jax.Array:
    """Number of (query block, key block) pairs a pass computes: sum_i hi[i] - lo[i]."""
    return jnp.sum(ranges.hi - ranges.lo)
