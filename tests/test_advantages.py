import numpy as np
import pytest

from rl import advantages
from rl.types import Trajectory


def _traj(reward, status="finished"):
    return Trajectory(task_id="t", uid=str(np.random.rand()), turns=[], reward=reward,
                      status=status)


def test_grpo_hand_computed():
    # r = (1,0,0,0): mean 0.25, population std sqrt(0.1875) = 0.4330127
    a = advantages.grpo(np.array([1, 0, 0, 0]))
    np.testing.assert_allclose(a, np.array([0.75, -0.25, -0.25, -0.25]) / (0.4330127 + 1e-6),
                               rtol=1e-6)


def test_rloo_is_leave_one_out_mean():
    r = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
    loo = [r[i] - np.mean(np.delete(r, i)) for i in range(len(r))]
    np.testing.assert_allclose(advantages.rloo(r), loo, atol=1e-12)


def test_drgrpo_has_no_std():
    np.testing.assert_allclose(advantages.get("drgrpo")(np.array([1, 0, 0, 1])),
                               [0.5, -0.5, -0.5, 0.5])


def test_unknown_name_is_named():
    with pytest.raises(KeyError, match="nope"):
        advantages.get("nope")


def test_group_rejection_and_env_errors():
    keep = [_traj(1), _traj(0), _traj(None, "env_error"), _traj(0)]
    all_fail = [_traj(0), _traj(0)]
    all_pass_with_error = [_traj(1), _traj(1), _traj(0, "env_error")]
    kept, adv, rejected = advantages.group_advantages(
        [keep, all_fail, all_pass_with_error], "grpo_nostd")
    assert rejected == 2
    assert len(kept) == 3 and all(not t.is_env_error for t in kept)
    np.testing.assert_allclose(adv, [2 / 3, -1 / 3, -1 / 3])
    kept, _, rejected = advantages.group_advantages([all_fail], "grpo",
                                                    reject_degenerate=False)
    assert rejected == 0 and len(kept) == 2
