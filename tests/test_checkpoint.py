"""Checkpoint round trip: 3 steps, save, restore in a new process, 2 more steps equals
5 uninterrupted steps bit for bit (CPU, fixed seeds), host state included."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from rl.checkpoint import Checkpointer, decode_host, encode_host

# Run both in this process and in the child, so the two sides build identical inputs.
SETUP = textwrap.dedent("""
    import numpy as np
    from flax import nnx

    from configs import common
    from models.qwen3 import Qwen3, Qwen3Config
    from models.sharding import make_mesh
    from rl import learner
    from rl.batch import pack_arrays

    TINY = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=256)
    CFG = common.learner_defaults()
    CFG.optim.lr = 1e-2
    CFG.num_minibatches = 2
    MESH = make_mesh(data=2, fsdp=2, tensor=2)

    def model():
        return Qwen3(TINY, rngs=nnx.Rngs(0))

    def batch(step):
        rng = np.random.default_rng(step)
        seqs = []
        for _ in range(6):
            n = int(rng.integers(8, 30))
            mask = (np.arange(n) >= 4).astype(np.int32)
            seqs.append((rng.integers(0, 256, n).astype(np.int32), mask,
                         np.where(mask, -rng.uniform(2, 6, n), 0).astype(np.float32)))
        return pack_arrays(seqs, rng.normal(size=6), buckets=[32],
                           row_multiple=learner.row_multiple(CFG, MESH))[0]

    def host_state():
        tracker = {"alpha": np.linspace(0.5, 2.0, 5), "beta": np.arange(5, dtype=np.int16)}
        queue = [{"uid": "a", "k": 3}, {"uid": "b", "k": 1, "w": np.ones((2, 2), np.float32)}]
        return {"tracker": tracker, "queue": queue, "data_position": 17,
                "rho": np.float32(0.75), "note": None}
""")

CHILD = SETUP + textwrap.dedent("""
    import sys
    import jax
    from rl.checkpoint import Checkpointer

    workdir, out = sys.argv[1], sys.argv[2]
    ckpt = Checkpointer(workdir)
    step = ckpt.latest_step()
    graphdef, abstract = learner.abstract_train_state(nnx.eval_shape(model), CFG, MESH)
    state, host = ckpt.restore(step, abstract)
    same_layout = all(x.sharding == a.sharding for x, a in
                      zip(jax.tree.leaves(state), jax.tree.leaves(abstract)))
    expected = host_state()
    host_ok = (repr(jax.tree.map(np.asarray, host)) == repr(jax.tree.map(np.asarray, expected))
               and host["rho"].dtype == np.float32 and host["tracker"]["beta"].dtype == np.int16)
    train_step = learner.make_train_step(graphdef, CFG, MESH)
    for i in range(int(state.step), 5):
        state, _ = train_step(state, batch(i))
    leaves = jax.tree.leaves(jax.device_get(state))
    np.savez(out, *leaves)
    print("RESULT", step, same_layout, host_ok)
""")

namespace = {}
exec(SETUP, namespace)  # noqa: S102 - the same source the child process runs


def _train(state, train_step, steps):
    for i in steps:
        state, _ = train_step(state, namespace["batch"](i))
    return state


def test_resume_in_new_process_is_bitwise(tmp_path):
    learner, cfg, mesh = namespace["learner"], namespace["CFG"], namespace["MESH"]
    graphdef, state = learner.init_train_state(namespace["model"](), cfg, mesh)
    train_step = learner.make_train_step(graphdef, cfg, mesh)
    state = _train(state, train_step, range(3))
    ckpt = Checkpointer(str(tmp_path), keep=2)
    assert ckpt.save(3, state, namespace["host_state"]())
    ckpt.wait()
    ckpt.close()
    state = _train(state, train_step, range(3, 5))
    expected = jax.tree.leaves(jax.device_get(state))

    script = tmp_path / "resume.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.getcwd(),
               XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(tmp_path / "out.npz")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT 3 True True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as got:
        resumed = [got[f"arr_{i}"] for i in range(len(got.files))]
    assert len(resumed) == len(expected)
    for x, y in zip(expected, resumed, strict=True):
        np.testing.assert_array_equal(x, y)
    assert int(resumed[-2]) == 5  # TrainState leaves end with step, rng


def test_keep_latest_and_missing_step(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=2, async_save=False)
    state = {"w": np.arange(3.0)}
    for step in (1, 2, 3):
        ckpt.save(step, state, {"step": step})
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    restored, host = ckpt.restore(3, abstract)
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert host == {"step": 3}
    with pytest.raises(FileNotFoundError, match="step 1"):
        ckpt.restore(1, abstract)
    ckpt.close()


def test_host_encoding_round_trip_and_errors():
    value = {"a": np.array([[1, 2]], np.uint8), "b": [1.5, "x", None, True],
             "c": np.float64(2.5), "d": np.zeros((0, 3), np.float32)}
    back = decode_host(json.loads(json.dumps(encode_host(value))))
    assert back["b"] == [1.5, "x", None, True] and back["c"] == 2.5
    assert isinstance(back["c"], np.float64)
    np.testing.assert_array_equal(back["a"], value["a"])
    assert back["a"].dtype == np.uint8 and back["d"].shape == (0, 3)
    with pytest.raises(TypeError, match="keys must be str"):
        encode_host({1: 2})
    with pytest.raises(TypeError, match="set"):
        encode_host({"s": {1, 2}})
