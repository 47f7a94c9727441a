"""Prefix Sampling bookkeeping against the seed 000 table, examples and a simulated population."""

import dataclasses
import json
import logging

import numpy as np
import pytest

from configs import common
from rl.prefix import (
    AdaptiveController,
    PrefixConfig,
    PrefixQueue,
    build_prefix_tasks,
    classify,
    classify_groups,
    fresh_pass_rate,
    make_prefix_task,
    prefix_k,
    prefix_metrics,
    revisit_task,
    select_source,
)
from rl.types import PrefixInfo, Trajectory, Turn


def ps_config(**changes) -> PrefixConfig:
    """The `ps` section's defaults with `changes`."""
    return dataclasses.replace(PrefixConfig(**common.prefix_defaults()), **changes)


def traj(task_id="t", uid="u", reward=0, steps=4, status="finished", prefix=None):
    turns = [Turn(obs_ids=[100 * s + 1, 100 * s + 2], action_ids=[100 * s + 3],
                  action_logprobs=[-0.5 * s], tool_call={"name": "bash", "arguments": {"i": s}},
                  observation=f"out{s}", patch=f"diff{s}") for s in range(steps)]
    return Trajectory(task_id=task_id, uid=uid, turns=turns, reward=reward, status=status,
                      prefix=prefix)


def group(rewards, task_id="t", steps=4, prefix=None, status="finished"):
    return [traj(task_id, f"{task_id}-{i}", r, steps, status, prefix)
            for i, r in enumerate(rewards)]


# ---------------------------------------------------------------- classification


# Seed 000, N=8: 0/8 all-fail, 1-2/8 too hard, 3-5/8 normal, 6-7/8 too easy, 8/8 all-pass.
SEED_N8 = ["all_fail", "too_hard", "too_hard", "normal", "normal", "normal",
           "too_easy", "too_easy", "all_pass"]


@pytest.mark.parametrize("k", range(9))
def test_classify_n8_every_k(k):
    rewards = np.array([1] * k + [0] * (8 - k))
    assert classify(rewards) == SEED_N8[k]
    assert classify(np.random.default_rng(k).permutation(rewards)) == SEED_N8[k]


def test_classify_boundaries_are_normal():
    assert classify([1] * 3 + [0] * 7) == "normal"   # p = 0.3 = low
    assert classify([1] * 7 + [0] * 3) == "normal"   # p = 0.7 = high
    assert classify([1] * 29 + [0] * 71) == "too_hard"
    assert classify([1] * 71 + [0] * 29) == "too_easy"
    assert classify([1, 0], low=0.6, high=0.9) == "too_hard"


def test_classify_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        classify([])
    with pytest.raises(ValueError, match="0 or 1"):
        classify([0.5, 1])


def test_classify_groups_counts_and_env_errors():
    groups = [group([1] * k + [0] * (8 - k), task_id=f"t{k}") for k in range(9)]
    # env_error rollouts are not failures: 2 passes + 6 infra errors is all-pass
    groups.append(group([1, 1]) + group([0] * 6, status="env_error"))
    groups.append(group([0, 0], status="env_error"))  # nothing scored
    out = classify_groups(groups)
    assert out.classes == SEED_N8 + ["all_pass", "unscored"]
    assert out.counts == {"all_fail": 1, "all_pass": 2, "normal": 3, "too_hard": 2,
                          "too_easy": 2, "unscored": 1, "solve_none": 1, "solve_all": 2,
                          "solve_partial": 7}


# ---------------------------------------------------------------- k selection


def test_prefix_k_seed_examples():
    # seed: 20 steps, remaining_ratio 0.25 -> replay 15, model does the last 5
    assert prefix_k(20, "too_hard", 0.25) == 15
    # seed: 20 steps, prefix_ratio 0.25 -> replay the failure's first 5
    assert prefix_k(20, "too_easy", 0.25) == 5


