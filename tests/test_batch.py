"""Packing: layout, bookkeeping, buckets, truncation, padding share."""

import logging

import numpy as np
import pytest

from rl.batch import first_fit_decreasing, pack_arrays, pack_trajectories, unpack
from rl.types import Trajectory, Turn


def _traj(uid, obs_lens, act_lens, replayed=(), seed=0):
    rng = np.random.default_rng(seed)
    turns = [Turn(obs_ids=rng.integers(1, 50, o).tolist(),
                  action_ids=rng.integers(1, 50, a).tolist(),
                  action_logprobs=(-rng.random(a)).tolist(), replayed=i in replayed)
             for i, (o, a) in enumerate(zip(obs_lens, act_lens, strict=True))]
    return Trajectory(task_id="t", uid=uid, turns=turns, reward=1.0)


def test_first_fit_decreasing_by_hand():
    # capacity 8: 6 opens bin 0, 5 bin 1, 3 -> bin 1 (5+3), 2 -> bin 0 (6+2), 2 -> new bin 2
    assert first_fit_decreasing([2, 6, 3, 5, 2], 8) == [0, 0, 1, 1, 2]


def test_pack_layout_and_bookkeeping():
    trajs = [_traj("a", [3, 2], [4, 3], seed=1), _traj("b", [2], [3], seed=2),
             _traj("c", [2, 1], [2, 2], replayed={0}, seed=3)]
    advantages = [1.5, -0.5, 2.0]
    batch, info = pack_trajectories(trajs, advantages, buckets=[8, 16, 32], row_multiple=2)
    # lengths 12, 5, 7: bucket 16 -> rows [12], [5, 7]: 2 rows x 16 = 32 slots (bucket 8 is
    # too short, 32 would give 2 x 32 after rounding to row_multiple 2).
    assert batch.shape == (2, 16) and info.row_len == 16 and info.num_rows == 2
    assert info.real_tokens == 24 and info.real_token_fraction == 24 / 32
    for i, (traj, adv) in enumerate(zip(trajs, advantages, strict=True)):
        ids, mask, logp = traj.token_arrays()
        row, start, n = info.placements[i]
        assert n == len(ids)
        cols = slice(start, start + n)
        np.testing.assert_array_equal(batch.tokens[row, cols], ids)
        np.testing.assert_array_equal(batch.positions[row, cols], np.arange(n))
        expected_mask = mask.astype(np.float32)
        expected_mask[0] = 0.0
        np.testing.assert_array_equal(batch.loss_mask[row, cols], expected_mask)
        np.testing.assert_array_equal(batch.old_logprobs[row, cols], logp * expected_mask)
        np.testing.assert_array_equal(batch.advantages[row, cols], np.full(n, adv, np.float32))
        np.testing.assert_array_equal(batch.seq_num_tokens[row, cols],
                                      np.full(n, expected_mask.sum()))
        assert len(set(batch.segment_ids[row, cols].tolist())) == 1
    # "b" and "c" share row 1 as segments 1 and 2; padding is segment 0 with zeros.
    assert batch.segment_ids[1].tolist() == [1] * 5 + [2] * 7 + [0] * 4
    assert batch.segment_ids[0].tolist() == [1] * 12 + [0] * 4
    pad = batch.segment_ids == 0
    for name in ("tokens", "positions", "loss_mask", "old_logprobs", "advantages",
                 "seq_num_tokens"):
        assert not getattr(batch, name)[pad].any(), name
    # the replayed turn of "c" is not trained: only its second action (2 tokens) is
    assert info.loss_tokens == 7 + 3 + 2
    assert [x.tolist() for x in unpack(batch.tokens, info)] == [
        t.token_arrays()[0].tolist() for t in trajs]
    assert batch.ref_logprobs is None


def test_ref_logprobs_and_row_multiple():
    seqs = [(np.arange(1, 6), np.array([0, 0, 1, 1, 1]), np.full(5, -0.5)) for _ in range(3)]
    ref = [np.full(5, -1.0 - i) for i in range(3)]
    batch, info = pack_arrays(seqs, [0.1, 0.2, 0.3], buckets=[8], row_multiple=4, ref_logprobs=ref)
    assert batch.shape == (4, 8)  # three single-sequence rows rounded up to 4
    for i, (row, start, n) in enumerate(info.placements):
        np.testing.assert_array_equal(batch.ref_logprobs[row, start:start + n],
                                      np.array([0, 0, 1, 1, 1]) * (-1.0 - i))
    assert not batch.tokens[3].any()


def test_truncation_keeps_the_start_and_counts(caplog):
    seqs = [(np.arange(1, 21), np.ones(20), np.zeros(20)),
            (np.arange(1, 5), np.ones(4), np.zeros(4))]
    with caplog.at_level(logging.WARNING):
        batch, info = pack_arrays(seqs, [1.0, 1.0], buckets=[8, 16])
    assert info.num_truncated == 1 and "truncated" in caplog.text
    row, start, n = info.placements[0]
    assert n == 16 and batch.tokens[row, start:start + n].tolist() == list(range(1, 17))
    assert batch.seq_num_tokens[row, start] == 15


@pytest.mark.parametrize("kwargs, match", [
    (dict(advantages=[1.0]), "2 advantages|advantages"),
    (dict(advantages=[1.0, float("nan")]), "non-finite"),
    (dict(buckets=[1]), "buckets"),
    (dict(ref_logprobs=[np.zeros(3)]), "ref_logprobs"),
])
def test_bad_input_is_named(kwargs, match):
    seqs = [(np.arange(3), np.ones(3), np.zeros(3)), (np.arange(4), np.ones(4), np.zeros(4))]
    args = dict(advantages=[1.0, 2.0], buckets=[8])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pack_arrays(seqs, args.pop("advantages"), **args)
    with pytest.raises(ValueError, match="lengths"):
        pack_arrays([(np.arange(3), np.ones(2), np.zeros(3))], [0.0], buckets=[8])


def test_long_tailed_lengths_pack_densely():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(1200), 0.9, 256), 200, 8000).astype(int)
    seqs = [(np.ones(n, np.int32), np.ones(n, np.int32), np.zeros(n, np.float32))
            for n in lengths]
    _, info = pack_arrays(seqs, np.zeros(len(seqs)), buckets=[2048, 4096, 8192], row_multiple=8)
    assert info.real_tokens == lengths.sum()
    assert info.real_token_fraction >= 0.85, info.real_token_fraction
