"""train.py end to end: every config dry-runs; the smoke run trains, checkpoints and
resumes after being killed."""

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import train
from configs import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if os.path.basename(p) not in ("common.py", "__init__.py"))
VARIANTS = ["configs/default.py:smoke", "configs/default.py:spo", "configs/default.py:baseline",
            "configs/default.py:adaptive,seed=2"]


@pytest.mark.parametrize("spec", CONFIGS + VARIANTS)
def test_every_config_builds_with_dry_run(spec, capsys):
    train.main(["--config", os.path.join(ROOT, spec), "--workdir", "/nonexistent",
                "--dry_run"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["params"] > 0
    if "sglang_commands" in summary:
        assert all("--skip-tokenizer-init" in c for c in summary["sglang_commands"])


def test_unknown_config_key_is_named():
    config = common.load_config(os.path.join(ROOT, "configs/default.py"))
    with pytest.raises(AttributeError, match="nope"):
        config.rollout.nope = 1
    with pytest.raises(KeyError, match="nope"):
        common.load_config(os.path.join(ROOT, "configs/default.py:nope=1"))


def test_command_line_overrides(capsys):
    assert common.parse_overrides(["learner.optim.lr=1e-4", "env.backend=docker",
                                   "learner.row_buckets=(256, 512)"]) == {
        "learner.optim.lr": 1e-4, "env.backend": "docker", "learner.row_buckets": (256, 512)}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        common.parse_overrides(["learner.optim.lr"])
    train.main(["--config", os.path.join(ROOT, "configs/default.py"), "--workdir", "/x",
                "--dry_run", "--set", "model.num_layers=1", "--set", "rollout.max_steps=3"])
    one_layer = json.loads(capsys.readouterr().out)["params"]
    train.main(["--config", os.path.join(ROOT, "configs/default.py"), "--workdir", "/x",
                "--dry_run"])
    assert one_layer < json.loads(capsys.readouterr().out)["params"]
    with pytest.raises(KeyError, match="rollout.nope"):
        train.main(["--config", os.path.join(ROOT, "configs/default.py"), "--workdir", "/x",
                    "--dry_run", "--set", "rollout.nope=3"])


def test_a_relative_local_read_only_path_is_refused_by_dry_run():
    with pytest.raises(ValueError, match=r"env.local_read_only holds relative paths \['venv'\]"):
        train.main(["--config", os.path.join(ROOT, "configs/default.py"), "--workdir", "/x",
                    "--dry_run", "--set", "env.local_read_only=('venv',)"])


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a user's machine
    return env


def _run(workdir, timeout=900, spec="configs/default.py:smoke", overrides=()):
    sets = [a for kv in overrides for a in ("--set", kv)]
    return subprocess.run(
        [sys.executable, "train.py", "--config", spec, "--workdir", workdir, *sets],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _steps(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_smoke_run_resumes_after_kill(tmp_path):
    workdir = str(tmp_path / "run")
    # Checkpoints by wall clock only (ckpt_every_s: any time counts), none by step.
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--config", "configs/default.py:smoke", "--workdir",
         workdir, "--set", "ckpt_every=10", "--set", "ckpt_every_s=1e-6"], cwd=ROOT,
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    # Kill as soon as the checkpoint of RL step 1 is complete (Orbax finalises a step
    # by renaming its directory to the bare step number).
    deadline = time.monotonic() + 400
    step1 = os.path.join(workdir, "ckpt", "1")
    while not os.path.isdir(step1) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):  # (a run that failed has exited)
        os.killpg(proc.pid, signal.SIGKILL)
    out = proc.communicate()[0]
    assert os.path.isdir(step1), out[-3000:]

    resumed = _run(workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 1" in resumed.stderr
    rl_steps = sorted({m["step"] for m in _steps(workdir) if "time/rollout_s" in m})
    assert rl_steps[-1] == 2
    assert "step    2" in resumed.stdout and "step    1 " not in resumed.stdout
    assert os.path.isdir(os.path.join(workdir, "ckpt", "2"))
    assert glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))
    # One held-out eval scalar per eval step (0, and 2 = eval_every = the last step).
    evals = [m["step"] for m in _steps(workdir) if "eval/pass_rate" in m]
    assert evals == [0, 2], evals

    # --eval_only: the last checkpoint on a larger held-out set, the run left as it was.
    with open(os.path.join(workdir, "config.json")) as f:
        config_before = f.read()
    events_before = sorted(glob.glob(os.path.join(workdir, "tb", "*")))
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/default.py:smoke", "--workdir",
         workdir, "--eval_only", "--set", "env.eval_tasks=7", "--eval_out",
         str(tmp_path / "big_eval.json")], cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(os.path.join(workdir, "eval_2.json")) as f:
        in_run = json.load(f)
    # Each episode's conversation beside its reward, for reading what the policy did.
    with open(os.path.join(workdir, "eval_2_transcripts.jsonl")) as f:
        transcripts = [json.loads(line) for line in f]
    assert {t["task_id"]: t["reward"] for t in transcripts} == in_run["rewards"]
    for t in transcripts:
        assert t["text"].startswith("<|im_start|>system\n") and "<|im_start|>assistant\n" in t[
            "text"], t["text"][:300]
    assert not glob.glob(os.path.join(workdir, "eval_only_*"))  # --eval_out names the file
    assert os.path.exists(tmp_path / "big_eval_transcripts.jsonl")
    with open(tmp_path / "big_eval.json") as f:
        ev = json.load(f)
    assert ev["step"] == 2
    assert set(in_run["rewards"]) < set(ev["rewards"])   # the run's held-out set, and more
    assert ev["eval/pass_rate"] == pytest.approx(np.mean(list(ev["rewards"].values())))
    with open(os.path.join(workdir, "config.json")) as f:
        assert f.read() == config_before
    assert sorted(glob.glob(os.path.join(workdir, "tb", "*"))) == events_before
    # --eval_step: an earlier checkpoint than the latest, its step in the file.
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/default.py:smoke", "--workdir",
         workdir, "--eval_only", "--eval_step", "1", "--eval_out",
         str(tmp_path / "step1.json")], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "step1.json") as f:
        assert json.load(f)["step"] == 1
    empty = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/default.py:smoke", "--workdir",
         str(tmp_path / "empty"), "--eval_only"], cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=120)
    assert empty.returncode == 2 and "no checkpoints" in empty.stderr
    assert not os.path.exists(tmp_path / "empty")
    stray = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/default.py:smoke", "--workdir",
         str(tmp_path / "stray"), "--eval_out", str(tmp_path / "x.json")], cwd=ROOT,
        env=_env(), capture_output=True, text=True, timeout=120)
    assert stray.returncode == 2 and "need --eval_only" in stray.stderr
    assert not os.path.exists(tmp_path / "stray")


