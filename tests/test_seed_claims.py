"""bench.seed_claims: the gate's criteria, the arms' metrics and the whole metrics stage
over run directories laid out as train.py writes them, against hand counts and closed forms."""

import json
import math
import os

import numpy as np
import pytest

from bench import seed_claims as sc
from rl.prefix import prefix_k


def test_histogram_counts_and_criteria_by_hand():
    # 10 tasks x 8: k = 0,0,0,1,1,2,2,3,5,8 (and one task with nothing scored).
    ks = [0, 0, 0, 1, 1, 2, 2, 3, 5, 8]
    h = sc.histogram(ks + [0], [8] * 10 + [0], 8)
    assert h["tasks"] == 10 and h["counts"] == [3, 2, 2, 1, 0, 1, 0, 0, 1]
    assert h["mean"] == pytest.approx(sum(ks) / 80)
    assert h["share_1_2"] == 0.4 and h["share_0"] == 0.3
    assert not h["pass"]                         # mean 0.275 > 0.25
    h = sc.histogram([0, 0, 1, 1, 2, 1, 3, 0, 0, 1], [8] * 10, 8)
    assert h["mean"] == pytest.approx(9 / 80) and h["pass"]
    h = sc.histogram([0] * 6 + [2, 2, 2, 2], [8] * 10, 8)   # 60% at 0 of 8
    assert h["share_0"] == 0.6 and not h["pass"]
    assert sc.histogram([3], [4], 8)["counts"][6] == 1      # rescaled from 4 scored


def test_prefix_table_pools_by_steps_left_and_picks_the_band():
    rows = [(7, 1, 0, 8), (7, 3, 4, 8), (7, 6, 8, 8),     # 6 left: 0/8, 4 left: 4/8, 1: 8/8
            (8, 4, 2, 8), (8, 7, 7, 8)]                   # 4 left: 2/8, 1 left: 7/8
    t = sc.prefix_table(rows)
    assert t["by_steps_left"]["4"] == {"pass_rate": 6 / 16, "rollouts": 16}
    assert t["by_steps_left"]["1"]["pass_rate"] == 15 / 16
    assert t["steps_left_in_band"] == [4] and t["best_steps_left"] == 4 and t["pass"]
    only_final = sc.prefix_table([(7, 6, 4, 8), (7, 1, 0, 8)])   # 0.5, but 1 step left
    assert not only_final["pass"] and only_final["best_steps_left"] is None


@pytest.mark.parametrize("left,totals", [(4, [7, 7, 8]), (2, [6, 7, 9]), (3, [5])])
def test_remaining_ratio_leaves_the_steps_asked_for_in_rl_prefix(left, totals):
    ratio = sc.remaining_ratio_for(left, totals)
    total = int(np.median(totals))
    assert total - prefix_k(total, "too_hard", ratio) == left


def test_saturating_fit_and_steps_to_target_closed_form():
    steps = np.arange(0, 49)
    curve = 0.1 + 0.3 * (1 - np.exp(-steps / 12.0))
    fit = sc.fit_saturating(steps, curve)
    assert np.allclose(fit(steps), curve, atol=2e-3)
    target = 0.1 + 0.9 * 0.3 * (1 - math.exp(-40 / 12.0))
    exact = -12.0 * math.log(1 - (target - 0.1) / 0.3)
    assert sc.steps_to_target(fit, target, 48) == pytest.approx(exact, abs=0.5)
    assert sc.steps_to_target(lambda s: np.zeros_like(s), 0.5, 48) == math.inf
    assert sc.slope([1, 2, 3, 4], [0.1, 0.12, 0.14, 0.16]) == pytest.approx(0.02)


def test_steps_ratio_of_a_twice_faster_arm_and_paired_bootstrap():
    steps = list(range(1, 49))
    rng = np.random.default_rng(0)
    grpo, ps = [], []
    for tau in (10.0, 12.0, 14.0, 16.0):
        g = 0.1 + 0.3 * (1 - np.exp(-np.array(steps) / tau))
        p = 0.1 + 0.3 * (1 - np.exp(-np.array(steps) / (tau / 2)))
        grpo.append((steps, list(g + rng.normal(0, 0.002, len(steps)))))
        ps.append((steps, list(p + rng.normal(0, 0.002, len(steps)))))
    out = sc.steps_ratio(grpo, ps)
    assert out["fit"]["ratio"] == pytest.approx(2.0, rel=0.1)
    assert 1.6 < out["fit"]["ci_low"] <= out["fit"]["ratio"] <= out["fit"]["ci_high"] < 2.4
    assert out["trailing"]["ratio"] > 1.2 and out["fit"]["seeds"] == 4
    # ratio_ci against a plain loop over the same bootstrap draws.
    num, den = np.array([4.0, 6.0, 8.0]), np.array([2.0, 2.0, 4.0])
    got = sc.ratio_ci(num, den, n_boot=50, seed=3)
    draws = np.random.default_rng(3)
    reps = []
    for _ in range(50):
        idx = draws.integers(3, size=3)
        reps.append(sum(num[i] for i in idx) / sum(den[i] for i in idx))
    assert got["ratio"] == pytest.approx(18 / 8)
    assert got["ci_low"] == pytest.approx(np.percentile(reps, 2.5))
    assert sc.ratio_ci(np.array([3.0]), np.array([math.inf]))["ratio"] == 0.0


