"""SPO tracker, advantages and sampler against seed 002's worked numbers and plain loops."""

import dataclasses
import json
import math

import numpy as np
import pytest

from configs import common
from rl.tracker import (
    MAX_OFFLINE_N,
    BetaTracker,
    OfflineValuesError,
    PrioritizedSampler,
    SPOConfig,
    drift_mask,
    load_offline_values,
    offline_prior,
    policy_drift,
    rho_from_drift,
    spo_advantages,
)


def spo_config(**changes) -> SPOConfig:
    """The `spo` section's defaults with `changes`."""
    return dataclasses.replace(SPOConfig(**common.spo_defaults()), **changes)


def seed_values(successes, d_over_dhalf, rewards):
    """Seed 002 protocol: n0 = 8 offline samples, constant D, v read after each update."""
    tracker = BetaTracker(spo_config())
    tracker.init_offline(["p"], [successes], n0=8, form="paper")
    out = []
    for r in rewards:
        rho = tracker.update(["p"], [r], D=[d_over_dhalf * 0.06])
        assert rho[0] == 0.875            # 2**-1 and 2**-2 both clip up to rho_min
        out.append(tracker.values(["p"])[0])
    return out


def test_seed_group_a():
    # alpha0 = beta0 = 4; exact binary fractions of the seed's 0.5625, 0.492188, 0.555664
    assert seed_values(4, 1.0, [1, 0, 1]) == [0.5625, 0.4921875, 0.5556640625]


def test_seed_group_b():
    # alpha0 = 2, beta0 = 6; the seed's 0.34375, 0.425781, 0.372559
    assert seed_values(2, 2.0, [1, 1, 0]) == [0.34375, 0.42578125, 0.37255859375]


def test_offline_prior_forms():
    a, b = offline_prior([0, 2, 8], n0=8, rho_min=0.875, form="paper")
    assert a.tolist() == [0.0, 2.0, 8.0] and b.tolist() == [8.0, 6.0, 0.0]
    a, b = offline_prior([2], n0=8, rho_min=0.875, form="reference")
    assert a[0] == pytest.approx(8 * 2.5 / 9) and b[0] == pytest.approx(8 * 6.5 / 9)
    assert offline_prior([1], n0=4, rho_min=0.5, form="paper")[0][0] == 0.5        # N0 = 2
    with pytest.raises(ValueError, match="successes"):
        offline_prior([9], n0=8, rho_min=0.875, form="paper")
    with pytest.raises(ValueError, match="form"):
        offline_prior([1], n0=8, rho_min=0.875, form="half")


def loop_update(state, ids, rewards, rhos):
    """The plain per-sample rule on a dict: state[id] = [alpha, beta]."""
    for t, r, rho in zip(ids, rewards, rhos, strict=True):
        a, b = state.setdefault(t, [1.0, 1.0])
        state[t] = [rho * a + r, rho * b + (1.0 - r)]


def test_vectorised_update_equals_sequential_loop():
    rng = np.random.default_rng(0)
    pool = [f"task{i}" for i in range(40)]
    tracker = BetaTracker(spo_config(), capacity=4)
    tracker.init_offline(pool[:10], rng.integers(0, 9, 10), n0=8, form="paper")
    ref = {t: [tracker.alpha[i], tracker.beta[i]] for i, t in enumerate(pool[:10])}
    for _ in range(30):
        ids = [pool[i] for i in rng.integers(0, len(pool), rng.integers(1, 64))]
        rewards = rng.integers(0, 2, len(ids))
        D = rng.exponential(0.05, len(ids))
        rho = tracker.update(ids, rewards, D=D)
        loop_update(ref, ids, rewards.astype(float), rho.tolist())
    assert len(tracker) == len(ref)
    got = {t: [tracker.alpha[r], tracker.beta[r]] for t, r in zip(
        ref, tracker.rows(list(ref)), strict=True)}
    assert got == ref                                 # bit-exact, duplicates included
    v = tracker.values(list(ref))
    assert v.tolist() == [a / (a + b) for a, b in ref.values()]


def test_constant_rho_is_rho_min_and_the_prior_a_float_pair():
    cfg = spo_config(rho_type="constant", rho_min=0.7, rho_max=0.9, prior=[1, 3])
    assert cfg.prior == (1.0, 3.0) and all(type(x) is float for x in cfg.prior)
    tracker = BetaTracker(cfg)
    assert tracker.rho(np.array([0.0, 5.0])).tolist() == [0.7, 0.7]
    assert tracker.update(["a"], [1]).tolist() == [0.7]
    assert (tracker.alpha[0], tracker.beta[0]) == (0.7 * 1.0 + 1, 0.7 * 3.0)


