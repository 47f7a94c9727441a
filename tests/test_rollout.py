"""Agent rollouts: token accounting, budgets, prefix replay, group and stream collection.

Real parts throughout: a tiny random Qwen3 behind the embedded engine, local
sandboxes, generated mini-SWE tasks, the BPE tokenizer trained on them.
"""

import asyncio
import dataclasses
import hashlib

import jax
import numpy as np
import pytest
from flax import nnx

from env import episode as episode_lib
from env import miniswe, sandbox
from env.sandbox.pool import SandboxPool
from inference.embedded import EmbeddedEngine
from inference.engine import Engine
from models.qwen3 import Qwen3, Qwen3Config
from models.tokenizer import render_chat, train_bpe
from rl import prefix, sft
from rl.learner import init_train_state, make_train_step
from rl.metrics import rollout_metrics
from rl.rollout import Agent, RolloutJob, StreamCollector, collect_groups
from tests.owners import engine_options, env_config, learner_config, rollout_config

TASKS = miniswe.generate_tasks(6, seed=7, difficulties=(0, 1))


class RecordingEngine(Engine):
    """Passes requests to a real engine and keeps every prompt it was sent."""

    def __init__(self, inner: Engine):
        self.inner, self.prompts = inner, []

    async def generate(self, requests):
        self.prompts += [list(r.prompt_ids) for r in requests]
        return await self.inner.generate(requests)

    async def update_weights(self, params_or_path):
        await self.inner.update_weights(params_or_path)

    async def health(self):
        return await self.inner.health()

    def close(self):
        self.inner.close()


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(sft.tokenizer_corpus(TASKS), 600)


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = Qwen3Config(vocab_size=640, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10_000.0)
    return Qwen3(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def factory():
    return sandbox.from_config(env_config(backend="local", image="",
                                             local_allow_unisolated=False, local_read_only=()))


def make_agent(model, tokenizer, factory, **cfg):
    cfg = rollout_config(**{"max_steps": 3, "max_turn_tokens": 24, "max_response_tokens": 200,
                            "max_context": 1024, "test_timeout_s": 30.0, "temperature": 1.0,
                            **cfg})
    engine = RecordingEngine(EmbeddedEngine(model, engine_options(max_batch=16,
                                                                  max_len=cfg.max_context), seed=0))
    return Agent(engine, tokenizer, SandboxPool(factory, 4), cfg, tools_in_prompt=False)


def conversation(traj, tokenizer, system):
    """The chat messages a trajectory stands for, rendered independently of its ids."""
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": TASK_BY_ID[traj.task_id].problem_statement}]
    for i, turn in enumerate(traj.turns):
        text = tokenizer.decode(turn.action_ids)
        messages.append({"role": "assistant", "content": text.removesuffix("<|im_end|>")})
        if i + 1 < len(traj.turns):
            messages.append({"role": "tool", "content": turn.observation})
    return messages


TASK_BY_ID = {t.instance_id: t for t in TASKS}


def test_expert_demonstration_token_accounting(model, tokenizer, factory):
    agent = make_agent(model, tokenizer, factory, max_steps=8, max_response_tokens=2000,
                       max_turn_tokens=400, max_context=4096)
    task = TASKS[0]
    actions = sft.expert_actions_text(miniswe.expert_demo(task))
    traj = asyncio.run(agent.demonstrate(task, actions))
    assert traj.status == "finished" and traj.reward == 1.0
    ids, mask, logp = traj.token_arrays()
    # The ids decode to the conversation rendered from its texts (Qwen3 chat format);
    # the final assistant turn was not closed by <|im_end|> (the episode ended).
    rendered = render_chat(conversation(traj, tokenizer, agent.cfg.system_prompt))
    assert tokenizer.decode(ids) == rendered.removesuffix("<|im_end|>\n")
    # loss_mask covers exactly the action ids, in order.
    assert list(ids[mask == 1]) == [i for t in traj.turns for i in t.action_ids]
    assert [tokenizer.decode(t.action_ids) for t in traj.turns] == actions
    assert not logp[mask == 0].any()
    # Held to a 2-step budget the demonstration is cut; given its own limit it is whole.
    short = make_agent(model, tokenizer, factory, max_steps=2, max_response_tokens=2000,
                       max_turn_tokens=400, max_context=4096)
    cut = asyncio.run(short.demonstrate(task, actions))
    assert (cut.status, len(cut.turns)) == ("max_steps", 2)
    whole = asyncio.run(short.demonstrate(task, actions, max_steps=len(actions)))
    assert whole.status == "finished" and whole.reward == 1.0
    assert [t.action_ids for t in whole.turns] == [t.action_ids for t in traj.turns]


def test_revisit_job_runs_from_the_start_and_is_marked(model, tokenizer, factory):
    """A k = 0 task (ps.revisit) runs exactly as a fresh job of the same seed, token for
    token (same first prompt, same sampled ids), and carries its PrefixInfo."""
    fresh = asyncio.run(make_agent(model, tokenizer, factory).run(RolloutJob(TASKS[1], seed=3)))
    job = RolloutJob(TASKS[1], seed=3,
                     prefix=prefix.revisit_task(TASKS[1].instance_id, "too_hard", 0))
    again = asyncio.run(make_agent(model, tokenizer, factory).run(job))
    assert again.prefix == prefix.PrefixInfo("", 0, "too_hard") and fresh.prefix is None
    assert [t.obs_ids for t in again.turns] == [t.obs_ids for t in fresh.turns]
    assert [t.action_ids for t in again.turns] == [t.action_ids for t in fresh.turns]
    assert not any(t.replayed for t in again.turns) and again.num_replayed_tokens == 0


def test_sampled_rollout_is_token_in_token_out(model, tokenizer, factory):
    agent = make_agent(model, tokenizer, factory)
    traj = asyncio.run(agent.run(RolloutJob(TASKS[1], seed=3)))
    assert traj.status in ("max_steps", "truncated") and traj.reward == 0.0
    assert traj.num_steps >= 1
    ids, mask, logp = traj.token_arrays()
    prompts = agent.engine.prompts
    # Each request's prompt is exactly the stream before that turn's action.
    offset = 0
    for turn, prompt in zip(traj.turns, prompts, strict=True):
        offset += len(turn.obs_ids)
        assert prompt == list(ids[:offset])
        offset += len(turn.action_ids)
        np.testing.assert_array_equal(logp[offset - len(turn.action_ids):offset],
                                      np.float32(turn.action_logprobs))
    assert int(mask.sum()) == traj.num_generated_tokens
    # Every turn after a turn not closed by <|im_end|> starts by closing it.
    for prev, turn in zip(traj.turns, traj.turns[1:], strict=False):
        if prev.action_ids[-1] != tokenizer.eos_id:
            assert turn.obs_ids[0] == tokenizer.eos_id


def test_token_budget_ends_in_truncated(model, tokenizer, factory):
    agent = make_agent(model, tokenizer, factory, max_steps=10, max_response_tokens=30)
    traj = asyncio.run(agent.run(RolloutJob(TASKS[2], seed=1)))
    assert traj.status == "truncated"
    assert traj.num_generated_tokens <= 30
    assert traj.reward is not None  # graded all the same


class SlowEngine(RecordingEngine):
    """A real engine whose n-th call waits `delays[n]` seconds first."""

    def __init__(self, inner: Engine, delays: list[float]):
        super().__init__(inner)
        self.delays = delays

    async def generate(self, requests):
        await asyncio.sleep(self.delays[min(len(self.prompts), len(self.delays) - 1)])
        return await super().generate(requests)


@pytest.mark.parametrize("delays,status", [((600.0,), "env_error"), ((0.0, 600.0), "timeout")])
def test_wall_timeout_before_the_first_turn_is_an_env_error(model, tokenizer, factory,
                                                             delays, status):
    """A rollout whose engine answers nothing within wall_timeout_s has no turn of the
    policy to grade or train on: an env error (never scored); one that times out after a
    turn is graded as a timeout."""
    agent = make_agent(model, tokenizer, factory, max_steps=2, wall_timeout_s=10.0)
    asyncio.run(agent.run(RolloutJob(TASKS[2], seed=1)))  # its shapes compiled first
    agent.engine = SlowEngine(agent.engine.inner, list(delays))
    traj = asyncio.run(agent.run(RolloutJob(TASKS[2], seed=1)))
    assert traj.status == status and len(traj.turns) == len(delays) - 1
    if status == "env_error":
        assert traj.reward is None and "no turn sampled within" in traj.error
    else:
        assert traj.reward is not None


def test_sandbox_failure_is_env_error_not_reward_zero(model, tokenizer):
    class Broken(sandbox.SandboxFactory):
        def __call__(self, task):
            raise episode_lib.SandboxError("daemon unreachable")

    agent = make_agent(model, tokenizer, Broken("local"), env_retries=2)
    traj = asyncio.run(agent.run(RolloutJob(TASKS[0])))
    assert traj.status == "env_error" and traj.reward is None
    assert "daemon unreachable" in traj.error


def _file_hashes(sandbox) -> dict[str, str]:
    out = sandbox.run("git ls-files -co --exclude-standard").output.split()
    return {p: hashlib.sha256(sandbox.read_file(p).encode()).hexdigest() for p in sorted(out)}


def test_prefix_replay_restores_files_prompt_and_masks(model, tokenizer, factory):
    agent = make_agent(model, tokenizer, factory, max_steps=8, max_response_tokens=2000,
                       max_turn_tokens=400, max_context=4096)
    task = next(t for t in TASKS if t.difficulty == 1)
    demo = miniswe.expert_demo(task)
    source = asyncio.run(agent.demonstrate(task, sft.expert_actions_text(demo)))
    assert source.num_steps >= 4
    k = 3
    ptask = prefix.make_prefix_task(source, k, "too_hard", step=0)
    # Files: the restored sandbox equals the source episode's sandbox after step k.
    original = episode_lib.Episode(factory, task)
    original.reset()
    for turn in source.turns[:k]:
        original.step(turn.tool_call)
    restored, mismatches = episode_lib.restore(
        task, [episode_lib.StepRecord(t.tool_call, t.observation, t.patch, "", t.unpatched)
               for t in ptask.turns], k, factory)
    try:
        assert mismatches == []
        assert _file_hashes(restored.sandbox) == _file_hashes(original.sandbox)
    finally:
        original.close()
        restored.close()
    # Prompt: the first request of the continuation is the source's ids up to step k's
    # observation, fed as prompt (nothing of it decoded).
    agent.engine.prompts.clear()
    cont = asyncio.run(agent.run(RolloutJob(task, prefix=ptask, seed=5)))
    src_ids = source.token_arrays()[0]
    n_prompt = sum(len(t.obs_ids) + len(t.action_ids) for t in source.turns[:k]) + len(
        source.turns[k].obs_ids)
    assert agent.engine.prompts[0] == list(src_ids[:n_prompt])
    assert cont.prefix == ptask.info and all(t.replayed for t in cont.turns[:k])
    assert not any(t.replayed for t in cont.turns[k:])
    ids, mask, _ = cont.token_arrays()
    n_replayed = sum(len(t.obs_ids) + len(t.action_ids) for t in cont.turns[:k])
    assert not mask[:n_replayed].any()
    assert cont.num_replayed_tokens == n_replayed
    assert cont.num_generated_tokens == int(mask.sum())


def test_replayed_tokens_do_not_influence_the_update(model, tokenizer, factory):
    """Changing the replayed turns' log-probs leaves loss and gradients bit-identical."""
    agent = make_agent(model, tokenizer, factory, max_steps=6, max_response_tokens=600,
                       max_turn_tokens=200, max_context=2048)
    task = TASKS[0]
    source = asyncio.run(agent.demonstrate(
        task, sft.expert_actions_text(miniswe.expert_demo(task))))
    ptask = prefix.make_prefix_task(source, 2, "too_easy", step=0)
    cont = asyncio.run(agent.run(RolloutJob(task, prefix=ptask, seed=2)))
    perturbed = dataclasses.replace(cont, turns=[
        dataclasses.replace(t, action_logprobs=list(np.full(len(t.action_ids), -3.0)))
        if t.replayed else t for t in cont.turns])
    cfg = learner_config()
    graphdef, state0 = init_train_state(model, cfg)
    step = make_train_step(graphdef, cfg)
    outs = []
    for traj in (cont, perturbed):
        batch, _ = setup_pack([traj])
        state = jax.tree.map(lambda x: x.copy(), state0)
        new_state, metrics = step(state, batch)
        outs.append((jax.device_get(new_state.params), float(metrics["loss"])))
    assert outs[0][1] == outs[1][1]
    for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0]), strict=True):
        np.testing.assert_array_equal(a, b)


