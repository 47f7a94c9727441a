"""Qwen3 model: cached decoding and packed rows against the plain forward; presets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import qwen3
from models.qwen3 import PRESETS, Qwen3, Qwen3Config, remat_group

CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10_000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model():
    return Qwen3(CFG, rngs=nnx.Rngs(0))


@nnx.jit
def _call(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids)


def _forward(model, tokens, pad_to=12):
    """Hidden states [T, d] of one unpacked sequence (padded to one shape: one compile)."""
    n = len(tokens)
    padded = np.zeros((1, pad_to), np.int32)
    padded[0, :n] = tokens
    positions = np.arange(pad_to, dtype=np.int32)[None]
    segments = (positions < n).astype(np.int32)
    hidden = _call(model, jnp.asarray(padded), jnp.asarray(positions), jnp.asarray(segments))
    return np.asarray(hidden[0, :n])


@pytest.mark.parametrize("dense_scores", [qwen3._DENSE_SCORES, 0], ids=["dense", "blocks"])
def test_decode_matches_forward(model, dense_scores, monkeypatch):
    """Two rows with prompts of 5 and 3 tokens, prefilled in chunks of 3 and 2 (row 1's
    second chunk is padding, position -1), then 4 single-token steps; the prefill chunks
    attend densely, or through kernels.attention's blocks."""
    monkeypatch.setattr(qwen3, "_DENSE_SCORES", dense_scores)
    decode = nnx.jit(lambda m, tokens, positions, cache: m.decode(tokens, positions, cache))
    rng = np.random.RandomState(0)
    seqs = [rng.randint(0, CFG.vocab_size, 9), rng.randint(0, CFG.vocab_size, 7)]
    full = [_forward(model, s) for s in seqs]
    cache = model.init_cache(batch=2, max_len=12)
    chunks = [
        ([seqs[0][0:3], seqs[1][0:3]], [[0, 1, 2], [0, 1, 2]]),
        ([seqs[0][3:5], [0, 0]], [[3, 4], [-1, -1]]),
    ] + [([[seqs[0][5 + i]], [seqs[1][3 + i]]], [[5 + i], [3 + i]]) for i in range(4)]
    for tokens, positions in chunks:
        hidden, cache = decode(model, jnp.asarray(np.array(tokens, np.int32)),
                               jnp.asarray(np.array(positions, np.int32)), cache)
        for b in range(2):
            for t, p in enumerate(positions[b]):
                if p >= 0:
                    np.testing.assert_allclose(np.asarray(hidden[b, t]), full[b][p], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [9, 7])
    np.testing.assert_array_equal(np.asarray(cache.valid),
                                  np.arange(12)[None] < np.array([[9], [7]]))


def test_packed_row_matches_separate_sequences(model):
    rng = np.random.RandomState(2)
    a, b = rng.randint(0, CFG.vocab_size, 5), rng.randint(0, CFG.vocab_size, 4)
    tokens = np.concatenate([a, b, [0, 0]])[None].astype(np.int32)
    positions = np.concatenate([np.arange(5), np.arange(4), [0, 0]])[None].astype(np.int32)
    segments = np.array([[1] * 5 + [2] * 4 + [0, 0]], np.int32)
    packed = np.asarray(_call(model, jnp.asarray(tokens), jnp.asarray(positions),
                              jnp.asarray(segments)))
    np.testing.assert_allclose(packed[0, :5], _forward(model, a), atol=1e-5)
    np.testing.assert_allclose(packed[0, 5:9], _forward(model, b), atol=1e-5)
    assert np.isfinite(packed).all()


def test_functional_split_merge_under_jit(model):
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.array([[3, 1, 4, 1, 5]], jnp.int32)
    positions = jnp.arange(5)[None]

    @jax.jit
    def logits(params, tokens):
        m = nnx.merge(graphdef, params)
        return m(tokens, positions) @ m.lm_head()

    out = logits(params, tokens)
    assert out.shape == (1, 5, CFG.vocab_size)
    np.testing.assert_allclose(np.asarray(out[0]), _forward(model, [3, 1, 4, 1, 5])
                               @ np.asarray(model.lm_head()), atol=1e-5)


def test_remat_gives_same_loss_and_grads(model):
    graphdef, params = nnx.split(model, nnx.Param)
    remat_cfg = dataclasses.replace(CFG, remat="full")
    graphdef_remat, _ = nnx.split(nnx.eval_shape(lambda: Qwen3(remat_cfg)), nnx.Param)
    tokens = jnp.array([[3, 1, 4, 1, 5, 9]], jnp.int32)

    def loss(params, graphdef):
        m = nnx.merge(graphdef, params)
        logits = m(tokens, jnp.arange(6)[None]) @ m.lm_head()
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[0, :, 2])

    assert "remat" in str(jax.make_jaxpr(loss, static_argnums=1)(params, graphdef_remat))
    assert "remat" not in str(jax.make_jaxpr(loss, static_argnums=1)(params, graphdef))
    plain = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, graphdef)
    remat = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, graphdef_remat)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_gradients_are_autodiffs(dtype):
    """qwen3.linear's own VJP (x transposed for the kernel gradient) gives autodiff's
    gradients of x @ kernel, for [B, T, in] inputs, in their dtypes, up to the rounding
    of a dot that sums in another order."""
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(keys[0], (2, 5, 8)).astype(dtype)
    kernel = jax.random.normal(keys[1], (8, 6)).astype(dtype)
    g = jax.random.normal(keys[2], (2, 5, 6)).astype(dtype)
    ours = jax.vjp(qwen3.linear, x, kernel)[1](g)
    autodiff = jax.vjp(jnp.dot, x, kernel)[1](g)
    for a, b in zip(ours, autodiff, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6 if dtype == "float32" else 1e-2, atol=1e-6)


