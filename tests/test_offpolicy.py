"""Off-policy correction (rl.loss.offpolicy_weights) against a NumPy reference that loops
over hand-made sequences: token- and sequence-level truncated importance weights and
geometric-mean sequence masks, packed with padding, prompts and replayed prefixes."""

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rl import loss as losses
from rl.batch import pack_arrays, unpack

# Each sequence: its loss mask (0 = prompt, observation or replayed-prefix token; the
# packer also masks every first token), the sampler's and the learner's old log-probs.
# Multiples of 1/32, so float32 sums are exact and only exp rounds.
MASKS = [
    [0, 0, 1, 1, 1, 0, 1, 1],            # prompt, action, observation, action
    [0, 0, 0, 0, 1, 1, 1],               # a replayed prefix, then its own turn
    [0, 1, 1, 0, 0, 1, 1, 1, 1, 0],      # trailing observation
    [0, 0, 0, 0],                        # every turn replayed: nothing trained
    [0, 1, 1, 1, 1, 1],                  # far off-policy
]
SHIFTS = [0.0625, -0.25, 0.03125, 0.5, 1.5]  # mean old - sampler of each sequence


def _sequences(seed=0):
    rng = np.random.default_rng(seed)
    seqs, olds = [], []
    for mask, shift in zip(MASKS, SHIFTS, strict=True):
        n = len(mask)
        sampler = -rng.integers(1, 24, n) / 8.0
        old = sampler + shift + rng.integers(-2, 3, n) / 16.0
        seqs.append((rng.integers(0, 50, n).astype(np.int32), np.array(mask, np.int32),
                     sampler.astype(np.float32)))
        olds.append(old.astype(np.float32))
    return seqs, olds


def _packed(seqs, olds):
    """Packed into rows of 16 (several segments a row, padding after them)."""
    batch, info = pack_arrays(seqs, np.ones(len(seqs)), buckets=[16])
    assert batch.shape[0] >= 2 and (batch.segment_ids == 0).any()  # padding present
    assert (batch.segment_ids.max(axis=1) >= 2).any()  # segments share a row
    old = np.zeros(batch.shape, np.float32)
    for (row, start, n), o in zip(info.placements, olds, strict=True):
        old[row, start:start + n] = o
    return batch, info, old


def reference(cfg, seqs, olds):
    """Per sequence (weight[T], keep, geo_ratio) on its loss tokens, in float64 loops."""
    out = []
    for (_, mask, sampler), old in zip(seqs, olds, strict=True):
        trained = [t for t in range(1, len(mask)) if mask[t]]  # first token: no context
        d = [float(old[t]) - float(sampler[t]) for t in trained]
        geo = float(np.exp(sum(d) / len(d))) if d else 1.0
        if not cfg.tis_cap:
            weight = [1.0] * len(d)
        elif cfg.tis_level == "token":
            weight = [min(float(np.exp(x)), cfg.tis_cap) for x in d]
        else:
            weight = [min(float(np.exp(sum(d))), cfg.tis_cap)] * len(d)
        keep = not cfg.seq_mask_high or cfg.seq_mask_low <= geo <= cfg.seq_mask_high
        out.append((np.array(weight), float(keep), geo, trained))
    return out


def _cfg(**kw):
    base = dict(name="ppo", agg="token-mean", eps_low=0.2, eps_high=0.28, dual_clip=0.0,
                kl="none", kl_coef=0.0, old_logprobs="learner", tis_cap=0.0, tis_level="token",
                seq_mask_low=0.0, seq_mask_high=0.0)
    base.update(kw)
    return ml_collections.ConfigDict(base)