def test_prefix_k_caps_and_clamps():
    assert prefix_k(100, "too_hard", 0.25, cap=10) == 90     # remaining capped at 10
    assert prefix_k(100, "too_easy", 0.25, cap=10) == 10     # prefix capped at 10
    assert prefix_k(3, "too_easy", 0.25) == 1                # int(0.75) = 0 -> clamp to 1
    assert prefix_k(3, "too_hard", 0.25) == 2                # remaining 0 -> k = 3 -> 2
    assert prefix_k(2, "too_hard", 0.95) == 1
    assert prefix_k(10, "too_easy", 0.95) == 9
    assert prefix_k(1, "too_hard", 0.25) is None
    assert prefix_k(0, "too_easy", 0.25) is None
    assert prefix_k(20, "too_easy", 0.35) == 7               # int(20 * 0.35) despite 0.3499..
    with pytest.raises(ValueError, match="kind"):
        prefix_k(20, "normal", 0.25)


def test_select_source_excludes_env_errors_and_short_runs():
    rng = np.random.default_rng(0)
    g = group([0, 0, 0, 1]) + group([1], "e", status="env_error") + [traj(uid="short", reward=1,
                                                                        steps=1)]
    picks = {select_source(g, "too_hard", rng).uid for _ in range(50)}
    assert picks == {"t-3"}
    picks = {select_source(g, "too_easy", rng).uid for _ in range(100)}
    assert picks == {"t-0", "t-1", "t-2"}
    assert select_source(group([0, 0]), "too_hard", rng) is None


def test_make_prefix_task_records_state_at_step_k():
    src = traj(uid="src", reward=1, steps=5)
    task = make_prefix_task(src, 3, "too_hard", step=7)
    assert [t.action_ids for t in task.turns] == [[3], [103], [203]]
    assert all(t.replayed for t in task.turns) and not any(t.replayed for t in src.turns)
    assert task.next_obs_ids == [301, 302]       # observation of step 3
    assert task.patch == "diff2"                 # repository after step 3
    assert task.info == PrefixInfo("src", 3, "too_hard")
    assert task.num_prefix_tokens == 3 * 3 + 2
    with pytest.raises(ValueError, match="outside"):
        make_prefix_task(src, 5, "too_hard", 7)


# ---------------------------------------------------------------- queue


def tasks_at(step, n, kind="too_hard"):
    return [make_prefix_task(traj(f"s{step}-{i}", f"s{step}-{i}", 1, 6), 3, kind, step)
            for i in range(n)]


def test_queue_share_freshness_and_expiry():
    q = PrefixQueue(max_age=2)
    q.push(tasks_at(1, 5))
    q.push(tasks_at(2, 5))
    q.push(tasks_at(3, 2))
    # step 3: only tasks made before step 3; share 0.25 * 16 = 4, freshest first
    out = q.take(3, batch_size=16, max_share=0.25)
    assert [t.task_id for t in out] == ["s2-0", "s2-1", "s2-2", "s2-3"]
    # step 4: s1 entries are 3 steps old -> expired; then s3, then the leftover s2
    out = q.take(4, batch_size=10, max_share=0.5)
    assert q.last_expired == 5 and q.expired_total == 5
    assert [t.task_id for t in out] == ["s3-0", "s3-1", "s2-4"]
    assert len(q) == 0
    q.push(tasks_at(4, 3))
    assert q.take(5, batch_size=3, max_share=0.34) == tasks_at(4, 1)[:1]   # floor(1.02) = 1
    assert q.take(7, batch_size=100, max_share=1.0) == [] and q.last_expired == 2


