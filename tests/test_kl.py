"""KL estimators against hand-computed values and exact expectations; exact_kl against naive."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kl import exact_kl, kl_k1, kl_k2, kl_k3, kl_k3plus

LOGP = jnp.array([-1.0, -2.0, -0.5])
REF_LOGP = jnp.array([-2.0, -1.0, -0.5])


def test_estimator_values_by_hand():
    # log r = ref_logp - logp = [-1, 1, 0]
    np.testing.assert_allclose(kl_k1(LOGP, REF_LOGP), [1.0, -1.0, 0.0])
    np.testing.assert_allclose(kl_k2(LOGP, REF_LOGP), [0.5, 0.5, 0.0])
    k3 = [np.exp(-1.0) + 1.0 - 1.0, np.exp(1.0) - 1.0 - 1.0, 0.0]
    np.testing.assert_allclose(kl_k3(LOGP, REF_LOGP), k3, rtol=1e-6)
    np.testing.assert_allclose(kl_k3plus(LOGP, REF_LOGP), k3, rtol=1e-6)


def test_estimator_gradients_by_hand():
    grad = lambda k: jax.grad(lambda lp: k(lp, REF_LOGP).sum())(LOGP)
    np.testing.assert_allclose(grad(kl_k1), [1.0, 1.0, 1.0])
    np.testing.assert_allclose(grad(kl_k2), [1.0, -1.0, 0.0])
    np.testing.assert_allclose(grad(kl_k3), 1.0 - np.exp([-1.0, 1.0, 0.0]), rtol=1e-6)
    for argnums in (0, 1):
        k2_grad = jax.grad(lambda *a: kl_k2(*a).sum(), argnums)(LOGP, REF_LOGP)
        k3plus_grad = jax.grad(lambda *a: kl_k3plus(*a).sum(), argnums)(LOGP, REF_LOGP)
        np.testing.assert_array_equal(k3plus_grad, k2_grad)


def test_estimator_gradient_bias_in_expectation():
    """E_{y~pi}[grad k] by enumeration: k1 -> 0, k2 -> grad KL(pi||ref), k3 -> grad KL(ref||pi)."""
    theta = jnp.array([0.3, -1.2, 0.8, 0.0, 2.0])
    ref_log_q = jax.nn.log_softmax(jnp.array([1.0, 0.5, -0.3, 0.2, -1.0]))

    def expected_grad(estimator):
        def surrogate(th):
            log_p = jax.nn.log_softmax(th)
            weights = jax.lax.stop_gradient(jnp.exp(log_p))  # samples are not differentiated
            return jnp.sum(weights * estimator(log_p, ref_log_q))
        return jax.grad(surrogate)(theta)

    reverse = jax.grad(lambda th: jnp.sum(jax.nn.softmax(th) * (jax.nn.log_softmax(th)
                                                               - ref_log_q)))(theta)
    forward = jax.grad(lambda th: jnp.sum(jnp.exp(ref_log_q) * (ref_log_q
                                                                - jax.nn.log_softmax(th))))(theta)
    np.testing.assert_allclose(expected_grad(kl_k1), 0.0, atol=1e-6)
    np.testing.assert_allclose(expected_grad(kl_k2), reverse, atol=1e-6)
    np.testing.assert_allclose(expected_grad(kl_k3plus), reverse, atol=1e-6)
    np.testing.assert_allclose(expected_grad(kl_k3), forward, atol=1e-6)
    assert not np.allclose(forward, reverse, atol=1e-2)


N, D, D_REF, V = 29, 8, 12, 150


def _kl_inputs(masked_fraction):
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    hidden = jax.random.normal(keys[0], (N, D))
    lm_head = jax.random.normal(keys[1], (D, V)) * 0.5
    ref_hidden = jax.random.normal(keys[2], (N, D_REF))
    ref_lm_head = jax.random.normal(keys[3], (D_REF, V)) * 0.5
    if masked_fraction == 0.5:
        mask = jax.random.bernoulli(keys[4], 0.5, (N,))
    else:
        mask = jnp.full((N,), masked_fraction == 0.0)
    cotangent = jax.random.normal(keys[5], (N,))
    return hidden, lm_head, ref_hidden, ref_lm_head, mask, cotangent


@pytest.mark.parametrize(("temperature", "masked_fraction"), [(0.7, 0.5), (1.0, 0.0),
                                                                (1.0, 1.0)])
def test_exact_kl_matches_naive(temperature, masked_fraction):
    hidden, lm_head, ref_hidden, ref_lm_head, mask, cotangent = _kl_inputs(masked_fraction)

    def value_and_grads(implementation, **blocks):
        def loss(h, w):
            kl = exact_kl(h, w, ref_hidden, ref_lm_head, mask, temperature=temperature,
                          implementation=implementation, **blocks)
            return jnp.sum(cotangent * kl), kl
        (_, kl), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(hidden,
                                                                                lm_head)
        return kl, *grads

    actual = value_and_grads("xla", row_block=8, vocab_block=64)
    expected = value_and_grads("reference")
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    masked = ~np.asarray(mask)
    assert np.all(np.asarray(actual[0])[masked] == 0.0)
    assert np.all(np.asarray(actual[1])[masked] == 0.0)
    assert np.all(np.asarray(actual[0])[~masked] > 0.0)


def test_exact_kl_bfloat16_with_every_row_in_one_block():
    """One row block holds every row, so XLA folds the weight gradient's row slice away;
    its bfloat16 dot must still run on CPU, close to the float32 reference."""
    hidden, lm_head, ref_hidden, ref_lm_head, mask, cotangent = _kl_inputs(0.0)

    def value_and_grads(dtype, implementation, **blocks):
        def loss(h, w):
            kl = exact_kl(h, w, ref_hidden.astype(dtype), ref_lm_head.astype(dtype), mask,
                          implementation=implementation, **blocks)
            return jnp.sum(cotangent * kl), kl
        (_, kl), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
            hidden.astype(dtype), lm_head.astype(dtype))
        return kl, *grads

    actual = value_and_grads(jnp.bfloat16, "xla", row_block=32, vocab_block=64)
    expected = value_and_grads(jnp.float32, "reference")
    for a, e in zip(actual, expected, strict=True):
        a, e = np.asarray(a, np.float32), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=5e-2, atol=5e-2 * np.abs(e).max())


def test_exact_kl_is_zero_for_identical_models():
    hidden, lm_head, *_, mask, _ = _kl_inputs(0.0)
    kl = exact_kl(hidden, lm_head, hidden, lm_head, mask, row_block=8, vocab_block=64)
    np.testing.assert_allclose(kl, 0.0, atol=1e-5)


def test_exact_kl_bad_shapes_are_named():
    hidden, lm_head, ref_hidden, ref_lm_head, mask, _ = _kl_inputs(0.0)
    with pytest.raises(ValueError, match="ref_lm_head"):
        exact_kl(hidden, lm_head, ref_hidden, ref_lm_head[:, 1:], mask)
    with pytest.raises(ValueError, match="implementation must be"):
        exact_kl(hidden, lm_head, ref_hidden, ref_lm_head, mask, implementation="pallas")