def test_duplicates_in_one_batch_apply_in_order():
    tracker = BetaTracker(spo_config(rho_type="constant", rho_min=0.5, prior=(2.0, 2.0)))
    tracker.update(["a", "b", "a", "a"], [1, 0, 0, 1])
    # a: (2,2) -r1-> (2,1) -r0-> (1,1.5) -r1-> (1.5,0.75)
    assert tracker.alpha[0] == 1.5 and tracker.beta[0] == 0.75
    assert tracker.alpha[1] == 1.0 and tracker.beta[1] == 2.0
    tracker.update(["c"], [1], rho=0.25)
    assert tracker.alpha[2] == 1.5 and tracker.beta[2] == 0.5


def test_rho_from_drift_hand_values():
    D = np.array([0.0, 0.003, 0.005, 0.03, 0.06, 0.12, 10.0])
    rho = rho_from_drift(D)
    assert rho[0] == 0.96 and rho[1] == 0.96          # 2**-0.05 = 0.9659 > rho_max
    assert rho[2] == pytest.approx(2 ** (-1 / 12)) == pytest.approx(0.9438743126816935)
    assert rho[3:].tolist() == [0.875] * 4             # 2**-0.5 = 0.707 < rho_min
    assert rho_from_drift([0.03], rho_min=0.5)[0] == pytest.approx(math.sqrt(0.5))


def test_policy_drift_hand_values():
    assert policy_drift([-1.0, -2.0, -3.0], [-1.5, -2.0, -2.0], [1, 1, 0]) == 0.25
    assert policy_drift([-1.0], [-2.0], [0]) == 0.0
    with pytest.raises(ValueError, match="one shape"):
        policy_drift([-1.0, 0.0], [-1.0], [1, 1])


def test_drift_mask_generated_or_whole_response():
    """A 3-turn episode (prompt, then tool outputs between the policy's turns): the
    "generated" mask is the loss mask; "response" marks every token after the prompt,
    built here turn by turn, and D over it includes the tool outputs' drift."""
    from rl.types import Trajectory, Turn

    turns = [Turn(obs_ids=[1] * 5 if i == 0 else [2] * 3, action_ids=[3] * (2 + i),
                  action_logprobs=[-1.0] * (2 + i)) for i in range(3)]
    traj = Trajectory(task_id="t", uid="u", turns=turns, reward=1.0, status="finished")
    ids, loss_mask, _ = traj.token_arrays()
    expected = []
    for i, t in enumerate(turns):
        expected += [i > 0] * len(t.obs_ids) + [True] * len(t.action_ids)
    got = drift_mask(loss_mask, len(turns[0].obs_ids), "response")
    assert got.tolist() == expected and got.dtype == bool
    assert drift_mask(loss_mask, 5, "generated").tolist() == [bool(m) for m in loss_mask]
    # Drift on the tool outputs only: invisible to "generated", seen by "response".
    then = np.zeros(len(ids))
    now = np.where(np.array(expected) & ~loss_mask.astype(bool), 0.4, 0.0)
    assert policy_drift(then, now, drift_mask(loss_mask, 5, "generated")) == 0.0
    assert policy_drift(then, now, got) == pytest.approx(0.4 * 6 / 15)
    with pytest.raises(ValueError, match="drift tokens"):
        drift_mask(loss_mask, 5, "all")


