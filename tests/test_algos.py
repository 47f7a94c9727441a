"""rl.algos: SPO's step order (value before the update, D after it), its offline start in
both forms, duplicates, and a differential test against a port of the official
trainer's tracker logic (tests/spo_official.py) on random sequences; GRPO + Prefix
Sampling's host state round trip."""

import asyncio
import json

import numpy as np
import pytest

from env.tasks import Task
from rl import algos
from rl.tracker import load_offline_values, policy_drift, rho_from_drift
from rl.types import Trajectory, Turn
from tests.owners import algo_config
from tests.spo_official import OfficialSPO

POOL = [f"task{i}" for i in range(10)]


def _tasks(ids=POOL):
    return [Task(instance_id=i, problem_statement=f"fix {i}") for i in ids]


def _config(batch_tasks=6, **spo_overrides):
    return algo_config(name="spo", batch_tasks=batch_tasks, group_size=1, spo=spo_overrides)


def policy_logp(version: int, ids, mask) -> np.ndarray:
    """A synthetic policy: a fixed log-prob per token stream, moved by a version-dependent
    amount (0.2% to 2.2% of a nat) so that rho lands on both sides of its clip."""
    ids = np.asarray(ids, np.int64)
    key = int((ids * np.arange(1, ids.size + 1)).sum() % (1 << 31))
    base = -np.random.default_rng([key, ids.size]).uniform(0.1, 3.0, ids.size)
    scale = 0.002 + 0.02 * np.random.default_rng([version, 7]).random()
    noise = np.random.default_rng([version, key]).normal(0.0, scale, ids.size)
    return np.where(np.asarray(mask, bool), base + noise, 0.0)


def score(version, seqs):
    """rl.learner.make_score's contract, float32 like the logprob kernel's output."""
    return [policy_logp(version, ids, mask).astype(np.float32) for ids, mask in seqs]


def _traj(task_id, reward, rng):
    """One response: 1-3 turns of random observation and action ids."""
    turns = [Turn(list(rng.integers(0, 500, rng.integers(1, 6))),
                  list(rng.integers(0, 500, k)), [0.0] * k)
             for k in rng.integers(1, 8, rng.integers(1, 4))]
    return Trajectory(task_id=task_id, uid=str(rng.integers(1 << 30)), turns=turns,
                      reward=float(reward))


def _algo(tmp_path=None, values=None, start=True, **spo_overrides):
    if values is not None:
        path = tmp_path / "values.jsonl"
        path.write_text("".join(json.dumps({"task_id": t, "successes": int(s), "n": int(n)})
                                + "\n" for t, (s, n) in values.items()))
        spo_overrides["init_values"] = str(path)
    ctx = algos.Context(_config(**spo_overrides), agent=None, train_tasks=_tasks(), score=score)
    algo = algos.build(ctx)
    if start and not algo.started:
        asyncio.run(algo.start())
    return algo


def _step(algo, groups, version):
    kept, adv, _ = algo.advantages(version, groups)
    metrics = asyncio.run(algo.after_update(version, version))
    return kept, adv, metrics


