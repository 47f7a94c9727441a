"""Blockwise XLA and Pallas (interpret) attention against the dense reference."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import fallback
from kernels.attention import attention
from kernels.attention.blocks import block_ranges, visited_pairs

BLOCKS = {"xla": {"block_q": 8, "block_k": 8},
          "pallas": {"block_q": 8, "block_k": 16, "interpret": True}}


def _segments(lengths, row_len):
    """One packed row: segment i+1 for lengths[i] tokens, then padding (0)."""
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [[]])
    return np.pad(ids, (0, row_len - len(ids))).astype(np.int32)


# (batch rows as segment lengths, T, H, K, D). T is not a multiple of the blocks.
CASES = {
    "packed_odd_many": ([[3, 7, 1, 5, 9, 2, 4], [11, 13, 6]], 37, 4, 2, 16),
    "gqa_one_kv_head": ([[37], [20, 17]], 37, 6, 1, 16),
    "head_dim_not_hidden_over_heads": ([[12, 9]], 21, 2, 2, 24),
    "fully_padded_row": ([[30], []], 33, 4, 2, 8),
}


def _inputs(case, dtype, seed=0):
    rows, t, h, kv, d = CASES[case]
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (len(rows), t, h, d)).astype(dtype)
    k = jax.random.normal(keys[1], (len(rows), t, kv, d)).astype(dtype)
    v = jax.random.normal(keys[2], (len(rows), t, kv, d)).astype(dtype)
    seg = jnp.asarray(np.stack([_segments(r, t) for r in rows]))
    return q, k, v, seg, jax.random.normal(keys[3], q.shape)


def _value_and_grads(implementation, q, k, v, seg, cotangent, **kwargs):
    def loss(q, k, v):
        o = attention(q, k, v, seg, implementation=implementation, **kwargs)
        return jnp.sum(o.astype(jnp.float32) * cotangent), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return o, grads


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_f32(implementation, case):
    q, k, v, seg, cot = _inputs(case, jnp.float32)
    o_ref, g_ref = _value_and_grads("reference", q, k, v, seg, cot)
    o, g = _value_and_grads(implementation, q, k, v, seg, cot, **BLOCKS[implementation])
    for actual, expected in zip((o, *g), (o_ref, *g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=1e-5,
                                   rtol=1e-5)
    padded = np.asarray(seg) == 0
    assert np.all(np.asarray(o)[padded] == 0) and np.all(np.asarray(g[0])[padded] == 0)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_bfloat16_close_to_reference(implementation):
    q, k, v, seg, cot = _inputs("head_dim_not_hidden_over_heads", jnp.bfloat16, seed=1)
    o_ref, g_ref = _value_and_grads("reference", *(x.astype(jnp.float32) for x in (q, k, v)),
                                    seg, cot)
    o, g = _value_and_grads(implementation, q, k, v, seg, cot, **BLOCKS[implementation])
    assert o.dtype == jnp.bfloat16 and all(x.dtype == jnp.bfloat16 for x in g)
    for actual, expected in zip((o, *g), (o_ref, *g_ref), strict=True):
        expected = np.asarray(expected)
        np.testing.assert_allclose(np.asarray(actual, np.float32), expected,
                                   atol=3e-2 * np.abs(expected).max())


def test_cache_decode_reads_filled_slots_only():
    """Queries at positions 5..6 of row 0 and 2 of row 1 against a 40-slot cache whose
    rows are filled up to 7 and 3: equal to the reference, and key blocks past the filled
    part are not visited."""
    b, s, h, kv, d = 2, 40, 4, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(keys[0], (b, 2, h, d))
    k, v = (jax.random.normal(x, (b, s, kv, d)) for x in keys[1:])
    filled = (jnp.arange(s)[None] < jnp.array([[7], [3]])).astype(jnp.int32)
    positions = jnp.array([[5, 6], [2, -1]])
    kwargs = dict(kv_segment_ids=filled, q_positions=positions)
    q_seg = (positions >= 0).astype(jnp.int32)
    run = jax.jit(lambda impl, **blocks: attention(q, k, v, q_seg, implementation=impl,
                                                   **blocks, **kwargs), static_argnums=0,
                  static_argnames=("block_q", "block_k"))
    expected, actual = run("reference"), run("xla", block_q=2, block_k=8)
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=1e-6)
    kv_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    ranges = block_ranges(q_seg, filled, positions, kv_pos, 2, 8)
    assert (int(ranges.lo[0]), int(ranges.hi[0])) == (0, 1)


def test_packed_row_visits_its_segments_only():
    """A 2048-token row of 4 segments visits at most a quarter of the block pairs of one
    dense causal row (the measure bench.learner reports as attention FLOPs)."""
    t, block = 2048, 128
    pos = jnp.arange(t)[None]
    dense = visited_pairs(block_ranges(jnp.ones((1, t)), jnp.ones((1, t)), pos, pos,
                                       block, block))
    seg = jnp.asarray(_segments([512] * 4, t))[None]
    packed = visited_pairs(block_ranges(seg, seg, pos, pos, block, block))
    assert int(dense) == 16 * 17 // 2
    assert int(packed) == 4 * (4 * 5 // 2)


def test_bad_arguments_are_named():
    q, k, v, seg, _ = _inputs("gqa_one_kv_head", jnp.float32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        attention(q, k, v, seg, implementation="cuda")
    with pytest.raises(ValueError, match="needs interpret=True"):
        attention(q, k, v, seg, implementation="pallas")
    with pytest.raises(ValueError, match="segment_ids must be"):
        attention(q, k, v, seg[:, 1:])
    with pytest.raises(ValueError, match="query heads are not a multiple"):
        attention(q[:, :, :5], k[:, :, :1].repeat(2, 2), v[:, :, :1].repeat(2, 2), seg)


def test_pallas_fallback_is_logged_and_a_required_kernel_is_an_error(caplog):
    """Compiled (not interpreted) Pallas kernels do not lower on CPU."""
    q, k, v, seg, _ = _inputs("gqa_one_kv_head", jnp.float32)
    from kernels.attention.api import _Blocked

    kernel = _Blocked("pallas", 8, 8)
    args = fallback.signature(q, k, v, seg, seg, seg, seg)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert not fallback.use_pallas("attention", kernel.forward_backward, args, False)
    assert "attention" in caplog.text and "falling back to XLA" in caplog.text
    with pytest.raises(fallback.KernelUnavailable, match="attention was required"):
        fallback.use_pallas("attention", kernel.forward_backward, args, True)
    assert fallback.use_pallas("attention", _Blocked("xla", 8, 8).forward_backward, args, True)
