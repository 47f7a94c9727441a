"""SGLangClient's weight sync, errors and startup checks against stub SGLang 0.5.x
servers (tests/sglang_stub.py: real HTTP on 127.0.0.1, SGLang's locking, pause and
error behaviour), the launcher's placement, and the recipes' dry runs."""

import asyncio
import os

import pytest
from flax import nnx

from configs.common import apply_overrides, load_config
from inference import build as engines
from inference import launcher, sglang
from inference.engine import BrokenSampleError, ContextLengthError, EngineError, GenerateRequest
from models.qwen3 import Qwen3, Qwen3Config
from models.tokenizer import train_bpe
from tests.owners import sglang_config
from tests.sglang_stub import StubSGLang, expected_ids, token_logprob

RECIPES = ["configs/grpo_swe.py", "configs/ps_qwen3_14b_swe.py", "configs/ps_qwen3_32b_swe.py",
           "configs/spo_qwen3_8b.py"]


def run(coro):
    return asyncio.run(coro)


async def with_stubs(n, body, **stub_kw):
    stubs = [await StubSGLang(**stub_kw).start() for _ in range(n)]
    try:
        return await body(stubs)
    finally:
        for stub in stubs:
            await stub.stop()


def test_stub_reload_waits_for_in_flight_and_blocks_new(tmp_path):
    """The stub itself, driven with raw HTTP: SGLang's model_update_lock semantics."""
    import aiohttp

    async def body(stubs):
        (stub,) = stubs
        gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 40}}
        async with aiohttp.ClientSession() as http:
            async def post(route, payload):
                async with http.post(stub.url + route, json=payload) as r:
                    return r.status, await r.json()

            first = asyncio.create_task(post("/generate", gen))
            await asyncio.sleep(0.02)
            reload = asyncio.create_task(post("/update_weights_from_disk",
                                              {"model_path": str(tmp_path)}))
            await asyncio.sleep(0.01)
            late = asyncio.create_task(post("/generate", gen))
            (_, a), (_, r), (_, b) = await asyncio.gather(first, reload, late)
            assert a["meta_info"]["weight_version"] == "default"  # finished before the load
            assert r["success"] and b["meta_info"]["weight_version"] == "default"
            assert stub.reload_overlaps == 0 and stub.reloads == [str(tmp_path)]
            status, over = await post("/generate", {"input_ids": [1] * 10, "sampling_params":
                                                    {"max_new_tokens": 5000}})
            assert status == 400 and "context length" in over["error"]["message"]

    run(with_stubs(1, body, token_s=0.001))


@pytest.mark.parametrize("mode", sglang.SYNC_MODES)
def test_one_reload_per_server_with_32_in_flight(tmp_path, mode):
    """32 requests in flight on 2 servers and one update: exactly one reload per server,
    every request completes with the tokens an uninterrupted request gives, and each
    records the oldest weight version that produced it."""
    weights = tmp_path / "w1"
    weights.mkdir()
    reqs = [GenerateRequest([i + 1, 7, 9], 60) for i in range(32)]

    async def body(stubs):
        client = sglang.SGLangClient([s.url for s in stubs], sglang_config(sync_mode=mode,
                                                                           export_dir=str(tmp_path)))
        pending = asyncio.gather(*(client.generate([r]) for r in reqs))
        await asyncio.sleep(0.05)
        await client.update_weights(str(weights))
        late = await client.generate([GenerateRequest([5, 5], 4)])
        results = [r for (r,) in await pending]
        await client.aclose()
        return results, late[0]

    stubs_holder = []

    async def capture(stubs):
        stubs_holder.extend(stubs)
        return await body(stubs)

    results, late = run(with_stubs(2, capture, token_s=0.002))
    assert [s.reloads for s in stubs_holder] == [[str(weights)], [str(weights)]]
    assert all(s.reload_overlaps == 0 for s in stubs_holder)
    for req, res in zip(reqs, results, strict=True):
        assert res.output_ids == expected_ids(req.prompt_ids, 60)
        assert res.logprobs == [token_logprob(t) for t in res.output_ids]
        assert res.finish_reason == "length" and res.policy_version == 0
    assert late.policy_version == 1
    assert sum(s.generated_requests for s in stubs_holder) >= 33


