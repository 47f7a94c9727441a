"""Chunked XLA and Pallas (interpret) token log-probs against the naive [N, V] reference."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.logprob import token_logprobs
from kernels.logprob.rows import compact_rows

# N and V are not multiples of the block sizes below, so tail blocks are exercised.
N, D, V = 37, 16, 203
BLOCKS = {"xla": {"row_block": 8, "vocab_block": 64},
          "pallas": {"row_block": 16, "vocab_block": 64, "interpret": True}}


def _inputs(dtype, masked_fraction, seed=0, d=D):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    hidden = jax.random.normal(keys[0], (N, d)).astype(dtype)
    lm_head = (jax.random.normal(keys[1], (d, V)) * (0.5 * (D / d) ** 0.5)).astype(dtype)
    targets = jax.random.randint(keys[2], (N,), 0, V)
    if masked_fraction == 0.5:
        mask = jax.random.permutation(keys[3], jnp.arange(N) % 2 == 0)
    else:
        mask = jnp.full((N,), masked_fraction == 0.0)
    cotangents = jax.random.normal(keys[4], (2, N))
    return hidden, lm_head, targets, mask, cotangents


def _value_and_grads(implementation, hidden, lm_head, targets, mask, cotangents, temperature,
                     **blocks):
    """((logp, entropy), (d hidden, d lm_head)) of sum(c0 logp + c1 entropy)."""

    def loss(h, w):
        logp, entropy = token_logprobs(h, w, targets, mask, temperature=temperature,
                                       implementation=implementation, **blocks)
        return jnp.sum(cotangents[0] * logp + cotangents[1] * entropy), (logp, entropy)

    (_, outputs), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(hidden,
                                                                                  lm_head)
    return outputs, grads


def _assert_close(actual, expected, dtype):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        scale = np.abs(expected).max() + 1e-6
        np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=2e-2 * scale)


CASES = [(jnp.float32, t, f) for t in (0.7, 1.0) for f in (0.0, 0.5, 1.0)]
CASES += [(jnp.bfloat16, 0.7, 0.0), (jnp.bfloat16, 1.0, 0.5)]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize(("dtype", "temperature", "masked_fraction"), CASES)
def test_matches_reference(implementation, dtype, temperature, masked_fraction):
    hidden, lm_head, targets, mask, cotangents = _inputs(dtype, masked_fraction)
    args = (hidden, lm_head, targets, mask, cotangents, temperature)
    outputs, grads = _value_and_grads(implementation, *args, **BLOCKS[implementation])
    ref_outputs, ref_grads = _value_and_grads("reference", *args)
    for name, actual, expected in zip(("logp", "entropy", "d_hidden", "d_lm_head"),
                                      (*outputs, *grads), (*ref_outputs, *ref_grads),
                                      strict=True):
        assert actual.dtype == (jnp.float32 if name in ("logp", "entropy") else dtype), name
        _assert_close(actual, expected, dtype)

    # Masked rows: value exactly 0 and gradient exactly 0.
    masked = ~np.asarray(mask)
    for x in (*outputs, grads[0]):
        assert np.all(np.asarray(x, np.float32)[masked] == 0.0)
    if masked.all():
        assert np.all(np.asarray(grads[1], np.float32) == 0.0)


@pytest.mark.parametrize(("dtype", "d", "masked_fraction"), [
    (jnp.float32, 200, 0.5), (jnp.float32, 48, 0.0), (jnp.bfloat16, 200, 0.0)])
def test_pallas_accumulates_logits_over_chunks_of_d(dtype, d, masked_fraction):
    """d = 200 is four 64-wide chunks, the last one zero-padded; 48 is three 16-wide ones."""
    d_block = 64 if d == 200 else 16
    hidden, lm_head, targets, mask, cotangents = _inputs(dtype, masked_fraction, seed=5, d=d)
    args = (hidden, lm_head, targets, mask, cotangents, 0.7)
    outputs, grads = _value_and_grads("pallas", *args, **BLOCKS["pallas"], d_block=d_block)
    ref_outputs, ref_grads = _value_and_grads("reference", *args)
    for actual, expected in zip((*outputs, *grads), (*ref_outputs, *ref_grads), strict=True):
        _assert_close(actual, expected, dtype)
    assert grads[0].shape == (N, d) and grads[1].shape == (d, V)


@pytest.mark.parametrize("d", [1024, 4096, 5120])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_blocks_fit_the_shared_memory_budget(d, dtype):
    """Qwen3-0.6B, 8B and 14B hidden sizes at Qwen3's vocabulary, by the documented model."""
    from kernels.logprob import pallas

    vocab, itemsize = 151936, jnp.dtype(dtype).itemsize
    for budget in (pallas.DEFAULT_SHARED_MEMORY, pallas.SHARED_MEMORY_BYTES["8.6"]):
        engine = pallas.PallasEngine(shared_memory=budget)
        row_block = engine.rows_per_block(4096)
        vocab_block, d_block = engine.blocks(row_block, d, vocab, dtype)
        assert pallas.shared_memory_bytes(row_block, vocab_block, d_block, itemsize) <= budget
        assert d % d_block == 0 and d_block < d and vocab_block >= 16
        # Whole [R, d] and [d, C] tiles, as the kernels loaded before, do not fit.
        assert (row_block + vocab_block) * d * itemsize > budget
    assert pallas.DEFAULT_SHARED_MEMORY == 232_448
    assert pallas.shared_memory_bytes(64, 128, 128, 2) == 147_456  # 2 * 24576 * 2 + 8192 * 6
    with pytest.raises(ValueError, match="no logprob tiles fit 1000 bytes"):
        pallas.PallasEngine(shared_memory=1000).blocks(64, d, vocab, dtype)


