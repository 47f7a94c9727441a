"""The experiment benches' read-back and summary figures on hand-made runs."""

import json
import os

import numpy as np
import pytest

from bench import experiments as ex
from bench import ps_ablation, spo_vs_grpo


def _write_run(root, seed, arm, evals, partial, step_s, prefix_rate=None, replayed=0,
               generated=100, entropy=1.0):
    workdir = os.path.join(root, f"seed{seed}", arm)
    os.makedirs(workdir)
    rows = [{"step": 0, "sft/loss": 1.0}, {"step": 10, "sft/loss": 0.5}]  # SFT shares steps
    rows.append({"step": 0, "eval/pass_rate": evals[0]})
    for step in range(1, len(partial) + 1):
        row = {"step": step, "rollout/solve_partial": partial[step - 1],
               "rollout/pass_rate": 0.3, "time/step_s": step_s, "learner/entropy": entropy,
               "train/trajectories": 40, "ps/replayed_tokens": replayed,
               "ps/generated_tokens": generated}
        if prefix_rate is not None:
            row["ps/prefix_pass_rate"] = prefix_rate[step - 1]
        if step % 2 == 0:
            row["eval/pass_rate"] = evals[step // 2]
        rows.append(row)
    # A resumed run repeats step 2 after its checkpoint; the later write wins.
    rows.append({**rows[-2], "step": 2, "eval/pass_rate": evals[1]})
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(workdir, "run.json"), "w") as f:
        json.dump({"arm": arm, "seed": seed, "steps": len(partial), "wall_s": 1.0}, f)


def test_helpers():
    rows = [{"step": 0, "a": 1.0}, {"step": 2, "a": 3.0}, {"step": 1, "a": 2.0},
            {"step": 2, "a": 4.0}, {"step": 3, "b": 0.0}]
    assert ex.curve(rows, "a") == ([0, 1, 2], [1.0, 2.0, 4.0])
    assert ex.rl_curve(rows, "a") == ([1, 2], [2.0, 4.0])
    np.testing.assert_allclose(ex.smooth([0, 2, 4, 0]), [0, 1, 3, 2])
    assert ex.steps_to_reach([0, 2, 4], [0.1, 0.3, 0.5], 0.3) == 2
    assert ex.steps_to_reach([0, 2, 4], [0.1, 0.3, 0.5], 0.6) == float("inf")
    steps, mean, std = ex.mean_curve([([0, 1, 2], [1, 2, 3]), ([0, 1], [3, 4])])
    assert steps == [0, 1]
    np.testing.assert_allclose(mean, [2, 3])
    np.testing.assert_allclose(std, [1, 1])


