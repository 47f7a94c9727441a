"""In-process JAX sampler over a device-resident Qwen3 KV cache, with continuous batching.

The keys and values live in a pool on the device (qwen3.KVCache's layout with a row
per slot: per layer, keys [slots, K, D, max_len] and values [slots, K, max_len, D]), made
once and passed through every jitted call with its buffers donated, so no call
allocates or copies a cache on the host. A request owns one slot (one row of the
pool) while it generates.

One scheduler thread runs the device. Each round it admits waiting requests into
free slots (jitted prefills of their new tokens, rows of similar length together),
then runs one jitted decode chunk: single-token steps over the active rows inside a
`lax.while_loop` that stops after `chunk_steps` steps or, past `min_chunk_steps`, once
enough rows have finished (one when requests are waiting for a slot). Finished rows'
results go back to their callers at once and their slots take the next waiting
requests, so short requests never wait for the longest row of a batch (continuous
batching). An aborted request ends at the end of the current call with its tokens so
far.

Prefill and decode attend only to the filled part of the cache: each call reads the
rows it serves cut to a window (at least `min_cache_len`) that covers every position it
reads or writes, and stores back only the positions it fed.

Row counts, lengths and windows are rounded up to powers of two (decode rows past 8 to
multiples of 8, windows past 256 to multiples of 256: see `bucket`), so a long run
compiles a bounded set of shapes and then reuses them. Sampling is seeded per request
and per position (u = uniform(fold_in(PRNGKey(seed), pos))), so a request's sample does
not depend on what it was batched with.

Prompts that share a prefix share its keys and values: an admitted request whose
prompt starts with whole blocks that sit in a running or just-admitted row's slot
copies them into its own slot and prefills only the rest (`SharedPrefixes`); the eight
rollouts of a task prefill their common prompt once.

Prefix cache (as SGLang's radix cache does for a multi-turn agent): a finished
request's slot is parked with the ids whose keys and values it holds (prompt and
output but the last id), up to `prefix_cache_tokens` positions of parked slots, least
recently used first out. A request whose prompt extends a parked sequence takes that
slot over and prefills only the new tokens (the observation of the last tool call).
New weights empty the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.engine import Engine, EngineError, GenerateRequest, GenerateResult
from inference.sampling import RowSampling, sample_tokens
from models import hf_io, qwen3

log = logging.getLogger(__name__)


def bucket(n: int, cap: int, minimum: int = 1, step: int = 0) -> int:
    """Smallest power of two >= max(n, minimum), capped at `cap`; past `step` (a power
    of two, 0: none) the smallest multiple of `step` instead."""
    n = max(n, minimum, 1)
    if step and n > step:
        return min(cap, -(-n // step) * step)
    return min(cap, 1 << (n - 1).bit_length())


# A decode step reads every row of its call over the whole window, padding included, so
# decode rounds rows up to a multiple of 8 past 8 and windows to a multiple of 256 past
# 256 (24 rows of 600 positions read 24 x 768 slots, not 32 x 1024: on CPU, 52 against
# 107 ms for 10 steps of the default model). Prefill windows are rounded the same way.
_DECODE_ROW_STEP = 8
_WINDOW_STEP = 256


# The fixed cost of a prefill call in padded tokens (on CPU an [8, 64] call, 512 tokens,
# takes about as long as 300 more tokens in a longer one).
_PREFILL_CALL_TOKENS = 512
# Qwen3Config fields that say how this engine runs a model, not which model it is (a
# config.json does not fix them): the rest must match for weights to load in place.
HOW_RUN = frozenset({"dtype", "param_dtype", "remat", "attention", "max_position_embeddings"})


def prefill_rows(n: int, width: int, *, max_batch: int, min_batch: int, min_len: int) -> int:
    """Rows of a prefill call of n rows `width` tokens wide: a power of two of at least
    `min_batch` rows, fewer for wider calls, so that the least area is min_batch x min_len
    (a task's first prompt, 600 new tokens, is not padded with seven empty rows of 1024:
    on CPU 660 ms a call)."""
    return bucket(n, max_batch, max(1, min(min_batch, min_batch * min_len // width)))


def prefill_groups(lengths: Sequence[int], *, max_batch: int, min_batch: int, max_len: int,
                   min_len: int) -> list[list[int]]:
    """Splits rows with `lengths` new tokens into prefill calls, longest first, so that
    padding to each call's [prefill_rows, bucket(longest)] rectangle plus a fixed cost
    per call is least (a row of 300 tokens no longer pads 31 rows of 40 to 512).
    Returns lists of indices into `lengths`.

    cost[j], the least cost of the rows order[j:], never grows with j (fewer rows), and
    a call's rows are a power of two (or max_batch), so the call that starts at row j
    takes as many rows as a power of two, max_batch or all that are left: O(n log n),
    not the O(n^2) of trying every size."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    cost, cut = [0] * (n + 1), [n] * (n + 1)
    sizes = sorted({1 << i for i in range(n.bit_length() + 1)} | {max_batch})
    area = functools.cache(lambda m, width: width * prefill_rows(
        m, width, max_batch=max_batch, min_batch=min_batch, min_len=min_len))
    for j in range(n - 1, -1, -1):  # cost[j]: the rows order[j:], grouped best
        width = bucket(lengths[order[j]], max_len, min_len)
        cost[j], cut[j] = min((area(k - j, width) + _PREFILL_CALL_TOKENS + cost[k], k)
                              for k in {min(j + m, n) for m in sizes})
    groups, j = [], 0
    while j < n:
        groups.append(order[j:cut[j]])
        j = cut[j]
    return groups


