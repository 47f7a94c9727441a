"""Multi-host runs as several JAX processes on this machine (a local coordinator, gloo
collectives between fake CPU devices): the rl.distributed helpers against plain Python,
and train.py as 2 processes x 4 devices against 1 process x 8 devices."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import common
from rl import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, port: int | None = None, index: int = 0, count: int = 1) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(key, None)
    if port is not None:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(count),
                   JAX_PROCESS_ID=str(index))
    return env


def _spawn(args: list[str], count: int, devices: int, logs: str) -> list[subprocess.Popen]:
    """`count` processes of one run (a fresh local coordinator) with `devices` CPU devices
    each, or one plain process for count=0; output to files `logs`.{i}.{out,err}."""
    port = _free_port()
    procs = []
    for i in range(max(count, 1)):
        env = _env(devices, port, i, count) if count else _env(devices)
        with open(f"{logs}.{i}.out", "w") as out, open(f"{logs}.{i}.err", "w") as err:
            procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=err,
                                          text=True, start_new_session=True))
    return procs


def _kill_once_saved(procs: list[subprocess.Popen], step_dir: str,
                     timeout: float = 900) -> None:
    """Waits until the checkpoint `step_dir` is complete (Orbax finalises a step by renaming
    its directory), a process exits or `timeout` passes; then SIGKILLs every process group."""
    deadline = time.monotonic() + timeout
    while (not os.path.isdir(step_dir) and time.monotonic() < deadline
           and all(p.poll() is None for p in procs)):
        time.sleep(0.2)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):  # (one that failed has exited)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _logs(logs: str, count: int) -> list[tuple[str, str]]:
    """(stdout, stderr) of each process of `_spawn(..., logs)`, stdout without the lines
    gloo prints as its connections come up."""
    out = []
    for i in range(max(count, 1)):
        with open(f"{logs}.{i}.out") as o, open(f"{logs}.{i}.err") as e:
            stdout = "".join(line for line in o if not line.startswith("[Gloo]"))
            out.append((stdout, e.read()))
    return out


def _finish(procs: list[subprocess.Popen], logs: str, timeout: float) -> list[tuple[str, str]]:
    """Waits for every process (killing all if one runs past `timeout`); their output,
    each checked to have exited 0."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
    outs = _logs(logs, len(procs))
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return outs


# Each process: its share of 7 items squared (gather_map), an all-gather of a dict, the
# digest check on equal and on differing state, a parameter sharded over both
# processes gathered whole, and weight syncs of it.
HELPERS = """
import asyncio, json
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from configs import common
from rl import distributed

assert distributed.initialize(common.ConfigDict(common.distributed_defaults()))
me = jax.process_index()
seen = []
async def square(xs):
    seen.extend(xs)
    return [x * x for x in xs]
gathered = asyncio.run(distributed.gather_map(square, list(range(7))))
objects = distributed.allgather_objects({"p": me, "a": np.arange(me + 1)})
same = distributed.check_consistent({"step": 3, "x": np.ones(2)}, "equal state")
try:
    distributed.check_consistent({"step": me}, "step 9")
    differing = ""
except RuntimeError as e:
    differing = str(e)
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
x = np.arange(24, dtype=np.float32).reshape(8, 3)
params = {"w": jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp", None)))}
local = distributed.local_params(params)["w"]

class Engine:  # records what a weight sync hands it
    def __init__(self):
        self.loaded = []
    async def update_weights(self, p):
        self.loaded.append(bool(np.array_equal(np.asarray(p["w"]), x)))
shared, own = Engine(), Engine()
asyncio.run(distributed.sync_weights(shared, params, shared_servers=True))
asyncio.run(distributed.sync_weights(own, params, shared_servers=False))
print(json.dumps({"seen": seen, "gathered": gathered,
                  "objects": [[o["p"], o["a"].tolist()] for o in objects],
                  "same": same, "differing": differing,
                  "local_equal": bool(np.array_equal(np.asarray(local), x)),
                  "local_addressable": local.is_fully_addressable,
                  "shared_loads": shared.loaded, "own_loads": own.loaded,
                  "layout": distributed.layout()}))
"""


def test_share_is_a_partition():
    for n in range(0, 11):
        for count in (1, 2, 3, 8):
            parts = [list(distributed.share(n, p, count)) for p in range(count)]
            assert sorted(i for part in parts for i in part) == list(range(n))


