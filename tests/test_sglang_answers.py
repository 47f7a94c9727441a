"""SGLangClient against a misbehaving SGLang 0.5.x server (tests/sglang_stub.py over real
HTTP): every malformed answer is an EngineError naming what was wrong, after a bounded
retry; weight versions never go backwards; a restarted server is reloaded before its
answers are used; a pause is always followed by a confirmed continue."""

import asyncio
import math

import pytest

from inference import sglang
from inference.engine import EngineError, GenerateRequest
from tests.owners import sglang_config
from tests.sglang_stub import StubSGLang, expected_ids, token_logprob


def run(coro):
    return asyncio.run(coro)


async def with_stub(body, **stub_kw):
    stub = await StubSGLang(**stub_kw).start()
    try:
        return await body(stub)
    finally:
        await stub.stop()


def tokens(answer, ids, logprobs=None):
    """`answer` with its output replaced by `ids` (and their log-probs)."""
    logprobs = logprobs if logprobs is not None else [-0.5] * len(ids)
    answer["output_ids"] = list(ids)
    answer["meta_info"]["output_token_logprobs"] = [[lp, t, None]
                                                   for lp, t in zip(logprobs, ids, strict=True)]
    return answer


def meta(answer, **fields):
    answer["meta_info"].update(fields)
    return answer


