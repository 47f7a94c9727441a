"""In-process JAX sampler over the Qwen3 KV cache, with micro-batching of concurrent callers.

One device batch = one jitted prefill of the padded prompts, then one jitted
`lax.while_loop` of single-token decode steps that exits as soon as every row has
hit a stop id or its `max_new_tokens`. Batch size and lengths are rounded up to
powers of two, so a long run compiles a handful of shapes and then reuses them.

Concurrent `generate` calls put their requests on an asyncio queue; one batching
task drains it into device batches of up to `max_batch` rows and runs them on a
single worker thread, so the event loop (an HTTP server, a rollout of many
episodes) stays responsive while the device works.

Sampling is seeded per request and per position (key = fold_in(PRNGKey(seed), pos)),
so a request's sample does not depend on what it was batched with.

Prefix cache (as SGLang's radix cache does for a multi-turn agent): the keys and
values of every finished request's prompt + output are kept on the host, up to a
token budget, least recently used first out. A request whose prompt extends a kept
sequence starts from those keys and values and prefills only the new tokens (the
observation of the last tool call), instead of the whole conversation again. New
weights empty the cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.engine import Engine, EngineError, GenerateRequest, GenerateResult
from inference.sampling import sample_tokens
from models import qwen3


def bucket(n: int, cap: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum), capped at `cap`."""
    return min(cap, max(minimum, 1 << (max(n, 1) - 1).bit_length()))


@dataclasses.dataclass
class _Pending:
    request: GenerateRequest
    seed: int
    future: asyncio.Future
    enqueued: float


@dataclasses.dataclass(frozen=True)
class _Batch:
    """Host arrays of one padded device batch (B rows, prompt bucket P, cache length L)."""

    tokens: np.ndarray        # [B,P] int32, 0 in padding
    positions: np.ndarray     # [B,P] int32, -1 in padding
    lengths: np.ndarray       # [B] int32 prompt lengths (1 for padding rows)
    max_new: np.ndarray       # [B] int32 (1 for padding rows)
    stop_ids: np.ndarray      # [B,S] int32, -1 padded
    temperature: np.ndarray   # [B] f32
    top_p: np.ndarray         # [B] f32
    top_k: np.ndarray         # [B] int32
    seeds: np.ndarray         # [B] uint32
    last: np.ndarray          # [B] int32 index in `tokens` of each prompt's last token
    cache_len: int


@dataclasses.dataclass
class _Cached:
    """Keys and values of positions 0..len(ids)-1 of one sequence: [L,len,K,D] each."""

    ids: tuple[int, ...]
    k: np.ndarray
    v: np.ndarray


