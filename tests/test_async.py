"""Rollouts that run ahead of the learner (rollout.max_staleness), end to end in train.py:
0 is the synchronous loop bit for bit; 1 trains on groups as they finish, records
each batch's lag, and a kill in the middle loses and repeats no job."""

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time

from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2

from rl.checkpoint import saved_digests
from rl.seeds import job_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The smoke config, every group trained on (its 2-step-old policy solves nothing, so GRPO
# would reject every group and never update) with the sft loss, so the weights move.
SMOKE = ["--config", "configs/default.py:smoke,steps=3", "--set", "reject_degenerate=False",
         "--set", "learner.loss.name=sft"]
# SPO's stream starts the next rollout as soon as one ends, so which rollouts a step
# trains on depends on thread timing (two runs of `:spo,smoke` at 4fbd928 differ); with
# one rollout per step and one in flight each starts only when the step asks for it.
SPO_SMOKE = ["--config", "configs/default.py:spo,smoke,steps=3", "--set", "batch_tasks=1",
             "--set", "spo.in_flight=1"]

def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device
    return env


def _run(workdir, args, timeout=900):
    return subprocess.run([sys.executable, "train.py", *args, "--workdir", workdir], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _digests(workdir: str, step: int) -> tuple[str, str]:
    """16 hex digits of each of checkpoint `step`'s digests (rl.checkpoint.saved_digests)."""
    train, host, _ = saved_digests(workdir, step)
    return train[:16], host[:16]


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _tb(workdir, tag):
    """(step, value) of every summary `tag` in workdir/tb, in file order: the text, or
    the histogram's (min, max, count)."""
    out = []
    for path in sorted(glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))):
        for record in RawEventFileLoader(path).Load():
            event = event_pb2.Event.FromString(record)
            for v in event.summary.value:
                if v.tag != tag:
                    continue
                value = (v.tensor.string_val[0].decode() if v.HasField("tensor")
                         else (v.histo.min, v.histo.max, v.histo.num))
                out.append((event.step, value))
    return out


def _same_as_the_default_run(tmp_path, args: list[str], steps: tuple[int, ...]) -> str:
    """Runs `args` as configured (rollout.max_staleness left at its default, the
    synchronous loop) and with rollout.max_staleness=0 set, on this machine, and checks
    that the train and host states of `steps` are equal bit for bit. Both runs are made
    here: XLA's CPU code differs between processors, so a digest recorded on another
    machine says nothing about this one. Returns the second run's workdir."""
    runs = {}
    for name, extra in (("default", []), ("staleness0", ["--set", "rollout.max_staleness=0"])):
        workdir = runs[name] = str(tmp_path / name)
        out = _run(workdir, [*args, *extra])
        assert out.returncode == 0, out.stderr[-3000:]
    for step in steps:
        assert _digests(runs["default"], step) == _digests(runs["staleness0"], step), step
    return runs["staleness0"]


def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(tmp_path):
    workdir = _same_as_the_default_run(tmp_path, SMOKE, (2, 3))
    # The lag of a synchronous step is 0: every rollout sampled by the learner's policy.
    rl = [m for m in _metrics(workdir) if "time/rollout_s" in m]
    assert [m["async/lag_max"] for m in rl] == [0, 0, 0]


def test_spo_at_max_staleness_0_is_the_synchronous_stream_bit_for_bit(tmp_path):
    _same_as_the_default_run(tmp_path, SPO_SMOKE, (3,))


def _host(workdir, step):
    from rl.checkpoint import decode_host

    with open(os.path.join(workdir, "ckpt", str(step), "host", "metadata")) as f:
        return decode_host(json.load(f))


