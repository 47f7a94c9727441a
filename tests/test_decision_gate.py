"""bench.decision_gate: the pre-registered paired verdict, checked against direct
computation on made-up curves."""

import json

import numpy as np

from bench import decision_gate as dg

HIST = {"pass": True}
PREFIX = {"pass": True}


def _curves(diff, seed=0, steps=24):
    rng = np.random.default_rng(seed)
    lr0 = {s: float(rng.uniform(0.3, 0.5)) for s in range(1, steps + 1)}
    return {s: v + diff + float(rng.normal(0, 0.02)) for s, v in lr0.items()}, lr0


def test_the_difference_is_the_mean_over_steps_13_to_24_only():
    grpo, lr0 = _curves(0.1)
    grpo[1] = 5.0  # outside the window: no effect
    out = dg.paired(grpo, lr0)
    assert out["steps"] == list(range(13, 25))
    assert np.isclose(out["diff"], np.mean([grpo[s] - lr0[s] for s in range(13, 25)]))
    assert out["ci_low"] < out["diff"] < out["ci_high"]
    flat = dg.paired({s: 0.4 for s in range(1, 25)}, {s: 0.3 for s in range(1, 25)})
    assert np.isclose(flat["diff"], 0.1) and np.isclose(flat["ci_low"], 0.1)
    assert dg.paired({}, lr0)["diff"] is None


def test_the_verdict_needs_every_seed_complete_above_the_bar_and_the_warm_start():
    ok = [dg.paired(*_curves(0.1, seed=s)) for s in (0, 1)]
    assert dg.passes(ok, HIST, PREFIX)
    assert not dg.passes(ok[:1], HIST, PREFIX)  # one seed of two
    assert not dg.passes(ok, {"pass": False}, PREFIX)
    assert not dg.passes(ok, HIST, {"pass": False})
    small = [dg.paired(*_curves(0.03, seed=s)) for s in (0, 1)]
    assert not dg.passes(small, HIST, PREFIX)  # +0.03 < +0.05
    grpo, lr0 = _curves(0.1, seed=1)
    short = dg.paired({s: v for s, v in grpo.items() if s <= 20}, lr0)
    assert not dg.passes([ok[0], short], HIST, PREFIX)  # steps 21-24 not run yet
    noisy = {s: 0.4 + (0.35 if s % 2 else -0.2) for s in range(1, 25)}
    wide = dg.paired(noisy, {s: 0.4 for s in range(1, 25)})
    assert wide["diff"] >= 0.05 and wide["ci_low"] <= 0
    assert not dg.passes([ok[0], wide], HIST, PREFIX)


def test_first_calls_reads_how_each_held_out_episode_began(tmp_path):
    from models.tokenizer import render_tool_call

    def episode(call: str, reward: float) -> dict:
        return {"task_id": "t", "reward": reward, "status": "max_steps", "error": "",
                "text": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                        f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>user\nO"}

    view = render_tool_call({"name": "file_editor",
                             "arguments": {"command": "view", "path": "ops.py"}})
    tests = render_tool_call({"name": "execute_bash", "arguments": {"command": "ls"}})
    rows = [episode(view, 1.0), episode(view, 0.0), episode(tests, 0.0),
            episode("<tool_call>{oops</tool_call>", 0.0)]
    (tmp_path / "seed0" / "arm").mkdir(parents=True)
    with open(tmp_path / "seed0" / "arm" / "eval_4_transcripts.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert dg.first_calls(str(tmp_path), 0, "arm", 4) == {
        "first_call": {"file_editor/view": 2, "execute_bash": 1, "malformed": 1},
        "passed": {"file_editor/view": 1, "execute_bash": 0, "malformed": 0}}
    assert dg.first_calls(str(tmp_path), 0, "arm", 8) is None