# ---------------------------------------------------------------- the metrics stage


def _write_run(workdir, step_s, start_s, fresh, ckpts, extra=None):
    """metrics.jsonl rows and checkpoint folders as train.py leaves them."""
    os.makedirs(os.path.join(workdir, "ckpt"), exist_ok=True)
    rows = [{"step": 0, "eval/pass_rate": 0.1}]
    if start_s:
        rows.append({"step": 0, "time/start_s": start_s})
    for i, (t, f) in enumerate(zip(step_s, fresh, strict=True), start=1):
        rows.append({"step": i, "time/step_s": t, "rollout/fresh_pass_rate": f,
                     "rollout/solve_partial": 3.0, "train/trajectories": 10.0,
                     **(extra(i) if extra else {})})
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    for s in ckpts:
        os.makedirs(os.path.join(workdir, "ckpt", str(s)))


def _write_eval(workdir, step, d, rewards):
    path = sc.eval_path(workdir, step, d, 5, 6)
    with open(path, "w") as f:
        json.dump({"step": step, "eval/pass_rate": float(np.mean(rewards)),
                   "rewards": {f"t{i}": r for i, r in enumerate(rewards)}}, f)


def test_metrics_stage_end_to_end_on_run_directories(tmp_path):
    """Two seeds, every arm: GRPO 48 steps of 40 s (32 min); SPO arms 10 s steps after a
    100 s offline start. Held-out rewards chosen so that SPO - GRPO at GRPO's end is
    +1/6 on d3 for both seeds; the summary keys, the eval points and the numbers follow."""
    root = str(tmp_path / "runs")
    steps = np.arange(1, 49)
    for seed in (1, 2):
        base = os.path.join(root, f"seed{seed}")
        grpo = list(0.1 + 0.2 * (1 - np.exp(-steps / 12)))
        ps = list(0.1 + 0.2 * (1 - np.exp(-steps / 6)))
        _write_run(f"{base}/grpo", [40.0] * 48, 0, grpo, [0, 15, 30, 45, 48])
        _write_run(f"{base}/ps", [40.0] * 48, 0, ps, [0, 48],
                   extra=lambda i: {"ps/prefix_pass_rate": 0.4 + 0.2 * (i % 2)})
        _write_run(f"{base}/revisit", [40.0] * 48, 0, grpo, [0, 48])
        for arm in ("spo", "spo_barrier"):
            _write_run(f"{base}/{arm}", [10.0] * 180, 100.0, [0.2] * 180, [0, 50, 110, 170],
                       extra=lambda i: {"spo/residual_var_ratio": 0.8})
        for arm, points in sc.eval_points({a: f"{base}/{a}" for a in sc.ARMS}).items():
            for step in set(points.values()):
                for d in (3, 1):
                    better = arm.startswith("spo") and step == 170
                    _write_eval(f"{base}/{arm}", step, d, [1, 1, 0, 0, 0, 1 if better else 0])
    points = sc.eval_points({a: f"{root}/seed1/{a}" for a in sc.ARMS})
    # GRPO's clock: 40 s a step, checkpoints at 600 s (15), 1200 s (30), 1800 s (45), 1920 s.
    assert points["grpo"] == {"last": 48, "10min": 15, "20min": 30, "30min": 45, "grpo_end": 48}
    # SPO's: 100 s start + 10 s a step: step 50 at 600 s, 110 at 1200, 170 at 1800 (<= 1920).
    assert points["spo"] == {"last": 170, "10min": 50, "20min": 110, "30min": 170,
                             "grpo_end": 170}
    out = sc.metrics(root, [1, 2], 5, 6, str(tmp_path / "results"), {"gate_pass": True},
                     run=False)
    s = out["summary"]
    assert set(s) >= {"seeds", "eval_tasks_d3", "ps_steps_ratio", "ps_steps_ratio_ci_low",
                      "solve_partial_ratio", "prefix_pass_rate_mean", "prefix_pass_rate_sd",
                      "spo_minus_grpo_equal_time", "spo_minus_grpo_equal_time_ci_low",
                      "gate_pass"}
    assert s["seeds"] == 2 and s["eval_tasks_d3"] == 6 and s["gate_pass"]
    assert s["ps_steps_ratio"] == pytest.approx(2.0, rel=0.05)
    assert s["solve_partial_ratio"] == pytest.approx(1.0)
    assert s["prefix_pass_rate_mean"] == pytest.approx(0.5)
    assert s["prefix_pass_rate_sd"] == pytest.approx(0.1)
    assert s["spo_minus_grpo_equal_time"] == pytest.approx(1 / 6)
    assert out["heldout"]["ps_minus_grpo"]["d1"]["last"]["gain_mean"] == 0.0
    assert out["per_arm"]["spo"]["residual_var_ratio"] == pytest.approx(0.8)
    assert out["per_arm"]["grpo"]["trained_per_s"] == pytest.approx(480 / 1920)
    assert all(os.path.exists(p) for p in out["figures"])
    with open(tmp_path / "results" / "seed_claims.json") as f:
        assert json.load(f)["summary"] == s


