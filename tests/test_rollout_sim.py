"""The rollout simulation: real collectors, Agent and Episode over SimEngine / SimSandbox.

References: plans drawn by the engine (turn counts, statuses), hand-computed durations of
a degenerate (zero-variance) model, and a Bernoulli grading rate.
"""

import asyncio
import threading

import numpy as np
import pytest

from bench import rollout_sim as sim
from env.sandbox.pool import SandboxPool
from models.tokenizer import TOOL_CALL_END
from rl.rollout import Agent, RolloutJob
from tests.owners import rollout_config

FIXED = sim.LongTailModel(turns_sigma=0.0, tokens_sigma=0.0, tool_sigma=0.0)
# D = 10 turns * 300 tokens * 0.02 s + 9 tool calls * 2 s = 60 + 18 = 78 simulated s.
FIXED_DURATION, FIXED_DECODE = 78.0, 60.0


@pytest.fixture(scope="module")
def tokenizer():
    return sim.sim_tokenizer()


def test_both_modes_fill_batches_and_trajectories_follow_their_plans(tokenizer):
    # max_steps 20 < some drawn turn counts, so both budget endings occur. Which mode is
    # faster is the benchmark's business (python -m bench.rollout_sim): at this time scale
    # a loaded machine's scheduling noise is as large as the simulated durations.
    cfg = sim.SimConfig(time_scale=0.002, batches=2, max_steps=20, learner_s=10.0)
    results = {mode: asyncio.run(sim.run_mode(mode, cfg, tokenizer))
               for mode in ("group", "stream")}
    summary = {mode: sim.summarize(r, cfg) for mode, r in results.items()}
    assert all(summary[mode]["samples_per_s"] > 0 for mode in summary)
    statuses = set()
    for mode, result in results.items():
        assert [len(b) for b in result.batches] == [cfg.batch] * cfg.batches
        assert 0.0 <= summary[mode]["engine_idle_fraction"] <= 1.0
        for traj in (t for b in result.batches for t in b):
            assert traj.reward in (0.0, 1.0)
            first = traj.turns[0]
            plan = result.engine.plan_for([*first.obs_ids, *first.action_ids])
            assert plan is not None
            if plan.turns <= cfg.max_steps:
                assert (traj.status, traj.num_steps) == ("finished", plan.turns)
            else:
                assert (traj.status, traj.num_steps) == ("max_steps", cfg.max_steps)
            statuses.add(traj.status)
    assert statuses == {"finished", "max_steps"}
    # Every label is unique: one plan per trajectory started.
    group_labels = [t.turns[0].action_ids for b in results["group"].batches for t in b]
    assert len({tuple(ids) for ids in group_labels}) == len(group_labels)


def test_group_and_stream_draw_the_same_plans_for_the_same_jobs(tokenizer):
    cfg = sim.SimConfig(batch=8, group_size=4, concurrency=8, time_scale=0.002, batches=1,
                        learner_s=0.0)
    drawn = {}
    for mode in ("group", "stream"):
        result = asyncio.run(sim.run_mode(mode, cfg, tokenizer))
        drawn[mode] = [(t.task_id, result.engine.plan_for([*t.turns[0].obs_ids,
                                                           *t.turns[0].action_ids]))
                       for t in result.batches[0]]
    # The stream's first finishers include jobs 0..7, which are the group's rollouts.
    shared = [d for d in drawn["stream"] if d[0] in {task for task, _ in drawn["group"]}]
    assert shared
    assert set(shared) <= set(drawn["group"])


def test_fixed_model_times_one_trajectory_as_computed(tokenizer):
    scale = 0.01
    engine = sim.SimEngine(tokenizer, FIXED, scale, seed=0)
    agent = Agent(engine, tokenizer, SandboxPool(sim.sandbox_factory(FIXED, scale, seed=0), 8),
                  rollout_config(max_steps=50, max_turn_tokens=128, max_response_tokens=4096,
                                 max_context=8192, temperature=1.0, test_timeout_s=60.0),
                  tools_in_prompt=False)

    async def one():
        return await agent.run(RolloutJob(sim.task(0), seed=3))

    traj = asyncio.run(one())
    busy_s, request_s = engine.accounting()
    assert (traj.status, traj.num_steps) == ("finished", 10)
    assert [t.tool_call["name"] for t in traj.turns] == ["execute_bash"] * 9 + ["finish"]
    assert traj.turns[1].tool_call["arguments"] == {"command": "sleep 2.000"}
    end_id = tokenizer.special_ids[TOOL_CALL_END]
    assert all(t.action_ids[-1] == end_id and t.action_ids.count(end_id) == 1
               for t in traj.turns)
    # Sleeps never end early; scheduling adds a little on a loaded machine.
    assert FIXED_DECODE <= busy_s / scale < FIXED_DECODE * 1.15
    assert request_s == pytest.approx(busy_s)  # one request at a time
    assert FIXED_DURATION <= sum(traj.timings.values()) / scale < FIXED_DURATION * 1.15


def test_predict_matches_hand_computed():
    out = sim.predict(FIXED, batch=4, concurrency=2, learner_s=10.0, draws=3)
    assert out["trajectory_s_mean"] == pytest.approx(FIXED_DURATION)
    assert out["group_seconds_per_batch"] == pytest.approx(FIXED_DURATION + 10.0)
    assert out["stream_seconds_per_batch"] == pytest.approx(4 * FIXED_DURATION / 2)
    assert out["speedup"] == pytest.approx(88.0 / 156.0)


def test_long_tail_draws_have_the_stated_medians():
    model = sim.LongTailModel()
    plans = [model.draw(np.random.default_rng(i)) for i in range(2000)]
    assert np.median([p.turns for p in plans]) == 10
    assert max(p.turns for p in plans) == model.max_turns  # the cap is reached
    tokens = np.concatenate([p.tokens for p in plans])
    tools = np.concatenate([p.tool_s for p in plans])
    assert np.median(tokens) == pytest.approx(300, rel=0.05)
    assert np.median(tools) == pytest.approx(2.0, rel=0.05)
    assert all(len(p.tool_s) == p.turns - 1 for p in plans)


def test_sim_sandbox():
    box = sim.SimSandbox(time_scale=0.001, pass_rate=0.3, rng=np.random.default_rng(0),
                         rng_lock=threading.Lock())
    assert box.run("sleep 1.5 # trajectory 7").exit_code == 0
    slow = box.run("sleep 90", timeout=30)
    assert (slow.exit_code, slow.timed_out) == (-1, True)
    assert box.run("pwd -P").output.strip() == "/testbed"
    assert box.run("rm -rf x").exit_code == 127
    passes = [box.run(sim.GRADE_COMMAND).exit_code == 0 for _ in range(4000)]
    assert np.mean(passes) == pytest.approx(0.3, abs=0.03)
    box.write_file("a/b.txt", "hi")
    assert box.read_file("a/./b.txt") == "hi"
    with pytest.raises(FileNotFoundError):
        box.read_file("missing.txt")
    with pytest.raises(ValueError, match="leaves the repository"):
        box.read_file("../x")
    box.close()
    with pytest.raises(sim.SandboxError):
        box.run("sleep 1")


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        sim.SimConfig(batch=10, group_size=4)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        sim.SimConfig(concurrency=0)
