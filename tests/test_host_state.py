"""Resume restores the host-side state exactly: the Prefix Sampling queue and controller,
the SPO tracker and sampler, the data loader and the run's RNG, through the real Orbax
checkpoint path that train.py uses; restored objects then behave identically."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from configs import common
from rl import prefix
from rl.checkpoint import Checkpointer
from rl.sampler import TaskSampler
from rl.tracker import BetaTracker, PrioritizedSampler, SPOConfig
from rl.types import Trajectory, Turn


def _traj(task_id, reward, steps, rng):
    turns = [Turn(list(rng.integers(0, 500, 7)), list(rng.integers(0, 500, 5)),
                  list(rng.normal(size=5)), tool_call={"name": "execute_bash",
                                                       "arguments": {"command": f"ls {i}"}},
                  observation=f"out {i} \u00e9", patch=f"diff {i}",
                  unpatched=[f"cache{i}/", "x.pyc"][:i % 3]) for i in range(steps)]
    return Trajectory(task_id=task_id, uid=f"{task_id}-{rng.integers(1 << 30)}", turns=turns,
                      reward=reward)


def _objects(seed=0):
    cfg = dataclasses.replace(prefix.PrefixConfig(**common.prefix_defaults()), adaptive=True,
                              max_age=3)
    return (prefix.PrefixQueue(cfg.max_age), prefix.AdaptiveController(cfg),
            BetaTracker(SPOConfig(**common.spo_defaults())),
            TaskSampler([f"t{i}" for i in range(7)], seed),
            np.random.default_rng(seed), cfg)


def _advance(queue, controller, tracker, sampler, rng, cfg, step):
    """One step of everything the trainer does with host state."""
    groups = []
    for task in sampler.next(3):
        rewards = (rng.random(8) < rng.random()).astype(float)
        groups.append([_traj(task, r, 4, rng) for r in rewards])
    ps = prefix.build_prefix_tasks(groups, step, cfg, controller, rng)
    queue.push(ps.tasks)
    taken = queue.take(step + 1, 2, 0.5)
    ids = [g[0].task_id for g in groups] + [groups[0][0].task_id]
    rewards = rng.integers(0, 2, len(ids)).astype(float)
    pending = tracker.pending_d_requests(ids)
    logp_now = {t: r.logp + 0.01 * step for t, r in pending.items()}
    tracker.update(ids, rewards, D=tracker.drift(ids, logp_now))
    for t in ids:
        tracker.store_response(t, rng.integers(0, 500, 12), rng.normal(size=12),
                               rng.random(12) < 0.5)
    return ([(p.task_id, p.k, p.kind) for p in taken], tracker.values(ids).tolist(),
            controller.state_dict())


def _host(queue, controller, tracker, sampler, rng, spo_sampler):
    return {"queue": queue.state_dict(), "controller": controller.state_dict(),
            "tracker": tracker.state_dict(), "sampler": sampler.state_dict(),
            "spo_sampler": spo_sampler.state_dict(), "np_rng": rng.bit_generator.state}


def test_resume_restores_host_state_exactly(tmp_path):
    queue, controller, tracker, sampler, rng, cfg = _objects()
    spo_sampler = PrioritizedSampler(tracker, seed=3)
    for step in range(4):
        _advance(queue, controller, tracker, sampler, rng, cfg, step)
    assert len(queue) > 0 and len(tracker) > 0

    ckpt = Checkpointer(str(tmp_path), keep=1)
    ckpt.save(4, {"w": jnp.arange(3.0)}, _host(queue, controller, tracker, sampler, rng,
                                               spo_sampler))
    ckpt.wait()
    _, host = Checkpointer(str(tmp_path)).restore(4, {"w": jnp.zeros(3)})

    q2, c2, t2, s2, r2, _ = _objects(seed=99)
    sp2 = PrioritizedSampler(t2, seed=99)
    q2.load_state_dict(host["queue"])
    c2.load_state_dict(host["controller"])
    t2.load_state_dict(host["tracker"])
    s2 = TaskSampler([f"t{i}" for i in range(7)], 0)
    s2.load_state_dict(host["sampler"])
    sp2.load_state_dict(host["spo_sampler"])
    r2.bit_generator.state = host["np_rng"]

    assert _equal_states(_host(q2, c2, t2, s2, r2, sp2),
                         _host(queue, controller, tracker, sampler, rng, spo_sampler))
    np.testing.assert_array_equal(t2.alpha[:len(t2)], tracker.alpha[:len(tracker)])
    np.testing.assert_array_equal(t2.beta[:len(t2)], tracker.beta[:len(tracker)])
    pool = [f"t{i}" for i in range(7)]
    assert sp2.sample(pool, 4) == spo_sampler.sample(pool, 4)
    for step in range(4, 8):
        assert (_advance(q2, c2, t2, s2, r2, cfg, step)
                == _advance(queue, controller, tracker, sampler, rng, cfg, step))


def _equal_states(a, b):
    """Deep equality with NumPy arrays compared exactly (dtype and values)."""
    if isinstance(a, dict):
        assert set(a) == set(b)
        return all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        assert len(a) == len(b)
        return all(_equal_states(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray | np.generic):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)
        return True
    assert a == b
    return True
