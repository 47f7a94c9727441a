"""Per-token estimators of KL(pi || pi_ref) from sampled tokens y ~ pi (on-policy).

Inputs are log-probs of the sampled tokens, logp = log pi(y) and ref_logp = log pi_ref(y),
[N] each; log r = ref_logp - logp. Used as a loss, only logp carries gradient (the sample
is not differentiated), so the expected gradient of an estimator k is E_pi[dk/dlogp grad logp].
The true gradient is grad KL(pi || pi_ref) = E_pi[(logp - ref_logp) grad logp].

Sources: J. Schulman, "Approximating KL Divergence" (2020), for the values; Y. Tang and
R. Munos, "On a few pitfalls in KL divergence gradient estimation for RL" (2025), for the
gradients.
"""

import jax
import jax.numpy as jnp


def kl_k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k1 = logp - ref_logp = -log r.

    Value: unbiased for KL, high variance, can be negative.
    Gradient: dk1/dlogp = 1, so E_pi[grad logp] = 0: zero-mean, it carries no signal about
    grad KL and is useless as a loss (it is useful as a reward to REINFORCE).
    """
    return logp - ref_logp


def kl_k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k2 = (logp - ref_logp)^2 / 2 = (log r)^2 / 2.

    Value: biased for KL (exact to second order in log r), low variance, >= 0.
    Gradient: dk2/dlogp = logp - ref_logp, so E_pi[(logp - ref_logp) grad logp] =
    grad KL(pi || pi_ref): unbiased for the reverse-KL gradient.
    """
    return 0.5 * jnp.square(logp - ref_logp)


def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k3 = r - log r - 1 with r = exp(ref_logp - logp).

    Value: unbiased for KL (E_pi[r] = 1), low variance, >= 0.
    Gradient: dk3/dlogp = 1 - r, so E_pi[(1 - r) grad logp] = -sum_y pi_ref(y) grad log pi(y)
    = grad KL(pi_ref || pi): the forward-KL gradient, biased for grad KL(pi || pi_ref).
    """
    log_r = ref_logp - logp
    return jnp.exp(log_r) - log_r - 1.0


def kl_k3plus(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k3+ = k2 + stop_gradient(k3 - k2): k3's value with k2's gradient.

    Value: that of k3 (unbiased, >= 0). Gradient: exactly k2's, logp - ref_logp, unbiased
    for grad KL(pi || pi_ref).
    """
    k2 = kl_k2(logp, ref_logp)
    return k2 + jax.lax.stop_gradient(kl_k3(logp, ref_logp) - k2)
