"""Episodes over two real `inference.server` processes: sent by the client itself (sticky
sessions) and through a real SGLang gateway (`smg`, pip package smg). Where each turn
ran is read from the servers' own access logs (each request's routing key).

References: the servers' logs (requests per routing key, reloads per server), smg's
worker list, SIGKILL of one server.
"""

import asyncio
import collections
import os
import re
import signal
import time

import pytest

from inference.engine import GenerateRequest
from inference.gateway import Gateway
from inference.sglang import SGLangClient
from models import hf_io
from tests.owners import sglang_config
from tests.test_server_client import CFG, tiny_model, two_servers

SESSIONS, TURNS = 6, 3
# Episodes in the spread check: the gateway hashes each routing key onto a ring of the two
# servers (whose ports are new each run), so n keys all land on one server with
# probability about 2**(1 - n): 3% for 6, 3e-5 for 16.
SPREAD_SESSIONS = 16
GENERATE = re.compile(r'"POST /generate HTTP/1.1" 200 .* routing_key=(\S+)')
RELOAD = re.compile(r'"POST /update_weights_from_disk HTTP/1.1" 200')


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Two HF directories of different random models."""
    out = []
    for seed in (0, 1):
        path = str(tmp_path_factory.mktemp(f"hf{seed}"))
        hf_io.save_hf(tiny_model(seed), CFG, path)
        out.append(path)
    return out


@pytest.fixture(scope="module")
def servers(weights, tmp_path_factory):
    yield from two_servers(weights[0], tmp_path_factory)


@pytest.fixture(scope="module")
def gateway(servers):
    with Gateway([s.url for s in servers]) as gw:
        yield gw


def turns_by_server(servers, prefix: str, total: int, wait_s: float = 10.0
                    ) -> dict[str, collections.Counter]:
    """routing key -> Counter(server index -> answered /generate calls), from the logs,
    once they hold `total` such calls (a server writes its access-log line after the
    response has gone out, so the client can read the answer before the line exists)
    or after wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for i, server in enumerate(servers):
            with open(server.config.log_path) as f:
                for key in GENERATE.findall(f.read()):
                    if key.startswith(prefix):
                        out[key][i] += 1
        if sum(map(sum, (c.values() for c in out.values()))) >= total or \
                time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def reloads(servers) -> list[int]:
    out = []
    for server in servers:
        with open(server.config.log_path) as f:
            out.append(len(RELOAD.findall(f.read())))
    return out


async def episode(client, session: str, turns: int, seed: int) -> list:
    """`turns` requests, each continuing the last one's context (a multi-turn episode)."""
    context, results = [1 + seed % 300, 2, 3], []
    for turn in range(turns):
        [result] = await client.generate([GenerateRequest(
            context, 4, temperature=1.0, seed=seed * 10 + turn, session=session)])
        results.append(result)
        context = context + list(result.output_ids) + [5]
    return results


def client_for(servers, gateway, mode: str, **cfg) -> SGLangClient:
    router = gateway.url if mode == "smg" else ""
    return SGLangClient([s.url for s in servers], sglang_config(router=router, **cfg))


@pytest.mark.parametrize("mode", ["sticky", "smg"])
def test_every_turn_of_an_episode_on_one_server(servers, gateway, mode):
    prefix = f"{mode}-one-"

    async def go():
        async with client_for(servers, gateway, mode) as client:
            return await asyncio.gather(*(episode(client, f"{prefix}{i}", TURNS, i)
                                          for i in range(SPREAD_SESSIONS)))

    results = asyncio.run(go())
    assert all(len(r) == TURNS for r in results)
    seen = turns_by_server(servers, prefix, SPREAD_SESSIONS * TURNS)
    assert sorted(seen) == sorted(f"{prefix}{i}" for i in range(SPREAD_SESSIONS))
    for key, where in seen.items():  # one server, every turn once
        assert len(where) == 1 and sum(where.values()) == TURNS, (key, where)
    assert {i for where in seen.values() for i in where} == {0, 1}  # both servers serve


@pytest.mark.parametrize("mode", ["sticky", "smg"])
def test_one_reload_per_server_per_version_with_generation_in_flight(servers, gateway,
                                                                     weights, mode):
    prefix = f"{mode}-reload-"
    before = reloads(servers)

    async def go():
        async with client_for(servers, gateway, mode) as client:
            running = asyncio.gather(*(episode(client, f"{prefix}{i}", 2 * TURNS, i)
                                       for i in range(SESSIONS)))
            await asyncio.sleep(0.05)
            await client.update_weights(weights[1])
            await client.update_weights(weights[0])
            return await running, client.version

    results, version = asyncio.run(go())
    assert version == 2
    assert [a - b for a, b in zip(reloads(servers), before, strict=True)] == [2, 2]
    for session in results:  # the versions a session's turns record never go back
        versions = [r.policy_version for r in session]
        assert versions == sorted(versions) and set(versions) <= {0, 1, 2}
    seen = turns_by_server(servers, prefix, SESSIONS * 2 * TURNS)
    for key, where in seen.items():
        assert len(where) == 1 and sum(where.values()) == 2 * TURNS, (key, where)


@pytest.mark.parametrize("mode", ["smg"])
def test_failover_when_a_server_is_killed(servers, gateway, mode):
    """Server 1 is SIGKILLed between the turns of running episodes: every turn is still
    answered once; the episodes it held go on on server 0."""
    prefix = f"{mode}-failover-"

    async def go():
        cfg = dict(max_retries=8, backoff_s=0.2, down_s=60)
        async with client_for(servers, gateway, mode, **cfg) as client:
            first = await asyncio.gather(*(episode(client, f"{prefix}{i}", 1, i)
                                           for i in range(SESSIONS)))
            # (the first turns' log lines written before the kill, which would lose them)
            turns_by_server(servers, prefix, SESSIONS)
            os.killpg(servers[1].process.pid, signal.SIGKILL)
            rest = await asyncio.gather(*(episode(client, f"{prefix}{i}", TURNS, 100 + i)
                                          for i in range(SESSIONS)))
            return first, rest

    first, rest = asyncio.run(go())
    assert all(len(r) == 1 for r in first) and all(len(r) == TURNS for r in rest)
    seen = turns_by_server(servers, prefix, SESSIONS * (1 + TURNS))
    moved = [k for k, where in seen.items() if where[1]]
    assert moved, "server 1 held episodes before it was killed"
    for key, where in seen.items():
        assert where[1] <= 1 and sum(where.values()) == 1 + TURNS, (key, where)