class PrefixCache:
    """Host-side keys/values of finished sequences, found by longest matching prefix.

    Entries are indexed by (length, hash of the ids); a lookup tries the stored lengths
    from the longest down. Least recently used entries go first once more than
    `max_tokens` positions are held.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self.tokens = 0
        self._entries: dict[tuple[int, int], _Cached] = {}  # insertion order = LRU order
        self._lengths: dict[int, int] = {}  # length -> number of entries of that length

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.tokens = 0

    def lookup(self, ids: Sequence[int]) -> _Cached | None:
        """The longest kept sequence that is a proper prefix of `ids` (at least one id
        is left to prefill, whose hidden state samples the next token)."""
        ids = tuple(ids)
        for n in sorted((n for n in self._lengths if n < len(ids)), reverse=True):
            key = (n, hash(ids[:n]))
            entry = self._entries.get(key)
            if entry is not None and entry.ids == ids[:n]:
                self._entries[key] = self._entries.pop(key)  # most recently used
                return entry
        return None

    def insert(self, ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> None:
        ids = tuple(ids)
        if not ids or len(ids) > self.max_tokens:
            return
        key = (len(ids), hash(ids))
        if key in self._entries:
            self._entries[key] = self._entries.pop(key)
            return
        self._entries[key] = _Cached(ids, k, v)
        self._lengths[len(ids)] = self._lengths.get(len(ids), 0) + 1
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            old_key = next(iter(self._entries))
            self._entries.pop(old_key)
            self.tokens -= old_key[0]
            self._lengths[old_key[0]] -= 1
            if not self._lengths[old_key[0]]:
                del self._lengths[old_key[0]]


def _pack(requests: Sequence[GenerateRequest], seeds: Sequence[int], max_batch: int,
          max_len: int, min_batch: int, min_len: int,
          cached: Sequence[int] | None = None, min_cache_len: int = 1) -> _Batch:
    """Pads a device batch; `cached[i]` leading ids of request i are already in the
    cache, so only the rest of its prompt is fed (at its absolute positions)."""
    n = len(requests)
    cached = [0] * n if cached is None else list(cached)
    rows = bucket(n, max_batch, min_batch) if n <= max_batch else n
    fed = max(len(r.prompt_ids) - c for r, c in zip(requests, cached, strict=True))
    prompt_len = bucket(fed, max_len, min_len)
    total = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    cache_len = bucket(max(total, prompt_len), max_len, max(min_len, min_cache_len))
    n_stop = bucket(max(len(r.stop_token_ids) for r in requests), 1 << 30, 4)
    b = _Batch(
        tokens=np.zeros((rows, prompt_len), np.int32),
        positions=np.full((rows, prompt_len), -1, np.int32),
        lengths=np.ones((rows,), np.int32),
        max_new=np.ones((rows,), np.int32),
        stop_ids=np.full((rows, n_stop), -1, np.int32),
        temperature=np.zeros((rows,), np.float32),
        top_p=np.ones((rows,), np.float32),
        top_k=np.full((rows,), -1, np.int32),
        seeds=np.zeros((rows,), np.uint32),
        last=np.zeros((rows,), np.int32),
        cache_len=cache_len,
    )
    for i, (r, seed, c) in enumerate(zip(requests, seeds, cached, strict=True)):
        t = len(r.prompt_ids)
        b.tokens[i, :t - c] = r.prompt_ids[c:]
        b.positions[i, :t - c] = np.arange(c, t)
        b.lengths[i] = t
        b.last[i] = t - c - 1
        b.max_new[i] = r.max_new_tokens
        b.stop_ids[i, :len(r.stop_token_ids)] = r.stop_token_ids
        b.temperature[i] = r.temperature
        b.top_p[i] = r.top_p
        b.top_k[i] = r.top_k
        b.seeds[i] = seed
    b.positions[n:, 0] = 0  # padding rows hold one dummy token so every row has a last position
    return b


def _sample_at(model, hidden, positions, seeds, temperature, top_p, top_k):
    """Samples the token for `positions` [B] from hidden [B,d]."""
    logits = hidden.astype(jnp.float32) @ model.lm_head().astype(jnp.float32)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seeds, positions)
    return sample_tokens(logits, temperature, top_p, top_k, keys)


def _prefill(graphdef, params, cache_k, cache_v, cache_valid, tokens, positions, lengths, last,
             max_new, stop_ids, temperature, top_p, top_k, seeds):
    """Prompts -> decode state with the first new token placed at position `lengths`.

    cache_k/v/valid: the cache with any reused prefix already in place; `tokens` are
    the rest of each prompt at `positions`, the prompt's last one at index `last`.
    Output buffers out_ids/out_logp [B, cache_len] are indexed by absolute position.
    """
    model = nnx.merge(graphdef, params)
    cache_len = cache_valid.shape[1]
    start = jnp.max(jnp.where(cache_valid, jnp.arange(cache_len) + 1, 0), axis=1)
    cache = qwen3.KVCache(k=cache_k, v=cache_v, valid=cache_valid, lengths=start)
    hidden, cache = model.decode(tokens, positions, cache)
    rows = jnp.arange(tokens.shape[0])
    first, logp = _sample_at(model, hidden[rows, last], lengths, seeds, temperature,
                             top_p, top_k)
    out_ids = jnp.zeros((tokens.shape[0], cache_len), jnp.int32).at[rows, lengths].set(first)
    out_logp = jnp.zeros((tokens.shape[0], cache_len), jnp.float32).at[rows, lengths].set(logp)
    stopped = jnp.any(first[:, None] == stop_ids, axis=1)
    done = stopped | (max_new <= 1)
    return cache, first, lengths, jnp.ones_like(lengths), done, stopped, out_ids, out_logp


def _decode(graphdef, params, cache, token, pos, n_new, done, stopped, out_ids, out_logp,
            max_new, stop_ids, temperature, top_p, top_k, seeds):
    """Single-token steps until every row is done.

    Row b feeds `token[b]` at position `pos[b]` and samples position pos[b] + 1. Finished
    rows re-feed their last token at the same position (an idempotent cache write), so
    the loop body has one shape for all rows.
    """
    model = nnx.merge(graphdef, params)
    rows = jnp.arange(token.shape[0])
    drop = out_ids.shape[1]

    def body(state):
        cache, token, pos, n_new, done, stopped, out_ids, out_logp = state
        hidden, cache = model.decode(token[:, None], pos[:, None], cache)
        nxt, logp = _sample_at(model, hidden[:, 0], pos + 1, seeds, temperature, top_p, top_k)
        active = ~done
        slot = jnp.where(active, pos + 1, drop)
        out_ids = out_ids.at[rows, slot].set(nxt, mode="drop")
        out_logp = out_logp.at[rows, slot].set(logp, mode="drop")
        n_new = n_new + active
        hit = active & jnp.any(nxt[:, None] == stop_ids, axis=1)
        stopped = stopped | hit
        done = done | hit | (n_new >= max_new)
        token = jnp.where(active, nxt, token)
        pos = jnp.where(active, pos + 1, pos)
        return cache, token, pos, n_new, done, stopped, out_ids, out_logp

    state = (cache, token, pos, n_new, done, stopped, out_ids, out_logp)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s[4]), body, state)
    cache, _, _, n_new, _, stopped, out_ids, out_logp = state
    return n_new, stopped, out_ids, out_logp, cache.k, cache.v


# Module-level so engines over the same architecture share compiled programs.
_prefill_jit = jax.jit(_prefill, static_argnames=("graphdef",))
_decode_jit = jax.jit(_decode, static_argnames=("graphdef",))


def _split(model) -> tuple[Any, Any]:
    if isinstance(model, tuple):
        return model
    return nnx.split(model, nnx.Param)


# Constructor options a config's `engine` section may set (absent ones keep the defaults).
CONFIG_OPTIONS = ("max_batch", "max_len", "min_batch", "min_len", "min_cache_len",
                  "prefix_cache_tokens")


def options_from_config(engine_cfg) -> dict[str, int]:
    """EmbeddedEngine keyword options from a config's `engine` section."""
    return {k: int(engine_cfg[k]) for k in CONFIG_OPTIONS if k in engine_cfg}