@pytest.mark.parametrize("arm", sorted(sc.ARMS))
def test_every_arm_config_is_valid_and_shaped_as_the_plan(arm):
    """Each arm's spec with its sets (as run_arms passes them, gate ratio 0.55) passes the
    trainer's config checks; batch shapes, PS / revisit / SPO settings as planned."""
    from configs import common
    from train import check_config

    sets = sc.arm_sets(arm, [*sc.RUN_SETS, "ckpt_every_s=120.0", "total_steps=48"], 0.55)
    config = common.load_config(os.path.join(sc.ex.ROOT, sc.ARMS[arm].format(seed=10)))
    config = common.apply_overrides(config, common.parse_overrides(sets))
    check_config(config)
    assert config.env.difficulties == (3, 1) and config.sft.imperfect_share == 0.0
    assert config.ckpt_every_s == 120.0 and config.seed == 10
    if arm.startswith("spo"):
        assert (config.algo, config.batch_tasks, config.group_size) == ("spo", 64, 1)
        assert config.spo.init_samples == 2
        assert config.spo.in_flight == (64 if arm == "spo_barrier" else 96)
    else:
        assert (config.algo, config.batch_tasks, config.group_size) == ("grpo", 8, 8)
        assert config.ps.enabled == (arm != "grpo") and config.ps.revisit == (arm == "revisit")
        assert config.ps.remaining_ratio == (0.55 if arm == "ps" else 0.6)


def test_tasks_per_step_sizes_every_arm_alike():
    """A gate try with 16 tasks per step: GRPO-like arms 16 x 8, SPO streams 128 prompts
    x 1 and its barrier waits for all 128."""
    def shape(arm):
        kv = dict(s.split("=") for s in sc.arm_sets(arm, tasks=16))
        return kv["batch_tasks"], kv["group_size"], kv.get("spo.in_flight")

    assert shape("grpo") == shape("ps") == shape("revisit") == ("16", "8", None)
    assert shape("spo") == ("128", "1", None) and shape("spo_barrier") == ("128", "1", "128")


def test_every_try_is_recorded_and_the_passing_one_chosen(tmp_path):
    def try_(name, passed, mean):
        return {"try": name, "sets": [f"sft.steps={name}"], "note": name, "gate_pass": passed,
                "histogram": {"mean": mean, "share_1_2": 0.3, "share_0": 0.5},
                "prefix": {"steps_left_in_band": [3]},
                "runs": {"fresh_pass_rate": {"slope": 0.01}} if passed else {"pending": True}}

    root, out = str(tmp_path / "runs"), str(tmp_path / "results")
    sc.record_try(root, out, try_("64", False, 0.02))
    sc.record_try(root, out, try_("96", True, 0.1))
    summary = sc.record_try(root, out, try_("128", False, 0.3))
    with open(os.path.join(out, "gate.json")) as f:
        assert json.load(f) == summary
    assert summary["gate_pass"] and summary["chosen"] == "96"
    assert summary["result"]["sets"] == ["sft.steps=96"]
    assert [(t["try"], t["hist_mean"], t["fresh_slope"]) for t in summary["tuned"]] == [
        ("64", 0.02, None), ("96", 0.1, 0.01), ("128", 0.3, None)]
    again = sc.record_try(root, out, try_("64", False, 0.03))   # a try redone replaces it
    assert [t["try"] for t in again["tuned"]] == ["96", "128", "64"]
