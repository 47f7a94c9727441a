"""Resume leaves metrics.jsonl and TensorBoard exactly as an uninterrupted run: a kill at
any point (during the SFT warm start, the step-0 eval, the offline start, an RL step)
followed by a resume writes every row and summary once."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from rl.metrics import MetricWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def _scalars(workdir):
    acc = EventAccumulator(os.path.join(workdir, "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


# A run as train.py writes it: (phase, step, scalars); "save" checkpoints and marks; the
# step-0 eval writes its row, then eval_0.json ("eval_json"), then marks ("eval_done").
EVAL = {"eval/pass_rate": 0.1, "eval/env_errors": 0.0}
RUN = [("sft", 0, {"sft/loss": 3.0}), ("sft", 10, {"sft/loss": 2.0}),
       ("sft", 20, {"sft/loss": 1.0}), ("save", 0, None),
       ("eval", 0, EVAL), ("eval_json", 0, EVAL), ("eval_done", 0, None),
       ("start", 0, {"start/value_mean": 0.4}), ("rl", 1, {"x": 1.0}), ("save", 1, None),
       ("rl", 2, {"x": 2.0}), ("save", 2, None), ("rl", 3, {"x": 3.0}), ("save", 3, None)]


def _play(workdir, events, resume_step):
    """Writes `events` with a writer resumed at `resume_step`. A resumed run reaching the
    step-0 eval does what train.py's loop does: keeps a finished one (train.saved_eval_row,
    which writes its row again where a kill dropped it) instead of evaluating again."""
    writer = MetricWriter(workdir, resume_step=resume_step)
    kept_eval = False
    for phase, step, scalars in events:
        if phase == "eval" and resume_step >= 0:
            kept_eval = train.saved_eval_row(workdir, writer, step)
        if phase in ("eval", "eval_json") and kept_eval:
            continue
        if phase == "eval_json":
            with open(os.path.join(workdir, f"eval_{step}.json"), "w") as f:
                json.dump({"step": step, **scalars, "rewards": {}}, f)
        elif phase in ("save", "eval_done"):
            writer.mark(step)
        else:
            writer.write_scalars(step, scalars)
    writer.close()


def _resume_point(kill_at):
    """(checkpoint step, events the resumed run goes through) after a kill before event
    `kill_at` of RUN: the newest save before it, and everything after that save."""
    saves = [i for i in range(kill_at) if RUN[i][0] == "save"]
    if not saves:
        return -1, RUN
    return RUN[saves[-1]][1], RUN[saves[-1] + 1:]


@pytest.mark.parametrize("kill_at", range(1, len(RUN) + 1))
def test_a_kill_anywhere_then_resume_writes_each_row_and_summary_once(tmp_path, kill_at):
    """Every kill point, those between eval_0.json and the step-0 mark included: the
    step-0 eval row is there once, as in the uninterrupted run."""
    whole = str(tmp_path / "whole")
    _play(whole, RUN, -1)
    run = str(tmp_path / "run")
    _play(run, RUN[:kill_at], -1)
    time.sleep(1.05)  # event files are named by their start's second
    step, rest = _resume_point(kill_at)
    _play(run, rest, step)
    assert _rows(run) == _rows(whole)
    assert _scalars(run) == _scalars(whole)


def test_a_start_without_checkpoint_drops_a_killed_warm_start_from_step_0(tmp_path):
    """SFT rows start at step 0; without a checkpoint the warm start runs again from it,
    so none of the killed attempt's rows or events stay (none duplicated at step 0)."""
    _play(str(tmp_path), RUN[:2], -1)
    time.sleep(1.05)
    _play(str(tmp_path), RUN[:3], -1)
    assert [r["step"] for r in _rows(tmp_path)] == [0, 10, 20]
    assert _scalars(tmp_path) == {"sft/loss": [(0, 3.0), (10, 2.0), (20, 1.0)]}


def _train(workdir, *sets):
    argv = [sys.executable, "train.py", "--config", "configs/default.py:smoke",
            "--workdir", workdir, "--set", "sft.steps=40", *[a for s in sets
                                                             for a in ("--set", s)]]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return argv, env


def test_a_kill_during_sft_then_resume_matches_an_uninterrupted_run(tmp_path):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    argv, env = _train(whole)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    argv, env = _train(killed)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and not any(
            r["step"] == 10 for r in _rows(killed)):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [r["step"] for r in _rows(killed)][:2] == [0, 10]  # killed during SFT
    time.sleep(1.05)
    argv, env = _train(killed)
    again = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]

    def shape(rows):  # timings differ between runs; steps and keys must not
        return [(r["step"], sorted(r)) for r in rows]

    assert shape(_rows(killed)) == shape(_rows(whole))
    sft = [r for r in _rows(killed) if "sft/loss" in r]
    assert sft == [r for r in _rows(whole) if "sft/loss" in r]  # deterministic warm start
    got, want = _scalars(killed), _scalars(whole)
    assert got.keys() == want.keys()
    assert {t: [s for s, _ in v] for t, v in got.items()} == \
        {t: [s for s, _ in v] for t, v in want.items()}
