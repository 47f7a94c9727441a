"""EmbeddedEngine against the full forward pass, the log-prob kernel and a naive sampler."""

import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference.embedded import (
    _PREFILL_CALL_TOKENS,
    EmbeddedEngine,
    MapBudget,
    bucket,
    map_count,
    prefill_groups,
)
from inference.engine import GenerateRequest
from inference.sampling import (
    RowSampling,
    first_argmax,
    greedy_tokens,
    inverse_cdf,
    nucleus_mask,
    sample_tokens,
    truncation_mask,
    uniform_at,
)
from kernels.logprob.api import token_logprobs
from models.qwen3 import Qwen3, Qwen3Config
from tests.owners import engine_options

CFG = Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                  tie_word_embeddings=False)
REF_LEN = 64


def tiny_model(seed: int) -> Qwen3:
    """Random tiny Qwen3 with a scaled-up output head: next-token distributions with a
    clear mode (max prob ~0.2) that sampling still often leaves."""
    model = Qwen3(CFG, rngs=nnx.Rngs(seed))
    model.lm_head_proj.kernel[...] = model.lm_head_proj.kernel[...] * 14.0
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def engine(model):
    eng = EmbeddedEngine(model, engine_options(max_batch=32, max_len=64, min_batch=8, min_len=32,
                                               min_cache_len=64), seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def forward(model):
    """Full (cache-free) forward of one sequence padded to REF_LEN -> hidden [REF_LEN, d]."""
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def run(params, tokens, segment_ids):
        m = nnx.merge(graphdef, params)
        return m(tokens[None], jnp.arange(REF_LEN)[None], segment_ids[None])[0], m.lm_head()

    def call(ids):
        tokens = np.zeros(REF_LEN, np.int32)
        tokens[:len(ids)] = ids
        segment_ids = (np.arange(REF_LEN) < len(ids)).astype(np.int32)
        return run(params, jnp.asarray(tokens), jnp.asarray(segment_ids))

    return call


def run(coro):
    return asyncio.run(coro)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, length).tolist()


def test_greedy_equals_stepwise_argmax_of_full_forward(engine, forward):
    ids = prompt(1, 7)
    (res,) = run(engine.generate([GenerateRequest(ids, 12, temperature=0.0)]))
    seq = list(ids)
    for _ in range(12):
        hidden, head = forward(seq)
        seq.append(int(jnp.argmax(hidden[len(seq) - 1] @ head)))
    assert res.output_ids == seq[len(ids):]
    assert res.finish_reason == "length"
    assert set(res.timings) == {"prefill_s", "decode_s", "queue_s"}


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_logprobs_match_kernel(engine, forward, temperature):
    ids = prompt(2, 9)
    req = GenerateRequest(ids, 16, temperature=temperature, seed=5)
    (res,) = run(engine.generate([req]))
    n = len(res.output_ids)
    hidden, head = forward(ids + res.output_ids)
    rows = hidden[len(ids) - 1:len(ids) - 1 + n]
    logp, _ = token_logprobs(rows, head, jnp.asarray(res.output_ids), jnp.ones(n),
                             temperature=temperature or 1.0, implementation="reference")
    np.testing.assert_allclose(res.logprobs, np.asarray(logp), atol=1e-4)
    if temperature > 0:  # really sampled: some token is not the argmax
        greedy = run(engine.generate([GenerateRequest(ids, 16, temperature=0.0)]))[0]
        assert res.output_ids != greedy.output_ids


def test_greedy_without_logprobs_gives_the_same_tokens(engine):
    ids = [prompt(3, 9), prompt(4, 5)]
    want = run(engine.generate([GenerateRequest(p, 12, temperature=0.0) for p in ids]))
    got = run(engine.generate([GenerateRequest(p, 12, temperature=0.0, return_logprob=False)
                               for p in ids]))
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert all(len(r.logprobs) == 12 and np.isnan(r.logprobs).all() for r in got)
    assert all(np.isfinite(r.logprobs).all() for r in want)