def test_prefix_tasks_are_not_reprefixed_unless_configured():
    rng = np.random.default_rng(0)
    info = PrefixInfo("old", 2, "too_hard")
    groups = [group([1, 0, 0, 0, 0, 0, 0, 0], "fresh"),
              group([1, 0, 0, 0, 0, 0, 0, 0], "pref", prefix=info)]
    ctrl = AdaptiveController(ps_config())
    ps = build_prefix_tasks(groups, 0, ps_config(), ctrl, rng)
    assert [t.task_id for t in ps.tasks] == ["fresh"] and ps.no_source == 1
    ps = build_prefix_tasks(groups, 0, ps_config(reprefix=True), ctrl, rng)
    assert [t.task_id for t in ps.tasks] == ["fresh", "pref"]


def test_queue_state_round_trip_exact():
    q = PrefixQueue(max_age=3)
    q.push(tasks_at(1, 2) + tasks_at(2, 3, "too_easy"))
    q.tasks[0].turns[1].tool_call = None
    q.expire(5)
    q.push(tasks_at(6, 2))
    state = q.state_dict()
    json.dumps({k: v for k, v in state.items() if not isinstance(v, np.ndarray)})
    q2 = PrefixQueue(max_age=2)
    q2.load_state_dict(state)
    assert q2.tasks == q.tasks and q2.max_age == 3 and q2.expired_total == q.expired_total
    empty = PrefixQueue(max_age=2)
    empty.load_state_dict(PrefixQueue(max_age=4).state_dict())
    assert empty.tasks == [] and empty.max_age == 4


def test_a_cap_of_0_is_uncapped():
    """The config's caps (0 = uncapped) read through PrefixConfig.cap."""
    cfg = ps_config(remaining_cap=0, prefix_cap=3)
    assert cfg.cap("too_hard") is None and cfg.cap("too_easy") == 3
    assert prefix_k(100, "too_hard", 0.25, cfg.cap("too_hard")) == 75      # 25 remaining
    assert prefix_k(100, "too_easy", 0.25, cfg.cap("too_easy")) == 3
    # A negative cap is refused where every range is checked (configs.common.RANGES).
    from configs import common, default

    with pytest.raises(ValueError, match="ps.prefix_cap=-1"):
        common.check_values(common.apply_overrides(default.get_config(), {"ps.prefix_cap": -1}))


# ---------------------------------------------------------------- build + metrics


def test_build_prefix_tasks_and_metrics():
    rng = np.random.default_rng(1)
    cfg = ps_config(remaining_cap=2)
    ctrl = AdaptiveController(cfg)
    groups = [
        group([0] * 8, "fail"),
        group([1] * 8, "pass"),
        group([1] * 4 + [0] * 4, "normal"),
        group([1] + [0] * 7, "hard", steps=20),
        group([1] * 7 + [0], "easy", steps=20),
        group([1, 1, 0, 0, 0, 0, 0, 0], "p-hard", steps=6,
              prefix=PrefixInfo("x", 3, "too_hard")),
    ]
    ps = build_prefix_tasks(groups, step=4, cfg=cfg, controller=ctrl, rng=rng)
    assert ps.train == [False, False, True, True, True, True]
    by_id = {t.task_id: t for t in ps.tasks}
    assert set(by_id) == {"hard", "easy"}
    assert by_id["hard"].k == 18 and by_id["hard"].source_uid == "hard-0"   # cap 2 remaining
    assert by_id["easy"].k == 5 and by_id["easy"].source_uid == "easy-7"
    assert ps.pass_counts == {"too_hard": (2, 8), "too_easy": (0, 0)}
    assert ctrl.ema("too_hard") == pytest.approx(0.95 * 0.5 + 0.05 * 0.25)
    m = prefix_metrics(ps, groups, ctrl, PrefixQueue(max_age=2))
    assert m["ps/solve_none"] == 1 and m["ps/solve_all"] == 1 and m["ps/solve_partial"] == 4
    assert m["ps/effective_tasks"] == 4
    assert m["ps/prefix_tasks/too_hard"] == 1 and m["ps/prefix_tasks/too_easy"] == 0
    assert m["ps/prefix_pass_rate/too_hard"] == 0.25 and "ps/prefix_pass_rate/too_easy" not in m
    assert m["ps/prefix_pass_rate"] == 0.25
    assert m["ps/new_prefix_tasks/too_hard"] == 1 and m["ps/ratio/too_easy"] == 0.25
    assert m["ps/generated_tokens"] == sum(t.num_generated_tokens for g in groups for t in g)


