"""SGLangClient against `python -m inference.server` processes over real HTTP on 127.0.0.1,
started and stopped by SGLangLauncher; the in-process EmbeddedEngine is the reference."""

import asyncio
import dataclasses
import importlib.metadata
import json
import os
import shlex
import signal
import sys
import urllib.error
import urllib.request

import aiohttp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from inference import build as engines
from inference.embedded import EmbeddedEngine
from inference.engine import ContextLengthError, EngineError, GenerateRequest
from inference.launcher import REPOSITORY, SGLangLauncher, free_port
from inference.sglang import SGLangClient
from models import hf_io
from models.qwen3 import Qwen3, Qwen3Config
from tests.owners import engine_options, launcher_config, sglang_config
from tests.servers import served

CFG = Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                  tie_word_embeddings=False)
# One batch bucket and one length bucket: each server compiles a single program pair.
ENGINE = dict(max_batch=16, min_batch=16, max_len=32, min_len=32)
SERVER = ("{python} -m inference.server --model-path {model_path} --port {port} --host {host} "
          "--max-batch 16 --min-batch 16 --max-len 32 --min-len 32")


def tiny_model(seed: int) -> Qwen3:
    model = Qwen3(CFG, rngs=nnx.Rngs(seed))
    model.lm_head_proj.kernel[...] = model.lm_head_proj.kernel[...] * 14.0
    return model


def run(coro):
    return asyncio.run(coro)


def requests(n: int, offset: int = 0) -> list[GenerateRequest]:
    rng = np.random.default_rng(offset)
    out = []
    for i in range(n):
        ids = rng.integers(0, CFG.vocab_size, int(rng.integers(2, 12))).tolist()
        temperature = [0.0, 1.0, 0.8][i % 3]
        out.append(GenerateRequest(ids, int(rng.integers(4, 17)), temperature=temperature,
                                   top_k=[-1, -1, 40][i % 3], top_p=[1.0, 1.0, 0.9][i % 3],
                                   stop_token_ids=tuple(rng.integers(0, 384, 4)),
                                   seed=offset * 1000 + i))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model, HF directory) for two different random models."""
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = tiny_model(seed)
        path = str(tmp_path_factory.mktemp(f"hf_{name}"))
        hf_io.save_hf(model, CFG, path)
        out[name] = (model, path)
    return out


@pytest.fixture(scope="module")
def references(models):
    """name -> in-process engine over the same weights (the expected answers)."""
    engines = {name: EmbeddedEngine(model, engine_options(**ENGINE), seed=0)
               for name, (model, _) in models.items()}
    yield engines
    for e in engines.values():
        e.close()


def two_servers(model_path, tmp_path_factory):
    """Two inference.server processes on `model_path`, started in parallel, each logging
    to its own file (a fixture's body: yields the launchers, closes them after)."""
    logs = tmp_path_factory.mktemp("logs")
    launchers = [SGLangLauncher(launcher_config(model_path=model_path, command=SERVER,
                                                env={"PYTHONPATH": REPOSITORY},
                                                log_path=str(logs / f"s{i}.log"),
                                                startup_timeout=120))
                 for i in range(2)]
    for launcher in launchers:
        launcher.spawn()
    try:
        for launcher in launchers:
            launcher.wait_healthy()
        yield launchers
    finally:
        for launcher in launchers:
            launcher.close()


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """Two inference.server processes on model "a"."""
    yield from two_servers(models["a"][1], tmp_path_factory)


def assert_same(results, expected):
    for got, want in zip(results, expected, strict=True):
        assert got.output_ids == want.output_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
        assert got.finish_reason == want.finish_reason


def test_generate_with_logprobs_matches_embedded(servers, references):
    reqs = requests(12)

    async def go():
        async with SGLangClient([servers[0].url], sglang_config()) as client:
            assert await client.health()
            return await client.generate(reqs)

    results = run(go())
    assert_same(results, run(references["a"].generate(reqs)))
    assert {r.finish_reason for r in results} <= {"stop", "length"}
    assert all(len(r.logprobs) == len(r.output_ids) > 0 for r in results)


def test_native_protocol(servers):
    url = servers[0].url

    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [[1, 2, 3], [4, 5]], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                        "skip_special_tokens": True, "n": 1}}
            async with s.post(url + "/generate", json=body) as r:
                assert r.status == 200
                batch = await r.json()
            async with s.post(url + "/generate", json={"text": "hello"}) as r:
                assert r.status == 400
                assert "input_ids" in (await r.json())["error"]["message"]
            bad = {"input_ids": [1], "sampling_params": {"temprature": 0.5}}
            async with s.post(url + "/generate", json=bad) as r:
                assert r.status == 400
                assert "temprature" in (await r.json())["error"]["message"]
            info = []
            for route in ("/get_model_info", "/model_info"):
                async with s.get(url + route) as r:
                    info.append(await r.json())
            statuses = []
            for method, route in (("get", "/health"), ("get", "/health_generate"),
                                  ("post", "/flush_cache")):
                async with s.request(method, url + route) as r:
                    statuses.append(r.status)
            async with s.post(url + "/abort_request", json={"rid": "nothing"}) as r:
                statuses.append(r.status)
            return batch, info, statuses

    batch, info, statuses = run(go())
    assert isinstance(batch, list) and len(batch) == 2
    for item, prompt_len in zip(batch, (3, 2), strict=True):
        meta = item["meta_info"]
        assert item["text"] == "" and len(item["output_ids"]) == 4
        assert [p[1] for p in meta["output_token_logprobs"]] == item["output_ids"]
        assert all(p[2] is None and p[0] <= 0 for p in meta["output_token_logprobs"])
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert meta["prompt_tokens"] == prompt_len and meta["completion_tokens"] == 4
    assert info[0] == info[1] and info[0]["is_generation"] is True
    assert statuses == [200, 200, 200, 200]


