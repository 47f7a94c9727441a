"""SFT warm start: cross-entropy on assistant tokens only, through the learner step."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from models.qwen3 import Qwen3, Qwen3Config
from rl import learner, sft
from rl.batch import unpack
from rl.types import Trajectory, Turn
from tests.owners import learner_config

TINY = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10_000.0,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=64)


def demo(i):
    """A fixed two-turn conversation: prompt, answer, tool output, answer."""
    rng = np.random.default_rng(i)
    prompt, tool = rng.integers(1, 64, 5).tolist(), rng.integers(1, 64, 4).tolist()
    answer = [(i + k) % 7 + 1 for k in range(5)]  # learnable: a fixed pattern
    turns = [Turn(obs_ids=prompt, action_ids=answer, action_logprobs=[0.0] * 5),
             Turn(obs_ids=tool, action_ids=answer[::-1], action_logprobs=[0.0] * 5)]
    return Trajectory(task_id=f"t{i}", uid=f"demo{i}", turns=turns)


def test_sft_is_cross_entropy_on_assistant_tokens_and_learns():
    cfg = learner_config(optim={"lr": 3e-2})
    graphdef, state = learner.init_train_state(Qwen3(TINY, rngs=nnx.Rngs(0)), cfg)
    demos = [demo(i) for i in range(8)]

    first = next(sft.demo_batches(demos, batch_size=4, epochs=1, seed=cfg.seed))
    batch, info = sft.pack_demonstrations(first, buckets=[32])
    logp = learner.make_compute_logprobs(graphdef, sft.sft_config(cfg))(state.params, batch)
    masks = unpack(batch.loss_mask, info)
    assert [int(m.sum()) for m in masks] == [10] * 4  # both answers, never prompt/tool
    first_nll = -sum(float(lp.sum()) for lp in unpack(np.asarray(logp), info)) / 40

    seen = []
    cfg = sft.sft_config(dataclasses.replace(cfg, row_buckets=(32,)))
    batches = sft.demo_batches(demos, batch_size=4, epochs=6, seed=cfg.seed)
    state = sft.train_sft(state, graphdef, batches, cfg,
                          on_metrics=lambda step, m: seen.append((step, m)))
    assert [s for s, _ in seen] == list(range(12))
    losses = [m["loss"] for _, m in seen]
    assert seen[0][1]["batch/loss_tokens"] == 40
    assert np.isfinite(losses).all() and np.mean(losses[-2:]) < 0.5 * np.mean(losses[:2])
    assert int(jax.device_get(state.step)) == 12
    np.testing.assert_allclose(losses[0], first_nll, rtol=1e-5)


def test_demo_without_assistant_tokens_is_rejected():
    empty = Trajectory(task_id="t", uid="empty", turns=[
        Turn(obs_ids=[1, 2], action_ids=[3], action_logprobs=[0.0], replayed=True)])
    with pytest.raises(ValueError, match="empty"):
        sft.pack_demonstrations([empty], buckets=[8])