def test_spo_smoke_run_starts_offline_and_trains_with_the_tracker(tmp_path):
    """spo.init_samples: 2 rollouts of each of 8 pool prompts with the initial policy,
    through the stream collector, before step 1; the tracker starts from them."""
    workdir = str(tmp_path / "spo")
    out = _run(workdir, spec="configs/default.py:smoke,spo",
               overrides=["spo.init_samples=2", "spo.pool_size=8"])
    assert out.returncode == 0, out.stderr[-3000:]
    start = [m for m in _steps(workdir) if "spo/init_rollouts" in m]
    assert len(start) == 1 and start[0]["step"] == 0, start
    start = start[0]
    assert start["spo/init_rollouts"] == 16 and start["spo/init_env_errors"] == 0
    assert start["spo/init_prompts"] == 8 and start["time/start_s"] > 0
    rl = [m for m in _steps(workdir) if "time/rollout_s" in m]
    assert [m["step"] for m in rl] == [1, 2]
    # Step 1's baseline is the offline start's ("+0.5" form, n0 = 2: 1/6 for a prompt
    # that failed both samples), not the Beta(1, 1) prior's 0.5.
    if start["spo/init_pass_rate"] == 0:
        assert rl[0]["spo/v_mean"] == pytest.approx(1 / 6)
    assert rl[0]["spo/v_mean"] != 0.5
    assert all(m["spo/tracked"] >= 8 and 0.875 <= m["spo/rho_mean"] <= 0.96 for m in rl)
    assert all(m["rollout/trajectories"] == 4 for m in rl)  # batch_tasks, one response each
    # Generation overlaps the learner in stream mode: throughput is per second of the step.
    for m in rl:
        assert m["rollout/env_errors"] == 0
        generated = m["rollout/generated_tokens_mean"] * m["rollout/trajectories"]
        assert m["rollout/generated_tokens_per_s"] == pytest.approx(
            generated / m["time/step_s"], rel=1e-4)


@pytest.mark.parametrize("kl", ["k3", "exact"])
def test_kl_anchor_smoke(tmp_path, kl):
    """learner.loss.kl from train.py: the reference is the starting policy (KL 0 at the
    first update), frozen while the policy moves (KL > 0 after it). The 2-step smoke
    policy solves nothing, so every PPO advantage is 0: the sft token loss on all
    groups makes the first update move the policy."""
    workdir = str(tmp_path / kl)
    out = _run(workdir, overrides=[f"learner.loss.kl={kl}", "learner.loss.kl_coef=0.1",
                                   "reject_degenerate=False", "learner.loss.name=sft",
                                   "learner.optim.lr=1e-3", "sft.steps=0",
                                   "env.eval_tasks=2"])
    assert out.returncode == 0, out.stderr[-3000:]
    rl = [m for m in _steps(workdir) if "time/rollout_s" in m]
    assert [m["step"] for m in rl] == [1, 2] and all(m["train/trajectories"] > 0 for m in rl)
    first, second = (m["learner/kl_ref"] for m in rl)
    assert abs(first) < 1e-6, first
    assert np.isfinite(second) and second > 1e-4, second
    assert os.path.isdir(os.path.join(workdir, "reference"))


def test_a_warm_start_without_one_demonstration_stops_naming_why(tmp_path):
    """Every grading times out, so every scripted demonstration is an env error: the SFT
    warm start stops with a clear error, not a ZeroDivisionError."""
    out = _run(str(tmp_path / "run"), overrides=("rollout.test_timeout_s=0.001",))
    assert out.returncode != 0
    assert "ZeroDivisionError" not in out.stderr, out.stderr[-3000:]
    assert "SFT has no demonstration to train on: of " in out.stderr, out.stderr[-3000:]
    assert " were env errors and 0 produced no tokens" in out.stderr, out.stderr[-3000:]


def test_a_run_whose_rollouts_are_all_env_errors_stops_with_an_error(tmp_path):
    """Every grading times out, in the episode and at the reference state (a test
    timeout no run can meet): each rollout is an env error, and after
    max_env_error_steps such steps in a row the run stops, non-zero, naming why."""
    workdir = str(tmp_path / "run")
    out = _run(workdir, overrides=("total_steps=4", "max_env_error_steps=2", "sft.steps=0",
                                   "rollout.test_timeout_s=0.001"))
    assert out.returncode != 0
    assert ("2 RL steps in a row (to step 2) trained on nothing: every rollout was an env "
            "error (max_env_error_steps=2)") in out.stderr, out.stderr[-3000:]
    assert [m["train/trajectories"] for m in _steps(workdir) if "train/trajectories" in m] \
        == [0, 0]