def test_update_weights_changes_outputs(servers, models, references):
    reqs = requests(6, offset=1)
    model_a, _ = models["a"]
    _, dir_b = models["b"]

    async def go(tmp):
        # The servers run the f32 model: exports in their dtype reproduce it exactly.
        cfg = sglang_config(export_dir=tmp, export_dtype="float32")
        async with SGLangClient([s.url for s in servers], cfg, model_config=CFG) as client:
            before = await client.generate(reqs)
            await client.update_weights(dir_b)
            after = await client.generate(reqs)
            # Back to "a", through the params -> safetensors export path.
            await client.update_weights(nnx.state(model_a, nnx.Param))
            restored = await client.generate(reqs)
            return before, after, restored, client.weights_path

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        before, after, restored, exported = run(go(tmp))
        assert os.path.exists(os.path.join(exported, "config.json"))
    assert_same(before, run(references["a"].generate(reqs)))
    assert_same(after, run(references["b"].generate(reqs)))
    assert [r.output_ids for r in before] != [r.output_ids for r in after]
    assert_same(restored, before)


def test_update_weights_failure_is_reported(servers):
    async def go():
        async with SGLangClient([servers[0].url], sglang_config()) as client:
            await client.update_weights("/nonexistent/model")

    with pytest.raises(EngineError, match="nonexistent"):
        run(go())
    # The failed server got no new weights and is skipped for a while; it still serves.
    assert urllib.request.urlopen(servers[0].url + "/health").status == 200


def test_from_config(servers):
    from configs.common import engine_defaults, sglang_defaults

    sglang = dict(sglang_defaults(), launch=True, ports=(30000, 30001), tp_size=2,
                  max_retries=1, host_gpus=6)
    section = ml_collections.ConfigDict(dict(engine_defaults(), kind="sglang", sglang=sglang))
    served = engines.Served(hf_path="/w/qwen3", model_config=CFG, max_context=32, seed=0)
    commands = engines.launch_commands(engines.EngineConfig.from_section(section), served)
    assert [c[c.index("--port") + 1] for c in commands] == ["30000", "30001"]
    assert all(c[c.index("--model-path") + 1] == "/w/qwen3" for c in commands)
    assert [c[0] for c in commands] == ["CUDA_VISIBLE_DEVICES=2,3", "CUDA_VISIBLE_DEVICES=4,5"]
    section.sglang.urls = tuple(s.url for s in servers)
    cfg = engines.EngineConfig.from_section(section)
    client = engines.from_config(cfg, served, None, "/tmp")
    assert [s.url for s in client.servers] == list(section.sglang.urls)
    assert client.max_retries == 1 and client.launchers == [] and client.seeded
    client.close()
    longer = dataclasses.replace(served, max_context=64)  # the servers take 32 tokens
    with pytest.raises(EngineError, match="at most 32 tokens"):
        engines.from_config(cfg, longer, None, "/tmp")