def test_stop_ids_and_max_new_tokens(engine):
    ids = prompt(3, 5)
    (full,) = run(engine.generate([GenerateRequest(ids, 20, temperature=0.9, seed=1)]))
    stop = full.output_ids[6]
    first = full.output_ids.index(stop)
    (res,) = run(engine.generate([GenerateRequest(ids, 20, temperature=0.9, seed=1,
                                                  stop_token_ids=(stop, CFG.vocab_size + 1))]))
    assert res.output_ids == full.output_ids[:first + 1]
    assert res.finish_reason == "stop"
    assert res.logprobs == full.logprobs[:first + 1]
    (short,) = run(engine.generate([GenerateRequest(ids, 3, temperature=0.9, seed=1)]))
    assert short.output_ids == full.output_ids[:3] and short.finish_reason == "length"
    (one,) = run(engine.generate([GenerateRequest(ids, 1, temperature=0.9, seed=1)]))
    assert one.output_ids == full.output_ids[:1] and one.finish_reason == "length"


def test_seeded_sampling_is_reproducible(engine):
    ids = prompt(4, 6)
    a, b, c = (run(engine.generate([GenerateRequest(ids, 16, seed=s)]))[0] for s in (7, 7, 8))
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    assert a.output_ids != c.output_ids


def _mixed_requests(n: int) -> list[GenerateRequest]:
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(n):
        kind = i % 4
        reqs.append(GenerateRequest(
            prompt(100 + i, int(rng.integers(1, 15))), int(rng.integers(1, 17)),
            temperature=[0.0, 1.0, 0.7, 1.3][kind], top_p=[1.0, 1.0, 0.8, 0.95][kind],
            top_k=[-1, -1, 20, 5][kind], stop_token_ids=tuple(rng.integers(0, 384, 3)),
            seed=1000 + i))
    return reqs


def test_concurrent_callers_get_their_own_results(engine):
    reqs = _mixed_requests(64)

    async def together():
        return await asyncio.gather(*(engine.generate([r]) for r in reqs))

    async def alone():
        return [await engine.generate([r]) for r in reqs]

    batched, single = run(together()), run(alone())
    for r, (b,), (s,) in zip(reqs, batched, single, strict=True):
        assert b.output_ids == s.output_ids
        np.testing.assert_allclose(b.logprobs, s.logprobs, atol=1e-5)
        assert b.finish_reason == s.finish_reason
        assert 1 <= len(b.output_ids) <= r.max_new_tokens
        stopped = b.output_ids[-1] in r.stop_token_ids
        assert b.finish_reason == ("stop" if stopped else "length")
        assert not set(b.output_ids[:-1]) & set(r.stop_token_ids)
    assert any(b.finish_reason == "stop" for (b,) in batched)


def test_short_request_returns_while_a_long_one_runs(model):
    """Continuous batching: a row that finishes hands its result back (and its slot on)
    without waiting for the longest row of its batch."""
    with EmbeddedEngine(model, engine_options(max_batch=4, max_len=64, min_len=16,
                                              min_cache_len=64, chunk_steps=2), seed=0) as eng:
        async def both():
            long = asyncio.ensure_future(eng.generate([GenerateRequest(prompt(6, 4), 56)]))
            short = asyncio.ensure_future(eng.generate([GenerateRequest(prompt(7, 4), 2)]))
            done, _ = await asyncio.wait([long, short], return_when=asyncio.FIRST_COMPLETED)
            assert done == {short} and not long.done()
            return (await long)[0]

        assert len(run(both()).output_ids) == 56