@pytest.mark.parametrize("mode", ["pause", "abort"])
def test_a_client_sharing_servers_records_the_version_they_serve(tmp_path, mode):
    """Multi-host runs: process 0's client updates the shared servers and the other
    processes' clients, which load no weights, record the version each result (and each
    turn of a rollout) was sampled under: the one served when it started, so a request
    in flight across an update records the older one (and, aborted by it, is continued
    from its tokens so far)."""
    from env import miniswe
    from env.sandbox import SandboxFactory
    from env.sandbox.pool import SandboxPool
    from rl import sft
    from rl.rollout import Agent, RolloutJob, collect_groups
    from tests.owners import rollout_config

    weights = tmp_path / "w1"
    weights.mkdir()
    tasks = miniswe.generate_tasks(1, seed=3, difficulties=(0,))
    tokenizer = train_bpe(sft.tokenizer_corpus(tasks), 400)
    cfg = rollout_config(max_steps=2, max_turn_tokens=8, max_response_tokens=100,
                         max_context=4096, test_timeout_s=30.0, temperature=1.0)

    async def body(stubs):
        urls = [s.url for s in stubs]
        updater = sglang.SGLangClient(urls, sglang_config(sync_mode=mode, export_dir=str(tmp_path)))
        follower = sglang.SGLangClient(urls, sglang_config())
        (before,) = await follower.generate([GenerateRequest([3, 4], 5)])
        spanning = asyncio.ensure_future(follower.generate([GenerateRequest([1, 7, 9], 80)]))
        await asyncio.sleep(0.05)
        await updater.update_weights(str(weights))
        (after,) = await follower.generate([GenerateRequest([3, 4], 5)])
        (spanned,) = await spanning
        agent = Agent(follower, tokenizer, SandboxPool(SandboxFactory("local"), 1), cfg,
                      tools_in_prompt=False)
        try:
            (group,) = await collect_groups(agent, [RolloutJob(tasks[0])], 1)
        finally:
            agent.close()
            await updater.aclose()
            await follower.aclose()
        return before, spanned, after, group[0]

    before, spanned, after, traj = run(with_stubs(2, body, vocab=400, token_s=0.002))
    assert spanned.output_ids == expected_ids([1, 7, 9], 80, vocab=400)
    assert (before.policy_version, spanned.policy_version, after.policy_version) == (0, 0, 1)
    assert len(traj.turns) == 2 and [t.policy_version for t in traj.turns] == [1, 1]


@pytest.mark.parametrize(("stub_kw", "limit", "source"), [
    ({"context_length": 4096, "launched_context_length": False}, 4096, "max_req_input_len"),
    ({"context_length": 4096, "kv_tokens": 3000}, 3000, "max_req_input_len"),
    ({"context_length": 2048}, 2048, "context_length")])
def test_startup_checks_a_url_servers_own_context_limit(stub_kw, limit, source):
    """Servers given as URLs: launched without --context-length SGLang reports
    context_length null, and its limit (the model's, or a smaller KV pool) only through
    its scheduler; the engine refuses rollout.max_context above it either way."""
    from configs.common import engine_defaults, sglang_defaults

    def start(urls, max_context):
        sg = dict(sglang_defaults(), urls=tuple(urls), deterministic=True)
        cfg = engines.EngineConfig.from_section(dict(engine_defaults(), kind="sglang", sglang=sg))
        served = engines.Served(hf_path="", model_config=None, max_context=max_context, seed=0)
        return engines.from_config(cfg, served, None, "/tmp")

    async def body(stubs):
        url = stubs[0].url
        client = await asyncio.to_thread(start, [url], limit)
        await client.aclose()
        with pytest.raises(EngineError, match=rf"{url} takes at most {limit} tokens "
                                              rf"\({source}.*rollout.max_context is {limit + 1}"):
            await asyncio.to_thread(start, [url], limit + 1)

    run(with_stubs(1, body, **stub_kw))