def test_pallas_kernels_lower_for_cuda_at_qwen3_shapes():
    """Lowered (not compiled: no GPU here) for CUDA through Triton at d = 1024 and 5120,
    V = 151936: three kernels, the logit tiles over 1187 vocabulary blocks."""
    import re

    from kernels.logprob.chunked import token_logprobs_chunked
    from kernels.logprob.pallas import PallasEngine

    engine = PallasEngine()
    triton = "__gpu$xla.gpu.triton"

    def forward_backward(h, w, t, m):
        outputs, vjp = jax.vjp(lambda h, w: token_logprobs_chunked(h, w, t, m, 1.0, engine),
                               h, w)
        return outputs, vjp(outputs)

    for d in (1024, 5120):
        args = (jax.ShapeDtypeStruct((300, d), jnp.bfloat16),
                jax.ShapeDtypeStruct((d, 151936), jnp.bfloat16),
                jax.ShapeDtypeStruct((300,), jnp.int32), jax.ShapeDtypeStruct((300,), bool))
        exported = jax.export.export(
            jax.jit(forward_backward), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*args)
        text = exported.mlir_module()
        grids = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+)", text)
        assert text.count(triton) == 3 and sorted(grids) == [
            ("1187", "1"), ("5", "1"), ("5", "1187")], grids


def test_entropy_gradient_alone_matches_reference():
    hidden, lm_head, targets, mask, _ = _inputs(jnp.float32, 0.5, seed=3)

    def entropy_sum(implementation, h, w):
        _, entropy = token_logprobs(h, w, targets, mask, implementation=implementation,
                                    **BLOCKS.get(implementation, {}))
        return entropy.sum()

    for implementation in ("xla", "pallas"):
        grad = lambda i: jax.jit(jax.grad(lambda h, w: entropy_sum(i, h, w), (0, 1)))
        grads = grad(implementation)(hidden, lm_head)
        expected = grad("reference")(hidden, lm_head)
        for actual, ref in zip(grads, expected, strict=True):
            _assert_close(actual, ref, jnp.float32)


def test_kept_and_recomputed_logits_agree():
    """The XLA engine keeps the logits for the backward when they fit `keep_bytes`, and
    recomputes them otherwise: both match the reference, and each other exactly."""
    from kernels.logprob.chunked import token_logprobs_chunked
    from kernels.logprob.xla import XlaEngine

    hidden, lm_head, targets, mask, cotangents = _inputs(jnp.float32, 0.5, seed=4)
    results = []
    for keep_bytes in (1 << 30, 0):
        engine = XlaEngine(**BLOCKS["xla"], keep_bytes=keep_bytes)
        assert engine.keeps_logits(40, V) == (keep_bytes > 0)
        f = lambda h, w, e=engine: token_logprobs_chunked(h, w, targets, mask, 0.7, e)
        outputs, vjp = jax.vjp(f, hidden, lm_head)
        results.append((*outputs, *vjp(tuple(cotangents))))
    ref_outputs, ref_grads = _value_and_grads("reference", hidden, lm_head, targets, mask,
                                              cotangents, 0.7)
    for kept, recomputed, expected in zip(*results, (*ref_outputs, *ref_grads), strict=True):
        _assert_close(kept, expected, jnp.float32)
        np.testing.assert_allclose(kept, recomputed, rtol=1e-6, atol=1e-6)