# Prompts share keys and values in whole blocks of this many ids (see SharedPrefixes).
_SHARE_BLOCK = 32


def block_hashes(hashes: list[int], ids: Sequence[int], n: int, block: int) -> list[int]:
    """Extends `hashes` (chained: hashes[j] names ids[:(j + 1) * block]) to the whole
    blocks of ids[:n] and returns those; ids may only have grown since the last call."""
    for j in range(len(hashes), n // block):
        hashes.append(hash((hashes[-1] if hashes else 0, tuple(ids[j * block:(j + 1) * block]))))
    return hashes[:n // block]


class SharedPrefixes:
    """Sequences whose keys/values sit in a slot, found by the chained hashes of their
    whole blocks: the longest shared prefix of a new prompt with any of them, as SGLang's
    radix cache finds it, at block granularity. The eight rollouts of a task start from
    one prompt; with this, one of them prefills it and the others copy its keys/values."""

    def __init__(self, block: int):
        self.block = block
        self._where: dict[int, tuple[Sequence[int], int]] = {}  # hash -> (ids, slot)

    def add(self, hashes: Sequence[int], ids: Sequence[int], slot: int) -> None:
        for h in hashes:
            self._where.setdefault(h, (ids, slot))

    def longest(self, hashes: Sequence[int], ids: Sequence[int]) -> tuple[int, int] | None:
        """(slot, length) of the longest run of whole blocks named by `hashes` that a
        sequence in a slot starts with (checked id for id), or None."""
        for j in range(len(hashes), 0, -1):
            hit = self._where.get(hashes[j - 1])
            n = j * self.block
            if hit is not None and list(hit[0][:n]) == list(ids[:n]):
                return hit[1], n
        return None


@dataclasses.dataclass
class _Pending:
    request: GenerateRequest
    seed: int
    future: asyncio.Future
    enqueued: float
    aborted: bool = False


@dataclasses.dataclass
class _Row:
    """A request in a slot: its ids so far and where it stands.

    `ids[:fed]` have keys and values in the slot; ids[fed] is the next one to feed.
    """

    pending: _Pending
    slot: int
    ids: list[int]
    fed: int
    cached: int
    version: int
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    stopped: bool = False
    started: float = 0.0
    prefill_s: float = 0.0
    hashes: list[int] = dataclasses.field(default_factory=list)  # block_hashes of ids

    def block_hashes(self, n: int) -> list[int]:
        return block_hashes(self.hashes, self.ids, n, _SHARE_BLOCK)

    @property
    def finished(self) -> bool:
        return self.stopped or len(self.output) >= self.pending.request.max_new_tokens

    @property
    def done(self) -> bool:
        return self.finished or self.pending.aborted


class PrefixCache:
    """Parked slots and the ids whose keys/values they hold, found by longest prefix.

    Entries are indexed by (length, hash of the ids); a lookup tries the stored lengths
    from the longest down. Once more than `max_tokens` positions are parked, the least
    recently used entries go first; `insert` returns the slots they free.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self.tokens = 0
        self._entries: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}  # LRU order
        self._lengths: dict[int, int] = {}  # length -> number of entries of that length

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, ids: Sequence[int]) -> tuple[int, int] | None:
        """(slot, length) of the longest parked sequence that is a proper prefix of `ids`
        (at least one id is left to prefill, whose hidden state samples the next token);
        the entry leaves the cache, as its slot goes on with the request."""
        ids = tuple(ids)
        for n in sorted((n for n in self._lengths if n < len(ids)), reverse=True):
            key = (n, hash(ids[:n]))
            entry = self._entries.get(key)
            if entry is not None and entry[0] == ids[:n]:
                self._remove(key)
                return entry[1], n
        return None

    def insert(self, ids: Sequence[int], slot: int) -> list[int]:
        """Parks `slot` holding `ids`; returns the slots no longer parked (evicted, or
        `slot` itself when it is not kept)."""
        ids = tuple(ids)
        key = (len(ids), hash(ids))
        if not ids or len(ids) > self.max_tokens or key in self._entries:
            return [slot]
        self._entries[key] = (ids, slot)
        self._lengths[len(ids)] = self._lengths.get(len(ids), 0) + 1
        self.tokens += len(ids)
        freed = []
        while self.tokens > self.max_tokens:
            freed.append(self._remove(next(iter(self._entries))))
        return freed

    def evict(self) -> int | None:
        """The slot of the least recently used entry, which leaves the cache."""
        return self._remove(next(iter(self._entries))) if self._entries else None

    def clear(self) -> list[int]:
        """Empties the cache; returns the slots that were parked."""
        slots = [slot for _, slot in self._entries.values()]
        self._entries.clear()
        self._lengths.clear()
        self.tokens = 0
        return slots

    def _remove(self, key) -> int:
        _, slot = self._entries.pop(key)
        self.tokens -= key[0]
        self._lengths[key[0]] -= 1
        if not self._lengths[key[0]]:
            del self._lengths[key[0]]
        return slot


# ----------------------------------------------------------------------------- device code


def _window(pool_k, pool_v, slots, window: int):
    """Rows `slots` of the pool cut to positions [0, window): per layer, k [R,K,D,window]
    and v [R,K,window,D] (KVCache's layout). Out-of-range slots (padding rows) read the
    last slot; their writes are dropped."""
    read = jnp.minimum(slots, pool_k[0].shape[0] - 1)
    return (tuple(k[read, ..., :window] for k in pool_k),
            tuple(v[read, :, :window] for v in pool_v))


def _write_back(pool_k, pool_v, slots, positions, k, v):
    """Stores the keys/values of fed positions [R,T] (-1: none) of window caches k, v
    into pool rows `slots`: only what the call wrote is copied back."""
    rows = jnp.arange(positions.shape[0])[:, None]
    read = jnp.maximum(positions, 0)
    write = jnp.where(positions >= 0, positions, pool_v[0].shape[2])  # -1: dropped
    slots = slots[:, None]
    # Advanced indices split by slices: the [R,T] index dims lead, then K, D.
    return (tuple(p.at[slots, :, :, write].set(w[rows, :, :, read], mode="drop")
                  for p, w in zip(pool_k, k, strict=True)),
            tuple(p.at[slots, :, write].set(w[rows, :, read], mode="drop")
                  for p, w in zip(pool_v, v, strict=True)))


def _copy_prefix(pool_k, pool_v, src, dst, *, window: int):
    """Positions [0, window) of pool rows `src` copied into rows `dst` (out of range:
    dropped)."""
    return (tuple(p.at[dst, ..., :window].set(p[src, ..., :window], mode="drop")
                  for p in pool_k),
            tuple(p.at[dst, :, :window].set(p[src, :, :window], mode="drop") for p in pool_v))


def _output_head(graphdef, params) -> jax.Array:
    """The output head [d,V] in float32, laid out for `hidden @ head`, made once per
    weights and passed to every call: a tied head is the embedding [V,d] transposed,
    which a decode step's matmul read in place at 15-30% more time on CPU, and which
    materialised inside each decode call cost a transposing copy per call (0.3-0.6 ms
    for the tiny preset, a tenth of a 32-step call at 32 rows)."""
    return nnx.merge(graphdef, params).lm_head().astype(jnp.float32)


def _sample_at(head, hidden, positions, sampling: RowSampling):
    """Samples the token for `positions` [B] from hidden [B,d] and the head [d,V]."""
    logits = hidden.astype(jnp.float32) @ head
    return sample_tokens(logits, sampling, positions)


def _prefill(graphdef, params, head, pool_k, pool_v, slots, tokens, positions, start, last,
             sampling, *, window: int):  # (the traced arrays of a jitted call)
    """Feeds `tokens` [R,P] at `positions` (-1: padding) into rows `slots`, whose
    positions [0, start) are already filled, and samples the token after index `last`.

    sampling: the rows' RowSampling, [R] each.
    Returns (pool_k, pool_v, tokens [R], logp [R]).
    """
    model = nnx.merge(graphdef, params)
    k, v = _window(pool_k, pool_v, slots, window)
    valid = jnp.arange(window)[None, :] < start[:, None]
    hidden, cache = model.decode(tokens, positions, qwen3.KVCache(k, v, valid, start))
    rows = jnp.arange(tokens.shape[0])
    nxt_pos = positions[rows, last] + 1
    token, logp = _sample_at(head, hidden[rows, last], nxt_pos, sampling)
    pool_k, pool_v = _write_back(pool_k, pool_v, slots, positions, cache.k, cache.v)
    return pool_k, pool_v, token, logp


def _decode(graphdef, params, head, pool_k, pool_v, slots, token, pos, remaining, stop_ids,
            sampling, min_finished, min_steps, *, window: int,
            steps: int):  # (the traced arrays of a jitted call, and its static shapes)
    """Up to `steps` single-token steps of rows `slots`; stops early, after at least
    `min_steps` steps, once `min_finished` rows have finished (or at once when all have).

    Row r feeds token[r] at position pos[r] (positions [0, pos) filled) and samples the
    token of pos[r] + 1, until it emits a stop id (stop_ids [R,S], -1 padded) or has
    sampled `remaining[r]` tokens (0: a padding row). Finished rows re-feed their last
    token at the same position (an idempotent cache write), so every step has one shape.
    Returns (pool_k, pool_v, out_ids [R,steps], out_logp [R,steps], n_out [R], stopped [R]).
    """
    model = nnx.merge(graphdef, params)
    layers = model.unstacked_layers()
    k, v = _window(pool_k, pool_v, slots, window)
    rows = token.shape[0]
    out_ids = jnp.zeros((rows, steps), jnp.int32)
    out_logp = jnp.zeros((rows, steps), jnp.float32)
    n_out = jnp.zeros((rows,), jnp.int32)
    stopped = jnp.zeros((rows,), bool)

    def body(state):
        i, (k, v), token, pos, n_out, stopped, out_ids, out_logp = state
        active = (n_out < remaining) & ~stopped
        filled = jnp.arange(window)[None, :] < pos[:, None]
        hidden, cache = model.decode(token[:, None], pos[:, None],
                                     qwen3.KVCache(k, v, filled, pos), layers)
        k, v, hidden = cache.k, cache.v, hidden[:, 0]
        nxt, logp = _sample_at(head, hidden, pos + 1, sampling)
        out_ids = out_ids.at[:, i].set(nxt)
        out_logp = out_logp.at[:, i].set(logp)
        n_out = n_out + active
        stopped = stopped | (active & jnp.any(nxt[:, None] == stop_ids, axis=1))
        token = jnp.where(active, nxt, token)
        pos = jnp.where(active, pos + 1, pos)
        return i + 1, (k, v), token, pos, n_out, stopped, out_ids, out_logp

    def running(state):
        i, _, _, _, n_out, stopped = state[:6]
        live = remaining > 0
        finished = jnp.sum(live & (stopped | (n_out >= remaining)))
        total = jnp.sum(live)
        return (i < steps) & (finished < total) & (
            (finished < jnp.minimum(min_finished, total)) | (i < min_steps))

    state = (0, (k, v), token, pos, n_out, stopped, out_ids, out_logp)
    _, (k, v), _, _, n_out, stopped, out_ids, out_logp = jax.lax.while_loop(running, body, state)
    step = jnp.arange(steps)[None, :]
    fed = jnp.where(step < n_out[:, None], pos[:, None] + step, -1)
    pool_k, pool_v = _write_back(pool_k, pool_v, slots, fed, k, v)
    return pool_k, pool_v, out_ids, out_logp, n_out, stopped


def _split(model) -> tuple[Any, Any]:
    if isinstance(model, tuple):
        return model
    return nnx.split(model, nnx.Param)


def max_map_count(path: str = "/proc/sys/vm/max_map_count") -> int | None:
    """The kernel's limit on one process's memory mappings (None where unreadable)."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def map_count(path: str = "/proc/self/maps") -> int:
    """This process's memory mappings now."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


class MapBudget:
    """Keeps the process's memory mappings under the kernel's limit by dropping jitted
    functions' compiled executables.

    XLA:CPU loads each kernel of an executable as an object of its own (code, data and
    read-only pages: three mappings), so one prefill or decode executable of the graded
    family's 2-layer model holds about 500 of the process's mappings. A run of 16 x 8
    rollouts compiled 81 engine shapes in its first step and held 68,500 mappings by
    step 12: past Linux's default vm.max_map_count (65,530) LLVM fails with "Cannot
    allocate memory" and the run dies. After a call that compiled (a jit cache grew),
    once the mappings pass `share` of the limit, every cache is cleared and the next
    calls recompile the shapes they use. `clears` counts the clearings."""

    def __init__(self, fns: Sequence[Any], share: float = 0.75, limit: int | None = None):
        self.fns, self.share = list(fns), share
        self.limit = max_map_count() if limit is None else limit
        self.clears = 0
        self._cached = self._cache_size()

    def _cache_size(self) -> int:
        return sum(f._cache_size() for f in self.fns)

    def check(self) -> None:
        if not self.limit:
            return
        cached = self._cache_size()
        grew, self._cached = cached > self._cached, cached
        if not grew or (n := map_count()) < self.share * self.limit:
            return
        for f in self.fns:
            f.clear_cache()
        gc.collect()  # an executable can sit in a reference cycle
        self._cached, self.clears = 0, self.clears + 1
        log.warning("%d memory mappings of at most %d (vm.max_map_count): cleared %d compiled "
                    "engine shapes (clearing %d); raising vm.max_map_count avoids the "
                    "recompilations", n, self.limit, cached, self.clears)


@dataclasses.dataclass(frozen=True)
class EmbeddedOptions:
    """The embedded engine's shape: the `engine` section's keys less `kind` and `sglang`
    (documented with their defaults in configs.common.engine_defaults)."""

    max_batch: int
    max_len: int
    min_batch: int
    min_len: int
    min_cache_len: int
    prefix_cache_tokens: int
    chunk_steps: int
    min_chunk_steps: int

    @classmethod
    def from_section(cls, engine) -> EmbeddedOptions:
        """From a config's `engine` section (its other keys are the SGLang engine's)."""
        return cls(**{f.name: int(engine[f.name]) for f in dataclasses.fields(cls)})


# The embedded engine at its smallest: one-row and 16-token buckets, a window of any
# length, no prefix cache. A standalone `inference.server`'s defaults (as SGLang's
# launcher has its own), and the tests' and benches' engine: every batch size and length
# compiles its own shapes, and each test chooses what it exercises.
SMALLEST = EmbeddedOptions(max_batch=32, max_len=2048, min_batch=1, min_len=16, min_cache_len=1,
                           prefix_cache_tokens=0, chunk_steps=32, min_chunk_steps=0)


class EmbeddedEngine(Engine):
    """Serves a Qwen3 model in this process.

    model: an nnx `Qwen3`, or its `(graphdef, params)` from `nnx.split(model, nnx.Param)`.
    options: batch, length and cache shape (EmbeddedOptions).
    seed: draws the seeds of requests that come without one.
    """

    def __init__(self, model, options: EmbeddedOptions, *, seed: int):
        self.graphdef, self.params = _split(model)
        # Jitted per engine with the graph bound: as a static argument it was hashed
        # on every call.
        self._prefill_fn = jax.jit(functools.partial(_prefill, self.graphdef),
                                   static_argnames=("window",), donate_argnums=(2, 3))
        self._decode_fn = jax.jit(functools.partial(_decode, self.graphdef),
                                  static_argnames=("window", "steps"), donate_argnums=(2, 3))
        self._head_fn = jax.jit(functools.partial(_output_head, self.graphdef))
        self._head = self._head_fn(self.params)
        self._copy_fn = jax.jit(_copy_prefix, static_argnames=("window",),
                                donate_argnums=(0, 1))
        self.map_budget = MapBudget([self._prefill_fn, self._decode_fn, self._copy_fn])
        self.cfg = nnx.merge(self.graphdef, self.params).cfg
        self.vocab_size = int(self.cfg.vocab_size)
        o = options
        self.max_batch = o.max_batch
        self.max_len = o.max_len
        self.min_batch = min(o.min_batch, self.max_batch)
        self.min_len = min(o.min_len, self.max_len)
        self.min_window = min(max(o.min_cache_len, self.min_len), self.max_len)
        self.chunk_steps = o.chunk_steps
        if self.chunk_steps < 1:
            raise ValueError(f"chunk_steps must be >= 1, got {o.chunk_steps}")
        self.min_steps = max(1, min(o.min_chunk_steps, self.chunk_steps)
                             if o.min_chunk_steps else self.chunk_steps // 4)
        self.prefix_cache = PrefixCache(o.prefix_cache_tokens) if o.prefix_cache_tokens else None
        self.num_slots = self.max_batch + -(-o.prefix_cache_tokens // self.max_len)
        self.version = 0  # weight updates applied; a row reports the one it started under
        self._seeds = np.random.default_rng(seed)
        self._pool: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]] | None = None
        self._free = list(range(self.num_slots))[::-1]
        self._rows: list[_Row] = []
        self._waiting: list[_Pending] = []
        self._live: dict[int, _Pending] = {}  # id(request) -> its pending, while generating
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ protocol

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if self._closed:
            raise EngineError("EmbeddedEngine is closed")
        for r in requests:
            self._validate(r)
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        pending = [_Pending(r, r.seed if r.seed is not None else int(self._seeds.integers(2**32)),
                            loop.create_future(), now) for r in requests]
        with self._cv:
            self._waiting.extend(pending)
            self._live.update((id(p.request), p) for p in pending)
            self._cv.notify()
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        finally:
            with self._cv:
                for p in pending:
                    self._live.pop(id(p.request), None)

    def abort(self, request: GenerateRequest) -> bool:
        """A waiting request ends at once with no tokens, a running one at the end of the
        current device call (at most `chunk_steps` more tokens) with its tokens so far."""
        with self._cv:
            pending = self._live.get(id(request))
            if pending is None or pending.request is not request:
                return False
            pending.aborted = True
            waiting = any(p is pending for p in self._waiting)
            self._waiting = [p for p in self._waiting if p is not pending]
        if waiting:
            _deliver_all([(pending.future, GenerateResult([], [], "abort"))])
        return True

    async def update_weights(self, params_or_path) -> None:
        if self._closed:
            raise EngineError("EmbeddedEngine is closed")
        await asyncio.to_thread(self.set_weights, params_or_path)

    async def health(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def close(self) -> None:
        """Aborts what is waiting and returns once the scheduler thread has stopped: a
        daemon thread still inside a device call when the interpreter exits aborts the
        process ("FATAL: exception not rethrown")."""
        with self._cv:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cv.notify()
        _deliver_all([(p.future, GenerateResult([], [], "abort")) for p in waiting])
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ------------------------------------------------------------------ weights

    def set_weights(self, params_or_path) -> None:
        """Replaces the served parameters (pytree like the current one, or an HF directory).
        Requests generating now go on with the new weights (their results report the
        version they started under); parked prefixes are dropped."""
        if isinstance(params_or_path, str | os.PathLike):
            cfg, model = hf_io.load_hf(os.fspath(params_or_path), dtype=self.cfg.dtype,
                                       param_dtype=self.cfg.param_dtype)
            changed = [f"{f.name} {getattr(self.cfg, f.name)!r} -> {getattr(cfg, f.name)!r}"
                       for f in dataclasses.fields(cfg) if f.name not in HOW_RUN
                       and getattr(cfg, f.name) != getattr(self.cfg, f.name)]
            if changed:
                raise ValueError(f"{os.fspath(params_or_path)}/config.json is not the served "
                                 f"model's ({', '.join(changed)}): another model's weights "
                                 f"cannot be loaded in its place")
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
        params = jax.tree.map(lambda new, cur: jnp.asarray(new, cur.dtype), params, self.params)
        head = self._head_fn(params)
        with self._cv:
            self.params, self._head = params, head
            self.version += 1
            if self.prefix_cache is not None:
                self._free.extend(self.prefix_cache.clear())  # keys/values of the old weights

    def flush_cache(self) -> None:
        """Drops every parked prefix; running requests keep their slots."""
        with self._cv:
            if self.prefix_cache is not None:
                self._free.extend(self.prefix_cache.clear())

    # ------------------------------------------------------------------ scheduler

    def _validate(self, r: GenerateRequest) -> None:
        if len(r.prompt_ids) + r.max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {len(r.prompt_ids)} tokens + max_new_tokens="
                             f"{r.max_new_tokens} exceeds the engine's max_len={self.max_len}")
        if max(r.prompt_ids) >= self.vocab_size:
            raise ValueError(f"prompt token id {max(r.prompt_ids)} is outside the vocabulary "
                             f"(size {self.vocab_size})")

    def _serve(self) -> None:
        """The scheduler thread: admit, prefill, decode a chunk, hand out finished rows."""
        while True:
            with self._cv:
                while not (self._closed or self._waiting or self._rows):
                    self._cv.wait()
                if self._closed:
                    break
                admitted = self._admit()
                weights = self.params, self._head  # of self.version, for this whole round
            try:
                followers = self._share(admitted)
                later = {id(r) for r, _, _ in followers}
                self._prefill_all(weights, [r for r in admitted if id(r) not in later])
                if followers:
                    self._copy_prefixes(followers)
                    self._prefill_all(weights, [r for r, _, _ in followers])
                if self._rows:
                    self._decode(weights)
                self.map_budget.check()
            except Exception as e:  # noqa: BLE001 - every waiting caller must hear of it
                self._fail(e, admitted)
        _deliver_all([(row.pending.future, GenerateResult([], [], "abort"))
                      for row in self._rows])
        self._rows = []

    def _admit(self) -> list[_Row]:
        """Waiting requests -> rows in slots, as many as `max_batch` allows (lock held)."""
        admitted = []
        while self._waiting and len(self._rows) + len(admitted) < self.max_batch:
            p = self._waiting.pop(0)
            if p.future.done():  # the caller went away
                continue
            ids = list(p.request.prompt_ids)
            hit = self.prefix_cache.take(ids) if self.prefix_cache is not None else None
            if hit is not None:
                slot, cached = hit
            else:
                if not self._free:
                    self._free.append(self.prefix_cache.evict())
                slot, cached = self._free.pop(), 0
            admitted.append(_Row(p, slot, ids, cached, cached, self.version,
                                 started=time.perf_counter()))
        return admitted

    def _share(self, admitted: list[_Row]) -> list[tuple[_Row, int, int]]:
        """Admitted rows whose prompt shares more whole blocks with keys/values in a slot
        (a running row's, or an earlier admitted row's once it is prefilled) than the row
        holds: (row, source slot, shared length), at least one id left to prefill. Such a
        row is prefilled after the others, from a copy of its source's positions."""
        if not admitted:  # most rounds: only decoding rows, nothing to look up
            return []
        index = SharedPrefixes(_SHARE_BLOCK)
        for r in self._rows:
            index.add(r.block_hashes(r.fed), r.ids, r.slot)
        followers = []
        for r in admitted:
            hit = index.longest(r.block_hashes(len(r.ids) - 1), r.ids)
            if hit is not None and hit[1] > r.fed:
                followers.append((r, *hit))
            else:
                index.add(r.block_hashes(len(r.ids)), r.ids, r.slot)
        return followers

    def _copy_prefixes(self, followers: list[tuple[_Row, int, int]]) -> None:
        n = bucket(len(followers), self.max_batch, self.min_batch)
        pad = n - len(followers)
        window = bucket(max(length for _, _, length in followers), self.max_len, self.min_window,
                        _WINDOW_STEP)
        pool_k, pool_v = self._pool_arrays()
        self._pool = None
        self._pool = self._copy_fn(
            pool_k, pool_v, np.array([src for _, src, _ in followers] + [0] * pad, np.int32),
            np.array([r.slot for r, _, _ in followers] + [self.num_slots] * pad, np.int32),
            window=window)
        for r, _, length in followers:
            r.fed = r.cached = length

    def _prefill_all(self, weights, rows: list[_Row]) -> None:
        for group in prefill_groups(
                [len(r.ids) - r.fed for r in rows], max_batch=self.max_batch,
                min_batch=self.min_batch, max_len=self.max_len, min_len=self.min_len):
            self._prefill(weights, [rows[i] for i in group])

    def _pool_arrays(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        if self._pool is None:
            model = nnx.merge(self.graphdef, self.params)
            cache = model.init_cache(self.num_slots, self.max_len)
            self._pool = (cache.k, cache.v)
        return self._pool

    def _sampling(self, rows: Sequence[_Row], n: int) -> RowSampling:
        """The sampling parameters of `rows`, padded to n rows (padding rows: greedy, no
        log-prob)."""
        reqs = [r.pending.request for r in rows]
        pad = n - len(rows)
        return RowSampling(
            temperature=np.array([q.temperature for q in reqs] + [0.0] * pad, np.float32),
            top_p=np.array([q.top_p for q in reqs] + [1.0] * pad, np.float32),
            top_k=np.array([q.top_k for q in reqs] + [-1] * pad, np.int32),
            seeds=np.array([r.pending.seed for r in rows] + [0] * pad, np.uint32),
            want_logp=np.array([q.return_logprob for q in reqs] + [False] * pad, bool))

    def _prefill(self, weights, rows: list[_Row]) -> None:
        fed = max(len(r.ids) - r.fed for r in rows)
        width = bucket(fed, self.max_len, self.min_len)
        n = prefill_rows(len(rows), width, max_batch=self.max_batch, min_batch=self.min_batch,
                         min_len=self.min_len)
        window = bucket(max(len(r.ids) for r in rows), self.max_len, self.min_window,
                        _WINDOW_STEP)
        tokens = np.zeros((n, width), np.int32)
        positions = np.full((n, width), -1, np.int32)
        positions[len(rows):, 0] = 0  # padding rows hold one dummy token (writes dropped)
        slots = np.full(n, self.num_slots, np.int32)
        for i, r in enumerate(rows):
            tokens[i, :len(r.ids) - r.fed] = r.ids[r.fed:]
            positions[i, :len(r.ids) - r.fed] = np.arange(r.fed, len(r.ids))
            slots[i] = r.slot
        last = np.array([len(r.ids) - r.fed - 1 for r in rows] + [0] * (n - len(rows)), np.int32)
        start = np.array([r.fed for r in rows] + [0] * (n - len(rows)), np.int32)
        t0 = time.perf_counter()
        pool_k, pool_v = self._pool_arrays()
        self._pool = None  # donated: a failed call leaves no stale arrays behind
        pool_k, pool_v, token, logp = self._prefill_fn(
            *weights, pool_k, pool_v, slots, tokens, positions, start, last,
            self._sampling(rows, n), window=window)
        self._pool = (pool_k, pool_v)
        token, logp = jax.device_get((token, logp))
        elapsed = time.perf_counter() - t0
        for i, r in enumerate(rows):
            r.fed, r.prefill_s = len(r.ids), elapsed
            self._append(r, [int(token[i])], [float(logp[i])])
        self._rows.extend(rows)
        self._finish()

    def _decode(self, weights) -> None:
        rows, steps = self._rows, self.chunk_steps
        n = bucket(len(rows), self.max_batch, self.min_batch, _DECODE_ROW_STEP)
        pad = n - len(rows)
        remaining = [r.pending.request.max_new_tokens - len(r.output) for r in rows]
        window = bucket(max(r.fed + min(steps, m) for r, m in zip(rows, remaining, strict=True)),
                        self.max_len, self.min_window, _WINDOW_STEP)
        n_stop = bucket(max(len(r.pending.request.stop_token_ids) for r in rows), 1 << 30, 4)
        stop_ids = np.full((n, n_stop), -1, np.int32)
        for i, r in enumerate(rows):
            stop = r.pending.request.stop_token_ids
            stop_ids[i, :len(stop)] = stop
        pool_k, pool_v = self._pool_arrays()
        self._pool = None
        pool_k, pool_v, out_ids, out_logp, n_out, _ = self._decode_fn(
            *weights, pool_k, pool_v,
            np.array([r.slot for r in rows] + [self.num_slots] * pad, np.int32),
            np.array([r.ids[r.fed] for r in rows] + [0] * pad, np.int32),
            np.array([r.fed for r in rows] + [0] * pad, np.int32),
            np.array(remaining + [0] * pad, np.int32), stop_ids,
            self._sampling(rows, n), np.int32(self._finish_quota(len(rows))),
            np.int32(self.min_steps), window=window, steps=steps)
        self._pool = (pool_k, pool_v)
        out_ids, out_logp, n_out = jax.device_get((out_ids, out_logp, n_out))
        for i, r in enumerate(rows):
            r.fed += int(n_out[i])
            self._append(r, out_ids[i, :n_out[i]].tolist(), out_logp[i, :n_out[i]].tolist())
        self._finish()

    def _finish_quota(self, rows: int) -> int:
        """Finished rows that end a decode call: one when requests wait for a slot (it
        goes to them at once), else a quarter of the rows (each call's end reads the
        rows' caches again; their results wait a few steps)."""
        return 1 if self._waiting else max(1, rows // 4)

    def _append(self, row: _Row, ids: list[int], logprobs: list[float]) -> None:
        stops = row.pending.request.stop_token_ids
        row.output += ids
        row.logprobs += logprobs
        row.ids += ids
        row.stopped = bool(ids) and ids[-1] in stops

    def _finish(self) -> None:
        """Hands out finished rows' results and parks (or frees) their slots."""
        done = [r for r in self._rows if r.done]
        if not done:
            return
        self._rows = [r for r in self._rows if not r.done]
        now = time.perf_counter()
        with self._cv:
            for r in done:
                if self.prefix_cache is not None:
                    # ids[:fed] have keys/values: the prompt and all but the last output id.
                    self._free.extend(self.prefix_cache.insert(r.ids[:r.fed], r.slot))
                else:
                    self._free.append(r.slot)
        _deliver_all([(r.pending.future, GenerateResult(
            output_ids=r.output, logprobs=r.logprobs,
            finish_reason=("stop" if r.stopped else "length") if r.finished else "abort",
            timings={"prefill_s": r.prefill_s,
                     "decode_s": now - r.started - r.prefill_s,
                     "queue_s": r.started - r.pending.enqueued},
            cached_tokens=r.cached, policy_version=r.version)) for r in done])

    def _fail(self, error: Exception, admitted: list[_Row]) -> None:
        """A device call failed: its rows' callers get the error; the pool starts afresh."""
        rows = self._rows + [r for r in admitted if all(r is not x for x in self._rows)]
        self._rows = []
        with self._cv:
            self._pool = None
            self._free = list(range(self.num_slots))[::-1]
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
        _deliver_all([(r.pending.future, error) for r in rows])


def _deliver_all(results: list[tuple[asyncio.Future, Any]]) -> None:
    """Sets callers' futures from the scheduler thread (an exception fails its future),
    with one wake-up of each event loop: a batch of 32 finished rows woke a loop 32
    times (0.3 ms of a 55 ms call of 32 rows x 64 tokens)."""

    def put(batch):
        for future, result in batch:
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    by_loop: dict[Any, list] = {}
    for future, result in results:
        by_loop.setdefault(future.get_loop(), []).append((future, result))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is waiting
            loop.call_soon_threadsafe(put, batch)
