"""Per-row token sampling: temperature, top-k, top-p, greedy; SGLang-convention log-probs.

Decoding a small model is bound by what runs over the vocabulary per row, so each
path does only what its rows need, over the logits cut into blocks of 128 tokens: a
batch of greedy rows takes a first-index argmax (block maxima, then one block) and one
log-sum-exp, and draws no random numbers; sampled rows draw one uniform each and invert
the CDF blockwise (block sums, then one block's cumulative sum) instead of drawing
noise for every token, from the same pass of exp that gives their log-sum-exp;
truncated rows (top-k / top-p) sample among the `candidates` largest logits whenever
those hold the whole kept set; past them, top-p alone finds its threshold by bisection
(32 masked sums over the row), and only a top-k beyond the candidates sorts the row.

A row's uniform is jax.random.uniform(fold_in(PRNGKey(seed), position)), bit for bit,
computed by `uniform_at` with the Threefry-2x32 rounds unrolled: jax lowers Threefry
on CPU as a loop of five rounds, which in a decode step costs more than the rest of
the sampling.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_BLOCK = 128  # tokens per block of the blockwise inverse CDF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


class RowSampling(NamedTuple):
    """Each row's sampling parameters, [B] arrays (a pytree: one traced argument).

    temperature: 0 = greedy. top_p: in (0, 1]. top_k: -1 = all. seeds: uint32; with a
    row's position, it names the row's uniform (`uniform_at`). want_logp: bool, whether
    the row wants its log-prob (None: every row does)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seeds: jax.Array
    want_logp: jax.Array | None = None


