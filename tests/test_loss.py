"""Policy loss against a plain Python-loop reference of the same arithmetic."""

import itertools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rl import loss as losses
from rl.batch import pack_arrays, unpack

LENGTHS = (5, 4, 6)
ADVANTAGES = (1.5, -2.0, -0.5)


def _cfg(**kw):
    base = dict(name="ppo", agg="token-mean", eps_low=0.2, eps_high=0.28, dual_clip=0.0,
                kl="none", kl_coef=0.0, old_logprobs="sampler", tis_cap=0.0,
                tis_level="token", seq_mask_low=0.0, seq_mask_high=0.0)
    base.update(kw)
    return ml_collections.ConfigDict(base)


def _problem(seed=0):
    """Three sequences packed into 2 rows of 10; per-sequence current, learner-old and
    reference log-probs with logp - old spread over [-2, 2] to reach every clip branch."""
    rng = np.random.default_rng(seed)
    seqs, cur, learner_old, ref = [], [], [], []
    for n in LENGTHS:
        mask = np.ones(n, np.int32)
        mask[:2] = 0  # prompt tokens
        sampler = -rng.uniform(0.1, 3.0, n).astype(np.float32)
        seqs.append((rng.integers(0, 50, n).astype(np.int32), mask, sampler))
        cur.append((sampler + rng.uniform(-2, 2, n)).astype(np.float32))
        learner_old.append((sampler + rng.uniform(-1, 1, n)).astype(np.float32))
        ref.append(-rng.uniform(0.1, 3.0, n).astype(np.float32))
    batch, info = pack_arrays(seqs, ADVANTAGES, buckets=[10], ref_logprobs=ref)
    assert batch.shape == (2, 10)

    def scatter(values):
        out = np.zeros(batch.shape, np.float32)
        for (row, start, n), v in zip(info.placements, values, strict=True):
            out[row, start:start + n] = v
        return out

    return batch, info, scatter(cur), scatter(learner_old), seqs, cur, learner_old, ref


def reference_loss(cfg, seqs, cur, learner_old, ref):
    """Python loops over sequences and tokens."""
    per_seq = []
    for (_, mask, sampler), logp, lold, rlogp, adv in zip(
            seqs, cur, learner_old, ref, ADVANTAGES, strict=True):
        terms = []
        for t in range(1, len(mask)):
            if not mask[t]:
                continue
            old = float(lold[t]) if cfg.old_logprobs == "learner" else float(sampler[t])
            ratio = math.exp(float(logp[t]) - old)
            clipped = min(max(ratio, 1 - cfg.eps_low), 1 + cfg.eps_high)
            term = -min(ratio * adv, clipped * adv)
            if cfg.dual_clip and adv < 0:
                term = min(term, -cfg.dual_clip * adv)
            if cfg.name == "sft":
                term = -float(logp[t])
            if cfg.tis_cap:
                term *= min(math.exp(old - float(sampler[t])), cfg.tis_cap)
            d = float(logp[t]) - float(rlogp[t])
            kl = {"none": 0.0, "k1": d, "k2": 0.5 * d * d,
                  "k3": math.exp(-d) - 1 + d, "k3plus": math.exp(-d) - 1 + d}[cfg.kl]
            terms.append(term + cfg.kl_coef * kl)
        per_seq.append(terms)
    if cfg.agg == "token-mean":
        return sum(map(sum, per_seq)) / sum(map(len, per_seq))
    if cfg.agg == "seq-mean-token-sum":
        return sum(sum(s) for s in per_seq) / len(per_seq)
    return sum(sum(s) / len(s) for s in per_seq) / len(per_seq)


def _loss(cfg, batch, logp, learner_old):
    mb = jax.tree.map(jnp.asarray, batch)
    weights = losses.AGGREGATIONS[cfg.agg](mb.loss_mask, mb.seq_num_tokens)
    token_weights = losses.token_mean_weights(mb.loss_mask, None)
    old = learner_old if cfg.old_logprobs == "learner" else mb.old_logprobs
    return losses.policy_loss(cfg, jnp.asarray(logp), jnp.zeros_like(mb.loss_mask), mb, weights,
                              token_weights, old_logp=jnp.asarray(old))


