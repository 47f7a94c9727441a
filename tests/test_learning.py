"""bench.learning's statistics against closed forms on synthetic rewards."""

import numpy as np

from bench.learning import bootstrap_means, paired_bootstrap


def test_paired_bootstrap_covers_a_known_gain_and_matches_the_normal_interval():
    rng = np.random.default_rng(0)
    before = [rng.random(400) < 0.3 for _ in range(3)]
    after = [b | (rng.random(400) < 0.25) for b in before]  # true gain 0.7 * 0.25 = 0.175
    got = paired_bootstrap(before, after, n_boot=1000)
    diffs = np.concatenate([a.astype(float) - b for b, a in zip(before, after, strict=True)])
    assert got["gain_mean"] == diffs.mean()
    assert got["gain_ci_low"] < 0.175 < got["gain_ci_high"] and got["gain_ci_low"] > 0
    # Seeds drawn alike: the two-level bootstrap is close to the normal-approximation
    # interval of a paired mean, mean +- 1.96 sd / sqrt(n).
    half = 1.96 * diffs.std(ddof=1) / np.sqrt(len(diffs))
    width = (got["gain_ci_high"] - got["gain_ci_low"]) / 2
    assert abs(width - half) < 0.25 * half


def test_no_change_gives_zero_and_seed_spread_widens_the_interval():
    same = [np.ones(50), np.zeros(50)]
    assert paired_bootstrap(same, same, n_boot=200) == {
        "gain_mean": 0.0, "gain_ci_low": 0.0, "gain_ci_high": 0.0}
    # Seeds at 0.1 and 0.9: resampling seeds moves the mean much more than tasks alone.
    rng = np.random.default_rng(1)
    spread = [rng.random(200) < 0.1, rng.random(200) < 0.9]
    reps = bootstrap_means(spread, n_boot=1000)
    within = np.sqrt(0.5 * 0.5 / 400)  # what resampling tasks alone would give
    assert reps.std() > 3 * within


def test_reads_finished_runs_into_learning_json(tmp_path):
    import json

    from bench import learning

    rng = np.random.default_rng(2)
    tasks = [f"t{i:03d}" for i in range(40)]
    for seed in (0, 1, 2):
        for arm, p in (("sft", 0.2), ("ps_fixed", 0.5), ("baseline", 0.3)):
            run = tmp_path / f"seed{seed}" / arm
            run.mkdir(parents=True)
            for name in ("final_eval_40.json", "eval_0.json", "eval_12.json"):
                rewards = {t: float(rng.random() < p) for t in tasks}
                (run / name).write_text(json.dumps({"step": 12, "rewards": rewards}))
            rows = [{"step": 0, "sft/loss": 1.0}] + [
                {"step": s, "rollout/pass_rate": p + seed / 10} for s in (1, 2)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = learning.main(["--root", str(tmp_path), "--eval-tasks", "40", "--out",
                         str(tmp_path / "results")])
    saved = json.loads((tmp_path / "results" / "learning.json").read_text())
    assert saved["seeds"] == 3 and saved["eval_tasks"] == 40
    assert saved["gain_ci_low"] < saved["gain_mean"] < saved["gain_ci_high"]
    assert out["ps_vs_baseline"]["gain_mean"] == saved["ps_vs_baseline"]["gain_mean"]
    assert saved["curves"]["ps_fixed"]["step"] == [0, 12]
    # Training rollout pass rate: RL steps only, mean over seeds (0.5 + 0, 0.1, 0.2).
    assert saved["rollout_curves"]["ps_fixed"]["step"] == [1, 2]
    assert np.allclose(saved["rollout_curves"]["ps_fixed"]["mean"], [0.6, 0.6])
    assert saved["baseline_arm"] == "baseline"
    assert (tmp_path / "results" / "learning.png").exists()
