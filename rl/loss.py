"""Policy losses: per-token objectives, aggregation weights, KL and off-policy terms.

Everything here is per token over arrays of one shape (e.g. a micro-batch [r, L])
and pure; sequence-level terms sum over each token's segment (rl.batch packs one
trajectory per segment of a row). Which log-probs are which:
- `sampler_logp` (Batch.old_logprobs): what the inference engine reported when it
  generated the token, `log_softmax(logits / T)` under the rollout policy.
- `old_logp`: the PPO ratio's denominator. Either the sampler's log-probs
  (cfg.old_logprobs = "sampler") or the learner's own log-probs of the same
  tokens, recomputed with the parameters at the start of the train step
  (cfg.old_logprobs = "learner"); only then is the off-policy correction between
  the two meaningful: truncated importance sampling (TIS), per token or per
  sequence, and sequence masks (offpolicy_weights). Rollouts that ran ahead of the
  learner (rollout.max_staleness) were sampled by older policies: this is where
  that is corrected.
- `logp`: the learner's current log-probs, the only differentiated input.

Aggregation turns per-token losses into one scalar through weights w with
loss = sum(w * loss_tok). Weights are computed over a whole mini-batch (one
optimizer update), so summing micro-batch losses gives exactly the
mini-batch loss and gradient accumulation is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels.kl import api as kl_api

# --------------------------------------------------------------------------- per-token losses


def ppo_token_loss(logp, old_logp, adv, *, eps_low: float, eps_high: float,
                   dual_clip: float = 0.0):
    """Asymmetric clipped surrogate with optional dual clip; arrays of one shape.

    ratio    = exp(logp - old_logp)
    loss_tok = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    dual clip (c = dual_clip > 1): where A < 0, loss_tok = min(loss_tok, -c * A)

    Returns (loss_tok, stats) with per-token indicators for the metrics.
    """
    ratio = jnp.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss_tok = -jnp.minimum(unclipped, clipped)
    stats = {
        "ratio": ratio,
        "clip_low": ((adv < 0) & (ratio < 1.0 - eps_low)).astype(jnp.float32),
        "clip_high": ((adv > 0) & (ratio > 1.0 + eps_high)).astype(jnp.float32),
    }
    if dual_clip:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or 0 for off), got {dual_clip}")
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss_tok > bound)
        loss_tok = jnp.where(adv < 0, jnp.minimum(loss_tok, bound), loss_tok)
        stats["dual_clip"] = dual.astype(jnp.float32)
    return loss_tok, stats


def sft_token_loss(logp, old_logp, adv, **_):
    """Cross-entropy on the trained tokens: loss_tok = -logp (old_logp, adv unused)."""
    del old_logp, adv
    return -logp, {}


TOKEN_LOSSES: dict[str, Callable] = {"ppo": ppo_token_loss, "sft": sft_token_loss}

# --------------------------------------------------------------------------- aggregation


def num_sequences(mask, seq_num_tokens):
    """Sequences with at least one loss token: sum over loss tokens of 1 / n_seq."""
    return jnp.sum(mask / jnp.maximum(seq_num_tokens, 1.0))


def token_mean_weights(mask, seq_num_tokens):
    """w = mask / N, N = loss tokens in the mini-batch (DAPO's token-level mean)."""
    del seq_num_tokens
    return mask / jnp.maximum(jnp.sum(mask), 1.0)


def seq_mean_token_sum_weights(mask, seq_num_tokens):
    """w = mask / S, S = sequences in the mini-batch: mean over sequences of token sums."""
    return mask / jnp.maximum(num_sequences(mask, seq_num_tokens), 1.0)


def seq_mean_token_mean_weights(mask, seq_num_tokens):
    """w = mask / (n_seq * S): mean over sequences of each sequence's token mean."""
    per_seq = mask / jnp.maximum(seq_num_tokens, 1.0)
    return per_seq / jnp.maximum(num_sequences(mask, seq_num_tokens), 1.0)


AGGREGATIONS: dict[str, Callable] = {
    "token-mean": token_mean_weights,
    "seq-mean-token-sum": seq_mean_token_sum_weights,
    "seq-mean-token-mean": seq_mean_token_mean_weights,
}

# --------------------------------------------------------------------------- KL and off-policy

KL_ESTIMATORS: dict[str, Callable] = {
    "k1": kl_api.kl_k1, "k2": kl_api.kl_k2, "k3": kl_api.kl_k3, "k3plus": kl_api.kl_k3plus,
}
KL_KINDS = ("none", *KL_ESTIMATORS, "exact")
TIS_LEVELS = ("token", "sequence")  # where truncated importance weights are taken


def sequence_sums(x, segment_ids):
    """[r, L] -> [r, L]: at each token, the sum of x over its segment (its trajectory's
    tokens in the row); 0 on padding (segment 0)."""
    num_segments = x.shape[-1] + 1

    def row(values, segments):
        sums = jax.ops.segment_sum(values, segments, num_segments=num_segments)
        return jnp.where(segments > 0, sums[segments], 0.0)

    return jax.vmap(row)(x.reshape(-1, x.shape[-1]), segment_ids.reshape(-1, x.shape[-1])
                         ).reshape(x.shape)


def offpolicy_weights(cfg, old_logp, sampler_logp, loss_mask, segment_ids):
    """(weight[...], keep[...], geo_ratio[...]): the sampler -> learner-old correction of
    each token, no gradient. With d = old_logp - sampler_logp on the loss tokens:

      tis_level "token":    weight = min(exp(d_t), tis_cap)
      tis_level "sequence": weight = min(exp(sum_seq d), tis_cap), on every token of it
      (tis_cap 0: weight 1)
      geo_ratio = exp(mean_seq d), the sequence's geometric-mean ratio
      keep = 1 unless seq_mask_high > 0 and geo_ratio is outside [seq_mask_low,
             seq_mask_high] (the whole sequence masked: its loss weight is 0)

    A sequence is a segment of a row (rl.batch); sums and means run over its loss tokens
    only, so prompt, observation and replayed-prefix tokens never count.
    """
    valid = loss_mask > 0
    d = jnp.where(valid, old_logp - sampler_logp, 0.0)
    seq_d = sequence_sums(d, segment_ids)
    count = sequence_sums(valid.astype(jnp.float32), segment_ids)
    geo_ratio = jnp.exp(seq_d / jnp.maximum(count, 1.0))
    weight = jnp.ones_like(d)
    if cfg.tis_cap:
        weight = jnp.minimum(jnp.exp(d if cfg.tis_level == "token" else seq_d), cfg.tis_cap)
    keep = jnp.ones_like(d)
    if cfg.seq_mask_high:
        inside = (geo_ratio >= cfg.seq_mask_low) & (geo_ratio <= cfg.seq_mask_high)
        keep = inside.astype(jnp.float32)
    stop = jax.lax.stop_gradient
    return stop(weight), stop(keep), stop(geo_ratio)


# --------------------------------------------------------------------------- the loss


def offpolicy_metrics(cfg, weight, keep, geo_ratio, valid, token_weights):
    """Token means (and max / min) of the importance weight, the share of loss tokens it
    truncated, the share in masked sequences and the range of geometric-mean ratios."""
    some = lambda x, fill: jnp.where(valid, x, fill)
    m = {}
    if cfg.tis_cap:
        m.update(tis_mean=jnp.sum(token_weights * weight),
                 tis_max=jnp.max(some(weight, -jnp.inf)), tis_min=jnp.min(some(weight, jnp.inf)),
                 tis_clip_frac=jnp.sum(token_weights * (weight >= cfg.tis_cap)))
    m.update(seq_masked_frac=jnp.sum(token_weights * (1.0 - keep)),
             geo_ratio_max=jnp.max(some(geo_ratio, -jnp.inf)),
             geo_ratio_min=jnp.min(some(geo_ratio, jnp.inf)))
    return m


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The `learner.loss` section, one field per key (each documented with its default in
    configs.common.learner_defaults); built, it has passed `check_config`."""

    name: str
    agg: str
    eps_low: float
    eps_high: float
    dual_clip: float
    kl: str
    kl_coef: float
    old_logprobs: str
    tis_cap: float
    tis_level: str
    seq_mask_low: float
    seq_mask_high: float

    def __post_init__(self):
        check_config(self)


def check_config(cfg) -> None:
    """Raises ValueError naming the first bad loss option of `cfg` (the loss section)."""
    if cfg.name not in TOKEN_LOSSES:
        raise ValueError(f"loss.name {cfg.name!r} unknown; known: {sorted(TOKEN_LOSSES)}")
    if cfg.agg not in AGGREGATIONS:
        raise ValueError(f"loss.agg {cfg.agg!r} unknown; known: {sorted(AGGREGATIONS)}")
    if cfg.kl not in KL_KINDS:
        raise ValueError(f"loss.kl {cfg.kl!r} unknown; known: {list(KL_KINDS)}")
    if cfg.old_logprobs not in ("sampler", "learner"):
        raise ValueError(f"loss.old_logprobs must be 'sampler' or 'learner', got "
                         f"{cfg.old_logprobs!r}")
    if (cfg.tis_cap or cfg.seq_mask_high) and cfg.old_logprobs != "learner":
        raise ValueError("loss.tis_cap and loss.seq_mask_high need loss.old_logprobs='learner' "
                         "(they compare the learner's old log-probs with the sampler's)")
    if cfg.tis_level not in TIS_LEVELS:
        raise ValueError(f"loss.tis_level must be one of {TIS_LEVELS}, got {cfg.tis_level!r}")
    if cfg.seq_mask_high and not 0 <= cfg.seq_mask_low <= 1 <= cfg.seq_mask_high:
        raise ValueError(f"loss.seq_mask_low ({cfg.seq_mask_low}) and seq_mask_high "
                         f"({cfg.seq_mask_high}) must bracket 1 (a sequence sampled by the "
                         "learner's own policy is kept)")
    if cfg.dual_clip and cfg.dual_clip <= 1.0:
        raise ValueError(f"loss.dual_clip must be > 1 (or 0 for off), got {cfg.dual_clip}")


# How each metric of policy_loss combines over micro-batches: "sum" (it is a sum of
# per-token values times token weights, so the micro-batches' sum is the mini-batch's
# token mean or total), "max" or "min".
METRIC_REDUCTIONS = {
    "loss": "sum", "pg_loss": "sum", "entropy": "sum", "kl_ref": "sum", "kl_old": "sum",
    "ratio_mean": "sum", "ratio_max": "max", "ratio_min": "min",
    "clip_low_frac": "sum", "clip_high_frac": "sum", "dual_clip_frac": "sum", "clip_frac": "sum",
    "sampler_gap_mean": "sum", "sampler_gap_max": "max",
    "tis_mean": "sum", "tis_max": "max", "tis_min": "min", "tis_clip_frac": "sum",
    "seq_masked_frac": "sum", "geo_ratio_max": "max", "geo_ratio_min": "min",
}


def policy_loss(cfg, logp, entropy, mb, weights, token_weights, *, old_logp,
                kl_tok=None):  # (traced in the jitted train step: the micro-batch's arrays)
    """Scalar loss of a micro-batch and its metric contributions.

    cfg: the loss section (name, agg, eps_low, eps_high, dual_clip, kl, kl_coef,
      old_logprobs, tis_cap, tis_level, seq_mask_low, seq_mask_high).
    logp, entropy: [...] current log-probs and tempered entropies (0 off the mask).
    mb: the micro-batch (`rl.batch.Batch` of [...] arrays).
    weights: [...] aggregation weights (AGGREGATIONS[cfg.agg] over the mini-batch).
    token_weights: [...] mask / (mini-batch loss tokens), for token-mean metrics.
    old_logp: [...] the ratio's denominator (see module docstring).
    kl_tok: [...] per-token KL to the reference when cfg.kl == "exact", else None.

    loss = sum(w * (tis * keep * loss_tok + kl_coef * kl_tok)), tis and keep from
    offpolicy_weights (1 when off); a masked sequence keeps its share of the
    aggregation's denominator, as a token whose weight is 0.
    With learner old log-probs, sampler_gap_mean / _max are the token mean and max of
    |old_logp - sampler_logp|.
    Metrics are sums whose total over a mini-batch's micro-batches is the
    mini-batch value (token means; "_max"/"_min" keys reduce by max/min).
    """
    valid = mb.loss_mask > 0
    # Off-mask values never enter the arithmetic, so they cannot leak NaN/Inf into
    # the loss or its gradient.
    zero = lambda x: jnp.where(valid, x, 0.0)
    old_logp, adv, sampler_logp = zero(old_logp), zero(mb.advantages), zero(mb.old_logprobs)

    loss_tok, stats = TOKEN_LOSSES[cfg.name](
        logp, old_logp, adv, eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip)
    metrics = {}
    if cfg.old_logprobs == "learner":
        # How far the sampler's numerics are from the learner's on the same tokens.
        gap = jnp.abs(old_logp - sampler_logp)
        metrics["sampler_gap_mean"] = jnp.sum(token_weights * gap)
        metrics["sampler_gap_max"] = jnp.max(jnp.where(valid, gap, 0.0))
    if cfg.tis_cap or cfg.seq_mask_high:
        weight, keep, geo_ratio = offpolicy_weights(cfg, old_logp, sampler_logp, mb.loss_mask,
                                                    mb.segment_ids)
        loss_tok = loss_tok * (weight * keep)
        metrics.update(offpolicy_metrics(cfg, weight, keep, geo_ratio, valid, token_weights))
    pg_loss = jnp.sum(weights * zero(loss_tok))
    loss = pg_loss
    if cfg.kl != "none":
        if cfg.kl != "exact":
            kl_tok = KL_ESTIMATORS[cfg.kl](logp, zero(mb.ref_logprobs))
        kl_tok = zero(kl_tok)
        loss = loss + cfg.kl_coef * jnp.sum(weights * kl_tok)
        metrics["kl_ref"] = jnp.sum(token_weights * kl_tok)

    metrics.update(loss=loss, pg_loss=pg_loss,
                   entropy=jnp.sum(token_weights * jax.lax.stop_gradient(entropy)))
    metrics.update(ratio_metrics(stats, logp, old_logp, valid, token_weights))
    return loss, metrics


def ratio_metrics(stats, logp, old_logp, valid, token_weights):
    """Token means (and max / min) of the token loss's ratio statistics `stats`, and the
    KL from the old policy; {} for a loss without a ratio."""
    metrics = {}
    if "ratio" in stats:
        ratio = jax.lax.stop_gradient(stats["ratio"])
        # KL(old || current) with samples from old: k3 with the roles of the two swapped.
        kl_old = kl_api.kl_k3(old_logp, jax.lax.stop_gradient(logp))
        metrics.update(
            kl_old=jnp.sum(token_weights * jnp.where(valid, kl_old, 0.0)),
            ratio_mean=jnp.sum(token_weights * ratio),
            ratio_max=jnp.max(jnp.where(valid, ratio, -jnp.inf)),
            ratio_min=jnp.min(jnp.where(valid, ratio, jnp.inf)))
    for name in ("clip_low", "clip_high", "dual_clip"):
        if name in stats:
            metrics[f"{name}_frac"] = jnp.sum(token_weights * stats[name])
    if "clip_low" in stats:
        metrics["clip_frac"] = metrics["clip_low_frac"] + metrics["clip_high_frac"]
    return metrics
