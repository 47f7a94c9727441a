"""The project's SGLang-protocol server (inference.server) over real HTTP on 127.0.0.1:
every malformed body answers 400 with the reason, and the server keeps serving."""

import asyncio
import contextlib
import dataclasses
import json

import pytest
from flax import nnx

from inference.embedded import EmbeddedEngine
from inference.engine import GenerateRequest
from inference.sglang import SGLangClient
from models import hf_io
from models.qwen3 import Qwen3, Qwen3Config
from tests.owners import engine_options, sglang_config
from tests.servers import served

CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10_000.0,
                  tie_word_embeddings=True)

DEEP = "[" * 100_000 + "]" * 100_000
GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}

GENERATE = {
    "sampling_params a string": ({**GOOD, "sampling_params": "abc"},
                                 "sampling_params must be an object, got 'abc'"),
    "sampling_params a number": ({**GOOD, "sampling_params": 5},
                                 "sampling_params must be an object, got 5"),
    "stop_token_ids a number": ({**GOOD, "sampling_params": {"stop_token_ids": 7}},
                                "stop_token_ids must be a list of token ids, got 7"),
    "stop_token_ids a string": ({**GOOD, "sampling_params": {"stop_token_ids": "ab"}},
                                "stop_token_ids must be a list of token ids, got 'ab'"),
    "stop_token_ids boolean": ({**GOOD, "sampling_params": {"stop_token_ids": [True]}},
                               r"stop_token_ids [True] are not token ids"),
    "boolean prompt ids": ({**GOOD, "input_ids": [True, False]},
                           "input_ids[0] must be a list of integers, got [True, False]"),
    "boolean seed": ({**GOOD, "sampling_params": {"sampling_seed": True}},
                     "sampling_seed must be an integer"),
    "max_new_tokens a list": ({**GOOD, "sampling_params": {"max_new_tokens": [3]}},
                              "max_new_tokens must be an integer >= 0, got [3]"),
    "temperature a string": ({**GOOD, "sampling_params": {"temperature": "hot"}},
                             "temperature must be a number, got 'hot'"),
    "rid a dict": ({**GOOD, "rid": {"a": 1}}, "rid must be a string"),
    "rid a nested list": ({**GOOD, "rid": [[1]]}, "rid must be a string"),
    "body a list": ([GOOD], "the request body must be a JSON object"),
    "body not JSON": ("{'input_ids': [1]", "the request body is not JSON"),
    "deep nesting": (DEEP, "nested too deeply"),
    "top_k Infinity": ('{"input_ids": [1, 2, 3], "sampling_params": {"top_k": Infinity}}',
                       "top_k must be -1 (every token) or an integer in [1, 2**31), got inf"),
    "top_k 1e300": ({**GOOD, "sampling_params": {"top_k": 1e300}},
                    "top_k must be -1 (every token) or an integer in [1, 2**31), got 1e+300"),
    "top_k 2.7": ({**GOOD, "sampling_params": {"top_k": 2.7}},
                  "top_k must be -1 (every token) or an integer in [1, 2**31), got 2.7"),
    "top_k 0": ({**GOOD, "sampling_params": {"top_k": 0}}, "top_k must be -1 (every token)"),
    "return_logprob a string": ({**GOOD, "return_logprob": "false"},
                                "return_logprob must be true or false (or a list of them), "
                                "got 'false'"),
}

ABORT = {
    "a list": ([1], "the request body must be a JSON object, got [1]"),
    "a string": ('"x"', "the request body must be a JSON object, got 'x'"),
    "not JSON": ("{", "the request body is not JSON"),
    "rid unhashable": ({"rid": ["a"]}, "rid must be a string, got ['a']"),
    "rid a number": ({"rid": 3}, "rid must be a string, got 3"),
    "abort_all a string": ({"abort_all": "yes"}, "abort_all must be true or false"),
    "deep nesting": (DEEP, "nested too deeply"),
}


@contextlib.asynccontextmanager
async def served_tiny(model=None):
    """The project's server on a tiny random model's engine; yields its URL."""
    options = engine_options(max_batch=2, min_batch=2, max_len=16, min_len=16)
    engine = EmbeddedEngine(model or Qwen3(CFG, rngs=nnx.Rngs(0)), options, seed=0)
    try:
        async with served(engine) as url:
            yield url
    finally:
        engine.close()


async def post(http, url, body):
    kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} \
        if isinstance(body, str) else {"json": body}
    async with http.post(url, **kwargs) as r:
        return r.status, await r.text()


def test_malformed_bodies_answer_400_with_the_reason_and_the_server_serves_on():
    async def go():
        async with served_tiny() as url, SGLangClient([url], sglang_config()) as client:
            http = client._http()
            answers = {}
            for route, cases in (("/generate", GENERATE), ("/abort_request", ABORT),
                                 ("/pause_generation", {"a list": ABORT["a list"]})):
                for name, (body, _) in cases.items():
                    answers[route, name] = await post(http, url + route, body)
            (ok,) = await client.generate([GenerateRequest([1, 2, 3], 2, temperature=0.0)])
            return answers, ok

    answers, ok = asyncio.run(go())
    expected = {("/generate", k): m for k, (_, m) in GENERATE.items()}
    expected |= {("/abort_request", k): m for k, (_, m) in ABORT.items()}
    expected[("/pause_generation", "a list")] = ABORT["a list"][1]
    wrong = {key: answers[key] for key, message in expected.items()
             if answers[key][0] != 400
             or message not in json.loads(answers[key][1])["error"]["message"]}
    assert not wrong
    assert len(ok.output_ids) == 2 and ok.finish_reason == "length"


@pytest.mark.parametrize("body", [{"rid": "nobody"}, {"abort_all": True}, {}, None])
def test_wellformed_abort_bodies_answer_200(body):
    async def go():
        async with served_tiny() as url, SGLangClient([url], sglang_config()) as client:
            return (await post(client._http(), url + "/abort_request", body or ""))[0]

    assert asyncio.run(go()) == 200


def test_weights_of_another_config_are_refused_with_the_fields_that_differ(tmp_path):
    """A reload from a directory whose config.json differs (rope_theta) answers 400
    naming the field, and the server keeps its model; the same config reloads (200)."""
    model = Qwen3(CFG, rngs=nnx.Rngs(0))
    same, other = str(tmp_path / "same"), str(tmp_path / "other")
    hf_io.save_hf(model, CFG, same)
    hf_io.save_hf(model, dataclasses.replace(CFG, rope_theta=500_000.0), other)

    async def go():
        async with served_tiny(model) as url, SGLangClient([url], sglang_config()) as client:
            http = client._http()
            refused = await post(http, url + "/update_weights_from_disk", {"model_path": other})
            loaded = await post(http, url + "/update_weights_from_disk", {"model_path": same})
            async with http.get(url + "/get_model_info") as r:
                info = await r.json()
            return refused, loaded, info

    (status, text), loaded, info = asyncio.run(go())
    assert status == 400 and "rope_theta 10000.0 -> 500000.0" in json.loads(text)["message"]
    assert loaded[0] == 200 and info["model_path"] == same