def test_revisit_queues_skewed_tasks_from_the_start():
    """The control: each too_hard / too_easy fresh group queues its task at k = 0 (no
    source, nothing replayed); normal and degenerate groups, and groups that were
    themselves revisits, queue nothing; training and the controller are as with PS."""
    groups = [group([0] * 8, "fail"), group([1] * 8, "pass"),
              group([1] * 4 + [0] * 4, "normal"), group([1] + [0] * 7, "hard"),
              group([1] * 7 + [0], "easy"),
              group([1, 0, 0, 0, 0, 0, 0, 0], "again", prefix=PrefixInfo("", 0, "too_hard"))]
    ps = build_prefix_tasks(groups, 3, ps_config(revisit=True), AdaptiveController(ps_config()),
                            np.random.default_rng(0))
    assert [(t.task_id, t.kind, t.k, t.turns, t.patch, t.created_step) for t in ps.tasks] == [
        ("hard", "too_hard", 0, [], "", 3), ("easy", "too_easy", 0, [], "", 3)]
    assert ps.train == [False, False, True, True, True, True] and ps.no_source == 0
    assert ps.pass_counts["too_hard"] == (1, 8)       # the revisited group's rollouts
    q = PrefixQueue(max_age=2)
    q.push(ps.tasks + tasks_at(1, 1))
    q2 = PrefixQueue(max_age=2)
    q2.load_state_dict(q.state_dict())
    assert q2.tasks == q.tasks and q2.tasks[0] == revisit_task("hard", "too_hard", 3)
    assert q2.tasks[0].info == PrefixInfo("", 0, "too_hard") and q2.tasks[0].num_prefix_tokens == 0


def test_fresh_pass_rate_leaves_out_prefixed_and_unscored_rollouts():
    info = PrefixInfo("x", 2, "too_hard")
    groups = [group([1, 0, 0, 0], "a"), group([1, 1, 1, 1], "b", prefix=info),
              group([1, 0], "c", status="env_error"), group([0, 1, 1], "d")]
    # Plain count: fresh scored rollouts are a's four and d's three.
    assert fresh_pass_rate(groups) == pytest.approx(3 / 7)
    assert fresh_pass_rate([group([1, 1], "b", prefix=info)]) is None


# ---------------------------------------------------------------- adaptive controller


def test_controller_steps_cooldown_and_clamp():
    c = AdaptiveController(ps_config(adaptive=True, ema_init=None, cooldown=2, ratio_max=0.35))
    ratios = []
    for _ in range(12):
        c.update({"too_hard": 0.9, "too_easy": None})
        ratios.append(c.ratio("too_hard"))
    # changes at steps 0, 3, then the clamp at 0.35 holds; too_easy never moves
    assert ratios == [0.3, 0.3, 0.3, 0.35] + [0.35] * 8
    assert c.ratio("too_easy") == 0.25 and c.ema("too_easy") is None
    fixed = AdaptiveController(ps_config(adaptive=False))
    for _ in range(20):
        fixed.update({"too_hard": 1.0, "too_easy": 0.0})
    assert fixed.ratios == {"too_hard": 0.25, "too_easy": 0.25}
    assert fixed.ema("too_hard") > 0.6 and fixed.ema("too_easy") < 0.4