MALFORMED = {
    "empty object": (lambda a: {}, "not an object with meta_info"),
    "a list": (lambda a: [a], "not an object with meta_info"),
    "string token id": (lambda a: tokens(a, ["5", 6]), r"token ids \['5'\] outside \[0, 1000\)"),
    "80 tokens for 8": (lambda a: tokens(a, list(range(80))), "80 tokens for max_new_tokens 8"),
    "ids without log-probs": (lambda a: meta(a, output_token_logprobs=[]),
                              r"log-probs for \[\] \(0 ids\)"),
    "log-probs missing": (lambda a: meta(a, output_token_logprobs=None),
                          "output_token_logprobs None: not a list"),
    "log-prob +3": (lambda a: tokens(a, [1, 2], [-0.1, 3.0]), r"log-probs \[3.0\]"),
    "log-prob NaN": (lambda a: tokens(a, [1, 2], [math.nan, -0.1]), r"log-probs \[nan\]"),
    "log-prob -inf": (lambda a: tokens(a, [1, 2], [-0.1, -math.inf]), r"log-probs \[-inf\]"),
    "token id -7": (lambda a: tokens(a, [-7]), r"token ids \[-7\] outside"),
    "token id 1e9": (lambda a: tokens(a, [1e9]), r"token ids \[1000000000.0\] outside"),
    "token id 2**40": (lambda a: tokens(a, [2**40]), r"token ids \[1099511627776\] outside"),
    "token id true": (lambda a: tokens(a, [True]), r"token ids \[True\] outside"),
    "finish_reason null": (lambda a: meta(a, finish_reason=None), "finish_reason None"),
    "finish_reason unknown": (lambda a: meta(a, finish_reason={"type": "eos"}),
                              "finish_reason {'type': 'eos'}"),
    "weight_version garbage": (lambda a: meta(a, weight_version="garbage"),
                               "weight_version 'garbage' is not a version"),
    "weight_version -3": (lambda a: meta(a, weight_version="-3"),
                          "weight_version '-3' is not a version"),
    "weight_version missing": (lambda a: (a["meta_info"].pop("weight_version"), a)[1],
                               "without meta_info.weight_version"),
    "stop without its token": (lambda a: meta(a, finish_reason={"type": "stop", "matched": 7}),
                               "a stop ends on the token it matched"),
    "stop on nothing": (lambda a: meta(a, finish_reason={"type": "stop"}),
                        "a stop ends on the token it matched"),
    "length with 2 of 8": (lambda a: tokens(a, [1, 2]), "with 2 of 8 tokens"),
    "cached_tokens -40": (lambda a: meta(a, cached_tokens=-40), "cached_tokens -40: not a"),
    "cached_tokens 2.5": (lambda a: meta(a, cached_tokens=2.5), "cached_tokens 2.5: not a"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_answer_is_an_engine_error_after_a_bounded_retry(case):
    hook, message = MALFORMED[case]

    async def body(stub):
        stub.answer_hook = hook
        async with sglang.SGLangClient([stub.url], sglang_config(max_retries=1, backoff_s=0.01),
                                       vocab_size=1000) as client:
            with pytest.raises(EngineError, match=message) as caught:
                await client.generate([GenerateRequest([1, 2, 3], 8)])
            stub.answer_hook = None
            (ok,) = await client.generate([GenerateRequest([1, 2, 3], 8)])
        return caught.value, ok, stub.generated_requests

    error, ok, calls = run(with_stub(body, token_s=0.0005))
    assert "no inference server answered after 2 attempts" in str(error)
    assert calls == 3  # the first try, one retry, then the good request
    assert ok.output_ids == expected_ids([1, 2, 3], 8)


def test_vocabulary_comes_from_the_model_config():
    class Cfg:
        vocab_size = 500

    async def body(stub):
        stub.answer_hook = lambda a: tokens(a, [499, 500])
        async with sglang.SGLangClient([stub.url], sglang_config(max_retries=0),
                                       model_config=Cfg()) as client:
            with pytest.raises(EngineError, match=r"token ids \[500\] outside \[0, 500\)"):
                await client.generate([GenerateRequest([1], 2)])

    run(with_stub(body, token_s=0.0005))


def test_finish_reason_null_is_not_continued_as_an_abort():
    """A client that loads no weights continues aborted requests (another process's
    reload); a null finish_reason is not an abort: no continuation joins partial outputs."""
    async def body(stub):
        stub.answer_hook = lambda a: meta(a, finish_reason=None)
        async with sglang.SGLangClient([stub.url], sglang_config(max_retries=2,
                                                                 backoff_s=0.01)) as client:
            with pytest.raises(EngineError, match="finish_reason None"):
                await client.generate([GenerateRequest([4, 5], 6)])
        return stub.prompt_lengths

    # Three tries of the original 2-token prompt, none continued from partial output.
    assert run(with_stub(body, token_s=0.0005)) == [2, 2, 2]


def test_a_reported_weight_version_never_goes_backwards():
    """A client sharing servers it does not update follows their reported versions:
    5, then 7, then 2 (backwards) is refused with both numbers."""
    async def body(stub):
        async with sglang.SGLangClient([stub.url], sglang_config(max_retries=0)) as client:
            got = []
            for version in ("5", "7"):
                stub.weight_version = version
                (result,) = await client.generate([GenerateRequest([1, 2], 3)])
                got.append(result.policy_version)
            stub.weight_version = "2"
            with pytest.raises(EngineError, match="reports weight_version 2 after 7"):
                await client.generate([GenerateRequest([1, 2], 3)])
            for bad in ("garbage", "-3"):
                stub.weight_version = bad
                with pytest.raises(EngineError, match=f"weight_version '{bad}' is not"):
                    await client.generate([GenerateRequest([1, 2], 3)])
        return got

    assert run(with_stub(body, token_s=0.0005)) == [5, 7]


@pytest.mark.parametrize("on_restart", sglang.ON_RESTART)
def test_a_restarted_server_is_reloaded_before_its_answers_are_used(tmp_path, on_restart):
    """The trainer loaded version 2; the server restarts on its launch weights and
    answers weight_version "default". That answer is never labelled version 2: the
    server is reloaded, and the request is sent again ("reload") or fails ("drop")."""
    paths = [tmp_path / "w1", tmp_path / "w2"]
    for p in paths:
        p.mkdir()

    async def body(stub):
        async with sglang.SGLangClient([stub.url], sglang_config(max_retries=2, backoff_s=0.01,
                                                                 on_restart=on_restart)) as client:
            for p in paths:
                await client.update_weights(str(p))
            stub.restart()
            if on_restart == "drop":
                with pytest.raises(EngineError, match="weight_version 0 for a request sent "
                                   "while it served version 2: it restarted"):
                    await client.generate([GenerateRequest([1, 2], 4)])
            (result,) = await client.generate([GenerateRequest([1, 2], 4)])
        return result, stub.reloads, stub.weight_version

    result, reloads, served = run(with_stub(body, token_s=0.0005))
    assert reloads == [str(paths[0]), str(paths[1]), str(paths[1])]
    assert served == "2" and result.policy_version == 2
    assert result.output_ids == expected_ids([1, 2], 4)


@pytest.mark.parametrize("fault", [503, "drop"])
def test_a_failed_continue_is_retried_and_the_server_serves_again(tmp_path, fault):
    async def body(stub):
        stub.faults["/continue_generation"] = [fault]
        async with sglang.SGLangClient([stub.url], sglang_config(backoff_s=0.01,
                                                                 timeout_s=5)) as client:
            await client.update_weights(str(tmp_path))
            paused = stub._paused
            (result,) = await asyncio.wait_for(
                client.generate([GenerateRequest([1, 2], 4)]), timeout=5)
        return paused, result, stub.routes_called

    paused, result, routes = run(with_stub(body, token_s=0.0005))
    assert not paused and result.policy_version == 1
    assert routes.count("/continue_generation") == 2


def test_a_server_that_stays_paused_is_named_and_gets_no_traffic(tmp_path):
    async def body(stub):
        stub.faults["/continue_generation"] = [503] * 3
        async with sglang.SGLangClient([stub.url], sglang_config(max_retries=2, backoff_s=0.01,
                                                                 timeout_s=5)) as client:
            with pytest.raises(EngineError, match=f"{stub.url} stays paused: "
                               "/continue_generation failed 3 times"):
                await client.update_weights(str(tmp_path))
            assert stub._paused and "/generate" not in stub.routes_called
            # The next request first continues it (the fault has cleared).
            (result,) = await asyncio.wait_for(
                client.generate([GenerateRequest([1, 2], 4)]), timeout=5)
        return result, stub._paused

    result, paused = run(with_stub(body, token_s=0.0005))
    assert not paused and result.output_ids == expected_ids([1, 2], 4)


def test_a_continue_that_fails_for_good_leaves_a_true_label_and_frees_held_requests(tmp_path):
    """The server loads v1, then its /continue_generation fails for good: the update
    says the weights were loaded (and by whom), the client's version is 1, so the next
    update loads new weights as v2 (not skipped as "v1 already there"); the request the
    pause held is sent again within seconds, not left to its 60 s timeout."""
    first, second = tmp_path / "v1", tmp_path / "v2"
    first.mkdir()
    second.mkdir()

    async def body(stub):
        stub.faults["/continue_generation"] = [503] * 3
        async with sglang.SGLangClient([stub.url], sglang_config(max_retries=2, backoff_s=0.01,
                                                                 timeout_s=60)) as client:
            held = asyncio.ensure_future(client.generate([GenerateRequest([1, 2], 100)]))
            while not stub._running:
                await asyncio.sleep(0.005)
            with pytest.raises(EngineError, match=r"weights v1 from .* loaded, but no server "
                               f"serves them: {stub.url}: {stub.url} stays paused"):
                await client.update_weights(str(first))
            assert client.version == 1 and stub.weight_version == "1"
            (result,) = await asyncio.wait_for(held, timeout=5)
            await client.update_weights(str(second))
            return result, stub.reloads, stub.weight_version, client.version

    result, reloads, served, version = run(with_stub(body, token_s=0.005))
    assert result.output_ids == expected_ids([1, 2], 100) and result.policy_version == 1
    assert reloads == [str(first), str(second)] and served == "2" and version == 2


def test_valid_answers_pass_unchanged():
    async def body(stub):
        async with sglang.SGLangClient([stub.url], sglang_config(), vocab_size=1000) as client:
            return await client.generate([GenerateRequest([7, 8], 5)])

    (result,) = run(with_stub(body, token_s=0.0005))
    assert result.output_ids == expected_ids([7, 8], 5)
    assert result.logprobs == [token_logprob(t) for t in result.output_ids]
    assert result.finish_reason == "length" and result.policy_version == 0
