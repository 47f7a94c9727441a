"""The tool-call latency model (env.latency): its distribution against the log-normal
it names, determinism per task and seed, slow tasks, and the sleep in a real episode."""

import math
import time

import numpy as np
import pytest

from configs import common
from env.episode import Episode
from env.latency import LatencyConfig, LatencyModel
from env.miniswe import generate_tasks
from env.sandbox import SandboxFactory


def _model(median_s, sigma, slow_share=0.0, slow_factor=1.0, seed=0):
    return LatencyModel(LatencyConfig(median_s, sigma, slow_share, slow_factor), seed)


def test_off_by_default():
    model = LatencyModel(LatencyConfig(**common.latency_defaults()), seed=0)
    assert not model.enabled and model.delay_s("t", 0, 0) == 0.0


def test_delays_are_log_normal_with_the_median_and_sigma():
    model = _model(0.5, 1.0, seed=3)
    delays = np.array([model.delay_s(f"task{i % 50}", i // 50, i % 7) for i in range(6000)])
    logs = np.log(delays)
    # Sampling error of the mean and std of 6000 normal draws: ~0.013 and ~0.009.
    assert abs(np.median(delays) - 0.5) < 0.03
    assert abs(logs.mean() - math.log(0.5)) < 0.05 and abs(logs.std() - 1.0) < 0.04


def test_draws_are_deterministic_per_task_rollout_call_and_seed():
    a, b = _model(0.5, 1.0, seed=1), _model(0.5, 1.0, seed=1)
    assert a.delay_s("x", 7, 2) == b.delay_s("x", 7, 2)
    others = {a.delay_s("x", 7, 3), a.delay_s("x", 8, 2), a.delay_s("y", 7, 2),
              _model(0.5, 1.0, seed=2).delay_s("x", 7, 2)}
    assert a.delay_s("x", 7, 2) not in others and len(others) == 4


def test_a_share_of_tasks_is_slow_on_every_call():
    model = _model(0.5, 1.0, slow_share=1 / 8, slow_factor=6.0)
    plain = _model(0.5, 1.0)
    ids = [f"task{i}" for i in range(4000)]
    slow = [t for t in ids if model.is_slow(t)]
    assert abs(len(slow) / len(ids) - 1 / 8) < 0.015  # binomial sd 0.005
    for t in ids[:200]:
        for rollout, call in ((0, 0), (3, 5)):
            want = plain.delay_s(t, rollout, call) * (6.0 if t in slow else 1.0)
            assert model.delay_s(t, rollout, call) == pytest.approx(want, rel=1e-12)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="slow_share"):
        _model(0.5, 1.0, slow_share=2.0)
    with pytest.raises(ValueError, match="median_s"):
        _model(-1.0, 0.0)


def test_an_episode_sleeps_before_each_tool_call():
    """Three steps with a 0.2 s constant delay take >= 0.6 s of wall time and little CPU
    (an action without a tool call waits for its answer too)."""
    model = _model(0.2, 0.0)
    calls = []

    def delay(i):
        calls.append(i)
        model.sleep("t", 0, i)

    task = generate_tasks(1, seed=5)[0]
    view = {"name": "file_editor", "arguments": {"command": "view", "path": "."}}
    with Episode(SandboxFactory("local", allow_unisolated=True), task,
                 call_delay=delay) as episode:
        episode.reset()
        t0, cpu0 = time.perf_counter(), time.process_time()
        episode.step(view)
        episode.step("no tool call here")
        episode.step(view)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert calls == [0, 1, 2]
    assert wall >= 0.6 and cpu < wall - 0.4