def test_remat_group_is_the_divisor_nearest_sqrt_layers():
    assert [remat_group(n) for n in (36, 40, 64, 28, 6, 7)] == [6, 5, 8, 4, 2, 1]


def test_nested_remat_gives_same_loss_and_grads():
    """remat="nested" (3 groups of 2 layers) against no remat: the same loss and gradients
    of every parameter, on a packed row with padding."""
    cfg = dataclasses.replace(CFG, num_layers=6, attention="reference")  # compiles fastest
    graphdef, params = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(1)), nnx.Param)
    nested, full = (nnx.split(nnx.eval_shape(lambda r=remat: Qwen3(dataclasses.replace(
        cfg, remat=r))), nnx.Param)[0] for remat in ("nested", "full"))
    tokens = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 0]], jnp.int32)
    positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0]], jnp.int32)
    segments = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0]], jnp.int32)

    def loss(params, graphdef):
        m = nnx.merge(graphdef, params)
        logits = m(tokens, positions, segments) @ m.lm_head()
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[0, :, 2])

    jaxpr = lambda g: str(jax.make_jaxpr(loss, static_argnums=1)(params, g))
    assert jaxpr(nested).count("scan[") == jaxpr(full).count("scan[") + 1  # over the groups
    assert jaxpr(nested).count("remat") == jaxpr(full).count("remat") + 1
    plain = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, graphdef)
    got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, nested)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(got), strict=True):
        assert np.abs(np.asarray(a)).max() > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


@pytest.mark.parametrize("remat", ["full", "save-dots", "nested"])
def test_bfloat16_gradients_reach_every_layer(model, remat):
    """bf16 compute with f32 parameters (the recipes' numerics): the gradients of the
    embedding and of the first layer follow the float32 model's."""
    graphdef, params = nnx.split(model, nnx.Param)
    cfg16 = dataclasses.replace(CFG, dtype="bfloat16", remat=remat)
    graphdef16, _ = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg16)), nnx.Param)
    tokens = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)

    def loss(params, graphdef):
        m = nnx.merge(graphdef, params)
        logits = (m(tokens, jnp.arange(8)[None]) @ m.lm_head()).astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[0, :, 2])

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g32, g16 = grad(params, graphdef), grad(params, graphdef16)
    for path in (("embed_tokens", "embedding"), ("layers", "self_attn", "q_proj", "kernel")):
        a, b = g32, g16
        for key in path:
            a, b = a[key], b[key]
        a, b = np.asarray(a[...]), np.asarray(b[...], np.float32)
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(b, a, atol=0.05 * np.abs(a).max())


def test_tied_head_is_embedding_transpose():
    m = Qwen3(dataclasses.replace(CFG, tie_word_embeddings=True))
    embedding = np.asarray(m.embed_tokens.embedding[...])
    np.testing.assert_array_equal(np.asarray(m.lm_head()), embedding.T)
    assert not hasattr(m, "lm_head_proj")


def test_bfloat16_close_to_float32(model):
    cfg16 = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg16)))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(abstract))
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param))
    m16 = nnx.merge(graphdef, params)
    tokens = jnp.array([[5, 6, 7, 8]], jnp.int32)
    h16 = _call(m16, tokens, jnp.arange(4)[None], None)
    assert h16.dtype == jnp.bfloat16
    h32 = _call(model, tokens, jnp.arange(4)[None], None)
    np.testing.assert_allclose(np.asarray(h16, np.float32), np.asarray(h32), atol=0.1)


# Released sizes: total / non-embedding parameters from the Qwen3 model cards.
@pytest.mark.parametrize("name,total,non_embedding", [
    ("qwen3-0.6b", 0.6, 0.44), ("qwen3-1.7b", 1.7, 1.4), ("qwen3-4b", 4.0, 3.6),
    ("qwen3-8b", 8.2, 6.95), ("qwen3-14b", 14.8, 13.2), ("qwen3-32b", 32.8, 31.2)])
def test_preset_parameter_counts(name, total, non_embedding):
    cfg = PRESETS[name]

    def count_params(layers):
        abstract = nnx.eval_shape(lambda: Qwen3(dataclasses.replace(cfg, num_layers=layers)))
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))

    # Layers are identical, so the count is affine in the layer count.
    one, two = count_params(1), count_params(2)
    count = one + (cfg.num_layers - 1) * (two - one)
    embedding = cfg.vocab_size * cfg.hidden_size
    assert round(count / 1e9, 1) == pytest.approx(total, abs=0.051)
    assert (count - embedding * (1 if cfg.tie_word_embeddings else 2)) / 1e9 == \
        pytest.approx(non_embedding, abs=0.051)


def test_config_hf_mapping_round_trip():
    for cfg in PRESETS.values():
        assert Qwen3Config.from_hf(cfg.to_hf()) == cfg
    hf = PRESETS["qwen3-8b"].to_hf()
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_theta": 5e6, "rope_type": "default"}
    assert Qwen3Config.from_hf(hf).rope_theta == 5e6


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE"),
    ({"model_type": "llama"}, "model_type"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_config_rejects_unsupported(change, message):
    with pytest.raises(ValueError, match=message):
        Qwen3Config.from_hf(PRESETS["tiny"].to_hf() | change)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(CFG, num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(CFG, dtype="float16")
    with pytest.raises(ValueError, match="remat must be one of"):
        dataclasses.replace(CFG, remat="yes")
    with pytest.raises(ValueError, match="attention must be one of"):
        dataclasses.replace(CFG, attention="flash")