def test_sglang_protocol_pause_info_limits_and_range_checks(servers):
    """The routes a GPU pod's SGLang has, on the project's server: server info, prompt-only
    requests, SGLang's context refusal, per-request range checks, pause / continue."""
    url = servers[1].url

    async def go():
        async with aiohttp.ClientSession() as http:
            async def generate(ids, **sampling):
                async with http.post(url + "/generate", json={
                        "input_ids": ids, "sampling_params": sampling}) as r:
                    return r.status, await r.json()

            async with http.get(url + "/get_server_info") as r:
                info = await r.json()
            assert info["version"] == "0.5.3" and info["context_length"] == 32
            assert info["enable_deterministic_inference"] is True
            status, body = await generate([1, 2, 3], max_new_tokens=0)
            assert status == 200 and body["output_ids"] == []
            assert body["meta_info"]["finish_reason"]["type"] == "length"
            status, body = await generate(list(range(1, 29)), max_new_tokens=8)
            assert status == 400
            assert "maximum context length of 32 tokens" in body["error"]["message"]
            # Bad seeds and stop ids fail alone; a good request sent with them is served.
            outcomes = await asyncio.gather(
                generate([5, 6], max_new_tokens=4, sampling_seed=-1),
                generate([5, 6], max_new_tokens=4, stop_token_ids=[384]),
                generate([5, 6], max_new_tokens=4, sampling_seed=2**32),
                generate([5, 6], max_new_tokens=4, sampling_seed=7))
            assert [s for s, _ in outcomes] == [400, 400, 400, 200]
            assert "sampling_seed" in outcomes[0][1]["error"]["message"]
            assert "[384]" in outcomes[1][1]["error"]["message"]
            # A batch with one invalid item is refused whole before any item runs, as
            # SGLang refuses it; requests sent beside it are served.
            for sampling, ids, message in (
                    ([{"max_new_tokens": 4}, {"max_new_tokens": 4, "sampling_seed": -1}],
                     [[5, 6], [5, 6]], "sampling_seed"),
                    ({"max_new_tokens": 4}, [[5, 6], [384, 6]],
                     "greater than the vocab size (384)")):
                async with http.post(url + "/generate", json={
                        "input_ids": ids, "sampling_params": sampling}) as r:
                    assert r.status == 400 and message in (await r.json())["error"]["message"]
            # Paused: a new request waits until generation continues.
            async with http.post(url + "/pause_generation", json={"mode": "retract"}) as r:
                assert r.status == 200
            waiting = asyncio.create_task(generate([5, 6], max_new_tokens=4))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            async with http.post(url + "/continue_generation", json={}) as r:
                assert r.status == 200
            status, body = await waiting
            assert status == 200 and len(body["output_ids"]) == 4

    run(go())

    async def overflow():
        async with SGLangClient([url], sglang_config()) as client:
            await client.generate([GenerateRequest(list(range(1, 29)), 8)])

    with pytest.raises(ContextLengthError, match="maximum context length of 32"):
        run(overflow())


def test_flush_cache_empties_the_engines_prefix_cache(models):
    """/flush_cache on a server whose engine parks prefixes: the next turn prefills all."""
    engine = EmbeddedEngine(models["a"][0], engine_options(prefix_cache_tokens=4096, **ENGINE),
                            seed=0)

    async def go():
        async with served(engine) as url, SGLangClient([url], sglang_config()) as client:
            async def turn(ids):
                (res,) = await client.generate([GenerateRequest(ids, 4, temperature=0.0)])
                return res

            first = await turn([5, 6, 7])
            follow_up = [5, 6, 7, *first.output_ids, 9]
            assert (await turn(follow_up)).cached_tokens > 0
            assert len(engine.prefix_cache) > 0
            async with client._http().post(url + "/flush_cache") as r:
                assert r.status == 200
            assert len(engine.prefix_cache) == 0
            assert (await turn(follow_up)).cached_tokens == 0

    try:
        run(go())
    finally:
        engine.close()


def test_abort_returns_the_tokens_generated_so_far(models):
    """/abort_request and /pause_generation {"mode": "abort"} end a running request with
    finish_reason abort and its tokens so far: a prefix of the uninterrupted answer."""
    import time

    engine = EmbeddedEngine(models["a"][0], engine_options(max_batch=4, min_batch=4, max_len=512,
                                                           min_len=16, chunk_steps=4), seed=0)
    body = {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 500, "temperature": 0}}

    async def go():
        async with served(engine) as url, aiohttp.ClientSession() as http:
            async def generate(rid):
                async with http.post(url + "/generate", json={**body, "rid": rid}) as r:
                    assert r.status == 200
                    return await r.json()

            await generate("compile")
            start = time.perf_counter()
            full = await generate("full")
            elapsed = time.perf_counter() - start
            cut = []
            for route, payload in (("/abort_request", {"rid": "cut"}),
                                   ("/pause_generation", {"mode": "abort"})):
                pending = asyncio.ensure_future(generate("cut"))
                await asyncio.sleep(elapsed / 3)
                async with http.post(url + route, json=payload) as r:
                    assert r.status == 200
                cut.append(await pending)
            async with http.post(url + "/continue_generation", json={}) as r:
                assert r.status == 200
            return full, cut

    try:
        full, cut = run(go())
    finally:
        engine.close()
    assert len(full["output_ids"]) == 500
    for part in cut:
        n = len(part["output_ids"])
        assert part["meta_info"]["finish_reason"]["type"] == "abort" and 0 < n < 500
        assert part["output_ids"] == full["output_ids"][:n]
        assert part["meta_info"]["output_token_logprobs"] == \
            full["meta_info"]["output_token_logprobs"][:n]