def test_ps_ablation_summary_from_runs(tmp_path):
    root, out = str(tmp_path / "runs"), str(tmp_path / "results")
    for seed in (0, 1):
        # evals at steps 0, 2, 4, 6. Seed-mean smoothed (window 2) baseline:
        #   means [0.2, 0.25, 0.3, 0.4] -> smoothed [0.2, 0.225, 0.275, 0.35]: best 0.35 at 6.
        # PS means [0.2, 0.4, 0.5, 0.5] -> smoothed [0.2, 0.3, 0.45, 0.5]: >= 0.35 at step 4.
        _write_run(root, seed, "baseline", [0.2, 0.25 + 0.05 * (seed - 0.5) * 2, 0.3, 0.4],
                   partial=[2, 2, 3, 3, 2, 2], step_s=10.0)
        _write_run(root, seed, "ps_fixed", [0.2, 0.4, 0.5, 0.5], partial=[3, 3, 4, 4, 3, 3],
                   step_s=8.0, prefix_rate=[0.4, 0.5, 0.6, 0.5, 0.5, 0.5], replayed=50,
                   generated=150)
    # Cached evaluations of the final checkpoints on a larger held-out set (train.py
    # --eval_only).
    # Seed 1's ps_fixed result is stale (step 0, e.g. copied with the warm start, while
    # the run's last checkpoint is step 6) and --no_run does not redo it.
    finals = {("sft", 0, 0): 0.2, ("sft", 1, 0): 0.3, ("baseline", 0, 6): 0.25,
              ("baseline", 1, 6): 0.3, ("ps_fixed", 0, 6): 0.4, ("ps_fixed", 1, 0): 0.3}
    for (arm, seed, step), rate in finals.items():
        workdir = os.path.join(root, f"seed{seed}", arm)
        os.makedirs(os.path.join(workdir, "ckpt", "0"), exist_ok=True)
        os.makedirs(os.path.join(workdir, "ckpt", "6.orbax-checkpoint-tmp-1"))  # unfinished
        if arm != "sft":
            os.makedirs(os.path.join(workdir, "ckpt", "6"))
        else:
            with open(os.path.join(workdir, "run.json"), "w") as f:
                json.dump({"wall_s": 1.0}, f)
        with open(os.path.join(workdir, "final_eval_144.json"), "w") as f:
            json.dump({"step": step, "eval/pass_rate": rate,
                       "rewards": {f"t{i}": float(i < rate * 10) for i in range(10)}}, f)
    ps_ablation.main(["--seeds", "0,1", "--arms", "baseline,ps_fixed", "--steps", "6",
                      "--root", root, "--out", out, "--no_run"])
    with open(os.path.join(out, "ps_ablation.json")) as f:
        result = json.load(f)
    s = result["summary"]
    assert s["baseline_best_smoothed_eval"] == pytest.approx(0.35)
    assert s["steps_baseline_to_best"] == 6 and s["steps_ps_to_baseline_best"] == 4
    assert s["step_speedup"] == pytest.approx(1.5)
    assert s["solve_partial_gain"] == pytest.approx(20 / 14)
    rates = [0.4, 0.5, 0.6, 0.5, 0.5, 0.5]
    assert s["prefix_pass_rate_mean"] == pytest.approx(np.mean(rates))
    assert s["prefix_pass_rate_std"] == pytest.approx(np.std(rates))
    assert s["replayed_token_share"] == pytest.approx(0.25)
    assert s["step_time_ratio"] == pytest.approx(1.25)
    fe = s["final_eval"]
    assert fe["tasks"] == 10
    assert fe["sft"]["mean"] == pytest.approx(0.25)
    assert fe["baseline"]["pass_rate"] == {"0": 0.25, "1": 0.3}
    assert fe["baseline"]["gain_over_sft_mean"] == pytest.approx(0.025)
    assert fe["ps_fixed"]["pass_rate"] == {"0": 0.4}
    assert fe["ps_fixed"]["gain_over_sft_mean"] == pytest.approx(0.2)
    assert result["curves"]["ps_fixed"]["0"]["eval"]["steps"] == [0, 2, 4, 6]
    assert result["curves"]["ps_fixed"]["0"]["solve_partial"]["steps"] == [1, 2, 3, 4, 5, 6]
    for path in result["figures"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_spo_vs_grpo_from_runs(tmp_path):
    root, out = str(tmp_path / "runs"), str(tmp_path / "results")
    _write_run(root, 0, "baseline", [0.2, 0.3, 0.3, 0.4], partial=[1] * 6, step_s=10.0)
    _write_run(root, 0, "spo", [0.2, 0.3, 0.4, 0.5], partial=[1] * 6, step_s=5.0)
    spo_vs_grpo.main(["--seeds", "0", "--steps", "6", "--root", root, "--out", out,
                      "--no_run"])
    with open(os.path.join(out, "spo_vs_grpo.json")) as f:
        result = json.load(f)
    spo = result["curves"]["spo"]["0"]
    assert spo["rollouts"] == [0, 96, 192, 288]
    assert spo["wall_s"] == [0.0, 10.0, 20.0, 30.0]
    assert result["summary"]["spo"]["eval_final_mean"] == 0.5
    assert result["summary"]["step_time_ratio_grpo_over_spo"] == pytest.approx(2.0)


def test_run_arm_refuses_a_finished_run_made_with_other_settings(tmp_path):
    _write_run(tmp_path, 0, "grpo", [0.1, 0.2], [0.5, 0.5], 1.0)
    record = os.path.join(tmp_path, "seed0", "grpo", "run.json")
    with open(record) as f:
        run = json.load(f)
    with open(record, "w") as f:
        json.dump({**run, "sets": ["learner.optim.lr=5e-5"]}, f)
    with pytest.raises(ValueError, match="was run with"):
        ex.run_arm(str(tmp_path), "grpo", 0, 2, ["learner.optim.lr=2e-4"])
    # The same settings: a finished run is read back, nothing is trained.
    assert ex.run_arm(str(tmp_path), "grpo", 0, 2, ["learner.optim.lr=5e-5"]).endswith("grpo")
