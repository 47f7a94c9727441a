"""Packing trajectories into fixed-shape learner batches.

Several trajectories share a row when that saves padding (first-fit decreasing
bin packing into rows of length L); each keeps its own `segment_ids` value and
positions that restart at 0, so attention never crosses trajectories. Shapes come
from a small set: L from a configured bucket list, the row count rounded up to a
multiple (mini-batches x micro-batches x data-parallel shards), which bounds the
number of compilations of the train step.

Alignment: every per-token array is aligned with `tokens`. `old_logprobs[r, t]` is
log p(tokens[r, t] | earlier tokens of its segment); the first token of a segment
has no context, so its loss_mask is forced to 0.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import flax.struct
import numpy as np

from rl.types import Trajectory

log = logging.getLogger(__name__)


@flax.struct.dataclass
class Batch:
    """Learner batch; all arrays [R, L] (a pytree, NumPy on the host, jax.Array on device).

    tokens: int32 token ids, pad_id on padding.
    positions: int32 position inside the segment (restarts at 0 per trajectory).
    segment_ids: int32 1..k for the k trajectories of a row, 0 on padding.
    loss_mask: float32 1 on tokens the policy generated in this rollout, else 0.
    old_logprobs: float32 the sampler's log-probs of the tokens (0 where mask is 0).
    advantages: float32 the trajectory's scalar advantage broadcast to its tokens.
    seq_num_tokens: float32 number of loss tokens of the token's trajectory (0 on
      padding); turns per-token sums into per-sequence means (rl/loss.py).
    ref_logprobs: float32 reference-policy log-probs, or None when KL is off.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    advantages: np.ndarray
    seq_num_tokens: np.ndarray
    ref_logprobs: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