def test_drift_requests_and_store_flow():
    tracker = BetaTracker(spo_config())
    assert tracker.drift(["x"], {}).tolist() == [0.0]  # first visit
    rho = tracker.update(["x"], [1], D=tracker.drift(["x"], {}))
    assert rho.tolist() == [0.96]
    assert tracker.alpha[0] == 0.96 + 1 and tracker.beta[0] == 0.96
    with pytest.raises(KeyError, match="before any update"):
        tracker.store_response("y", [1], [-1.0])
    with pytest.raises(ValueError, match="equal 1-D"):
        tracker.store_response("x", np.arange(6), np.zeros(5))
    tracker.store_response("x", [5, 6, 7], [-1.0, -2.0, -3.0], mask=[0, 1, 1])
    reqs = tracker.pending_d_requests(["x", "y", "x"])
    assert list(reqs) == ["x"] and reqs["x"].ids.tolist() == [5, 6, 7]
    D = tracker.drift(["x", "y", "x"], {"x": [-9.0, -2.06, -3.06]})
    assert D.tolist() == pytest.approx([0.06, 0.0, 0.06])
    assert tracker.rho(D).tolist() == [0.875, 0.96, 0.875]
    with pytest.raises(KeyError, match="no logp_now"):
        tracker.drift(["x"], {})
    with pytest.raises(ValueError, match="needs D"):
        tracker.update(["x"], [1])
    with pytest.raises(ValueError, match="0 or 1"):
        tracker.update(["x"], [0.5], D=[0.0])


def test_values_of_unknown_ids_use_prior_and_do_not_insert():
    tracker = BetaTracker(spo_config(prior=(1.0, 3.0)))
    assert tracker.values(["new"]).tolist() == [0.25] and "new" not in tracker
    with pytest.raises(TypeError, match="str"):
        tracker.update([3], [1], D=[0.0])


def test_spo_advantages_hand_values():
    r, v = [1, 0, 1, 1], [0.5, 0.5, 0.25, 0.9]
    a = [0.5, -0.5, 0.75, 0.1]
    mean = sum(a) / 4
    for ddof in (0, 1):  # population std, and torch's unbiased one (the default)
        std = math.sqrt(sum((x - mean) ** 2 for x in a) / (4 - ddof))
        out = spo_advantages(r, v, ddof=ddof)
        assert out == pytest.approx([(x - mean) / (std + 1e-8) for x in a], rel=1e-12)
        assert out.mean() == pytest.approx(0, abs=1e-12)
        assert out.std(ddof=ddof) == pytest.approx(1, abs=1e-7)
    assert spo_advantages(r, v).tolist() == spo_advantages(r, v, ddof=1).tolist()
    assert spo_advantages([1, 1], [0.3, 0.3]).tolist() == [0.0, 0.0]
    assert spo_advantages([1], [0.3]).tolist() == [0.0]  # one sample: no spread to measure


def test_sampler_weights_and_frequencies():
    tracker = BetaTracker(spo_config())
    pool = ["a", "b", "c", "d"]
    tracker.init_offline(pool, [4, 2, 6, 0], n0=8, form="paper")    # v = 0.5, 0.25, 0.75, 0
    sampler = PrioritizedSampler(tracker, seed=0, replace=True)
    w = sampler.weights(pool)
    q = math.sqrt(0.25 * 0.75) + 0.05
    assert w == pytest.approx([0.55, q, q, 0.05])
    draws = sampler.sample(pool, 40000)
    freq = [draws.count(t) / len(draws) for t in pool]
    assert freq == pytest.approx((w / w.sum()).tolist(), abs=0.01)


def test_sampler_without_replacement():
    tracker = BetaTracker(spo_config())
    pool = ["a", "b", "c", "d"]
    tracker.init_offline(pool, [4, 2, 6, 0], n0=8, form="paper")
    sampler = PrioritizedSampler(tracker, seed=1)
    w = sampler.weights(pool)
    firsts = []
    for _ in range(20000):
        batch = sampler.sample(pool, 3)
        assert len(set(batch)) == 3
        firsts.append(batch[0])
    freq = [firsts.count(t) / len(firsts) for t in pool]
    assert freq == pytest.approx((w / w.sum()).tolist(), abs=0.01)
    assert sorted(sampler.sample(pool, 4)) == pool
    with pytest.raises(ValueError, match="distinct"):
        sampler.sample(pool, 5)


def test_sampler_state_round_trip():
    tracker = BetaTracker(spo_config())
    pool = [f"t{i}" for i in range(50)]
    s1 = PrioritizedSampler(tracker, seed=3)
    s1.sample(pool, 8)
    state = json.loads(json.dumps(s1.state_dict()))
    s2 = PrioritizedSampler(tracker, seed=99)
    s2.load_state_dict(state)
    assert s1.sample(pool, 8) == s2.sample(pool, 8)