def test_update_weights_from_params_and_hf_dir(model, tmp_path):
    from models import hf_io

    other = tiny_model(1)
    reqs = [GenerateRequest(prompt(5, 8), 10, temperature=0.0)]
    with EmbeddedEngine(model, engine_options(max_batch=4, min_batch=4, max_len=64, min_len=32,
                                              min_cache_len=64), seed=0) as eng, \
            EmbeddedEngine(other, engine_options(max_batch=4, min_batch=4, max_len=64, min_len=32,
                                                 min_cache_len=64), seed=0) as ref:
        before = run(eng.generate(reqs))[0].output_ids
        expected = run(ref.generate(reqs))[0].output_ids
        assert before != expected
        run(eng.update_weights(nnx.state(other, nnx.Param)))
        (after,) = run(eng.generate(reqs))
        assert after.output_ids == expected and after.policy_version == 1
        hf_io.save_hf(model, CFG, str(tmp_path / "hf"))
        run(eng.update_weights(str(tmp_path / "hf")))
        assert run(eng.generate(reqs))[0].output_ids == before
        wrong = jax.tree.map(lambda x: x[:1], nnx.state(other, nnx.Param))
        with pytest.raises(ValueError, match="shape"):
            run(eng.update_weights(wrong))


def test_map_budget_clears_compiled_shapes_past_its_share_of_the_limit():
    """A call that compiled, with the process's mappings past share x limit, clears the
    caches and the mappings fall; with nothing compiled since the last check, or no
    readable limit, nothing is cleared."""
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0) * jnp.cos(x).mean())
    for n in range(3, 7):
        f(jnp.ones((n, 5)))
    idle = MapBudget([f], share=1.0, limit=map_count() + 1)
    idle.check()  # past the limit, but nothing compiled since it was made
    assert idle.clears == 0 and f._cache_size() == 4
    budget = MapBudget([f], share=1.0, limit=map_count() + 1)
    f(jnp.ones((7, 5)))
    held = map_count()
    budget.check()
    assert budget.clears == 1 and f._cache_size() == 0 and map_count() < held
    f(jnp.ones((3, 5)))
    budget.check()  # compiled, but under the limit again
    assert budget.clears == 1 and f._cache_size() == 1
    off = MapBudget([f], limit=0)
    f(jnp.ones((4, 5)))
    off.check()
    assert off.clears == 0 and f._cache_size() == 2