def setup_pack(trajs):
    from rl.batch import pack_trajectories

    return pack_trajectories(trajs, np.ones(len(trajs)), buckets=(2048,))


def test_group_collection_returns_n_per_task(model, tokenizer, factory):
    agent = make_agent(model, tokenizer, factory, max_steps=1)
    jobs = [RolloutJob(TASKS[0], seed=1), RolloutJob(TASKS[1], seed=2)]
    groups = asyncio.run(collect_groups(agent, jobs, 3))
    assert [len(g) for g in groups] == [3, 3]
    assert [g[0].task_id for g in groups] == [TASKS[0].instance_id, TASKS[1].instance_id]
    assert len({t.uid for g in groups for t in g}) == 6


def test_stream_collection_returns_first_finished_and_carries_the_rest(model, tokenizer,
                                                                       factory):
    agent = make_agent(model, tokenizer, factory, max_steps=2)
    launched = []

    def next_job():
        launched.append(len(launched))
        return RolloutJob(TASKS[len(launched) % len(TASKS)], seed=len(launched))

    async def run():
        collector = StreamCollector(agent, next_job, in_flight=5)
        first = await collector.collect(3)
        carried, launched_before = len(collector._running), len(launched)
        second = await collector.collect(3)
        await collector.close()
        return first, carried, launched_before, second

    first, carried, launched_before, second = asyncio.run(run())
    assert len(first) == 3 and len(second) == 3
    # Nothing is dropped: every launched rollout was returned or is still carried.
    assert launched_before == 3 + carried and carried >= 2
    assert len({t.uid for g in first + second for t in g}) == 6