def test_order_value_before_update_drift_after_it():
    algo = _algo(prior=(1.0, 1.0))
    rng = np.random.default_rng(0)
    first = _traj("task0", 1, rng)
    _, adv, m = _step(algo, [[first], [_traj("task1", 0, rng)]], version=1)
    assert adv.tolist() == pytest.approx([np.sqrt(0.5), -np.sqrt(0.5)])  # ddof 1
    assert m["spo/drift_mean"] == 0.0 and m["spo/rho_mean"] == 0.96  # first visits
    assert m["spo/first_visit_frac"] == 1.0
    alpha1 = 0.96 * 1.0 + 1.0
    assert algo.tracker.values(["task0"])[0] == alpha1 / (alpha1 + 0.96)
    # Revisited at the next step: the advantage uses the value after step 1, and D
    # compares the stored response under the policy after step 1 with the policy after
    # step 2 (measured before the update, D would be 0 here).
    second = _traj("task0", 0, rng)
    v_before = algo.tracker.values(["task0", "task2"])
    _, adv, m = _step(algo, [[second], [_traj("task2", 1, rng)]], version=2)
    a = np.array([0.0, 1.0]) - v_before
    assert adv.tolist() == pytest.approx(((a - a.mean()) / a.std(ddof=1)).tolist())
    ids, mask, _ = first.token_arrays()
    D = policy_drift(*score(1, [(ids, mask)]), *score(2, [(ids, mask)]), mask)
    assert D > 0 and m["spo/drift_mean"] == D / 2 and m["spo/first_visit_frac"] == 0.5
    rho = rho_from_drift([D])[0]
    assert algo.tracker.alpha[0] == pytest.approx(rho * alpha1, rel=1e-12)
    # ...and the stored response is now the second one, scored after step 2.
    stored = algo.tracker.pending_d_requests(["task0"])["task0"]
    ids2, mask2, _ = second.token_arrays()
    assert stored.ids.tolist() == ids2.tolist()
    assert stored.logp.tolist() == score(2, [(ids2, mask2)])[0].tolist()


def test_drift_over_the_whole_response_includes_tool_outputs():
    """spo.drift_tokens="response": the stored window and D cover every token after the
    prompt (built here from the turns), tool outputs included; the batch's
    Var(r - v) / Var(r) is logged beside."""
    algo = _algo(prior=(1.0, 1.0), drift_tokens="response")
    rng = np.random.default_rng(1)
    first = _traj("task0", 1, rng)
    # r = (1, 0), v = (0.5, 0.5) at the prior: r - v = (0.5, -0.5), Var 0.25 / 0.25.
    _, _, m = algo.advantages(1, [[first], [_traj("task1", 0, rng)]])
    assert m["spo/residual_var_ratio"] == 1.0
    asyncio.run(algo.after_update(1, 1))
    third = [[_traj("task0", 1, rng)], [_traj("task3", 1, rng)], [_traj("task4", 0, rng)]]
    v = algo.tracker.values(["task0", "task3", "task4"])
    r = np.array([1.0, 1.0, 0.0])
    assert algo.advantages(2, third)[2]["spo/residual_var_ratio"] == pytest.approx(
        np.var(r - v) / np.var(r))
    algo = _algo(prior=(1.0, 1.0), drift_tokens="response")
    _step(algo, [[first], [_traj("task1", 0, rng)]], version=1)
    ids, loss_mask, _ = first.token_arrays()
    response = np.array([i >= len(first.turns[0].obs_ids) for i in range(len(ids))])
    assert (response & ~loss_mask.astype(bool)).any()   # tool outputs in the window
    assert algo.tracker.pending_d_requests(["task0"])["task0"].mask.tolist() == response.tolist()
    _, _, m = _step(algo, [[_traj("task0", 0, rng)], [_traj("task2", 1, rng)]], version=2)
    D = policy_drift(*score(1, [(ids, response)]), *score(2, [(ids, response)]), response)
    assert m["spo/drift_mean"] == pytest.approx(D / 2, rel=1e-12)


def test_spo_starts_fresh_from_a_grpo_warm_start_but_not_from_a_later_step():
    grpo = algos.GRPOPrefix(algos.Context(_grpo_config(), None, _tasks(), score=None))
    algo = _algo(start=False, init_samples=2)
    algo.load_state_dict({"step": 0, **grpo.state_dict()})
    assert not algo.started and len(algo.tracker) == 0
    with pytest.raises(ValueError, match="step 3 holds no SPO state"):
        algo.load_state_dict({"step": 3, **grpo.state_dict()})