def test_clearing_compiled_shapes_changes_no_output(model, engine):
    """An engine whose budget is nearly spent clears its shapes again and again while
    serving, and returns what the unconstrained engine returns."""
    reqs = _mixed_requests(24)

    async def together(eng):
        return await asyncio.gather(*(eng.generate([r]) for r in reqs))

    with EmbeddedEngine(model, engine_options(max_batch=32, max_len=64, min_batch=8,
                                              min_len=32, min_cache_len=64), seed=0) as tight:
        tight.map_budget.share, tight.map_budget.limit = 1.0, map_count() + 50
        got, want = run(together(tight)), run(together(engine))
        assert tight.map_budget.clears >= 2
    for (a,), (b,) in zip(got, want, strict=True):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def _conversations(engine, turns: int, n: int, temperature: float):
    """n multi-turn exchanges: each turn's prompt is the previous prompt + output + a
    fresh 'observation'; returns every turn's result."""

    async def one(i):
        ids, out = prompt(200 + i, 5 + i), []
        for t in range(turns):
            (res,) = await engine.generate([GenerateRequest(
                ids, 6, temperature=temperature, seed=10 * i + t)])
            out.append(res)
            ids = ids + res.output_ids + prompt(300 + 10 * i + t, 3 + t)
        return out

    async def all_():
        return await asyncio.gather(*(one(i) for i in range(n)))

    return run(all_())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefix_cache_reuses_turns_and_changes_no_output(model, temperature):
    # One row bucket (8) keeps the compiled shapes few; windows still vary (32, 64).
    with EmbeddedEngine(model, engine_options(max_batch=8, min_batch=8, max_len=64, min_len=32,
                                              prefix_cache_tokens=4096), seed=0) as cached, \
            EmbeddedEngine(model, engine_options(max_batch=8, min_batch=8, max_len=64, min_len=32),
                           seed=0) as plain:
        got = _conversations(cached, turns=3, n=5, temperature=temperature)
        want = _conversations(plain, turns=3, n=5, temperature=temperature)
        for conv_got, conv_want in zip(got, want, strict=True):
            for t, (a, b) in enumerate(zip(conv_got, conv_want, strict=True)):
                assert a.output_ids == b.output_ids
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
                assert b.cached_tokens == 0
                # Turn t > 0 reuses everything the previous turn fed: its prompt and all
                # but its last output id.
                if t == 0:
                    assert a.cached_tokens == 0
                else:
                    prev_prompt = 5 + got.index(conv_got) + sum(
                        len(r.output_ids) + 3 + j for j, r in enumerate(conv_got[:t - 1]))
                    assert a.cached_tokens == prev_prompt + len(conv_got[t - 1].output_ids) - 1
        # New weights empty the cache: the next turn prefills from scratch.
        run(cached.update_weights(nnx.state(model, nnx.Param)))
        assert len(cached.prefix_cache) == 0
        again = _conversations(cached, turns=1, n=1, temperature=temperature)
        assert again[0][0].cached_tokens == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_shared_prompts_copy_keys_and_values_and_change_no_output(model, temperature):
    """Eight requests from one 45-id prompt (a task's group) and two that extend it:
    one prefills the shared 32-id block, the others copy it; every output and log-prob
    is what each request gets alone in a fresh engine."""
    base = prompt(7, 45)
    prompts = [base] * 8 + [base + prompt(8, 4), prompt(9, 20)]
    reqs = [GenerateRequest(p, 6, temperature=temperature, seed=i) for i, p in enumerate(prompts)]
    opts = dict(max_batch=16, min_batch=8, max_len=64, min_len=32, min_cache_len=64)
    with EmbeddedEngine(model, engine_options(**opts), seed=0) as eng:
        got = run(eng.generate(reqs))
    for req, res in zip(reqs, got, strict=True):
        with EmbeddedEngine(model, engine_options(**opts), seed=0) as alone:
            (want,) = run(alone.generate([req]))
        assert res.output_ids == want.output_ids
        np.testing.assert_allclose(res.logprobs, want.logprobs, atol=1e-5)
    assert [r.cached_tokens for r in got] == [0] + [32] * 8 + [0]


def test_bucket_rounds_to_powers_of_two_then_to_multiples_of_step():
    assert [bucket(n, 64) for n in (0, 1, 3, 8, 9, 33, 100)] == [1, 1, 4, 8, 16, 64, 64]
    assert [bucket(n, 1024, 64) for n in (1, 65, 600)] == [64, 128, 1024]
    assert [bucket(n, 64, 1, 8) for n in (3, 8, 9, 17, 24, 25, 70)] == [4, 8, 16, 24, 24, 32, 64]
    assert [bucket(n, 1024, 256, 256) for n in (1, 257, 600, 769, 2000)] == [
        256, 512, 768, 1024, 1024]


def test_shared_prefixes_find_the_longest_whole_block_match():
    from inference.embedded import SharedPrefixes, block_hashes

    index, a = SharedPrefixes(4), list(range(10))
    index.add(block_hashes([], a, len(a), 4), a, slot=3)  # blocks [0,4) and [4,8)
    assert index.longest(block_hashes([], a, 9, 4), a) == (3, 8)
    assert index.longest(block_hashes([], a[:7], 7, 4), a[:7]) == (3, 4)
    b = a[:5] + [99] * 5
    assert index.longest(block_hashes([], b, 10, 4), b) == (3, 4)
    assert index.longest(block_hashes([], [9] + a, 11, 4), [9] + a) is None
    grown = block_hashes([], a, 5, 4)  # extended in place as ids grow
    assert block_hashes(grown, a, 9, 4) == block_hashes([], a, 9, 4)