def test_helpers_over_two_processes(tmp_path):
    logs = str(tmp_path / "helpers")
    outs = _finish(_spawn([sys.executable, "-c", HELPERS], 2, 4, logs), logs, timeout=300)
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["seen"] for r in results] == [[0, 2, 4, 6], [1, 3, 5]]
    for me, r in enumerate(results):
        assert r["gathered"] == [x * x for x in range(7)]
        assert r["objects"] == [[0, [0]], [1, [0, 1]]]
        assert r["same"] == distributed.digest({"step": 3, "x": np.ones(2)})
        assert "step 9" in r["differing"] and "process 1" in r["differing"]
        assert r["local_equal"] and r["local_addressable"]
        # Servers shared by both processes: one update, from process 0, of the whole
        # parameters; an engine of each process's own: each loads them.
        assert r["shared_loads"] == ([True] if me == 0 else []) and r["own_loads"] == [True]
        assert r["layout"]["process_index"] == me and r["layout"]["process_count"] == 2
        by_process = r["layout"]["devices_by_process"]
        assert sorted(by_process) == ["0", "1"] and by_process == results[0]["layout"][
            "devices_by_process"]
        assert [len(ds) for ds in by_process.values()] == [4, 4]
        assert len(set(by_process["0"]) | set(by_process["1"])) == 8


def test_coordinator_without_process_count_is_named(monkeypatch):
    cfg = common.ConfigDict(dict(common.distributed_defaults(), coordinator="127.0.0.1:1"))
    for key in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="num_processes"):
        distributed.initialize(cfg)


# The smoke config on an 8-device fsdp mesh. Its policy, two SFT steps old, solves
# nothing, so GRPO would reject every group and never update; the sft loss on all
# groups makes both RL steps update the weights from the rollouts.
SMOKE = ["train.py", "--config", "configs/default.py:smoke", "--set", "mesh.fsdp=-1",
         "--set", "reject_degenerate=False", "--set", "learner.loss.name=sft"]