def simulate(steps=300, tasks=64, rollouts=8, seed=0):
    """Prefix tasks whose pass probability falls with the ratio and rises with training.

    Task i of kind j at step t, created one step earlier with ratio r:
      p = sigmoid(slope * (r_j - r_star_j) + z_i + drift * t),  z_i ~ N(0, 0.5),
    slope = -4 per unit ratio (a 0.05 step moves p by about 0.05 near 0.5), drift
    0.005 logit/step (1.5 logits of model improvement over the run). At the start
    r_star puts the too_hard pass rate near 0.3 and the too_easy one near 0.7, so the
    controller must first walk both ratios and then keep raising them.
    """
    rng = np.random.default_rng(seed)
    r_star = {"too_hard": 0.05, "too_easy": 0.45}
    ctrl = AdaptiveController(ps_config(adaptive=True))
    ema, ratio = {k: [] for k in r_star}, {k: [] for k in r_star}
    used = dict(ctrl.ratios)
    for t in range(steps):
        rates = {}
        for kind, rs in r_star.items():
            logit = -4.0 * (used[kind] - rs) + rng.normal(0, 0.5, tasks) + 0.005 * t
            p = 1 / (1 + np.exp(-logit))
            rates[kind] = rng.binomial(rollouts, p).sum() / (tasks * rollouts)
        ctrl.update(rates)
        used = dict(ctrl.ratios)  # tasks made this step run at the next
        for kind in r_star:
            ema[kind].append(ctrl.ema(kind))
            ratio[kind].append(ctrl.ratio(kind))
    return ({k: np.array(v) for k, v in ema.items()}, {k: np.array(v) for k, v in ratio.items()})


def test_controller_holds_half_on_drifting_population():
    warmup = 80
    ema, ratio = simulate()
    for kind in ema:
        band = ema[kind][warmup:]
        assert np.all(np.abs(band - 0.5) <= 0.05), (kind, band.min(), band.max())
        changes = np.flatnonzero(np.diff(ratio[kind]) != 0) + 1
        assert np.allclose(np.abs(np.diff(ratio[kind])[changes - 1]), 0.05)
        assert np.all(np.diff(changes) >= 6)      # cooldown 5: at most one move per window
        assert ratio[kind][-1] > ratio[kind][warmup] + 0.2   # it tracked the improvement


def test_controller_state_round_trip_exact():
    c = AdaptiveController(ps_config(adaptive=True, ema_init=None))
    for rate in (0.9, 0.8, None, 0.1):
        c.update({"too_hard": rate, "too_easy": 0.3})
    state = json.loads(json.dumps(c.state_dict()))
    c2 = AdaptiveController(ps_config(adaptive=True, ema_init=None))
    c2.load_state_dict(state)
    assert c2.state_dict() == c.state_dict()
    for rate in (0.7, 0.2, 0.9):
        c.update({"too_hard": rate, "too_easy": rate})
        c2.update({"too_hard": rate, "too_easy": rate})
    assert c2.state_dict() == c.state_dict()


def test_fixed_ratios_come_from_the_config_on_resume(caplog):
    old = AdaptiveController(ps_config(remaining_ratio=0.25, prefix_ratio=0.25))
    old.update({"too_hard": 1.0, "too_easy": None})
    state = json.loads(json.dumps(old.state_dict()))
    fixed = AdaptiveController(ps_config(remaining_ratio=0.75, prefix_ratio=0.25))
    with caplog.at_level("WARNING", logger="rl.prefix"):
        fixed.load_state_dict(state)
    assert fixed.ratio("too_hard") == 0.75 and fixed.ratio("too_easy") == 0.25
    assert fixed.ema("too_hard") == old.ema("too_hard")      # the EMA is still state
    assert "configured" in caplog.text
    adaptive = AdaptiveController(ps_config(remaining_ratio=0.75, adaptive=True))
    adaptive.load_state_dict(state)
    assert adaptive.ratio("too_hard") == 0.25                # learned: the controller's own
    # e.g. a warm start's
    untouched = AdaptiveController(ps_config(remaining_ratio=0.25)).state_dict()
    adaptive = AdaptiveController(ps_config(remaining_ratio=0.75, adaptive=True))
    adaptive.load_state_dict(untouched)
    assert adaptive.ratio("too_hard") == 0.75