CASES = [dict(tis_cap=c, tis_level=lv, seq_mask_low=lo, seq_mask_high=hi)
         for c, lv, (lo, hi) in itertools.product(
             (0.0, 1.5, 4.0), ("token", "sequence"), ((0.0, 0.0), (0.9, 1.2), (0.5, 2.0)))
         if c or hi]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_weights_and_masks_match_numpy(kw):
    cfg = _cfg(**kw)
    losses.check_config(cfg)
    seqs, olds = _sequences()
    batch, info, old = _packed(seqs, olds)
    weight, keep, geo = (np.asarray(x) for x in losses.offpolicy_weights(
        cfg, jnp.asarray(old), jnp.asarray(batch.old_logprobs), jnp.asarray(batch.loss_mask),
        jnp.asarray(batch.segment_ids)))
    expected = reference(cfg, seqs, olds)
    for got_w, got_k, got_g, (want_w, want_k, want_g, trained) in zip(
            unpack(weight, info), unpack(keep, info), unpack(geo, info), expected, strict=True):
        np.testing.assert_allclose(got_w[trained], want_w, rtol=1e-6, atol=1e-6)
        assert np.all(got_k[trained] == want_k)
        if trained:
            np.testing.assert_allclose(got_g[trained], want_g, rtol=1e-6, atol=1e-6)


def test_the_cases_reach_every_branch():
    """The hand-made sequences are truncated and not, masked and kept."""
    seqs, olds = _sequences()
    token = reference(_cfg(tis_cap=1.5), seqs, olds)
    weights = np.concatenate([w for w, *_ in token])
    assert (weights == 1.5).any() and (weights < 1.5).any()
    seq = reference(_cfg(tis_cap=1.5, tis_level="sequence"), seqs, olds)
    assert {w[0] == 1.5 for w, _, _, t in seq if t} == {True, False}
    masked = reference(_cfg(seq_mask_low=0.9, seq_mask_high=1.2), seqs, olds)
    assert {k for _, k, _, t in masked if t} == {0.0, 1.0}


def test_loss_and_metrics_match_numpy():
    """policy_loss with sequence TIS and a mask: loss = token mean of tis * keep * PPO
    term (a masked sequence keeps its share of the denominator); the metrics are the
    reference's token means, maxima and minima."""
    cfg = _cfg(tis_cap=4.0, tis_level="sequence", seq_mask_low=0.9, seq_mask_high=1.2)
    seqs, olds = _sequences()
    batch, info, old = _packed(seqs, olds)
    rng = np.random.default_rng(3)
    logp = old + rng.uniform(-0.3, 0.3, old.shape).astype(np.float32)
    adv = np.array([1.0, -1.0, 0.5, 2.0, -0.5])
    batch, _ = pack_arrays(seqs, adv, buckets=[16])
    mb = jax.tree.map(jnp.asarray, batch)
    token_weights = losses.token_mean_weights(mb.loss_mask, None)
    loss, metrics = losses.policy_loss(cfg, jnp.asarray(logp), jnp.zeros_like(mb.loss_mask), mb,
                                       token_weights, token_weights, old_logp=jnp.asarray(old))
    terms, weights, masked = [], [], []
    for i, (w, keep, _, trained) in enumerate(reference(cfg, seqs, olds)):
        row, start, _ = info.placements[i]
        for j, t in enumerate(trained):
            ratio = np.exp(float(logp[row, start + t]) - float(olds[i][t]))
            clipped = min(max(ratio, 0.8), 1.28)
            terms.append(-min(ratio * adv[i], clipped * adv[i]) * w[j] * keep)
            weights.append(w[j])
            masked.append(1.0 - keep)
    np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(metrics["tis_mean"]), np.mean(weights), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["tis_max"]), max(weights), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["tis_min"]), min(weights), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["seq_masked_frac"]), np.mean(masked), rtol=1e-6)
    assert 0 < np.mean(masked) < 1


@pytest.mark.parametrize("kw, match", [
    (dict(tis_level="trajectory", tis_cap=2.0), "tis_level"),
    (dict(seq_mask_low=1.1, seq_mask_high=1.5), "bracket 1"),
    (dict(seq_mask_high=1.5, old_logprobs="sampler"), "old_logprobs"),
])
def test_bad_config_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        losses.check_config(_cfg(**kw))