class EmbeddedEngine(Engine):
    """Serves a Qwen3 model in this process.

    model: an nnx `Qwen3`, or its `(graphdef, params)` from `nnx.split(model, nnx.Param)`.
    max_batch: most rows in one device batch (more concurrent requests wait a round).
    max_len: longest prompt + max_new_tokens; also the largest cache bucket.
    min_batch, min_len: smallest batch / length buckets (fewer shapes to compile).
    min_cache_len: smallest cache bucket (with a prefix cache, prompts to prefill are
      short but their caches long; one cache size means fewer shapes to compile).
    seed: draws the seeds of requests that come without one.
    batch_wait_s: how long the batcher waits after the first request for others to join.
    prefix_cache_tokens: positions of keys/values kept for prompt reuse (0: no cache).
    """

    def __init__(self, model, *, max_batch: int = 32, max_len: int = 2048, min_batch: int = 1,
                 min_len: int = 16, seed: int = 0, batch_wait_s: float = 0.002,
                 prefix_cache_tokens: int = 0, min_cache_len: int = 1):
        self.graphdef, self.params = _split(model)
        self.cfg = nnx.merge(self.graphdef, self.params).cfg
        self.vocab_size = int(self.cfg.vocab_size)
        self.max_batch = int(max_batch)
        self.max_len = int(max_len)
        self.min_batch = min(int(min_batch), self.max_batch)
        self.min_len = min(int(min_len), self.max_len)
        self.min_cache_len = min(int(min_cache_len), self.max_len)
        self.batch_wait_s = float(batch_wait_s)
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self._seeds = np.random.default_rng(seed)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task | None = None
        self._closed = False

    # ------------------------------------------------------------------ protocol

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if self._closed:
            raise EngineError("EmbeddedEngine is closed")
        for r in requests:
            self._validate(r)
        loop = asyncio.get_running_loop()
        self._ensure_worker(loop)
        now = time.perf_counter()
        pending = []
        for r in requests:
            seed = r.seed if r.seed is not None else int(self._seeds.integers(2**32))
            pending.append(_Pending(r, seed, loop.create_future(), now))
            self._queue.put_nowait(pending[-1])
        return list(await asyncio.gather(*(p.future for p in pending)))

    async def update_weights(self, params_or_path) -> None:
        if self._closed:
            raise EngineError("EmbeddedEngine is closed")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.set_weights, params_or_path)

    async def health(self) -> bool:
        return not self._closed and not (self._worker is not None and self._worker.done()
                                         and not self._worker.cancelled())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._worker.cancel)
        if self._queue is not None:
            while not self._queue.empty():
                p = self._queue.get_nowait()
                if not p.future.done():
                    p.future.get_loop().call_soon_threadsafe(
                        _set_result, p.future, GenerateResult([], [], "abort"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ synchronous API

    def set_weights(self, params_or_path) -> None:
        """Replaces the served parameters (pytree like the current one, or an HF directory)."""
        if isinstance(params_or_path, str | os.PathLike):
            from models import hf_io

            _, model = hf_io.load_hf(os.fspath(params_or_path), dtype=self.cfg.dtype,
                                     param_dtype=self.cfg.param_dtype)
            params = _split(model)[1]
        else:
            params = params_or_path
        old = jax.tree.structure(self.params)
        if jax.tree.structure(params) != old:
            raise ValueError(f"new parameters have a different tree structure than the served "
                             f"model: {jax.tree.structure(params)} vs {old}")
        for (path, new), cur in zip(jax.tree_util.tree_leaves_with_path(params),
                                    jax.tree.leaves(self.params), strict=True):
            if new.shape != cur.shape:
                raise ValueError(f"parameter {jax.tree_util.keystr(path)} has shape "
                                 f"{new.shape}, the served model has {cur.shape}")
        self.params = jax.tree.map(lambda new, cur: jnp.asarray(new, cur.dtype), params,
                                   self.params)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # keys and values of the old weights

    def run_batch(self, requests: Sequence[GenerateRequest],
                  seeds: Sequence[int]) -> list[GenerateResult]:
        """Generates for `requests` as one device batch (blocking)."""
        pc = self.prefix_cache
        hits = [pc.lookup(r.prompt_ids) if pc is not None else None for r in requests]
        b = _pack(requests, seeds, self.max_batch, self.max_len, self.min_batch, self.min_len,
                  cached=[len(h.ids) if h is not None else 0 for h in hits],
                  min_cache_len=self.min_cache_len)
        cfg, rows = self.cfg, len(b.lengths)
        shape = (cfg.num_layers, rows, b.cache_len, cfg.num_kv_heads, cfg.head_dim)
        cache_k = np.zeros(shape, jnp.dtype(cfg.dtype))
        cache_v = np.zeros(shape, jnp.dtype(cfg.dtype))
        cache_valid = np.zeros((rows, b.cache_len), bool)
        for i, h in enumerate(hits):
            if h is not None:
                cache_k[:, i, :len(h.ids)] = h.k
                cache_v[:, i, :len(h.ids)] = h.v
                cache_valid[i, :len(h.ids)] = True
        sampling = (jnp.asarray(b.max_new), jnp.asarray(b.stop_ids), jnp.asarray(b.temperature),
                    jnp.asarray(b.top_p), jnp.asarray(b.top_k), jnp.asarray(b.seeds))
        t0 = time.perf_counter()
        state = _prefill_jit(self.graphdef, self.params, jnp.asarray(cache_k),
                             jnp.asarray(cache_v), jnp.asarray(cache_valid),
                             jnp.asarray(b.tokens), jnp.asarray(b.positions),
                             jnp.asarray(b.lengths), jnp.asarray(b.last), *sampling)
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        out = _decode_jit(self.graphdef, self.params, *state, *sampling)
        n_new, stopped, out_ids, out_logp = jax.device_get(out[:4])
        t2 = time.perf_counter()
        if pc is not None:
            # Positions 0 .. prompt + n_new - 2 hold keys/values of fed tokens (the last
            # sampled token was never fed).
            cache_k, cache_v = jax.device_get(out[4:])
        results = []
        for i, r in enumerate(requests):
            start, stop = b.lengths[i], b.lengths[i] + n_new[i]
            results.append(GenerateResult(
                output_ids=out_ids[i, start:stop].tolist(),
                logprobs=out_logp[i, start:stop].tolist(),
                finish_reason="stop" if stopped[i] else "length",
                timings={"prefill_s": t1 - t0, "decode_s": t2 - t1},
                cached_tokens=len(hits[i].ids) if hits[i] is not None else 0))
            if pc is not None:
                n = stop - 1
                pc.insert((*r.prompt_ids, *results[-1].output_ids)[:n],
                          cache_k[:, i, :n].copy(), cache_v[:, i, :n].copy())
        return results

    # ------------------------------------------------------------------ batching

    def _validate(self, r: GenerateRequest) -> None:
        if len(r.prompt_ids) + r.max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {len(r.prompt_ids)} tokens + max_new_tokens="
                             f"{r.max_new_tokens} exceeds the engine's max_len={self.max_len}")
        if max(r.prompt_ids) >= self.vocab_size:
            raise ValueError(f"prompt token id {max(r.prompt_ids)} is outside the vocabulary "
                             f"(size {self.vocab_size})")

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop and self._worker is not None and not self._worker.done():
            return
        self._loop = loop
        self._queue = asyncio.Queue()
        self._worker = loop.create_task(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(self.batch_wait_s)
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [p for p in batch if not p.future.done()]
            if not batch:
                continue
            start = time.perf_counter()
            try:
                results = await loop.run_in_executor(
                    self._executor, self.run_batch, [p.request for p in batch],
                    [p.seed for p in batch])
            except Exception as e:  # noqa: BLE001 - every waiting caller must hear of it
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, res in zip(batch, results, strict=True):
                res.timings["queue_s"] = start - p.enqueued
                if not p.future.done():
                    p.future.set_result(res)


def _set_result(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)