def test_prefix_cache_lookup_and_lru_budget():
    from inference.embedded import PrefixCache

    pc = PrefixCache(max_tokens=10)
    assert pc.insert([1, 2, 3], 0) == [] and pc.insert([1, 2, 3, 4, 5], 1) == []
    assert pc.take([1, 2, 3, 4, 5]) == (0, 3)  # one id must stay to prefill
    assert pc.take([1, 2, 3, 4, 5]) is None  # the slot went on with the request
    assert pc.insert([1, 2, 3], 0) == []
    assert pc.take([1, 2, 9, 9]) is None and pc.take([2, 3, 4, 5]) is None
    assert pc.insert([7, 8, 9, 10], 2) == [1]  # 12 > 10 tokens: the least recently used goes
    assert pc.tokens == 7 and len(pc) == 2
    assert pc.take([1, 2, 3, 4, 5, 6]) == (0, 3)  # the longest match left
    assert pc.insert(list(range(11)), 3) == [3]  # longer than the budget: not kept
    assert pc.evict() == 2 and pc.evict() is None and pc.tokens == 0
    assert pc.insert([5], 4) == [] and pc.clear() == [4] and len(pc) == 0


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


@pytest.mark.parametrize("seed", range(4))
def test_prefill_groups_cost_least_of_every_partition(seed):
    """Against every partition of 7 rows (877 of them): the chosen grouping pads least
    (plus the per-call cost), and it covers each row once."""
    lengths = np.random.default_rng(seed).integers(1, 700, 7).tolist()
    lengths[seed] = 40  # at least one row of the narrowest width
    opts = dict(max_batch=8, min_batch=2, max_len=1024, min_len=64)

    def cost(groups):
        def area(g):  # the least rows: 2 up to 64 tokens wide, 1 past (128 tokens)
            width = bucket(max(lengths[i] for i in g), opts["max_len"], opts["min_len"])
            return bucket(len(g), opts["max_batch"], 2 if width <= 64 else 1) * width

        return sum(area(g) + _PREFILL_CALL_TOKENS for g in groups)

    groups = prefill_groups(lengths, **opts)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert cost(groups) == min(cost(p) for p in _partitions(list(range(7))))


def test_bad_requests_are_named(engine):
    with pytest.raises(ValueError, match="max_len"):
        run(engine.generate([GenerateRequest([1] * 60, 10)]))
    with pytest.raises(ValueError, match="vocabulary"):
        run(engine.generate([GenerateRequest([CFG.vocab_size], 2)]))
    with pytest.raises(ValueError, match="top_p"):
        GenerateRequest([1], 2, top_p=0.0)
    with pytest.raises(ValueError, match="prompt_ids"):
        GenerateRequest([], 2)


# ----------------------------------------------------------------------------- sampler


def _naive_keep(logits: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    order = np.argsort(-logits, kind="stable")
    k = len(logits) if top_k < 1 else top_k
    kept = order[:k]
    p = np.exp(logits[kept] - logits[kept].max())
    p /= p.sum()
    mass, n = 0.0, 0
    while n < k and mass < top_p:
        mass += p[n]
        n += 1
    keep = np.zeros(len(logits), bool)
    keep[kept[:n]] = True
    return keep


def test_truncation_mask_matches_naive():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 50)).astype(np.float32) * 2
    top_p = rng.choice([1.0, 0.9, 0.5, 0.05], 40).astype(np.float32)
    top_k = rng.choice([-1, 1, 3, 10], 40).astype(np.int32)
    got = np.asarray(truncation_mask(jnp.asarray(logits), jnp.asarray(top_p),
                                     jnp.asarray(top_k)))
    for i in range(40):
        np.testing.assert_array_equal(got[i], _naive_keep(logits[i], top_p[i], top_k[i]))