class SyncAfterFirstTurn(RecordingEngine):
    """A real engine whose weights are replaced after the first turn it serves, as a
    trainer's weight sync lands in the middle of an asynchronous run's episode."""

    def __init__(self, inner: Engine, agent_box: list, params):
        super().__init__(inner)
        self.agent_box, self.params = agent_box, params

    async def generate(self, requests):
        results = await super().generate(requests)
        if len(self.prompts) == 1:
            await self.inner.update_weights(self.params)
            self.agent_box[0].policy_version += 1
        return results


def teacher_forced_logprobs(graphdef, params, ids: np.ndarray) -> np.ndarray:
    """log p(ids[t] | ids[:t]) under `params`, by a whole-sequence forward (no cache)."""
    model = nnx.merge(graphdef, params)
    hidden = model(ids[None, :-1], np.arange(len(ids) - 1)[None])[0]
    logits = np.asarray(hidden @ model.lm_head(), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.concatenate([[0.0], logp[np.arange(len(ids) - 1), ids[1:]]])


def test_an_episode_goes_on_across_a_weight_update_each_turn_with_its_version(
        model, tokenizer, factory):
    """A partial rollout: the weights change after turn 1 of a 3-turn episode. The
    episode goes on (no restart), turn 1 is stamped version 0 and turns 2-3 version 1,
    and each turn's sampler log-probs are those of its own version's weights (checked
    against a whole-sequence forward of each parameter set)."""
    graphdef, old = nnx.split(model, nnx.Param)
    new = jax.tree.map(lambda x: x * 1.5, old)
    cfg = rollout_config(max_steps=3, max_turn_tokens=24, max_response_tokens=200,
                         max_context=1024, test_timeout_s=30.0, temperature=1.0)
    box = []
    engine = SyncAfterFirstTurn(EmbeddedEngine(model, engine_options(max_batch=4, max_len=1024),
                                               seed=0),
                                box, new)
    agent = Agent(engine, tokenizer, SandboxPool(factory, 1), cfg, tools_in_prompt=False)
    box.append(agent)
    try:
        traj = asyncio.run(agent.run(RolloutJob(TASKS[1], seed=3)))
    finally:
        agent.close()
    assert traj.status != "env_error" and traj.num_steps == 3, traj.error
    assert [t.policy_version for t in traj.turns] == [0, 1, 1] and traj.versions == (0, 1)
    assert len(engine.prompts) == 3  # one request per turn: nothing was re-run
    ids, mask, logp = traj.token_arrays()
    under = {v: teacher_forced_logprobs(graphdef, p, ids) for v, p in ((0, old), (1, new))}
    start = 0
    for turn in traj.turns:
        start += len(turn.obs_ids)
        span = slice(start, start + len(turn.action_ids))
        start = span.stop
        own, other = under[turn.policy_version][span], under[1 - turn.policy_version][span]
        np.testing.assert_allclose(logp[span], own, atol=2e-3)
        assert np.abs(logp[span] - other).max() > 0.05


@pytest.mark.parametrize("stale", ["drop", "finish"])
def test_stream_of_groups_bounds_staleness(model, tokenizer, factory, stale):
    """Groups of 2 with max_staleness=1: groups started at version 0 and collected at
    version 2 are run again under version 2 ("drop") or returned as they are ("finish"),
    and counted either way; whole groups come back, and pending() names the jobs in
    flight."""
    agent = make_agent(model, tokenizer, factory, max_steps=1)
    seeds = iter(range(100))

    def next_job():
        return RolloutJob(TASKS[0], seed=next(seeds))

    async def run():
        collector = StreamCollector(agent, next_job, in_flight=3, group_size=2,
                                    max_staleness=1, stale=stale)
        first = await collector.collect(1, version=0)
        in_flight = [j.seed for j in collector.pending()]
        await asyncio.sleep(3.0)  # (the groups in flight finish their one turn meanwhile)
        for _ in range(2):  # two weight updates, as train.py's sync makes them
            await agent.engine.update_weights(agent.engine.inner.params)
            agent.policy_version += 1
        second = await collector.collect(2, version=2)
        stats = collector.stats()
        await collector.close()
        return first, in_flight, second, stats

    first, in_flight, second, stats = asyncio.run(run())
    assert len(first) == 1 and len(in_flight) == 3 and len(second) == 2
    assert all(len(g) == 2 and len({t.seed for t in g}) == 2 for g in first + second)
    jobs = {t.seed // 1009 for g in second for t in g}
    assert len(jobs) == 2 and jobs <= set(in_flight)  # the jobs in flight, none new
    lags = [2 - min(t.versions[0] for t in g) for g in second]
    if stale == "drop":  # run again: within the bound
        assert max(lags) <= 1 and stats["async/trained_stale"] == 0
        assert stats["async/dropped_stale"] >= 1
    else:  # trained as they are, counted
        assert max(lags) == 2 and stats["async/dropped_stale"] == 0
        assert stats["async/trained_stale"] >= sum(lag > 1 for lag in lags)


def test_any_exception_of_one_episode_is_its_env_error_and_never_fails_collection(
        model, tokenizer, factory):
    """A bad task row (ValueError at sandbox creation) and a sandbox raising something
    other than SandboxError end their own trajectories as env_error, the exception in
    `error`; the other rollouts of the collection are scored as usual."""
    bad_row = dataclasses.replace(TASKS[1], instance_id="bad-row", repo_files=None)

    class Exploding(sandbox.SandboxFactory):
        def __call__(self, task):
            box = factory(task)
            if task.instance_id == TASKS[2].instance_id:
                def run(*args, **kwargs):
                    raise RuntimeError("boom in the sandbox")
                box.run = run
            return box

    agent = make_agent(model, tokenizer, Exploding("local"), max_steps=2, env_retries=0)
    jobs = [RolloutJob(TASKS[0], seed=1), RolloutJob(bad_row), RolloutJob(TASKS[2])]
    demo = asyncio.run(agent.demonstrate(TASKS[2], ['<tool_call>{"name": "execute_bash", '
                                                    '"arguments": {"command": "ls"}}'
                                                    '</tool_call>']))
    assert demo.status == "env_error" and "RuntimeError: boom in the sandbox" in demo.error
    groups = asyncio.run(collect_groups(agent, jobs, 2))
    good, bad, boom = groups
    assert all(t.status != "env_error" and t.reward is not None for t in good)
    assert all(t.is_env_error and t.reward is None for t in bad + boom)
    assert all(t.error.startswith("ValueError: ") and "only an image" in t.error for t in bad)
    assert agent.pool.live == 0
    metrics = rollout_metrics([t for g in groups for t in g], groups)
    assert metrics["rollout/env_errors"] == 4


def test_rollouts_grade_the_patch_in_a_fresh_sandbox(model, tokenizer, factory):
    """A demonstration that plants a .pth hook outside the repository (and changes no
    file in it): 0 with the default fresh grading, in the episode's slot; 1 in place."""
    from test_reward_integrity import USER_HACKS, fixed_copy

    task = miniswe.generate_tasks(1, seed=3)[0]
    calls = [{"name": "execute_bash", "arguments": {"command": c}}
             for c in (fixed_copy(task), USER_HACKS["user_pth"])]
    actions = sft.expert_actions_text([*calls, {"name": "finish", "arguments": {}}])
    rewards = {}
    for grading in ("fresh", "in_place"):
        agent = make_agent(model, tokenizer, factory, max_steps=8, max_turn_tokens=600,
                           max_response_tokens=2000, max_context=4096, grading=grading)
        traj = asyncio.run(agent.demonstrate(task, actions))
        assert traj.status == "finished" and traj.turns[-1].patch == "", traj.error
        rewards[grading] = traj.reward
        assert agent.pool.live == 0 and agent.pool.peak == 1
        agent.close()
    assert rewards == {"fresh": 0.0, "in_place": 1.0}
    with pytest.raises(ValueError, match="rollout.grading"):
        rollout_config(grading="fresh-ish")