def test_jobs_drawn_ahead_round_trip_and_an_older_checkpoint_draws_on_from_its_step():
    """The jobs drawn and not started are host state (a resume runs them first); a
    checkpoint written before SPO kept them resumes drawing after its step's chunks; one
    with another process count's jobs is refused."""
    a = _algo(prior=(1.0, 1.0))
    a._chunks, a._local = 2, a._draw() + a._draw()
    state = json.loads(json.dumps({"step": 1, **a.state_dict()}, default=lambda x: x.tolist()))
    b = _algo(prior=(1.0, 1.0))
    b.load_state_dict({**state, "tracker": a.tracker.state_dict()})
    assert b._chunks == 2 and b._local == [] and b._drawn == a._drawn
    assert [(j.task.instance_id, j.seed) for j in b._resumed] == [
        (j.task.instance_id, j.seed) for j in a._local]
    assert b._order == a._order and sorted(a._order.values()) == list(range(a._drawn))
    del state["ahead"]
    b.load_state_dict({**state, "step": 5, "tracker": a.tracker.state_dict()})
    assert b._chunks == 5 and b._resumed == [] and b._order == {}
    with pytest.raises(ValueError, match="resume it with as many"):
        b.load_state_dict({**state, "tracker": a.tracker.state_dict(),
                           "ahead": {"chunks": 2, "drawn": 8, "order": [], "jobs": [{}, {}]}})


def _grpo_config():
    return algo_config(batch_tasks=2, group_size=2)


@pytest.mark.parametrize("form", ["paper", "reference"])
def test_offline_start_from_a_values_file(tmp_path, form):
    values = {"task0": (2, 8), "task1": (0, 4), "task2": (3, 3), "nope": (1, 2)}
    algo = _algo(tmp_path, values, init_form=form)
    assert algo.started and len(algo.tracker) == 3          # "nope" is no training task
    a, b = algo.tracker.alpha[:3], algo.tracker.beta[:3]
    if form == "paper":                                     # N0 = 8: alpha0 = 8 s / n
        assert a.tolist() == [2.0, 0.0, 8.0] and b.tolist() == [6.0, 8.0, 0.0]
    else:                                                   # alpha0 = 8 (s + 1/2) / (n + 1)
        assert a.tolist() == pytest.approx([8 * 2.5 / 9, 8 * 0.5 / 5, 8 * 3.5 / 4])
        assert b.tolist() == pytest.approx([8 * 6.5 / 9, 8 * 4.5 / 5, 8 * 0.5 / 4])
    # unseen="skip" draws only prompts with an offline value (the official behaviour).
    skip = _algo(tmp_path, values, unseen="skip")
    assert {j.task.instance_id for _ in range(10) for j in skip._draw()} <= {
        "task0", "task1", "task2"}


def test_values_file_errors_name_the_line(tmp_path):
    path = tmp_path / "v.jsonl"
    path.write_text('{"task_id": "a", "successes": 1, "n": 2}\n{"task_id": "b", "n": 2}\n')
    with pytest.raises(ValueError, match=r"v.jsonl:2"):
        load_offline_values(str(path))
    path.write_text('{"task_id": "a", "successes": 3, "n": 2}\n')
    with pytest.raises(ValueError, match=r"v.jsonl:1.*successes <= n"):
        load_offline_values(str(path))


def test_duplicates_sequential_and_last():
    rng = np.random.default_rng(1)
    batch = [[_traj("task0", r, rng)] for r in (1, 0, 1)] + [[_traj("task1", 0, rng)]]
    for mode in ("sequential", "last"):
        algo = _algo(prior=(2.0, 2.0), duplicates=mode, rho_type="constant", rho_min=0.5)
        _step(algo, batch, version=1)
        if mode == "sequential":   # (2,2) -1-> (2,1) -0-> (1,1.5) -1-> (1.5,0.75)
            assert (algo.tracker.alpha[0], algo.tracker.beta[0]) == (1.5, 0.75)
        else:                      # each from (2,2), the last write wins: r = 1
            assert (algo.tracker.alpha[0], algo.tracker.beta[0]) == (2.0, 1.0)
        assert (algo.tracker.alpha[1], algo.tracker.beta[1]) == (1.0, 2.0)