# ---------------------------------------------------------------- replay through the algorithm


def test_unrestorable_prefix_is_an_env_error_and_reexec_replays_it(caplog):
    """Two GRPO + Prefix Sampling collect steps whose queue holds a prefix task of an
    expert demonstration with an unappliable recorded patch, run for real (a tiny random
    Qwen3 behind the embedded engine, local sandboxes, mini-SWE tasks): with
    ps.replay="patch" its rollouts are env errors and the step goes on; with "reexec"
    the patch is never applied, the prefix's tool calls run again, and give the recorded
    observations (the demonstration's calls, cut at 16 tokens, do not parse: they are
    replayed as written)."""
    import asyncio
    import dataclasses

    from flax import nnx

    from env import miniswe, sandbox
    from env.sandbox.pool import SandboxPool
    from inference.embedded import EmbeddedEngine
    from models.qwen3 import Qwen3, Qwen3Config
    from models.tokenizer import train_bpe
    from rl import algos, sft
    from rl.rollout import Agent
    from tests.owners import algo_config, engine_options, env_config, rollout_config

    tasks = miniswe.generate_tasks(3, seed=11, difficulties=(1,))
    tokenizer = train_bpe(sft.tokenizer_corpus(tasks), 600)
    model = Qwen3(Qwen3Config(vocab_size=640, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16),
                  rngs=nnx.Rngs(0))
    cfg = rollout_config(max_steps=4, max_turn_tokens=16, max_response_tokens=1000,
                         max_context=2048, test_timeout_s=30.0, env_retries=0, temperature=1.0)
    engine = EmbeddedEngine(model, engine_options(max_batch=8, max_len=2048), seed=0)
    factory = sandbox.from_config(env_config(backend="local", image="",
                                             local_allow_unisolated=False, local_read_only=()))
    agent = Agent(engine, tokenizer, SandboxPool(factory, 4), cfg, tools_in_prompt=False)

    def algorithm(replay):
        config = algo_config(batch_tasks=2, group_size=2, ps={"replay": replay})
        return algos.GRPOPrefix(algos.Context(config, agent, tasks, score=None))

    async def run():
        try:
            source = await agent.demonstrate(
                tasks[0], sft.expert_actions_text(miniswe.expert_demo(tasks[0])))
            ptask = make_prefix_task(source, 2, "too_hard", step=0)
            # The diff restore applies: that of the last replayed turn.
            bad = "--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"
            ptask.turns[-1] = dataclasses.replace(ptask.turns[-1], patch=bad)
            out = {}
            for replay in ("patch", "reexec"):
                algo = algorithm(replay)
                algo.queue.push([ptask])
                groups = await algo.collect(1)
                out[replay] = groups, algo.advantages(1, groups)
            return out
        finally:
            agent.close()
            engine.close()

    with caplog.at_level(logging.WARNING, logger="rl.rollout"):
        out = asyncio.run(run())
    assert "re-executed observations differ" not in caplog.text
    (prefixed, fresh), (kept, advs, metrics) = out["patch"]
    assert all(t.is_env_error and t.reward is None for t in prefixed)
    assert all(not t.is_env_error for t in fresh)
    assert metrics["ps/unscored"] == 1 and len(kept) == len(advs)
    (prefixed, _), _ = out["reexec"]
    assert all(not t.is_env_error and t.prefix is not None for t in prefixed)
    assert all(t.turns[0].replayed and t.turns[1].replayed for t in prefixed)
    from configs import common, default  # (the choices' one home: configs.common.CHOICES)

    with pytest.raises(ValueError, match="ps.replay='redo'"):
        common.check_values(common.apply_overrides(default.get_config(), {"ps.replay": "redo"}))
