"""Checkpoint round trip: 3 steps, save, restore in a new process, 2 more steps equals
5 uninterrupted steps bit for bit (CPU, fixed seeds), host state included."""

import glob
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from rl.checkpoint import Checkpointer, decode_host, encode_host
from rl.metrics import MetricWriter

# Run both in this process and in the child, so the two sides build identical inputs.
SETUP = textwrap.dedent("""
    import numpy as np
    from flax import nnx

    from models.qwen3 import Qwen3, Qwen3Config
    from models.sharding import make_mesh
    from rl import learner
    from rl.batch import pack_arrays
    from tests.owners import learner_config

    TINY = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position_embeddings=256)
    CFG = learner_config(optim={"lr": 1e-2}, num_minibatches=2)
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
    assert int(resumed[-1]) == 5  # TrainState leaves end with step


def test_a_train_state_saved_with_its_old_rng_restores_without_it(tmp_path):
    """Train states once carried an unread `rng` key: such a checkpoint restores into
    today's TrainState (the entry is dropped), and a state that differs otherwise raises."""
    learner, cfg, mesh = namespace["learner"], namespace["CFG"], namespace["MESH"]
    graphdef, state = learner.init_train_state(namespace["model"](), cfg, mesh)
    old = {"params": state.params, "opt_state": state.opt_state, "step": state.step + 3,
           "rng": jax.random.PRNGKey(cfg.seed)}
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(3, old, {"step": 3})
    ckpt.close()
    ckpt = Checkpointer(str(tmp_path))
    _, abstract = learner.abstract_train_state(namespace["model"](), cfg, mesh)
    step, restored, host = ckpt.restore_latest(abstract)
    assert step == 3 and host == {"step": 3} and not hasattr(restored, "rng")
    assert type(restored) is learner.TrainState and int(restored.step) == 3
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert x.sharding == y.sharding
        if x.ndim:  # the step differs: 3 saved, 0 in the fresh state
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ckpt.save(4, {**old, "extra": np.zeros(2)}, {})
    with pytest.raises(ValueError, match="extra"):
        ckpt.restore(4, abstract)
    ckpt.close()


def test_keep_latest_and_missing_step(tmp_path):
    ckpt = Checkpointer(str(tmp_path), keep=2)
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


def _truncate(pattern):
    paths = [p for p in glob.glob(pattern) if os.path.isfile(p)]
    assert paths, pattern
    for path in paths:
        with open(path, "r+b") as f:
            f.truncate(3)


def _saved(tmp_path, steps=(1, 2, 3)):
    ckpt = Checkpointer(str(tmp_path), keep=3)
    for step in steps:
        ckpt.save(step, {"w": np.arange(1000.0) * step}, {"step": step})
    return ckpt, {"w": jax.ShapeDtypeStruct((1000,), np.float64)}


@pytest.mark.parametrize("damage,error", [
    ("3/host/metadata", "JSONDecodeError"),            # the host state's JSON cut short
    ("3/state/d/*", "Requested byte range"),           # an array file cut short
    ("3/state", "not found in the checkpoint")])       # an item missing
def test_damaged_latest_step_falls_back_to_the_previous_one(tmp_path, caplog, damage, error):
    ckpt, abstract = _saved(tmp_path)
    ckpt.close()
    target = os.path.join(tmp_path, "ckpt", damage)
    if damage == "3/state":
        shutil.rmtree(target)
    else:
        _truncate(target)
    ckpt = Checkpointer(str(tmp_path), keep=3)
    with caplog.at_level(logging.WARNING, logger="rl.checkpoint"):
        step, state, host = ckpt.restore_latest(abstract)
    assert step == 2 and host == {"step": 2}
    np.testing.assert_array_equal(state["w"], np.arange(1000.0) * 2)
    warning = next(r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage())
    assert "step 3" in warning and error in warning, warning
    # Kept aside for inspection; the resumed run saves step 3 again.
    assert os.path.isdir(os.path.join(tmp_path, "ckpt", "3.damaged"))
    assert ckpt.all_steps() == [1, 2]
    assert ckpt.save(3, {"w": np.zeros(1000)}, {"step": 3}) and ckpt.latest_step() == 3
    ckpt.close()


def test_no_readable_step_is_an_error_naming_each(tmp_path):
    ckpt, abstract = _saved(tmp_path, steps=(1, 2))
    _truncate(os.path.join(tmp_path, "ckpt", "*", "host", "metadata"))
    with pytest.raises(RuntimeError, match=r"step 2: JSONDecodeError.*step 1: JSONDecodeError"):
        ckpt.restore_latest(abstract)
    assert ckpt.all_steps() == [1, 2]  # nothing moved when nothing restores
    with pytest.raises(FileExistsError, match="step 2 already exists"):
        ckpt.save(2, {"w": np.zeros(1000)})
    ckpt.close()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(str(tmp_path / "empty")).restore_latest(abstract)


def test_failed_save_is_raised_by_that_save(tmp_path):
    """A write that fails (here: files capped at 20 KB, EFBIG, as a full disk gives
    ENOSPC) raises from the save of that step; the previous step stays the latest."""
    ckpt, abstract = _saved(tmp_path, steps=(1,))
    big = {"w": np.random.default_rng(0).normal(size=100_000)}
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, limit[1]))
    try:
        with pytest.raises(Exception, match="File too large"):
            ckpt.save(2, big, {"step": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert ckpt.all_steps() == [1]
    assert Checkpointer(str(tmp_path)).restore_latest(
        {"w": jax.ShapeDtypeStruct((1000,), np.float64)})[0] == 1
    assert ckpt.save(2, big, {"step": 2}) and ckpt.all_steps() == [1, 2]  # space again
    ckpt.close()


KILLED_RUN = textwrap.dedent("""
    import glob, os, signal, sys, threading, time
    import numpy as np
    from rl.checkpoint import Checkpointer
    from rl.metrics import MetricWriter

    workdir = sys.argv[1]
    ckpt, writer = Checkpointer(workdir, keep=2), MetricWriter(workdir, resume_step=0)

    def kill_mid_save():  # SIGKILL once step 3's checkpoint is being written
        while not glob.glob(os.path.join(workdir, "ckpt", "3.orbax-checkpoint-tmp*")):
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_mid_save, daemon=True).start()
    for step in range(1, 5):
        writer.write_scalars(step, {"loss": 1.0 / step})
        ckpt.save(step, {"w": np.full(4_000_000, step, np.float32)}, {"step": step})
        print("saved", step, flush=True)
""")


def test_kill_mid_save_then_resume_writes_each_metrics_row_once(tmp_path):
    """A run killed while writing step 3's checkpoint (its metrics row already written)
    resumes from step 2; the rows of steps 1-4 are then each in metrics.jsonl once."""
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert proc.stdout.split() == ["saved", "1", "saved", "2"], proc.stdout
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # step 3's row, its checkpoint unfinished

    ckpt = Checkpointer(str(tmp_path), keep=2)
    step, _, host = ckpt.restore_latest({"w": jax.ShapeDtypeStruct((4_000_000,), np.float32)})
    assert step == 2 and host == {"step": 2}
    writer = MetricWriter(str(tmp_path), resume_step=step)
    for step in (3, 4):
        writer.write_scalars(step, {"loss": 1.0 / step})
        ckpt.save(step, {"w": np.zeros(4, np.float32)}, {"step": step})
    writer.close()
    ckpt.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_reader_falls_back_without_moving_anything(tmp_path):
    """--eval_only reads the newest step that restores and leaves a damaged one in place."""
    ckpt, abstract = _saved(tmp_path)
    ckpt.close()
    _truncate(os.path.join(tmp_path, "ckpt", "3", "host", "metadata"))
    ckpt = Checkpointer(str(tmp_path), keep=3)
    step, state, _ = ckpt.restore_latest(abstract, set_aside=False)
    assert step == 2 and ckpt.all_steps() == [1, 2, 3]
    np.testing.assert_array_equal(state["w"], np.arange(1000.0) * 2)
    assert not glob.glob(os.path.join(tmp_path, "ckpt", "*.damaged*"))
    ckpt.close()


def test_a_save_without_room_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A disk with less room than the last checkpoint takes (shutil.disk_usage reports
    what statvfs says; here it says 1 KiB): the save raises ENOSPC naming the sizes, and
    Orbax starts no write whose threads would each print a traceback."""
    import errno

    ckpt, _ = _saved(tmp_path, steps=(1,))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: real(path)._replace(free=1024))
    with pytest.raises(OSError, match=r"no room for the checkpoint of step 2: the last one "
                                      r"\(1\) takes 0\.\d MiB and .*ckpt has 0\.0 MiB free") as e:
        ckpt.save(2, {"w": np.zeros(1000)}, {"step": 2})
    assert e.value.errno == errno.ENOSPC
    assert ckpt.all_steps() == [1] and sorted(os.listdir(ckpt.directory)) == ["1"]
    monkeypatch.setattr(shutil, "disk_usage", real)
    assert ckpt.save(2, {"w": np.zeros(1000)}, {"step": 2}) and ckpt.all_steps() == [1, 2]
    ckpt.close()


FILLING_DISK = textwrap.dedent("""
    import os, shutil, sys
    import train

    real, ckpt_dir = shutil.disk_usage, os.path.join(sys.argv[1], "ckpt")

    def filling(path):  # full once the warm start's checkpoint is written
        full = os.path.isdir(os.path.join(ckpt_dir, "0"))
        return real(path)._replace(free=0) if full else real(path)

    shutil.disk_usage = filling
    train.main(["--config", "configs/default.py:smoke", "--workdir", sys.argv[1],
                "--compilation_cache", ""])
""")


def test_a_full_disk_stops_training_with_one_message(tmp_path):
    """train.py on a disk that fills after the warm start's checkpoint: the run stops at
    the next checkpoint with exit code 1 and one line naming the cause, no traceback."""
    script, workdir = tmp_path / "run.py", tmp_path / "run"
    script.write_text(FILLING_DISK)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(script), str(workdir)], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert " stopped: OSError: [Errno 28] no room for the checkpoint of step 1: the last " \
           "one (0) takes" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1  # step 1 ran; its checkpoint was refused