def _metrics(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _host(workdir: str, step: int) -> dict:
    from rl.checkpoint import decode_host

    with open(os.path.join(workdir, "ckpt", str(step), "host", "metadata")) as f:
        return decode_host(json.load(f))


def _params(workdir: str, step: int) -> list[tuple[str, np.ndarray]]:
    """Every array of checkpoint `step`'s train state as host NumPy (whatever devices
    and processes wrote it)."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    path = os.path.join(workdir, "ckpt", str(step), "state")
    tree = checkpointer.metadata(path).item_metadata.tree
    restored = checkpointer.restore(path, restore_args=jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    return [(jax.tree_util.keystr(k), np.asarray(v, np.float64))
            for k, v in jax.tree_util.tree_leaves_with_path(restored)]


def _logged_digests(err: str, prefix: str) -> list[str]:
    return [line.split(prefix, 1)[1].split()[0].strip("()")
            for line in err.splitlines() if prefix in line]


def test_two_processes_match_one_and_resume_after_kill(tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    # 1 process x 8 devices, and 2 processes x 4 devices (killed once the checkpoint of
    # RL step 1 is complete: Orbax finalises a step by renaming its directory), at once.
    reference = _spawn([sys.executable, *SMOKE, "--workdir", one], 0, 8, one)
    first = _spawn([sys.executable, *SMOKE, "--workdir", two], 2, 4, two + "_first")
    step1 = os.path.join(two, "ckpt", "1")
    _kill_once_saved(first, step1)
    first_logs = [err for _, err in _logs(two + "_first", 2)]
    assert os.path.isdir(step1), first_logs[0][-3000:]
    resumed = _finish(_spawn([sys.executable, *SMOKE, "--workdir", two], 2, 4, two),
                      two, timeout=900)
    ((_, ref_err),) = _finish(reference, one, timeout=900)

    # Acceptance 2: both processes resume at step 1 with the host state that was saved.
    saved = distributed.digest(_host(two, 1))
    for (out, err), killed in zip(resumed, first_logs, strict=True):
        assert _logged_digests(killed, "host state at step 1:") == [saved]
        assert _logged_digests(err, "at step 1 (host state") == [saved], err[-3000:]
        assert "step    1 " not in out
    # One process prints. (Gloo's C++ threads also write to stdout, and their lines can
    # interleave mid-line, so the check is for the trainer's console lines only.)
    assert "step    2" in resumed[0][0]
    assert [line for line in resumed[1][0].splitlines() if " | " in line] == []

    # Acceptance 1: losses after each of the 2 steps (and the SFT warm start's) and the
    # parameters and optimizer state after them match within 1e-5.
    ref_metrics, metrics = _metrics(one), _metrics(two)
    assert [m["step"] for m in ref_metrics] == [m["step"] for m in metrics] == [0, 0, 1, 2]
    losses = [(m["step"], k, v) for m in ref_metrics for k, v in m.items()
              if k.endswith("/loss")]
    assert [(s, k) for s, k, _ in losses] == [(0, "sft/loss"), (1, "learner/loss"),
                                              (2, "learner/loss")]
    for step, key, value in losses:
        assert abs(next(m[key] for m in metrics if m["step"] == step and key in m)
                   - value) < 1e-5, (step, key)
    ref_params, params = _params(one, 2), _params(two, 2)
    assert [k for k, _ in ref_params] == [k for k, _ in params]
    for (key, a), (_, b) in zip(ref_params, params, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5, err_msg=key)
    assert any(np.abs(b - a).max() > 0 for (key, a), (_, b) in zip(
        _params(one, 1), ref_params, strict=True) if key.startswith("['params']")), \
        "RL step 2 left the parameters as they were"

    # Acceptance 3: the same rollouts as one process. Every rollout count, reward and
    # status count matches per step, the data loader stands at the same task, the
    # held-out evals scored the same tasks, and the whole host state (loader, queue,
    # controller, RNG) went through the same states. Rates and the grade cache's hits are
    # the process's history, not the rollouts': the resumed run starts with an empty cache.
    for ref, got in zip(ref_metrics, metrics, strict=True):
        keys = [k for k in ref if k.startswith("rollout/") and not k.endswith("_per_s")
                and k != "rollout/grades_cached"]
        assert {k: got[k] for k in keys} == {k: ref[k] for k in keys}, ref["step"]
        if "rollout/trajectories" in ref:
            assert ref["rollout/trajectories"] == 2 * 2  # batch_tasks x group_size
    assert _host(two, 2)["sampler"] == _host(one, 2)["sampler"]
    for step in (0, 2):
        with open(os.path.join(one, f"eval_{step}.json")) as f, \
                open(os.path.join(two, f"eval_{step}.json")) as g:
            ref_eval, got_eval = json.load(f), json.load(g)
        assert got_eval["rewards"] == ref_eval["rewards"] and len(got_eval["rewards"]) == 4
    assert (_logged_digests(ref_err, "host state at step 2:")
            == _logged_digests(resumed[0][1], "host state at step 2:")
            == _logged_digests(resumed[1][1], "host state at step 2:"))


def test_dry_run_prints_the_process_and_device_layout(tmp_path):
    logs = str(tmp_path / "dry")
    outs = _finish(_spawn([sys.executable, "train.py", "--config", "configs/default.py:smoke",
                           "--dry_run", "--set", "mesh.fsdp=-1"], 2, 4, logs), logs, timeout=300)
    layouts = [json.loads(out)["layout"] for out, _ in outs]
    for me, layout in enumerate(layouts):
        assert layout["process_index"] == me and layout["process_count"] == 2
        assert layout["local_devices"] == 4 and layout["global_devices"] == 8
        assert layout["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
        assert layout["devices_by_process"] == layouts[0]["devices_by_process"]


def test_dry_run_says_why_a_mesh_does_not_fit(capsys):
    import train

    train.main(["--config", os.path.join(ROOT, "configs/default.py:smoke"), "--workdir",
                "/nonexistent", "--dry_run"])
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert layout["process_count"] == 1 and layout["global_devices"] == 8
    assert layout["mesh"].startswith("not on these devices") and "needs 1 devices" in layout[
        "mesh"]


# SPO's smoke config on the 8-device mesh, no warm start: 4 prompts a step, 4 rollouts in
# flight (the next starts as one finishes, the learner's time included). A rollout's
# first turn waits for the engine's first compile, minutes on a loaded machine: a wall
# timeout before it would end the rollout with no tokens.
SPO_SMOKE = ["train.py", "--config", "configs/default.py:smoke,spo,steps=3", "--set",
             "mesh.fsdp=-1", "--set", "spo.in_flight=4", "--set", "sft.steps=0",
             "--set", "eval_every=3", "--set", "ckpt_keep=10",
             "--set", "rollout.wall_timeout_s=3600.0"]


def test_spo_two_processes_match_one_and_resume_after_kill(tmp_path):
    """SPO as 2 processes x 4 devices, killed once the checkpoint of RL step 1 is complete
    and resumed to step 3, against 1 process x 8 devices: the host state is the same on
    both processes at every checkpoint, every prompt drawn is trained on once or still in
    flight at the end, and the tracker makes the same per-prompt updates as one process's."""
    from test_async import _tb

    from rl.seeds import host_rng

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    reference = _spawn([sys.executable, *SPO_SMOKE, "--workdir", one], 0, 8, one)
    first = _spawn([sys.executable, *SPO_SMOKE, "--workdir", two], 2, 4, two + "_first")
    step1 = os.path.join(two, "ckpt", "1")
    _kill_once_saved(first, step1, timeout=1800)
    first_logs = [err for _, err in _logs(two + "_first", 2)]
    assert os.path.isdir(step1), first_logs[0][-3000:]
    resumed = _finish(_spawn([sys.executable, *SPO_SMOKE, "--workdir", two], 2, 4, two),
                      two, timeout=1800)
    ((_, ref_err),) = _finish(reference, one, timeout=1800)

    # Host state (tracker, sampler, jobs in flight) identical on both processes at every
    # checkpoint: the killed run's step 1 (and 2 if it got there), the resumed run's.
    saved = {step: distributed.digest(_host(two, step)) for step in (1, 2, 3)}
    for killed in first_logs:
        digests = _logged_digests(killed, "host state at step 1:")
        assert digests == [saved[1]], killed[-3000:]
    for _, err in resumed:
        assert _logged_digests(err, "at step 1 (host state") == [saved[1]], err[-3000:]
        assert [_logged_digests(err, f"host state at step {s}:") for s in (2, 3)] == [
            [saved[2]], [saved[3]]]

    # No prompt trained twice or lost: every job drawn (chunks of 4, seeds from the host
    # generator in draw order) is trained on by exactly one step, or still in flight in
    # the last checkpoint, at its place in the draw; those in flight at step 1 ran again
    # after the kill.
    consumed = [text.split() for _, text in _tb(two, "rollout/consumed")]
    assert [s for s, _ in _tb(two, "rollout/consumed")] == [1, 2, 3]
    seeds = [int(item.rsplit(":", 1)[1]) for step in consumed for item in step]
    ahead = _host(two, 3)["ahead"]
    assert len(ahead["jobs"]) == 2 and int(ahead["chunks"]) == 4
    pending = [int(s) for host in ahead["jobs"] for s in host["seeds"]]
    rng = host_rng(0)
    drawn = [int(rng.integers(1 << 30)) for _ in range(4 * 4)]
    assert sorted(seeds + pending) == sorted(drawn) and len(seeds) == 3 * 4
    assert {int(s): i for _, s, i in ahead["order"]} == {s: drawn.index(s) for s in pending}
    in_flight_at_1 = [int(s) for host in _host(two, 1)["ahead"]["jobs"] for s in host["seeds"]]
    assert sorted(in_flight_at_1 + seeds[:4]) == sorted(drawn[:8])
    assert set(in_flight_at_1) & set(seeds[4:])

    # Against one process: the same tracker updates (below), and the same stored
    # responses where both trained on the same prompts in the same order. Steps 1 and
    # 2 train on rollouts sampled by the starting weights (step 1's update is zero:
    # every prompt is first seen at the prior's value and nothing is solved, so every
    # advantage is 0); step 3's rollouts ran while step 2's update arrived, at moments
    # that differ between the runs, and their tokens differ.
    trained = _spo_compare_trackers(one, two)
    for step in (1, 2):
        if trained[step]:
            ref_tracker, tracker = _host(one, step)["tracker"], _host(two, step)["tracker"]
            for key in ("resp_rows", "resp_len", "resp_ids", "resp_mask"):
                assert np.array_equal(tracker[key], ref_tracker[key]), (step, key)
            np.testing.assert_allclose(tracker["resp_logp"], ref_tracker["resp_logp"],
                                       atol=1e-5)
    assert _logged_digests(ref_err, "host state at step 3:")


def test_spo_over_more_processes_than_prompts_a_step_is_refused(tmp_path):
    """Each process runs its share of every batch: SPO with fewer prompts a step than
    processes is refused before anything is built, naming the key."""
    logs = str(tmp_path / "few")
    procs = _spawn([sys.executable, "train.py", "--config", "configs/default.py:smoke,spo",
                    "--dry_run", "--set", "mesh.fsdp=-1", "--set", "batch_tasks=1"], 2, 4, logs)
    for proc in procs:
        proc.wait(timeout=300)
    for proc, (_, err) in zip(procs, _logs(logs, 2), strict=True):
        assert proc.returncode != 0 and "needs batch_tasks >= 2" in err, err[-3000:]


def _visits(workdir: str) -> list[dict[str, list[int]]]:
    """For each RL step, every prompt's rewards of its scored rollouts trained on up to
    and including that step, in training order (TensorBoard text `rollout/groups`)."""
    from test_async import _tb

    seen: dict[str, list[int]] = {}
    out = []
    for _, text in _tb(workdir, "rollout/groups"):
        for task_id, _, _, successes, scored in json.loads(text):
            if scored:
                seen.setdefault(task_id, []).append(successes)
        out.append({t: list(r) for t, r in seen.items()})
    return out


def _spo_compare_trackers(one: str, two: str) -> dict[int, bool]:
    """Checks that the trackers of two SPO runs made the same per-prompt updates: at each
    checkpoint, every prompt trained on with the same rewards in both has the same
    (alpha, beta) (the drift D stays under the clip of rho in the smoke config), and where
    both trained on the same prompts in the same order, the same metrics and sampler.
    Returns, per step, whether they did."""
    ref_visits, visits = _visits(one), _visits(two)
    ref_metrics, metrics = _metrics(one), _metrics(two)
    assert [m["step"] for m in ref_metrics] == [m["step"] for m in metrics] == [0, 1, 2, 3]
    trained = {}
    for step in (1, 2, 3):
        ref_tracker, tracker = _host(one, step)["tracker"], _host(two, step)["tracker"]
        rows = {t: i for i, t in enumerate(tracker["task_ids"])}
        ref_rows = {t: i for i, t in enumerate(ref_tracker["task_ids"])}
        assert set(rows) == set(visits[step - 1]) and set(ref_rows) == set(ref_visits[step - 1])
        same = [t for t in rows if ref_visits[step - 1].get(t) == visits[step - 1][t]]
        assert same, step
        for t in same:
            assert tracker["alpha"][rows[t]] == ref_tracker["alpha"][ref_rows[t]], (step, t)
            assert tracker["beta"][rows[t]] == ref_tracker["beta"][ref_rows[t]], (step, t)
        trained[step] = (_tb_text(one, "rollout/consumed", step)
                         == _tb_text(two, "rollout/consumed", step)
                         and (step == 1 or trained[step - 1]))
        if trained[step]:
            _spo_same_step(ref_metrics[step], metrics[step], same_tokens=step < 3)
            assert list(tracker["task_ids"]) == list(ref_tracker["task_ids"])
            assert _host(two, step)["spo_sampler"] == _host(one, step)["spo_sampler"]
    return trained


def _tb_text(workdir: str, tag: str, step: int) -> str:
    from test_async import _tb

    return next(text for s, text in _tb(workdir, tag) if s == step)


def _spo_same_step(ref: dict, got: dict, same_tokens: bool) -> None:
    """One step's rollout and SPO metrics of two runs that trained on the same prompts
    in the same order: rewards and the tracker's figures equal; the loss and the drift D,
    which read the sampled tokens, close where the tokens are the same (rollouts sampled
    by the starting weights). A rollout spanning a weight update samples its later
    tokens under the weights of the moment, which differs between the runs."""
    close = ("learner/loss", "spo/drift_mean")
    keys = [k for k in ref if k.startswith(("rollout/reward", "spo/")) or k in close]
    for key in [k for k in keys if same_tokens or k not in close]:
        tolerance = 5e-2 * abs(ref[key]) if key in close else 1e-9
        assert abs(got[key] - ref[key]) <= tolerance, (ref["step"], key)
