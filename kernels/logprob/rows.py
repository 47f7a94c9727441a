"""Row compaction: valid rows first, so work is proportional to the number of valid rows.

Shapes stay static: the compacted arrays have N_pad = ceil(N / row_block) * row_block rows,
and loops visit only the first `num_blocks` row blocks, the ones holding valid rows.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RowCompaction(NamedTuple):
    """Where each compacted row comes from.

    index: [N_pad] int32, source row of compacted row i; N (out of range) for padding rows.
    num_blocks: [] int32, number of leading row blocks that hold at least one valid row.
    valid: [N_pad] bool, whether compacted row i is a valid source row.
    """

    index: jax.Array
    num_blocks: jax.Array
    valid: jax.Array

    def gather(self, x: jax.Array) -> jax.Array:
        """[N, ...] -> [N_pad, ...], zeros in padding rows."""
        return jnp.take(x, self.index, axis=0, mode="fill", fill_value=0)

    def scatter(self, x_c: jax.Array, num_rows: int) -> jax.Array:
        """[N_pad, ...] -> [num_rows, ...], exact zeros at masked rows."""
        out = jnp.zeros((num_rows, *x_c.shape[1:]), x_c.dtype)
        return out.at[self.index].set(x_c, mode="drop")


class RowGrads(NamedTuple):
    """What the backward pass reads per compacted row ([N_pad] each): the targets t, the
    forward's lse and entropy, the cotangents of logp and entropy; kept: the forward's
    tempered logits [N_pad, V] when its engine kept them, else None."""

    t: jax.Array
    lse: jax.Array
    entropy: jax.Array
    g_logp: jax.Array
    g_ent: jax.Array
    kept: jax.Array | None


def padded_rows(num_rows: int, row_block: int) -> int:
    """Rows after padding to whole row blocks."""
    return -(-num_rows // row_block) * row_block


def compact_rows(mask: jax.Array, row_block: int) -> RowCompaction:
    """mask[N] (nonzero = valid) -> RowCompaction with valid rows first, in order."""
    num_rows = mask.shape[0]
    valid = mask.astype(bool)
    (index,) = jnp.nonzero(valid, size=padded_rows(num_rows, row_block), fill_value=num_rows)
    num_valid = valid.sum(dtype=jnp.int32)
    num_blocks = (num_valid + row_block - 1) // row_block
    compact_valid = jnp.arange(index.shape[0]) < num_valid
    return RowCompaction(index.astype(jnp.int32), num_blocks, compact_valid)
