"""bench.mechanism_claims: the per-group record train.py writes, read back from real
TensorBoard files, and the figures computed from it against hand counts."""

import json
import math

import numpy as np

from bench import mechanism_claims as mc
from rl.metrics import MetricWriter, group_outcomes
from rl.types import PrefixInfo, Trajectory


def _group(task, rewards, kind=None, k=0):
    prefix = PrefixInfo("src", k, kind) if kind else None
    return [Trajectory(task, f"{task}-{i}", [], reward=r, prefix=prefix,
                       status="env_error" if r is None else "finished")
            for i, r in enumerate(rewards)]


def test_group_outcomes_counts_scored_rollouts_and_names_the_prefix():
    groups = [_group("a", [1, 0, None, 1]), _group("b", [0, 0], "too_hard", 3),
              _group("c", [1, 1, 1], "too_easy", 0)]
    assert json.loads(group_outcomes(groups)) == [
        ["a", None, 0, 2, 3], ["b", "too_hard", 3, 0, 2], ["c", "too_easy", 0, 3, 3]]


def test_records_round_trip_through_tensorboard_and_a_resume_rewrites_a_step(tmp_path):
    steps = {1: [_group("a", [1, 0]), _group("b", [1, 1, 0, 0], "too_hard", 2)],
             2: [_group("c", [0, 0, 0, 1], "too_easy", 1), _group("d", [1, 1])]}
    writer = MetricWriter(str(tmp_path))
    for step, groups in steps.items():
        writer.write_texts(step, {"rollout/groups": group_outcomes(groups)})
    writer.write_texts(2, {"rollout/groups": group_outcomes(steps[2][:1])})  # rewritten
    writer.close()
    records = mc.group_records(str(tmp_path))
    assert sorted(records) == [1, 2] and len(records[2]) == 1
    assert mc.prefix_group_rates(records) == {1: [0.5], 2: [0.25]}
    assert mc.prefix_group_rates(records, ("too_easy",)) == {1: [], 2: [0.25]}
    assert mc.solve_partial(records) == [2, 1]


def test_revisit_groups_are_not_prefix_groups():
    records = {1: [["a", "too_hard", 0, 1, 8], ["b", "too_hard", 4, 4, 8], ["c", None, 0, 0, 8]]}
    assert mc.prefix_group_rates(records) == {1: [0.5]}
    assert mc.solve_partial(records) == [2]


def test_stream_summary_pairs_repetitions_and_measures_the_tail():
    rows = [{"rep": i, "groups": {"seconds": g, "durations": [1.0, math.e]},
             "stream": {"seconds": s, "durations": [1.0]}}
            for i, (g, s) in enumerate([(8.0, 2.0), (12.0, 3.0), (10.0, 5.0)])]
    warmup = {"rep": -1, "warmup": True, "groups": {"seconds": 90.0, "durations": [50.0]},
              "stream": {"seconds": 1.0, "durations": [50.0]}}
    out = mc.summarize_setting([warmup, *rows], {"sigma": 1.0})  # compiling: left out
    assert out["groups_s"] == 10.0 and out["stream_s"] == 10.0 / 3
    assert math.isclose(out["speedup"]["ratio"], 3.0)
    pooled = np.log([1.0, math.e] * 3 + [1.0] * 3)
    assert math.isclose(out["episode_log_sd_pooled"], pooled.std(ddof=1))
    # within each repetition and arm: +-0.5 around the groups' mean log, 0 for the stream's
    assert math.isclose(out["episode_log_sd"], np.std([0.5, -0.5] * 3 + [0.0] * 3, ddof=1))
    assert out["speedup"]["ci_low"] <= 3.0 <= out["speedup"]["ci_high"]


def test_the_chosen_stream_setting_is_the_one_nearest_the_seeds_tail():
    settings = [{"latency": {"sigma": s}, "episode_log_sd": sd, "groups_s": 1.0,
                 "stream_s": 1.0, "speedup": {"ratio": r}}
                for s, sd, r in [(0.0, 0.3, 1.2), (1.0, 0.9, 2.5), (2.0, 1.6, 4.0)]]
    assert math.isclose(mc.SEED_TAIL_LOG_SD, math.log(486 / 112) / 1.38)
    assert mc.stream_figures(settings)["chosen"]["latency"]["sigma"] == 1.0