def threefry2x32(key: tuple[jax.Array, jax.Array],
                 x: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block cipher (20 rounds, Salmon et al. 2011) of the uint32 pair
    x under the uint32 key pair, elementwise: what jax.random's threefry2x32 computes."""
    ks = (key[0], key[1], key[0] ^ key[1] ^ jnp.uint32(0x1BD11BDA))
    x0, x1 = x[0] + ks[0], x[1] + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << jnp.uint32(r)) | (x1 >> jnp.uint32(32 - r))) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def uniform_at(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """u[B] in [0, 1): jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(seed),
    position)) per row, for uint32 seeds and int32 positions [B]."""
    zero = jnp.zeros_like(seeds, jnp.uint32)
    key = threefry2x32((zero, seeds.astype(jnp.uint32)), (zero, positions.astype(jnp.uint32)))
    bits0, bits1 = threefry2x32(key, (zero, zero))
    mantissa = ((bits0 ^ bits1) >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0


def truncation_mask(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Tokens kept by top-k then top-p (nucleus), per row.

    scaled[B,V] f32 logits / temperature; top_p[B] in (0, 1]; top_k[B] (-1 = all).
    Top-k keeps the k largest; top-p then keeps the smallest prefix of the sorted
    renormalised top-k distribution whose mass before the token is < top_p:
      keep_j  <=>  sum_{i<j} p_sorted_i < top_p.
    Returns keep[B,V] bool (ties at the threshold are all kept).
    """
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k < 1, vocab, jnp.minimum(top_k, vocab))
    rank = jnp.arange(vocab)[None, :]
    in_k = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    count = jnp.sum(in_k & (mass_before < top_p[:, None]), axis=-1)
    threshold = jnp.take_along_axis(desc, jnp.maximum(count, 1)[:, None] - 1, axis=-1)
    return scaled >= threshold


def first_argmax(x: jax.Array) -> jax.Array:
    """argmax over the last axis, the first index on ties: [B,V] -> [B] int32.

    A max and a min over indices (two plain reductions), which XLA's CPU backend runs
    several times faster than its variadic argmax reduction.
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1).astype(jnp.int32)


def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """[B,V] -> [B, ceil(V / _BLOCK), _BLOCK], the tail padded with `fill`."""
    pad = -x.shape[-1] % _BLOCK
    return jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill).reshape(x.shape[0], -1, _BLOCK)


def _blocked_argmax(blocks: jax.Array, block_max: jax.Array) -> jax.Array:
    """first_argmax of the rows of `blocks` [B,N,_BLOCK] given their maxima [B,N]: the
    first block holding the row's maximum, then the first index within that block."""
    block = first_argmax(block_max)
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    return block * _BLOCK + first_argmax(inner)


def _blocked_exp(x: jax.Array):
    """x [B,V] as `_blocks` (tail -inf), their maxima [B,N], the rows' maxima [B], and
    exp(x - row max) as blocks with their sums [B,N]: one pass of exp serves a row's
    log-sum-exp (max + log(sum of block sums)) and its inverse CDF's weights.

    The block maxima and the exponentials are materialised (optimization barriers):
    otherwise XLA takes the rows' maxima in a second pass over x and fuses the exp into
    its sum, a reduction the CPU backend runs on one thread (on CPU, at 32 rows x 4096
    tokens, greedy_tokens in 0.85 of the time)."""
    blocks = _blocks(x, -jnp.inf)
    block_max = jax.lax.optimization_barrier(jnp.max(blocks, axis=-1))
    top = jnp.max(block_max, axis=-1)
    weights = jax.lax.optimization_barrier(jnp.exp(blocks - top[:, None, None]))
    return blocks, block_max, top, weights, jnp.sum(weights, axis=-1)


def greedy_tokens(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first_argmax, log_softmax at it) of logits [B,V] f32, blockwise: the maximum's
    block from the block maxima, its index within that one block, and log_softmax(max) =
    -log(sum(exp(logits - max))). On CPU, at 32 rows x 4096 tokens, this takes half the
    time of the same reductions over whole rows, which wrote [B,V] intermediates."""
    blocks, block_max, _, _, block_sum = _blocked_exp(logits)
    return _blocked_argmax(blocks, block_max), -jnp.log(jnp.sum(block_sum, axis=-1))


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Index j with P(j) = w_j / sum(w): the first j whose cumulative weight exceeds u * sum(w).

    weights[B,V] >= 0 (some positive per row); u[B] in [0, 1). Blockwise: the block is
    found from cumulative block sums, the index from that block's cumulative sum, so
    only V / 128 + 128 prefix sums are taken per row. Returns [B] int32.
    """
    blocks = _blocks(weights, 0.0)
    return _blocked_inverse_cdf(blocks, blocks.sum(axis=-1), u, weights.shape[-1])


def _blocked_inverse_cdf(blocks, block_sum, u, vocab: int) -> jax.Array:
    """inverse_cdf of weights laid out as `_blocks` [B,N,_BLOCK] with their sums [B,N]."""
    block_cdf = jnp.cumsum(block_sum, axis=-1)
    threshold = u * block_cdf[:, -1]
    block = jnp.minimum(jnp.sum(block_cdf <= threshold[:, None], axis=-1), block_sum.shape[1] - 1)
    before = jnp.take_along_axis(block_cdf - block_sum, block[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    inner_cdf = before[:, None] + jnp.cumsum(inner, axis=-1)
    index = jnp.minimum(jnp.sum(inner_cdf <= threshold[:, None], axis=-1), _BLOCK - 1)
    return jnp.minimum(block * _BLOCK + index, vocab - 1).astype(jnp.int32)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 x in the floats' order (-0.0 and +0.0 alike)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    negative = bits >= jnp.uint32(0x80000000)
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def nucleus_mask(scaled: jax.Array, probs: jax.Array, top_p: jax.Array, below: jax.Array,
                 passes: int = 32) -> jax.Array:
    """truncation_mask with top-k off, without a sort: keep[B,V] of scaled[B,V] (probs:
    their softmax), where a row keeps every token at least as likely as the least
    likely one whose more likely tokens hold less than top_p of the mass (ties kept).

    That token's logit is the smallest value v with mass(scaled > v) < top_p; the mass
    of the tokens above a threshold falls as it rises, so v is found by bisection over
    the floats' order, each pass one masked sum over the row, exactly after 32 passes
    (the keys are 32 bits). below[B]: a logit no smaller than v (the top candidates'
    last, whose mass falls short of top_p), the bisection's upper end."""
    keys = _ordered_keys(scaled)
    lo = jnp.min(keys, axis=-1) - jnp.uint32(1)  # mass above: 1 >= top_p
    hi = _ordered_keys(below)  # mass above: < top_p

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // jnp.uint32(2)
        short = jnp.sum(jnp.where(keys > mid[:, None], probs, 0.0), axis=-1) < top_p
        return jnp.where(short, lo, mid), jnp.where(short, mid, hi)

    _, hi = jax.lax.fori_loop(0, passes, halve, (lo, hi))
    return keys >= hi[:, None]


def _sample_truncated(scaled, lse, u, rows: RowSampling, truncated, candidates: int):
    """Top-k / top-p sampling (`rows`' top_p and top_k); among the `candidates` largest
    logits when they hold the kept set of every `truncated` row; else rows with top-k off
    bisect for their top-p threshold over the vocabulary (`nucleus_mask`), and only a
    top-k larger than the candidates (k < V) sorts the vocabulary."""
    top_p, top_k, vocab = rows.top_p, rows.top_k, scaled.shape[-1]
    values, index = jax.lax.top_k(scaled, min(candidates, vocab))
    c = values.shape[-1]
    k = jnp.where(top_k < 1, vocab, jnp.minimum(top_k, vocab))
    in_k = jnp.arange(c)[None, :] < k[:, None]
    # Renormalised over the top k: within the candidates when k <= c; over the whole
    # vocabulary when top-k is off (k = V).
    norm = jnp.where(k <= c, jax.nn.logsumexp(jnp.where(in_k, values, -jnp.inf), axis=-1), lse)
    probs = jnp.where(in_k, jnp.exp(values - norm[:, None]), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (mass_before < top_p[:, None])
    covered = ~truncated | (k <= c) | ((k >= vocab) & (jnp.sum(probs, axis=-1) >= top_p))

    def among_candidates():
        pick = inverse_cdf(jnp.where(keep, probs, 0.0), u)
        return jnp.take_along_axis(index, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    def with_nucleus():  # the rows the candidates miss have top-k off
        softmax = jnp.exp(scaled - lse[:, None])
        kept = nucleus_mask(scaled, softmax, top_p, values[:, -1])
        full = inverse_cdf(jnp.where(kept, softmax, 0.0), u)
        return jnp.where(covered, among_candidates(), full)

    def over_vocabulary():
        full = truncation_mask(scaled, top_p, top_k)
        return inverse_cdf(jnp.where(full, jnp.exp(scaled - lse[:, None]), 0.0), u)

    branch = jnp.where(jnp.all(covered), 0, jnp.where(jnp.all(covered | (k >= vocab)), 1, 2))
    return jax.lax.switch(branch, [among_candidates, with_nucleus, over_vocabulary])


def sample_tokens(logits: jax.Array, rows: RowSampling, positions: jax.Array,
                  candidates: int = 64) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row.

    logits[B,V] f32; rows: each row's sampling parameters; its seeds and positions[B]
    int32 name each row's uniform (`uniform_at`). A sampled row takes the token where
    the CDF of the (truncated) softmax(logits / t) crosses its uniform. The log-prob is
    log_softmax(logits / t)[token] over the full vocabulary (t = 1 when greedy), which is
    what SGLang reports and what the learner recomputes. When no row wants its log-prob
    (rows.want_logp) and every row is greedy, only the argmax is taken and logp is NaN.
    Returns (tokens[B] int32, logp[B] f32).
    """
    temperature, top_p, top_k = rows.temperature, rows.top_p, rows.top_k
    greedy = temperature <= 0.0

    def mixed():
        # The block maxima also give greedy rows' argmax (their scaled logits are the
        # logits).
        scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
        blocks, block_max, top, weights, block_sum = _blocked_exp(scaled)
        lse = top + jnp.log(jnp.sum(block_sum, axis=-1))
        u = uniform_at(rows.seeds, positions)
        truncated = ~greedy & ((top_p < 1.0) | (top_k > 0))
        plain = _blocked_inverse_cdf(weights, block_sum, u, scaled.shape[-1])
        cut = jax.lax.cond(
            jnp.any(truncated),
            lambda: _sample_truncated(scaled, lse, u, rows, truncated, candidates),
            lambda: plain)
        argmax = _blocked_argmax(blocks, block_max)
        tokens = jnp.where(greedy, argmax, jnp.where(truncated, cut, plain))
        logp = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - lse
        return tokens, logp

    def argmax_only():
        blocks = _blocks(logits, -jnp.inf)
        # Materialised: otherwise XLA takes the rows' maxima in a second full pass over
        # the logits rather than from the block maxima.
        tokens = _blocked_argmax(blocks, jax.lax.optimization_barrier(jnp.max(blocks, axis=-1)))
        return tokens, jnp.full(tokens.shape, jnp.nan, jnp.float32)

    wanted = True if rows.want_logp is None else jnp.any(rows.want_logp)
    branch = jnp.where(jnp.all(greedy), jnp.where(wanted, 1, 0), 2)
    return jax.lax.switch(branch, [argmax_only, lambda: greedy_tokens(logits), mixed])
