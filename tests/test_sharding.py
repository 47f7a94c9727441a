"""Sharded Qwen3 on 8 fake CPU devices equals the single-device model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.hf_io import load_hf, save_hf
from models.qwen3 import Qwen3, Qwen3Config
from models.sharding import (
    data_sharding,
    make_mesh,
    param_shardings,
    partition_spec,
    shard_params,
)

CFG = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model():
    return Qwen3(CFG, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.fail("tests/conftest.py should provide 8 CPU devices", pytrace=False)
    return make_mesh(data=1, fsdp=4, tensor=2)


@jax.jit
def _hidden(graphdef_params, tokens):
    graphdef, params = graphdef_params
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return nnx.merge(graphdef, params)(tokens, positions)


def _run(model, tokens):
    graphdef, params = nnx.split(model, nnx.Param)
    return _hidden((graphdef, params), tokens)


def _spec(model, *path):
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node[...].sharding.spec


def _tokens(mesh=None):
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (4, 8)), jnp.int32)
    return tokens if mesh is None else jax.device_put(tokens, data_sharding(mesh))


def _assert_sharded(model):
    assert _spec(model, "embed_tokens", "embedding") == P("tensor", "fsdp")
    # Decoder layers are stacked: a leading [num_layers] axis, never split.
    assert _spec(model, "layers", "self_attn", "q_proj", "kernel") == P(None, "fsdp", "tensor")
    assert _spec(model, "layers", "self_attn", "o_proj", "kernel") == P(None, "tensor", "fsdp")
    assert _spec(model, "layers", "mlp", "down_proj", "kernel") == P(None, "tensor", "fsdp")
    assert _spec(model, "lm_head_proj", "kernel") == P("fsdp", "tensor")
    assert _spec(model, "layers", "self_attn", "q_norm", "scale") == P(None, None)
    q = model.layers.self_attn.q_proj.kernel[...]
    assert {s.data.shape for s in q.addressable_shards} == {(2, 16, 32)}


def test_sharded_forward_matches_single_device(model, mesh):
    single = np.asarray(_run(model, _tokens()))
    graphdef, params = nnx.split(model, nnx.Param)
    sharded_model = nnx.merge(graphdef, shard_params(params, mesh))
    _assert_sharded(sharded_model)
    out = _run(sharded_model, _tokens(mesh))
    np.testing.assert_allclose(np.asarray(out), single, atol=1e-5)


def test_load_hf_places_shards_directly(model, mesh, tmp_path):
    save_hf(model, CFG, str(tmp_path), max_shard_bytes=20_000)
    _, loaded = load_hf(str(tmp_path), mesh=mesh)
    _assert_sharded(loaded)
    out = _run(loaded, _tokens(mesh))
    np.testing.assert_allclose(np.asarray(out), np.asarray(_run(model, _tokens())), atol=1e-5)


def test_non_dividing_axis_is_replicated(mesh):
    # 3 kv heads * 16 = 48 columns split over tensor=2, but 51 columns and 62 rows cannot be.
    assert partition_spec(("layers", 0, "self_attn", "k_proj", "kernel"), (64, 48), mesh) == \
        P("fsdp", "tensor")
    assert partition_spec(("layers", 0, "self_attn", "k_proj", "kernel"), (62, 51), mesh) == \
        P(None, None)


def test_every_parameter_has_a_rule(mesh):
    abstract = nnx.state(nnx.eval_shape(lambda: Qwen3(CFG)), nnx.Param)
    shardings = jax.tree.leaves(param_shardings(abstract, mesh))
    assert len(shardings) == len(jax.tree.leaves(abstract))
    with pytest.raises(KeyError, match="no sharding rule for parameter extra.bias"):
        partition_spec(("extra", "bias"), (4,), mesh)


def test_make_mesh_sizes():
    assert dict(make_mesh(data=2, fsdp=-1, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="needs 6 devices"):
        make_mesh(data=3, fsdp=1, tensor=2)
    with pytest.raises(ValueError, match="at most one"):
        make_mesh(data=-1, fsdp=-1, tensor=1)