def test_nucleus_mask_matches_naive_top_p():
    """The bisection finds top-p's kept set exactly, ties included, with no sort."""
    rng = np.random.default_rng(6)
    logits = np.concatenate([rng.normal(size=(30, 700)) * 3,
                             rng.integers(-3, 3, (10, 700))]).astype(np.float32)  # ties
    logits[0, :5] = [-np.inf, 0.0, -0.0, 1e-30, -1e-30]
    # (at top_p 0.999 the mass above one boundary token is 2.5e-7 from it, under float32
    # summation error: the kept set is then a matter of rounding)
    top_p = rng.choice([0.95, 0.9, 0.5, 0.05], 40).astype(np.float32)
    probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    below = jnp.full(40, jnp.max(jnp.asarray(logits)))  # an upper end above every threshold
    got = np.asarray(jax.jit(nucleus_mask)(jnp.asarray(logits), probs, jnp.asarray(top_p),
                                           below))
    for i in range(40):
        threshold = logits[i][_naive_keep(logits[i], top_p[i], -1)].min()
        np.testing.assert_array_equal(got[i], logits[i] >= threshold)  # ties at it kept


def test_argmax_and_inverse_cdf_match_numpy():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, (50, 300)).astype(np.float32)  # many ties: the first index wins
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.argmax(x, -1))
    x[:, 290:] = 4  # the maximum in the last, partial block of 128 only
    x[:5, 7] = 4  # or also in the first
    tokens, logp = greedy_tokens(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(x, -1))
    lse = np.log(np.exp(x.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(logp), x.max(-1) - lse, atol=1e-5)
    w = rng.random((50, 300)).astype(np.float32) * (rng.random((50, 300)) < 0.3)
    u = rng.random(50).astype(np.float32)
    want = [np.searchsorted(np.cumsum(w[i]), u[i] * w[i].sum(), side="right") for i in range(50)]
    np.testing.assert_array_equal(np.asarray(inverse_cdf(jnp.asarray(w), jnp.asarray(u))), want)


def test_uniform_at_is_jax_random_bit_for_bit():
    """The unrolled Threefry gives exactly jax.random.uniform(fold_in(PRNGKey(seed), pos))."""
    rng = np.random.default_rng(3)
    seeds = rng.integers(0, 2**32, 500, dtype=np.uint64).astype(np.uint32)
    positions = rng.integers(0, 2**31 - 1, 500).astype(np.int32)
    want = jax.vmap(lambda s, p: jax.random.uniform(
        jax.random.fold_in(jax.random.PRNGKey(s), p)))(seeds, positions)
    got = jax.jit(uniform_at)(jnp.asarray(seeds), jnp.asarray(positions))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))


def test_greedy_rows_take_the_first_argmax_and_its_log_softmax():
    rng = np.random.default_rng(4)
    logits = rng.integers(0, 5, (16, 300)).astype(np.float32)  # ties: the first index wins
    temperature = np.where(np.arange(16) < 8, 0.0, 0.7).astype(np.float32)
    for t in (np.zeros(16, np.float32), temperature):  # all greedy, and mixed with sampled
        tokens, logp = jax.jit(sample_tokens)(
            jnp.asarray(logits), RowSampling(jnp.asarray(t), jnp.ones(16), -jnp.ones(16, jnp.int32),
                                             jnp.arange(16, dtype=jnp.uint32)),
            jnp.zeros(16, jnp.int32))
        greedy = t <= 0
        np.testing.assert_array_equal(np.asarray(tokens)[greedy], np.argmax(logits, -1)[greedy])
        lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
        np.testing.assert_allclose(np.asarray(logp)[greedy],
                                   (logits.max(-1) - lse)[greedy], atol=1e-5)