def test_no_server_up_names_every_url():
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def go():
        async with SGLangClient(urls, sglang_config(max_retries=2, backoff_s=0.01)) as client:
            assert not await client.health()
            await client.generate([GenerateRequest([1, 2], 3)])

    with pytest.raises(EngineError) as err:
        run(go())
    for url in urls:
        assert url in str(err.value)


def test_failover_when_a_server_dies_mid_run(servers, references):
    """Server 1 is SIGKILLed while requests are in flight; server 0 answers them all."""
    first, second = requests(8, offset=2), requests(24, offset=3)

    async def go():
        cfg = sglang_config(max_retries=4, backoff_s=0.05, down_s=60)
        async with SGLangClient([s.url for s in servers], cfg) as client:
            warm = await client.generate(first)
            pending = asyncio.ensure_future(client.generate(second))
            await asyncio.sleep(0.01)
            os.killpg(servers[1].process.pid, signal.SIGKILL)
            return warm, await pending

    warm, results = run(go())
    assert servers[1].process.wait(10) == -signal.SIGKILL
    assert_same(warm, run(references["a"].generate(first)))
    assert_same(results, run(references["a"].generate(second)))


# ----------------------------------------------------------------------------- launcher


def test_launcher_teardown_stops_the_server(servers):
    launcher = servers[0]
    pid = launcher.process.pid
    launcher.close()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(launcher.url + "/health", timeout=2)


def test_launcher_reports_early_exit_with_log_tail(tmp_path):
    cmd = "{python} -c " + shlex.quote("import sys; print('no weights at all'); sys.exit(3)")
    launcher = SGLangLauncher({**dataclasses.asdict(launcher_config()), "command": cmd,
                               "log_path": str(tmp_path / "log"), "startup_timeout": 30})
    with pytest.raises(EngineError, match="(?s)code 3.*no weights at all"):
        launcher.start()


def test_launcher_deadline_kills_the_group(tmp_path):
    cmd = "{python} -c " + shlex.quote("import time; print('loading', flush=True); "
                                       "time.sleep(60)")
    launcher = SGLangLauncher(launcher_config(command=cmd, log_path=str(tmp_path / "log"),
                                              startup_timeout=1.0))
    launcher.spawn()
    pid = launcher.process.pid
    with pytest.raises(EngineError, match="(?s)not healthy after.*loading"):
        launcher.wait_healthy()
    assert launcher.process is None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


# A stand-in for `python -m sglang.launch_server` that imports what SGLang imports at start:
# transformers and, through it and directly, the PyPI `kernels` library (SGLang 0.5 pins
# both). It answers /health with the file its `kernels` came from.
STAND_IN = """
import http.server, json, sys
import kernels, transformers
from kernels import get_kernel  # a name of the library, not of the project's package
port = int(sys.argv[sys.argv.index("--port") + 1])
body = json.dumps({"kernels": kernels.__file__, "sys_path": sys.path}).encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.mark.parametrize("inherited_pythonpath", [False, True])
def test_launched_server_imports_the_kernels_library_not_the_project(
        hf_reference, tmp_path, monkeypatch, inherited_pythonpath):
    """Started from the repository root (as `python train.py` is), with transformers 5 and
    the `kernels` library installed, and even with the repository in PYTHONPATH, the
    server's `import kernels` finds the library."""
    # hf_reference: skips (fails in CI) like the HF reference when transformers is absent
    if int(importlib.metadata.version("transformers").split(".")[0]) < 5:
        pytest.fail("this check needs transformers 5 (which depends on `kernels`)")
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "fake_sglang.py").write_text(STAND_IN)
    monkeypatch.chdir(REPOSITORY)
    mods = str(tmp_path / "mods")
    if inherited_pythonpath:  # the repository and the stand-in's directory, inherited
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPOSITORY, mods]))
        env = {}
    else:
        monkeypatch.delenv("PYTHONPATH", raising=False)
        env = {"PYTHONPATH": mods}
    launcher = SGLangLauncher(launcher_config(
        command="{python} -m fake_sglang --model-path {model_path} --port {port}",
        model_path="configs", env=env,
        log_path=str(tmp_path / "log"), startup_timeout=120))
    assert os.path.isdir(os.path.join(REPOSITORY, "kernels"))  # the package that would clash
    with launcher:
        answer = json.loads(urllib.request.urlopen(launcher.url + "/health", timeout=10).read())
    assert "site-packages" in answer["kernels"], answer
    assert not answer["kernels"].startswith(REPOSITORY + os.sep)
    assert REPOSITORY not in answer["sys_path"] and "" not in answer["sys_path"]
    assert launcher.command()[4] == os.path.join(REPOSITORY, "configs")  # made absolute