@pytest.mark.parametrize("offline_n", [0, 8])
@pytest.mark.parametrize("masked_mean_eps", [0.0, 1e-8])
def test_agrees_with_the_official_tracker_on_random_sequences(tmp_path, offline_n,
                                                              masked_mean_eps):
    """Where the project follows the official code (duplicates="last", unbiased std,
    Beta(0.5, 0.5) without offline values, the "+0.5" offline form), every advantage,
    D and (alpha, beta) agree to 1e-9 over 40 random steps with duplicates. verl's
    masked_mean adds 1e-8 to the token count, which moves D by up to 1e-8 of itself;
    with it they agree to 1e-8 (advantages and D absolute, alpha and beta relative)."""
    tol = 1e-9 if masked_mean_eps == 0 else 1e-8
    rng = np.random.default_rng(offline_n)
    scores = {t: list(rng.integers(0, 2, offline_n)) for t in POOL}
    official = OfficialSPO(scores, offline_n, masked_mean_eps=masked_mean_eps)
    kw = dict(duplicates="last", adv_std_ddof=1, init_form="reference", unseen="skip")
    if offline_n:
        ours = _algo(tmp_path, {t: (sum(s), offline_n) for t, s in scores.items()}, **kw)
    else:
        ours = _algo(prior=(0.5, 0.5), **kw)
    drifts = []
    for version in range(1, 41):
        prompts = [POOL[i] for i in rng.integers(0, len(POOL), 6)]
        rewards = rng.integers(0, 2, 6)
        if rewards.min() == rewards.max():
            rewards[0] = 1 - rewards[0]
        trajs = [_traj(p, r, rng) for p, r in zip(prompts, rewards, strict=True)]
        responses = [tuple(a.tolist() for a in t.token_arrays()[:2]) for t in trajs]
        want_adv = official.advantages(prompts, rewards.tolist())
        D, _ = official.after_update(prompts, rewards.tolist(), responses,
                                     lambda ids, mask, v=version: score(v, [(ids, mask)])[0]
                                     .tolist())
        drifts += D
        _, adv, m = _step(ours, [[t] for t in trajs], version)
        assert adv.tolist() == pytest.approx(want_adv, abs=tol, rel=0)     # O(1) values
        assert m["spo/drift_mean"] == pytest.approx(np.mean(D), abs=tol, rel=0)
        rows = ours.tracker.rows(POOL)
        assert ours.tracker.alpha[rows].tolist() == pytest.approx(
            [official.alpha[t] for t in POOL], rel=tol, abs=1e-12)
        assert ours.tracker.beta[rows].tolist() == pytest.approx(
            [official.beta[t] for t in POOL], rel=tol, abs=1e-12)
    rho = rho_from_drift(drifts)
    assert (rho == 0.96).any() and (rho == 0.875).any() and ((rho > 0.875) & (rho < 0.96)).any()
    assert [ours.sampler.weights([t])[0] for t in POOL] == pytest.approx(
        [official.weight(t) for t in POOL], rel=tol, abs=1e-12)


def test_state_round_trip_continues_identically(tmp_path):
    rng = np.random.default_rng(3)
    a = _algo(tmp_path, {t: (1, 4) for t in POOL})
    _step(a, [[_traj(t, 1, rng)] for t in POOL[:4]], version=1)
    state = json.loads(json.dumps(a.state_dict(), default=lambda x: x.tolist()))
    b = _algo(prior=(3.0, 1.0), init_samples=2, start=False)  # then the state
    assert not b.started
    b.load_state_dict({**state, "tracker": a.tracker.state_dict()})
    assert b.started
    batch = [[_traj(t, r, rng)] for t, r in zip(POOL[2:7], (1, 0, 0, 1, 0), strict=True)]
    _, adv_a, _ = _step(a, batch, 2)
    _, adv_b, _ = _step(b, batch, 2)
    assert adv_a.tolist() == adv_b.tolist()
    assert a.tracker.values(POOL).tolist() == b.tracker.values(POOL).tolist()
    assert [(j.task.instance_id, j.seed) for _ in (1, 2) for j in a._draw()] == [
        (j.task.instance_id, j.seed) for _ in (1, 2) for j in b._draw()]