def test_batch_rows_match_the_reference_row_by_row():
    """[R, N, d] input, flattened into one call without a mesh and vmapped per row under
    one, against the reference per row."""
    rows = 3
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    hidden = jax.random.normal(keys[0], (rows, N, D))
    lm_head = jax.random.normal(keys[1], (D, V)) * 0.5
    targets = jax.random.randint(keys[2], (rows, N), 0, V)
    mask = jax.random.bernoulli(keys[3], 0.6, (rows, N)).at[1].set(False)

    def loss(implementation, h, w):
        if implementation == "reference":
            outputs = [token_logprobs(h[r], w, targets[r], mask[r], implementation=implementation)
                       for r in range(rows)]
            logp, entropy = (jnp.stack(x) for x in zip(*outputs, strict=True))
        else:
            logp, entropy = token_logprobs(h, w, targets, mask, implementation=implementation,
                                           **BLOCKS["xla"])
        return jnp.sum(logp * 1.3 + entropy * 0.4), (logp, entropy)

    grads = lambda name: jax.value_and_grad(functools.partial(loss, name), (0, 1),
                                            has_aux=True)(hidden, lm_head)
    expected = grads("reference")
    with jax.set_mesh(jax.make_mesh((1,), ("rows",))):
        per_row = grads("xla")
    for actual in (grads("xla"), per_row):
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
            assert a.shape == e.shape
            _assert_close(a, e, jnp.float32)


def test_default_implementation_and_block_sizes():
    hidden, lm_head, targets, mask, _ = _inputs(jnp.float32, 0.5, seed=1)
    expected = token_logprobs(hidden, lm_head, targets, mask, implementation="reference")
    for kwargs in ({}, {"row_block": 1, "vocab_block": 1}, {"row_block": 1000,
                                                            "vocab_block": 1000}):
        actual = token_logprobs(hidden, lm_head, targets, mask, **kwargs)
        for a, e in zip(actual, expected, strict=True):
            _assert_close(a, e, jnp.float32)


def test_compaction_puts_valid_rows_first_in_whole_blocks():
    mask = jnp.array([0, 1, 0, 1, 1, 0, 0], bool)
    rows = compact_rows(mask, row_block=2)
    np.testing.assert_array_equal(rows.index, [1, 3, 4, 7, 7, 7, 7, 7])
    assert int(rows.num_blocks) == 2
    np.testing.assert_array_equal(rows.valid, [1, 1, 1, 0, 0, 0, 0, 0])
    x = jnp.arange(7.0) + 1
    np.testing.assert_array_equal(rows.scatter(rows.gather(x), 7), x * mask)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"implementation": "cuda"}, "implementation must be one of"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"implementation": "pallas"}, "needs interpret=True"),
    ({"row_block": 0}, "block sizes must be positive"),
])
def test_bad_arguments_are_named(kwargs, message):
    hidden, lm_head, targets, mask, _ = _inputs(jnp.float32, 0.0)
    with pytest.raises(ValueError, match=message):
        token_logprobs(hidden, lm_head, targets, mask, **kwargs)


def test_bad_shapes_are_named():
    hidden, lm_head, targets, mask, _ = _inputs(jnp.float32, 0.0)
    with pytest.raises(ValueError, match="does not match"):
        token_logprobs(hidden, lm_head[1:], targets, mask)
    with pytest.raises(ValueError, match="targets and mask must be"):
        token_logprobs(hidden, lm_head, targets[1:], mask)
    with pytest.raises(ValueError, match="integer token ids"):
        token_logprobs(hidden, lm_head, targets.astype(jnp.float32), mask)


def test_pallas_fallback_is_logged_and_a_required_kernel_is_an_error(caplog):
    from kernels import fallback
    from kernels.logprob.api import _ForwardBackward
    from kernels.logprob.pallas import PallasEngine
    from kernels.logprob.xla import XlaEngine

    signature = fallback.signature(*_inputs(jnp.float32, 0.5)[:4])
    # Compiled Pallas kernels do not lower on CPU: the default keeps the XLA engine, saying so.
    pallas = _ForwardBackward(PallasEngine(**BLOCKS["xla"]), 1.0)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert not fallback.use_pallas("logprob", pallas, signature, required=False)
    assert "Pallas kernel logprob does not compile on cpu, falling back to XLA" in caplog.text
    with pytest.raises(fallback.KernelUnavailable, match="logprob was required"):
        fallback.use_pallas("logprob", pallas, signature, required=True)
    xla = _ForwardBackward(XlaEngine(**BLOCKS["xla"]), 1.0)
    assert fallback.use_pallas("logprob", xla, signature, required=True)


def test_xla_bfloat16_with_every_row_in_one_block():
    """The train step's shape at short rows: one row block holds every row, so XLA folds
    the weight gradient's row slice away; its bfloat16 dot must still run on CPU."""
    hidden, lm_head, targets, mask, cotangents = _inputs(jnp.bfloat16, 0.0, seed=3)
    args = (hidden, lm_head, targets, mask, cotangents, 1.0)
    outputs, grads = _value_and_grads("xla", *args, row_block=64, vocab_block=64)
    ref_outputs, ref_grads = _value_and_grads("reference", *args)
    for actual, expected in zip((*outputs, *grads), (*ref_outputs, *ref_grads), strict=True):
        _assert_close(actual, expected, jnp.bfloat16)