def test_exports_rotate_and_are_bf16(tmp_path):
    """10 updates from parameters keep the newest export_keep directories, in bf16."""
    import json

    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model)

    async def body(stubs):
        client = sglang.SGLangClient([s.url for s in stubs],
                                     sglang_config(export_dir=str(tmp_path),
                                                   export_keep=2), model_config=cfg)
        sizes = []
        for _ in range(10):
            await client.update_weights(params)
            sizes.append(client.update_stats()["sync/export_bytes"])
            assert len([d for d in os.listdir(tmp_path) if d.startswith("weights_")]) <= 2
        await client.aclose()
        return client, sizes

    stubs_holder = []

    async def capture(stubs):
        stubs_holder.extend(stubs)
        return await body(stubs)

    client, sizes = run(with_stubs(2, capture, load_s=0.0))
    assert sorted(os.listdir(tmp_path)) == ["weights_000009", "weights_000010"]
    assert [len(s.reloads) for s in stubs_holder] == [10, 10]
    with open(tmp_path / "weights_000010" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    n_params = sum(x.size for x in __import__("jax").tree.leaves(params))
    assert n_params * 2 < sizes[-1] < n_params * 2 + 100_000
    assert client.update_stats()["sync/reloads"] == 2


@pytest.mark.parametrize("style", ["object", "string", "text"])
def test_error_bodies_become_engine_errors_with_the_servers_text(style):
    async def body(stubs):
        client = sglang.SGLangClient([stubs[0].url], sglang_config())
        with pytest.raises(ContextLengthError, match="maximum context length of 64"):
            await client.generate([GenerateRequest(list(range(1, 40)), 30)])
        stubs[0].version = "0.5.2"  # rejects sampling_seed
        with pytest.raises(EngineError, match="unexpected keyword argument 'sampling_seed'"):
            await client.generate([GenerateRequest([1, 2], 3, seed=4)])
        await client.aclose()

    run(with_stubs(1, body, context_length=64, error_style=style))


def test_nan_finish_is_a_broken_sample():
    async def body(stubs):
        client = sglang.SGLangClient([stubs[0].url], sglang_config())
        with pytest.raises(BrokenSampleError, match="NaN happened"):
            await client.generate([GenerateRequest([1, 999, 2], 8)])
        ok = await client.generate([GenerateRequest([1, 2], 3)])
        await client.aclose()
        return ok

    assert run(with_stubs(1, body))[0].output_ids == expected_ids([1, 2], 3)


def test_startup_checks_refuse_with_the_numbers():
    ok = {"version": "0.5.3", "context_length": 40960, "enable_deterministic_inference": True}
    launcher.check_server("u", ok, 40960, seeded=True)
    with pytest.raises(EngineError, match=r"at most 32768 tokens .*max_context is 40960"):
        launcher.check_server("u", {**ok, "context_length": 32768}, 40960, seeded=True)
    with pytest.raises(EngineError, match="0.4.9"):
        launcher.check_server("u", {**ok, "version": "0.4.9"}, 1024, seeded=False)
    with pytest.raises(EngineError, match="enable-deterministic-inference"):
        launcher.check_server("u", {**ok, "version": "0.5.2"}, 1024, seeded=True)
    with pytest.raises(EngineError, match="enable_deterministic_inference=False"):
        launcher.check_server("u", {**ok, "enable_deterministic_inference": False}, 1024,
                            seeded=True)
    launcher.check_server("u", {**ok, "version": "0.5.2"}, 1024, seeded=False)

    async def body(stubs):
        return await asyncio.to_thread(launcher.server_info, stubs[0].url)

    info = run(with_stubs(1, body, version="0.5.4rc1", context_length=512))
    assert launcher.parse_version(info["version"]) == (0, 5, 4)
    assert launcher.server_context_length(info) == (512, "context_length")


def test_unseeded_client_sends_no_seed():
    req = GenerateRequest([1], 2, seed=3)
    assert sglang.request_payload(req, seeded=True)["sampling_params"]["sampling_seed"] == 3
    assert "sampling_seed" not in sglang.request_payload(req, seeded=False)["sampling_params"]


# ----------------------------------------------------------------------------- placement


def _engine(config):
    """The engine section's owner, as train.py builds it."""
    from train import owners

    return owners(config).engine


def _launch_commands(config):
    from train import served

    return engines.launch_commands(_engine(config), served(config, None))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_placement_shares_no_gpu(recipe):
    config = load_config(recipe)
    place = engines.placement(_engine(config))
    server_gpus = [g for s in place["servers"] for g in s["gpus"]]
    assert place["servers"] and place["learner_gpus"]
    assert len(set(server_gpus)) == len(server_gpus)
    assert not set(server_gpus) & set(place["learner_gpus"])
    assert sorted(server_gpus + place["learner_gpus"]) == list(range(place["host_gpus"]))
    for line, server in zip(_launch_commands(config), place["servers"], strict=True):
        assert line[0] == "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, server["gpus"]))
        assert "--context-length" in line and line[line.index("--context-length") + 1] == \
            str(config.rollout.max_context)
        assert launcher.DETERMINISTIC_FLAG in line


def test_launcher_python_env_and_flags_from_config():
    config = load_config("configs/grpo_swe.py")
    apply_overrides(config, {"engine.sglang.python": "/opt/sgl/bin/python",
                             "engine.sglang.env": ("HF_HOME=/x", "A=b=c"),
                             "engine.sglang.extra_args": ("--dtype", "bfloat16", "--x"),
                             "engine.sglang.deterministic": False,
                             "engine.sglang.context_length": 32768})
    (line, _) = _launch_commands(config)
    assert line[:4] == ["A=b=c", "CUDA_VISIBLE_DEVICES=4,5", "HF_HOME=/x", "PYTHONSAFEPATH=1"]
    assert line[4:7] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"]
    assert line[-3:] == ["--dtype", "bfloat16", "--x"]
    assert launcher.DETERMINISTIC_FLAG not in line
    assert line[line.index("--context-length") + 1] == "32768"
    apply_overrides(config, {"engine.sglang.ports": tuple(range(30000, 30004))})
    with pytest.raises(ValueError, match="8 GPUs leave none of host_gpus=8"):
        engines.placement(_engine(config))
    apply_overrides(config, {"engine.sglang.urls": ("http://10.0.0.1:30000",)})
    assert engines.placement(_engine(config))["learner_gpus"] == list(range(8))


@pytest.mark.parametrize("override", [{}, {"engine.min_cache_len": 128, "engine.max_batch": 16}])
def test_launched_server_runs_the_configs_engine(override):
    """The default config's `server` option launches inference.server with the engine
    section's options (it used the server's own min_cache_len, 1, for the config's 256),
    overrides included."""
    import dataclasses

    from inference import server
    from inference.embedded import EmbeddedOptions

    config = apply_overrides(load_config("configs/default.py:server"), override)
    (line,) = _launch_commands(config)
    argv = line[line.index("inference.server") + 1:]
    expected = dataclasses.replace(EmbeddedOptions.from_section(config.engine),
                                   max_len=config.rollout.max_context)
    assert server.engine_options(server.parse_args(argv)) == expected


def test_learner_devices_restricted_to_the_rest():
    import jax

    config = load_config("configs/spo_qwen3_8b.py")
    before = jax.config.values["jax_cuda_visible_devices"]
    try:
        assert engines.restrict_learner_devices(_engine(config)) == [0, 1, 2, 3]
        assert jax.config.values["jax_cuda_visible_devices"] == "0,1,2,3"
    finally:
        jax.config.update("jax_cuda_visible_devices", before)


def test_dry_run_prints_disjoint_placement():
    """(Every recipe's placement is checked above; a dry run of each takes seconds.)"""
    from train import dry_run

    summary = dry_run(load_config("configs/grpo_swe.py"))
    place = summary["placement"]
    servers = {g for s in place["servers"] for g in s["gpus"]}
    assert servers and place["learner_gpus"] and not servers & set(place["learner_gpus"])


def test_dry_run_refuses_context_above_the_models_limit():
    from train import dry_run

    config = load_config("configs/grpo_swe.py")
    apply_overrides(config, {"rollout.max_context": 65536, "engine.max_len": 65536,
                             "learner.row_buckets": (65536,)})
    with pytest.raises(ValueError, match=r"max_context \(65536\) exceeds the model's context "
                                         r"limit \(40960"):
        dry_run(config)


def test_context_overflow_truncates_the_trajectory_and_the_run_goes_on():
    """A server whose context is shorter than rollout.max_context: the turn that would
    overflow ends its trajectory "truncated"; the other rollouts are unaffected."""
    from env import miniswe
    from env.sandbox import SandboxFactory
    from env.sandbox.pool import SandboxPool
    from rl import sft
    from rl.rollout import Agent, RolloutJob, collect_groups
    from tests.owners import rollout_config

    tasks = miniswe.generate_tasks(2, seed=7, difficulties=(0,))
    tokenizer = train_bpe(sft.tokenizer_corpus(tasks), 400)
    factory = SandboxFactory("local")
    cfg = rollout_config(max_steps=3, max_turn_tokens=16, max_response_tokens=200,
                         max_context=4096, test_timeout_s=30.0, temperature=1.0)

    async def body(stubs):
        client = sglang.SGLangClient([stubs[0].url], sglang_config())
        agent = Agent(client, tokenizer, SandboxPool(factory, 2), cfg, tools_in_prompt=False)
        try:
            groups = await collect_groups(agent, [RolloutJob(t) for t in tasks], 1)
        finally:
            agent.close()
            await client.aclose()
        return [g[0] for g in groups], stubs[0].prompt_lengths

    full, lengths = run(with_stubs(1, body, vocab=400, token_s=0.0))
    assert all(t.status == "max_steps" and len(t.turns) == 3 for t in full)
    # Room for the first turns only: each second turn overflows.
    second = sorted(lengths)[len(tasks)]
    short, _ = run(with_stubs(1, body, vocab=400, token_s=0.0, context_length=second + 8))
    assert [t.status for t in short] == ["truncated"] * len(tasks)
    assert all(len(t.turns) == 1 and t.reward is not None for t in short)
    assert all(t.turns[0].policy_version == 0 for t in short)
