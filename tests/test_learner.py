"""Train step: packing-invariant log-probs, masked tokens inert, accumulation and
sharding exact, NaN detection."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.qwen3 import Qwen3, Qwen3Config
from models.sharding import make_mesh
from rl import learner
from rl.batch import pack_arrays, unpack
from tests.owners import learner_config

TINY = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=256)


def make_cfg(optim=None, values=None, **loss):
    return learner_config(optim={"lr": 1e-2, **(optim or {})}, loss=loss, temperature=0.7,
                          **(values or {}))


def make_seqs(count=12, seed=0, max_len=40):
    """Token streams with prompt/action/observation stretches, sampler log-probs on the
    generated ones."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(count):
        n = int(rng.integers(8, max_len))
        mask = (rng.random(n) < 0.6).astype(np.int32)
        mask[:3] = 0
        logp = np.where(mask, -rng.uniform(2.0, 7.0, n), 0.0).astype(np.float32)
        seqs.append((rng.integers(0, TINY.vocab_size, n).astype(np.int32), mask, logp))
    return seqs


def make_batch(rows_multiple, seed=0, ref=False):
    seqs = make_seqs(seed=seed)
    rng = np.random.default_rng(seed + 1)
    refs = [np.where(m, lp + rng.normal(0, 0.3, len(lp)), 0).astype(np.float32)
            for _, m, lp in seqs] if ref else None
    return pack_arrays(seqs, rng.normal(0, 1, len(seqs)), buckets=[32, 64],
                       row_multiple=rows_multiple, ref_logprobs=refs)


def new_state(cfg, mesh=None):
    return learner.init_train_state(Qwen3(TINY, rngs=nnx.Rngs(0)), cfg, mesh)


def test_packed_logprobs_equal_each_sequence_alone():
    cfg = make_cfg()
    graphdef, state = new_state(cfg)
    seqs = make_seqs(count=4, seed=3, max_len=30)
    packed, info = pack_arrays(seqs, np.zeros(4), buckets=[128])
    assert packed.shape[0] == 1 and packed.segment_ids.max() == 4  # all in one row
    compute = learner.make_compute_logprobs(graphdef, cfg)
    got = unpack(np.asarray(compute(state.params, packed)), info)

    # Independent reference: each sequence alone in its own row (plain causal attention,
    # trailing padding cannot reach earlier tokens), full log_softmax over the vocabulary.
    width = max(len(ids) for ids, _, _ in seqs)
    tokens = np.stack([np.pad(ids, (0, width - len(ids))) for ids, _, _ in seqs])

    @jax.jit
    def reference(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden = model(tokens, jnp.broadcast_to(jnp.arange(width), tokens.shape))
        logits = hidden @ model.lm_head() / cfg.temperature
        full = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return jnp.take_along_axis(full, tokens[:, 1:, None], axis=-1)[..., 0]

    expected_rows = np.asarray(reference(state.params, tokens))
    for (ids, mask, _), logp, expected in zip(seqs, got, expected_rows, strict=True):
        trained = mask[1:] > 0
        np.testing.assert_allclose(logp[1:][trained], expected[:len(ids) - 1][trained], atol=1e-5)
        assert not logp[1:][~trained].any() and logp[0] == 0


@functools.cache
def _gradient(num_microbatches, mesh_shape=None):
    """Gradient and metrics of one train step of the shared config and batch.

    With lr = 1, Adam eps = 1, no decay and no clipping, the first update is
    u = -g / (|g| + 1) elementwise, so g = -u / (1 - |u|) is recovered exactly
    enough to compare gradients through the public train step.
    """
    cfg = make_cfg(optim=dict(lr=1.0, eps=1.0, weight_decay=0.0, max_grad_norm=0.0),
                   values=dict(num_microbatches=num_microbatches))
    mesh = None if mesh_shape is None else make_mesh(*mesh_shape)
    batch, _ = make_batch(rows_multiple=16)  # 4 micro-batches x 4 data shards
    graphdef, state = new_state(cfg, mesh)
    before = jax.device_get(state.params)
    state, metrics = learner.make_train_step(graphdef, cfg, mesh)(state, batch)
    update = jax.tree.map(np.subtract, jax.device_get(state.params), before)
    return jax.tree.map(lambda u: -u / (1 - np.abs(u)), update), jax.device_get(metrics)


def _assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def test_gradient_accumulation_equals_one_large_batch():
    grads_1, metrics_1 = _gradient(1)
    grads_4, metrics_4 = _gradient(4)
    np.testing.assert_allclose(metrics_4["loss"], metrics_1["loss"], atol=1e-6)
    np.testing.assert_allclose(metrics_4["grad_norm"], metrics_1["grad_norm"], rtol=1e-5)
    _assert_trees_close(grads_4, grads_1, 1e-5)
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in jax.tree.leaves(grads_1)))
    np.testing.assert_allclose(norm, metrics_1["grad_norm"], rtol=1e-3)  # recovery works
    assert metrics_1["grad_norm"] > 0 and metrics_1["step"] == 0