def test_tracker_state_round_trip_exact():
    rng = np.random.default_rng(2)
    tracker = BetaTracker(spo_config(), capacity=2)
    pool = [f"t{i}" for i in range(9)]
    tracker.update(pool, rng.integers(0, 2, 9), D=rng.exponential(0.05, 9))
    assert tracker.alpha.size == 16                   # 2 -> 4 -> 8 -> 16
    tracker.store_response("t3", [1, 2, 3], [-0.1, -0.2, -0.3], [0, 1, 1])
    tracker.store_response("t7", [4], [-0.4])
    state = tracker.state_dict()
    json.dumps(state["task_ids"])
    other = BetaTracker(spo_config())
    other.load_state_dict(state)
    s2 = other.state_dict()
    assert state.keys() == s2.keys()
    for k in state:
        assert np.array_equal(state[k], s2[k]) and np.asarray(state[k]).dtype == np.asarray(
            s2[k]).dtype, k
    ids = pool + ["new"]
    rewards, D = rng.integers(0, 2, 10), rng.exponential(0.05, 10)
    tracker.update(ids, rewards, D=D)
    other.update(ids, rewards, D=D)
    assert tracker.values(ids).tolist() == other.values(ids).tolist()
    assert other.pending_d_requests(["t3"])["t3"].logp.tolist() == pytest.approx(
        [-0.1, -0.2, -0.3])


GOOD_ROW = '{"task_id": "a", "successes": 1, "n": 2}'


@pytest.mark.parametrize("line, message", [
    ('{"task_id": "b", "successes": "abc", "n": 2}',
     "field 'successes' must be an integer count, got 'abc'"),
    ('{"task_id": "b", "successes": null, "n": 2}',
     "field 'successes' must be an integer count, got None"),
    ('{"task_id": "b", "successes": NaN, "n": 2}',
     "field 'successes' must be an integer count, got 'NaN'"),
    ('{"task_id": "b", "successes": 1, "n": Infinity}',
     "field 'n' must be an integer count, got 'Infinity'"),
    ('{"task_id": "b", "successes": 1, "n": 1e30}',
     "field 'n' must be an integer count, got 1e+30"),
    ('{"task_id": "b", "successes": 1.7, "n": 3.9}',
     "field 'successes' must be an integer count, got 1.7"),
    ('{"task_id": "b", "successes": 1, "n": 3.9}', "field 'n' must be an integer count, got 3.9"),
    ('{"task_id": "b", "successes": "3", "n": 4}',
     "field 'successes' must be an integer count, got '3'"),
    ('{"task_id": "b", "successes": true, "n": 4}',
     "field 'successes' must be an integer count, got True"),
    ('{"task_id": "", "successes": 1, "n": 4}',
     "field 'task_id' must be a non-empty string, got ''"),
    ('{"task_id": 7, "successes": 1, "n": 4}', "field 'task_id' must be a non-empty string"),
    ('{"task_id": "b", "successes": 1, "n": 1000000000000000}',
     f"field 'n' must be in [1, {MAX_OFFLINE_N}], got 1000000000000000"),
    ('{"task_id": "b", "successes": 0, "n": 0}', "field 'n' must be in [1, "),
    ('{"task_id": "b", "successes": 5, "n": 4}',
     "field 'successes' must satisfy 0 <= successes <= n (n = 4), got 5"),
    ('{"task_id": "b", "n": 4}', "missing field 'successes'"),
    ('[1, 2]', "a row must be a JSON object"),
    ('{"task_id": "b",', "invalid JSON"),
    (GOOD_ROW, "field 'task_id' 'a' repeats line 1"),
])
def test_offline_values_errors_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "values.jsonl"
    path.write_text(GOOD_ROW + "\n\n" + line + "\n")
    with pytest.raises(OfflineValuesError) as err:
        load_offline_values(str(path))
    assert str(err.value).startswith(f"{path}:3: {message}")


def test_offline_values_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "values.jsonl"
    path.write_bytes(GOOD_ROW.encode() + b'\n{"task_id": "\xc3(", "successes": 0, "n": 1}\n')
    with pytest.raises(OfflineValuesError, match=f"{path}:2: not UTF-8 text"):
        load_offline_values(str(path))


def test_offline_values_read_exactly(tmp_path):
    path = tmp_path / "values.jsonl"
    path.write_text(GOOD_ROW + '\n{"task_id": "b", "successes": 0, "n": 1000000}\n')
    ids, s, n = load_offline_values(str(path))
    assert ids == ["a", "b"] and s.tolist() == [1, 0] and n.tolist() == [2, 1_000_000]