@dataclasses.dataclass(frozen=True)
class PackInfo:
    """Host-side bookkeeping of one packing.

    placements[i] = (row, start, length) of input trajectory i (after truncation).
    """

    num_rows: int
    row_len: int
    num_trajectories: int
    num_truncated: int
    real_tokens: int
    loss_tokens: int
    placements: tuple[tuple[int, int, int], ...]

    @property
    def real_token_fraction(self) -> float:
        """Non-padding share of the batch's R*L slots."""
        return self.real_tokens / (self.num_rows * self.row_len)

    def stats(self) -> dict[str, float]:
        return {"batch/real_token_fraction": self.real_token_fraction,
                "batch/num_rows": self.num_rows, "batch/row_len": self.row_len,
                "batch/num_truncated": self.num_truncated,
                "batch/loss_tokens": self.loss_tokens}


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[int]:
    """Bin index of each item; bins of `capacity`, items placed longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    remaining = np.zeros(0, np.int64)
    bins = [0] * len(lengths)
    for i in order:
        fits = np.flatnonzero(remaining >= lengths[i])
        if fits.size:
            b = int(fits[0])
        else:
            b = remaining.size
            remaining = np.append(remaining, capacity)
        remaining[b] -= lengths[i]
        bins[i] = b
    return bins


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def choose_layout(lengths: Sequence[int], buckets: Sequence[int],
                  row_multiple: int) -> tuple[int, list[int], int]:
    """(row_len, bin of each item, num_rows) minimising padded slots num_rows*row_len.

    Candidates are the buckets that hold the longest item; ties go to the shorter row.
    """
    longest = max(lengths)
    best = None
    for row_len in sorted(buckets):
        if row_len < longest:
            continue
        bins = first_fit_decreasing(lengths, row_len)
        rows = _round_up(max(bins) + 1, row_multiple)
        if best is None or rows * row_len < best[2] * best[0]:
            best = (row_len, bins, rows)
    return best


def _checked_lengths(seqs, advantages, buckets, row_multiple, ref_logprobs
                     ) -> tuple[np.ndarray, list[int]]:
    """(advantages as float32, each sequence's packed length: at most max(buckets)), or
    ValueError naming what is wrong with pack_arrays' input."""
    if not seqs:
        raise ValueError("pack_arrays: no sequences to pack")
    if len(advantages) != len(seqs):
        raise ValueError(f"pack_arrays: {len(advantages)} advantages for {len(seqs)} sequences")
    if ref_logprobs is not None and len(ref_logprobs) != len(seqs):
        raise ValueError(f"pack_arrays: {len(ref_logprobs)} ref_logprobs for {len(seqs)} sequences")
    if not buckets or min(buckets) < 2:
        raise ValueError(f"pack_arrays: buckets must be lengths >= 2, got {list(buckets)}")
    if row_multiple < 1:
        raise ValueError(f"pack_arrays: row_multiple must be >= 1, got {row_multiple}")
    advantages = np.asarray(advantages, np.float32)
    if not np.all(np.isfinite(advantages)):
        bad = np.flatnonzero(~np.isfinite(advantages)).tolist()
        raise ValueError(f"pack_arrays: non-finite advantages at indices {bad}")

    max_len, lengths = max(buckets), []
    for i, (ids, mask, logp) in enumerate(seqs):
        if not len(ids) == len(mask) == len(logp):
            raise ValueError(f"pack_arrays: sequence {i} has ids/mask/logprobs of lengths "
                             f"{len(ids)}/{len(mask)}/{len(logp)}")
        if ref_logprobs is not None and len(ref_logprobs[i]) != len(ids):
            raise ValueError(f"pack_arrays: ref_logprobs {i} has length {len(ref_logprobs[i])}, "
                             f"sequence has {len(ids)}")
        if len(ids) == 0:
            raise ValueError(f"pack_arrays: sequence {i} is empty")
        lengths.append(min(len(ids), max_len))
    return advantages, lengths


def pack_arrays(seqs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
                advantages: Sequence[float], *, buckets: Sequence[int], row_multiple: int = 1,
                ref_logprobs: Sequence[np.ndarray] | None = None,
                pad_id: int = 0) -> tuple[Batch, PackInfo]:
    """Packs (ids[T], loss_mask[T], logprobs[T]) sequences into a `Batch`.

    Sequences longer than max(buckets) keep their first max(buckets) tokens
    (counted in PackInfo.num_truncated).
    """
    advantages, lengths = _checked_lengths(seqs, advantages, buckets, row_multiple,
                                           ref_logprobs)
    max_len = max(buckets)
    num_truncated = sum(len(s[0]) > max_len for s in seqs)
    if num_truncated:
        log.warning("pack_arrays: %d of %d sequences truncated to %d tokens",
                    num_truncated, len(seqs), max_len)

    row_len, bins, num_rows = choose_layout(lengths, buckets, row_multiple)
    shape = (num_rows, row_len)
    tokens = np.full(shape, pad_id, np.int32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    old_logprobs = np.zeros(shape, np.float32)
    adv = np.zeros(shape, np.float32)
    seq_num_tokens = np.zeros(shape, np.float32)
    ref = None if ref_logprobs is None else np.zeros(shape, np.float32)

    fill = np.zeros(num_rows, np.int64)
    segments = np.zeros(num_rows, np.int32)
    placements = []
    for i, (ids, mask, logp) in enumerate(seqs):
        row, n = bins[i], lengths[i]
        start = int(fill[row])
        fill[row] += n
        segments[row] += 1
        cols = slice(start, start + n)
        m = np.asarray(mask[:n], np.float32).copy()
        m[0] = 0.0  # no context to predict the segment's first token from
        tokens[row, cols] = ids[:n]
        positions[row, cols] = np.arange(n)
        segment_ids[row, cols] = segments[row]
        loss_mask[row, cols] = m
        old_logprobs[row, cols] = np.where(m > 0, logp[:n], 0.0)
        adv[row, cols] = advantages[i]
        seq_num_tokens[row, cols] = m.sum()
        if ref is not None:
            ref[row, cols] = np.where(m > 0, ref_logprobs[i][:n], 0.0)
        placements.append((row, start, n))

    batch = Batch(tokens=tokens, positions=positions, segment_ids=segment_ids,
                  loss_mask=loss_mask, old_logprobs=old_logprobs, advantages=adv,
                  seq_num_tokens=seq_num_tokens, ref_logprobs=ref)
    info = PackInfo(num_rows=num_rows, row_len=row_len, num_trajectories=len(seqs),
                    num_truncated=num_truncated, real_tokens=int(sum(lengths)),
                    loss_tokens=int(loss_mask.sum()), placements=tuple(placements))
    return batch, info


def pack_trajectories(trajectories: Sequence[Trajectory], advantages: Sequence[float], *,
                      buckets: Sequence[int], row_multiple: int = 1,
                      ref_logprobs: Sequence[np.ndarray] | None = None,
                      pad_id: int = 0) -> tuple[Batch, PackInfo]:
    """Packs trajectories (token stream, mask and sampler log-probs from
    `Trajectory.token_arrays()`) with one scalar advantage each."""
    return pack_arrays([t.token_arrays() for t in trajectories], advantages, buckets=buckets,
                       row_multiple=row_multiple, ref_logprobs=ref_logprobs, pad_id=pad_id)


def unpack(values: np.ndarray, info: PackInfo) -> list[np.ndarray]:
    """Per-trajectory slices of a [R, L] per-token array, in input order."""
    values = np.asarray(values)
    return [values[row, start:start + n] for row, start, n in info.placements]
