"""HF safetensors in/out against transformers' Qwen3ForCausalLM."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.hf_io import INDEX_FILE, load_hf, save_hf
from models.qwen3 import Qwen3, Qwen3Config

T = 12


@nnx.jit
def _logits(model, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model(tokens, positions) @ model.lm_head()


def _tokens(vocab):
    return np.random.RandomState(0).randint(0, vocab, (2, T)).astype(np.int32)


def _hf_make(hf_reference, tmp_path, tied, heads, kv_heads, head_dim, hidden, layers=2,
             shard_size=None):
    """A random transformers Qwen3 saved to tmp_path/hf; its logits on `_tokens(96)`."""
    config = dict(vocab_size=96, hidden_size=hidden, intermediate_size=40,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=tied, max_position_embeddings=64)
    return _hf_run(hf_reference, tmp_path, op="make", config=config, dir=str(tmp_path / "hf"),
                   max_shard_size=shard_size)


def _hf_run(hf_reference, tmp_path, **request):
    np.save(tmp_path / "tokens.npy", _tokens(96))
    answer = hf_reference({**request, "tokens": str(tmp_path / "tokens.npy"),
                           "logits": str(tmp_path / "logits.npy")})
    return answer, np.load(tmp_path / "logits.npy")


@pytest.mark.parametrize("tied,heads,kv_heads,head_dim,hidden,shard_size", [
    (True, 4, 2, 16, 32, None),     # tied; GQA; head_dim != hidden / heads
    (False, 4, 1, 12, 48, None),    # untied; one kv head
    (False, 2, 2, 8, 24, "20KB"),   # sharded checkpoint with an index file
])
def test_logits_match_transformers(hf_reference, tmp_path, tied, heads, kv_heads, head_dim,
                                   hidden, shard_size):
    _, want = _hf_make(hf_reference, tmp_path, tied, heads, kv_heads, head_dim, hidden,
                       shard_size=shard_size)
    assert os.path.exists(tmp_path / "hf" / INDEX_FILE) == (shard_size is not None)
    cfg, model = load_hf(str(tmp_path / "hf"))
    assert (cfg.tie_word_embeddings, cfg.num_kv_heads, cfg.head_dim) == (tied, kv_heads, head_dim)
    ours = np.asarray(_logits(model, jnp.asarray(_tokens(cfg.vocab_size))))
    np.testing.assert_allclose(ours, want, atol=1e-4)


def test_nested_remat_matches_transformers_and_saves_exactly(hf_reference, tmp_path):
    """A 4-layer checkpoint under remat="nested" (2 groups of 2 layers): logits within 1e-4
    of transformers, and saved back tensor for tensor."""
    _, want = _hf_make(hf_reference, tmp_path, False, 4, 2, 16, 32, layers=4)
    cfg, model = load_hf(str(tmp_path / "hf"), remat="nested")
    assert (cfg.num_layers, cfg.remat) == (4, "nested")
    ours = np.asarray(_logits(model, jnp.asarray(_tokens(cfg.vocab_size))))
    np.testing.assert_allclose(ours, want, atol=1e-4)
    save_hf(model, cfg, str(tmp_path / "ours"))
    _, again = load_hf(str(tmp_path / "ours"))
    a, b = _flat(model), _flat(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


CFG = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=40, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model():
    return Qwen3(CFG, rngs=nnx.Rngs(3))


def _flat(model):
    return {k: np.asarray(v) for k, v in
            jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}


@pytest.mark.parametrize("max_shard_bytes", [2**30, 8000])
def test_save_load_round_trip_is_exact(model, tmp_path, max_shard_bytes):
    save_hf(model, CFG, str(tmp_path), max_shard_bytes=max_shard_bytes)
    assert os.path.exists(tmp_path / INDEX_FILE) == (max_shard_bytes < 2**30)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    cfg, loaded = load_hf(str(tmp_path))
    assert cfg == CFG
    a, b = _flat(model), _flat(loaded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_bfloat16_round_trip_is_exact(model, tmp_path):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param))
    save_hf(params, CFG, str(tmp_path), dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cfg, loaded = load_hf(str(tmp_path), dtype="bfloat16", remat="full")
    assert (cfg.dtype, cfg.param_dtype, cfg.remat) == ("bfloat16", "bfloat16", "full")
    got = jax.tree.leaves(nnx.state(loaded, nnx.Param))
    for want, have in zip(jax.tree.leaves(params), got, strict=True):
        assert have.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(want), np.asarray(have))


def test_saved_checkpoint_loads_in_transformers(hf_reference, model, tmp_path):
    save_hf(model, CFG, str(tmp_path / "ours"), max_shard_bytes=8000)
    answer, want = _hf_run(hf_reference, tmp_path, op="load", dir=str(tmp_path / "ours"))
    assert answer["rope_theta"] == CFG.rope_theta
    ours = np.asarray(_logits(model, jnp.asarray(_tokens(CFG.vocab_size))))
    np.testing.assert_allclose(ours, want, atol=1e-4)


def test_missing_tensor_is_named(model, tmp_path):
    save_hf(model, CFG, str(tmp_path), max_shard_bytes=8000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf(str(tmp_path))


def test_shape_mismatch_is_named(model, tmp_path):
    save_hf(model, CFG, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"intermediate_size": 44}))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_hf(str(tmp_path))