@pytest.mark.parametrize("mixed", [False, True], ids=["all_greedy", "with_sampled"])
def test_log_probs_left_out_only_when_no_row_wants_them(mixed):
    """All-greedy rows none of which wants its log-prob take the argmax alone (NaN
    log-probs); one row that wants it, or a sampled row, gives every row its log-prob."""
    rng = np.random.default_rng(5)
    logits = rng.integers(0, 5, (8, 300)).astype(np.float32)
    t = np.where((np.arange(8) == 3) & mixed, 0.7, 0.0).astype(np.float32)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    for want in (np.zeros(8, bool), np.arange(8) == 5):
        tokens, logp = jax.jit(sample_tokens)(
            jnp.asarray(logits), RowSampling(jnp.asarray(t), jnp.ones(8), -jnp.ones(8, jnp.int32),
                                             jnp.arange(8, dtype=jnp.uint32), jnp.asarray(want)),
            jnp.zeros(8, jnp.int32))
        greedy = t <= 0
        np.testing.assert_array_equal(np.asarray(tokens)[greedy], np.argmax(logits, -1)[greedy])
        if want.any() or mixed:
            np.testing.assert_allclose(np.asarray(logp)[greedy],
                                       (logits.max(-1) - lse)[greedy], atol=1e-5)
        else:
            assert np.isnan(np.asarray(logp)).all()


@pytest.mark.parametrize("candidates", [64, 2])  # 2: top-k 3 / top-p 0.8 need the full sort
def test_sample_frequencies_follow_truncated_softmax(candidates):
    n, logits = 20000, np.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0], np.float32)
    seeds, positions = jnp.full(n, 7, jnp.uint32), jnp.arange(n, dtype=jnp.int32)
    sample = jax.jit(functools.partial(sample_tokens, candidates=candidates))
    for temperature, top_p, top_k in [(1.0, 1.0, -1), (0.5, 1.0, 3), (1.3, 0.8, -1)]:
        tokens, logp = sample(
            jnp.tile(logits, (n, 1)), RowSampling(jnp.full(n, temperature), jnp.full(n, top_p),
                                                  jnp.full(n, top_k, jnp.int32), seeds),
            positions)
        scaled = logits / temperature
        keep = _naive_keep(scaled, top_p, top_k)
        p = np.where(keep, np.exp(scaled - scaled.max()), 0)
        p /= p.sum()
        freq = np.bincount(np.asarray(tokens), minlength=len(logits)) / n
        np.testing.assert_allclose(freq, p, atol=0.015)
        full = scaled - np.log(np.exp(scaled).sum())
        np.testing.assert_allclose(np.asarray(logp), full[np.asarray(tokens)], atol=1e-5)


def test_server_builds_engine_from_training_config(tmp_path):
    from configs.common import load_config
    from inference.server import engine_from_saved_config

    config = load_config("configs/default.py:smoke")
    (tmp_path / "config.json").write_text(config.to_json_best_effort(indent=1))
    engine, model_path = engine_from_saved_config(str(tmp_path / "config.json"))
    with engine:
        assert model_path is None
        assert (engine.cfg.hidden_size, engine.cfg.num_layers) == (
            config.model.hidden_size, config.model.num_layers)
        assert (engine.max_batch, engine.max_len) == (config.engine.max_batch,
                                                      config.engine.max_len)


def test_close_waits_for_the_scheduler_thread(model):
    """close() during a long generation returns only once the scheduler thread has left
    its device call, and the running request ends as aborted."""
    eng = EmbeddedEngine(model, engine_options(max_batch=4, max_len=64, min_len=16,
                                               min_cache_len=64, chunk_steps=2), seed=0)

    async def close_mid_generation():
        task = asyncio.ensure_future(eng.generate([GenerateRequest(prompt(6, 4), 56)]))
        while not eng._rows:
            await asyncio.sleep(0.001)
        eng.close()
        assert not eng._thread.is_alive()
        return (await task)[0]

    result = run(close_mid_generation())
    assert result.finish_reason == "abort" and len(result.output_ids) < 56