# Flags of `python -m sglang.launch_server`, from SGLang's docs/advanced_features/
# server_arguments.md (v0.5): model and tokenizer, HTTP server, memory, runtime, dtype.
SGLANG_DOCUMENTED_FLAGS = {
    "--model-path", "--model", "--tokenizer-path", "--skip-tokenizer-init", "--host", "--port",
    "--tensor-parallel-size", "--tp-size", "--mem-fraction-static", "--dtype",
    "--context-length", "--random-seed", "--data-parallel-size", "--dp-size",
    "--max-running-requests", "--chunked-prefill-size", "--weight-version",
    "--enable-deterministic-inference",
}


def test_sglang_command_line_uses_documented_flags():
    launcher = SGLangLauncher(launcher_config(model_path="/ckpt/qwen3-14b", port=30011,
                                              host="0.0.0.0", tp_size=4,
                                              mem_fraction_static=0.8,
                                              context_length=40960, deterministic=True,
                                              extra_args=("--dtype", "bfloat16")))
    argv = launcher.command()
    assert argv == [sys.executable, "-m", "sglang.launch_server", "--model-path",
                    "/ckpt/qwen3-14b", "--port", "30011", "--tp-size", "4",
                    "--mem-fraction-static", "0.8", "--context-length", "40960",
                    "--skip-tokenizer-init", "--host", "0.0.0.0",
                    "--enable-deterministic-inference", "--dtype", "bfloat16"]
    flags = {a for a in argv if a.startswith("--")}
    assert flags <= SGLANG_DOCUMENTED_FLAGS
    assert launcher.url == "http://0.0.0.0:30011"
    with pytest.raises(KeyError, match="tp"):
        SGLangLauncher({"tp": 2})


def test_return_logprob_reaches_each_request():
    """SGLang's return_logprob (one flag, or one per item) becomes each request's, so the
    engine may skip log-probs nobody reads; left out, it is False, as in SGLang."""
    from inference.server import parse_generate

    params = {"max_new_tokens": 2, "temperature": 0}
    body = {"input_ids": [[1, 2], [3]], "return_logprob": [True, False],
            "sampling_params": [params, params]}
    _, requests, _ = parse_generate(body)
    assert [r.return_logprob for r, _ in requests] == [True, False]
    _, requests, _ = parse_generate({"input_ids": [4], "sampling_params": params})
    assert [r.return_logprob for r, _ in requests] == [False]


def test_a_restarted_server_is_reloaded_before_its_answers_are_used(models, references):
    """The project's server, restarted on its port with its launch weights ("a") after
    the client loaded "b" into it: the client sees weight_version "default" where it
    loaded 1, reloads "b", and answers only with "b"'s outputs, labelled version 1."""
    from aiohttp import web

    from inference.server import Server

    reqs = requests(4, offset=5)
    port = free_port()

    async def start():
        engine = EmbeddedEngine(models["a"][0], engine_options(**ENGINE), seed=0)
        runner = web.AppRunner(Server(engine, model_path=models["a"][1]).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, engine

    async def go():
        runner, engine = await start()
        async with SGLangClient([f"http://127.0.0.1:{port}"],
                                sglang_config(backoff_s=0.01)) as client:
            await client.update_weights(models["b"][1])
            await runner.cleanup()
            engine.close()
            runner, engine = await start()  # the same port, the launch weights
            results = await client.generate(reqs)
        await runner.cleanup()
        engine.close()
        return results

    results = run(go())
    assert_same(results, run(references["b"].generate(reqs)))
    assert {r.policy_version for r in results} == {1}