def test_sharded_step_equals_single_device():
    grads_1, metrics_1 = _gradient(4)
    grads_8, metrics_8 = _gradient(4, (1, 4, 2))  # data=1, fsdp=4, tensor=2
    np.testing.assert_allclose(metrics_8["loss"], metrics_1["loss"], atol=1e-6)
    _assert_trees_close(grads_8, grads_1, 1e-5)


def test_masked_tokens_have_no_influence():
    cfg = make_cfg(values=dict(num_minibatches=2), agg="seq-mean-token-mean", dual_clip=3.0,
                   kl="k3", kl_coef=0.1, old_logprobs="learner", tis_cap=2.0)
    batch, _ = make_batch(rows_multiple=2, ref=True)
    off = batch.loss_mask == 0
    rng = np.random.default_rng(7)
    noise = lambda x: np.where(off, rng.normal(0, 50, x.shape), x).astype(np.float32)
    changed = batch.replace(old_logprobs=noise(batch.old_logprobs),
                            advantages=noise(batch.advantages),
                            ref_logprobs=noise(batch.ref_logprobs))
    changed.old_logprobs[off & (batch.segment_ids > 0)] = np.inf
    graphdef, _ = new_state(cfg)
    train_step = learner.make_train_step(graphdef, cfg)
    results = []
    for b in (batch, changed):
        state, metrics = train_step(new_state(cfg)[1], b)
        results.append(jax.device_get((state.params, metrics)))
    (params_a, metrics_a), (params_b, metrics_b) = results
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert metrics_a[key] == metrics_b[key], key
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_nan_loss_raises_with_step_number():
    cfg = make_cfg()
    batch, _ = make_batch(rows_multiple=1)
    graphdef, state = new_state(cfg)
    train_step = learner.make_train_step(graphdef, cfg)
    state, _ = train_step(state, batch)
    state, _ = train_step(state, batch)
    advantages = batch.advantages.copy()
    advantages[batch.loss_mask > 0] = np.nan
    with pytest.raises(FloatingPointError, match="train step 2"):
        train_step(state, batch.replace(advantages=advantages))


def test_bad_batches_are_named():
    cfg = make_cfg(values=dict(num_minibatches=3), kl="k2", kl_coef=0.1)
    batch, _ = make_batch(rows_multiple=1)
    graphdef, state = new_state(cfg)
    train_step = learner.make_train_step(graphdef, cfg)
    with pytest.raises(ValueError, match="ref_logprobs"):
        train_step(state, batch)
    batch, _ = make_batch(rows_multiple=1, ref=True)
    with pytest.raises(ValueError, match="not a multiple of 3"):
        train_step(state, batch)


def test_row_multiple_takes_rows_multiple_and_sft_drops_it():
    """Rows are a multiple of mini x micro batches and of rows_multiple (their lcm), and
    the SFT copy of the section pads no rows."""
    from rl.sft import sft_config
    cfg = make_cfg(values=dict(num_minibatches=3, rows_multiple=8))
    assert learner.row_multiple(cfg) == 24
    cfg = dataclasses.replace(cfg, num_minibatches=4)
    assert learner.row_multiple(cfg) == 8
    assert learner.row_multiple(sft_config(cfg)) == 4
    batch, _ = make_batch(rows_multiple=1)
    assert batch.tokens.shape[0] % 8
    with pytest.raises(ValueError, match="not a multiple of 8"):
        learner.check_rows(batch, cfg)
    learner.check_rows(make_batch(rows_multiple=8)[0], cfg)


def test_schedule_warmup_then_cosine():
    cfg = make_cfg(optim=dict(lr=1.0, warmup_steps=4, schedule="cosine", decay_steps=10,
                              end_lr_frac=0.1))
    schedule = learner.make_schedule(cfg.optim)
    np.testing.assert_allclose([schedule(i) for i in (0, 2, 4, 9, 14, 20)],
                               [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1], atol=1e-6)


def test_exact_kl_matches_full_softmax():
    cfg = make_cfg(kl="exact", kl_coef=0.1)
    batch, _ = make_batch(rows_multiple=1)
    graphdef, state = new_state(cfg)
    ref_params = nnx.to_pure_dict(nnx.split(Qwen3(TINY, rngs=nnx.Rngs(1)), nnx.Param)[1])

    @jax.jit
    def reference(params, ref_params):
        def log_probs(p):
            model = nnx.merge(graphdef, p)
            hidden = model(batch.tokens, batch.positions, batch.segment_ids)
            return jax.nn.log_softmax(hidden[:, :-1] @ model.lm_head() / cfg.temperature, -1)
        logp, ref_logp = log_probs(params), log_probs(ref_params)
        kl = jnp.sum(jnp.exp(logp) * (logp - ref_logp), axis=-1)
        mask = batch.loss_mask[:, 1:]
        return jnp.sum(kl * mask) / jnp.sum(mask)

    expected = float(reference(state.params, ref_params))
    train_step = learner.make_train_step(graphdef, cfg)
    with pytest.raises(ValueError, match="ref_params"):
        train_step(state, batch)
    _, metrics = train_step(state, batch, ref_params)
    assert expected > 0.01
    np.testing.assert_allclose(float(metrics["kl_ref"]), expected, rtol=1e-5)