def test_async_run_resumes_after_kill_without_losing_or_repeating_a_job(tmp_path):
    """max_staleness=1, slow tool calls (some tasks 6x slower), killed once the checkpoint
    of RL step 2 is complete, then rerun to step 5. Every job drawn (chunks of
    batch_tasks, seeds job_seed(chunk, i)) is consumed by exactly one step of the final
    run, with all its group_size rollouts, or is still pending in the last checkpoint."""
    workdir = str(tmp_path / "async")
    args = ["--config", "configs/default.py:smoke,steps=5", "--set", "reject_degenerate=False",
            "--set", "learner.loss.name=sft", "--set", "rollout.max_staleness=1",
            "--set", "env.latency.median_s=0.05", "--set", "env.latency.slow_share=0.25",
            "--set", "ckpt_keep=10"]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "--workdir", workdir],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    step2 = os.path.join(workdir, "ckpt", "2")
    while not os.path.isdir(step2) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    killed = proc.communicate()[0]
    assert os.path.isdir(step2), killed[-3000:]
    assert "step    5" not in killed  # killed in the middle

    resumed = _run(workdir, args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr

    rl_steps = [m["step"] for m in _metrics(workdir) if "time/rollout_s" in m]
    assert rl_steps == [1, 2, 3, 4, 5]  # metrics rows once
    assert [s for s, _ in _tb(workdir, "rollout/consumed")] == [1, 2, 3, 4, 5]
    by_job = _consumed_jobs(workdir)  # steps x groups, each whole
    assert len(by_job) == 5 * 2 and all(sorted(m) == [0, 1] for m in by_job.values())

    ahead = _host(workdir, 5)["ahead"]
    pending = [int(s) for host in ahead["jobs"] for s in host["seeds"]]
    drawn = {job_seed(c, i) for c in range(1, int(ahead["chunks"]) + 1) for i in range(2)}
    assert not set(by_job) & set(pending)  # none trained and still pending
    assert set(by_job) | set(pending) == drawn and len(pending) == len(set(pending))
    # The jobs in flight at the checkpoint resumed from were run again and trained on.
    resumed_at = int(resumed.stderr.split("resumed from", 1)[1].split("at step ", 1)[1].split()[0])
    in_flight = {int(s) for host in _host(workdir, resumed_at)["ahead"]["jobs"]
                 for s in host["seeds"]}
    assert in_flight and in_flight <= set(by_job) | set(pending)
    assert in_flight & set(by_job)

    # Each batch's lag: a scalar and a histogram per step, within the bound once dropped
    # stale groups are run again.
    rl = [m for m in _metrics(workdir) if "time/rollout_s" in m]
    assert all(0 <= m["async/lag_max"] <= 1 for m in rl)
    assert any(m["async/lag_max"] == 1 for m in rl)  # the rollouts did run ahead
    assert [s for s, _ in _tb(workdir, "async/lag")] == [1, 2, 3, 4, 5]


def _consumed_jobs(workdir):
    """{job seed: [member index, ...]} of every rollout the steps consumed (TensorBoard
    text `rollout/consumed`, task:seed with seed = job seed * 1009 + member), checked to
    name no rollout twice."""
    rollouts = [item for _, text in _tb(workdir, "rollout/consumed") for item in text.split()]
    assert len(rollouts) == len(set(rollouts))
    by_job: dict[int, list[int]] = {}
    for item in rollouts:
        seed = int(item.rsplit(":", 1)[1])
        by_job.setdefault(seed // 1009, []).append(seed % 1009)
    return by_job


def test_two_processes_run_ahead_and_resume_after_kill(tmp_path):
    """2 processes x 4 devices, max_staleness=1: each runs its share of every chunk of
    jobs, the groups are gathered; killed after the checkpoint of RL step 1 and resumed,
    every job drawn is trained once (both members) or still pending, none twice."""
    from test_multihost import _finish, _kill_once_saved, _logs, _spawn

    workdir = str(tmp_path / "two")
    args = [sys.executable, "train.py", "--config", "configs/default.py:smoke,steps=4",
            "--set", "mesh.fsdp=-1", "--set", "reject_degenerate=False",
            "--set", "learner.loss.name=sft", "--set", "rollout.max_staleness=1",
            "--set", "env.latency.median_s=0.05", "--set", "env.latency.slow_share=0.25",
            "--set", "ckpt_keep=10", "--workdir", workdir]
    first = _spawn(args, 2, 4, workdir + "_first")
    step1 = os.path.join(workdir, "ckpt", "1")
    _kill_once_saved(first, step1)
    assert os.path.isdir(step1), _logs(workdir + "_first", 2)[0][1][-3000:]
    resumed = _finish(_spawn(args, 2, 4, workdir), workdir, timeout=900)
    assert all("resumed from" in err for _, err in resumed)

    assert [m["step"] for m in _metrics(workdir) if "time/rollout_s" in m] == [1, 2, 3, 4]
    by_job = _consumed_jobs(workdir)
    assert len(by_job) == 4 * 2 and all(sorted(m) == [0, 1] for m in by_job.values())
    ahead = _host(workdir, 4)["ahead"]
    assert len(ahead["jobs"]) == 2  # each process's jobs in flight
    pending = [int(s) for host in ahead["jobs"] for s in host["seeds"]]
    drawn = {job_seed(c, i) for c in range(1, int(ahead["chunks"]) + 1) for i in range(2)}
    assert not set(by_job) & set(pending) and len(pending) == len(set(pending))
    assert set(by_job) | set(pending) == drawn