CASES = [dict(agg=a, dual_clip=d) for a, d in itertools.product(losses.AGGREGATIONS, (0.0, 3.0))]
CASES += [dict(kl=k, kl_coef=0.1) for k in ("k1", "k2", "k3", "k3plus")]
CASES += [dict(old_logprobs="learner", tis_cap=1.5),
          dict(old_logprobs="learner", agg="seq-mean-token-mean", dual_clip=3.0, tis_cap=2.0,
               kl="k3", kl_coef=0.05),
          dict(name="sft"), dict(name="sft", agg="seq-mean-token-sum")]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_loss_matches_python_loop(kw):
    cfg = _cfg(**kw)
    losses.check_config(cfg)
    batch, _, logp, learner_old, seqs, cur, lold, ref = _problem()
    loss, metrics = _loss(cfg, batch, logp, learner_old)
    expected = reference_loss(cfg, seqs, cur, lold, ref)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(metrics["loss"]) == float(loss)


def test_problem_reaches_every_clip_branch():
    batch, _, logp, _, *_ = _problem()
    _, metrics = _loss(_cfg(dual_clip=3.0), batch, logp, None)
    for name in ("clip_low_frac", "clip_high_frac", "dual_clip_frac"):
        assert 0 < float(metrics[name]) < 1, name


def test_ppo_gradient_by_hand():
    """d loss / d logp = -ratio * A * w where the unclipped term is active, else 0;
    plus kl_coef * w * (logp - ref) for k3plus (the k2 gradient)."""
    cfg = _cfg(kl="k3plus", kl_coef=0.1)
    batch, info, logp, _, seqs, *_ = _problem()
    grad = jax.grad(lambda lp: _loss(cfg, batch, lp, None)[0])(jnp.asarray(logp))
    count = batch.loss_mask.sum()
    ratio = np.exp(logp - batch.old_logprobs)
    adv = batch.advantages
    clipped = ((adv > 0) & (ratio > 1.28)) | ((adv < 0) & (ratio < 0.8))
    expected = batch.loss_mask / count * (
        np.where(clipped, 0.0, -ratio * adv) + 0.1 * (logp - batch.ref_logprobs))
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)
    assert [len(x) for x in unpack(grad, info)] == list(LENGTHS)


def test_metrics_by_hand():
    batch, _, logp, _, *_ = _problem()
    _, metrics = _loss(_cfg(), batch, logp, None)
    valid = batch.loss_mask > 0
    ratio = np.exp(logp - batch.old_logprobs)[valid]
    np.testing.assert_allclose(float(metrics["ratio_mean"]), ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["ratio_max"]), ratio.max(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["ratio_min"]), ratio.min(), rtol=1e-6)
    d = (batch.old_logprobs - logp)[valid]  # KL(old || current) by k3 with samples from old
    np.testing.assert_allclose(float(metrics["kl_old"]), np.mean(np.exp(-d) - 1 + d), rtol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(name="reinforce"), "loss.name"), (dict(agg="sum"), "loss.agg"),
    (dict(kl="k4"), "loss.kl"), (dict(tis_cap=2.0), "tis_cap"),
    (dict(dual_clip=0.5), "dual_clip"), (dict(old_logprobs="ref"), "old_logprobs"),
])
def test_bad_config_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        losses.check_config(_cfg(**kw))


def test_sampler_gap_metrics_by_hand():
    """Learner old log-probs: token mean and max of |old - sampler| over the loss tokens."""
    batch, _, logp, learner_old, *_ = _problem()
    _, metrics = _loss(_cfg(old_logprobs="learner", tis_cap=2.0), batch, logp, learner_old)
    valid = batch.loss_mask > 0
    gap = np.abs(learner_old - batch.old_logprobs)[valid]
    assert gap.max() > 0
    np.testing.assert_allclose(float(metrics["sampler_gap_mean"]), gap.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["sampler_gap_max"]), gap.max(), rtol=1e-6)
    _, sampler_only = _loss(_cfg(), batch, logp, None)
    assert "sampler_gap_mean" not in sampler_only
