"""attention: picks an implementation; the Pallas kernels fall back to blockwise XLA, logged."""

import dataclasses

import jax
import jax.numpy as jnp

from kernels import fallback
from kernels.attention.blocks import Layout
from kernels.attention.pallas import attention_pallas
from kernels.attention.reference import attention_reference
from kernels.attention.xla import attention_xla

IMPLEMENTATIONS = ("reference", "xla", "pallas")
# Default blocks. XLA on CPU: a train step of the default model (2 layers, d=128) over 11
# rows of 1024 tokens takes 1.10 s with 128-token blocks against 1.44 s with 512 (more
# of the causal square skipped), and 3.75 s against 4.51 s over 4 rows of 4096. XLA
# elsewhere (the fallback where Pallas does not compile) keeps big blocks, fewer loop
# steps. Triton tiles are small.
BLOCKS = {"xla": (512, 512), "xla/cpu": (128, 128), "pallas": (64, 64)}


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # (the kernel's API: arrays, then options, as jax.nn.dot_product_attention)
    """Causal, packed, grouped-query attention: o = softmax(q k^T / sqrt(D), masked) v.

    Query t may read key s when segment_ids[t] == kv_segment_ids[s] != 0 and
    kv_positions[s] <= q_positions[t]. Whole blocks that no query may read are skipped
    (other segments, the future, padding), so a packed row costs its segments' squares.

    Args:
      q: [B, T, H, D]; k, v: [B, S, K, D] with H a multiple of K (GQA); D any width.
      segment_ids: [B, T] int, 0 = padding; None = one sequence (all ones).
      kv_segment_ids: [B, S]; None = segment_ids (needs S == T). For a KV cache: 1 on
        filled slots and 0 elsewhere, so empty blocks of the cache cost nothing.
      q_positions, kv_positions: [B, T], [B, S] int; None = 0..T-1 and 0..S-1 (causal by
        index, right for packed rows).
      implementation: None (xla on CPU; pallas elsewhere when it compiles for these shapes,
        else xla with a logged warning), "reference", "xla" or "pallas" (required: a
        kernel that does not compile raises kernels.fallback.KernelUnavailable).
      block_q, block_k: tile sizes; None keeps the implementation's defaults (BLOCKS,
        per backend where given).
      interpret: run the Pallas kernels in interpret mode (CPU tests).

    Returns:
      [B, T, H, D] in q's dtype; softmax statistics in float32; a query that may read no
      key (padding) gets 0 and no gradient. Differentiable in q, k, v.
    """
    ids = _layout(q, k, segment_ids, kv_segment_ids, q_positions, kv_positions)
    _check(q, k, v, ids, implementation)
    if implementation == "reference":
        return attention_reference(q, k, v, Layout(*ids))
    name = implementation or ("xla" if jax.default_backend() == "cpu" else "pallas")
    if name == "pallas":
        if implementation == "pallas" and jax.default_backend() == "cpu" and not interpret:
            raise ValueError("implementation='pallas' on CPU needs interpret=True")
        kernel = _Blocked("pallas", *_block_sizes("pallas", block_q, block_k), interpret)
        # Interpreted kernels always run; compiled ones are checked first.
        if interpret or fallback.use_pallas("attention", kernel.forward_backward,
                                            fallback.signature(q, k, v, *ids),
                                            required=implementation == "pallas"):
            return kernel(q, k, v, *ids)
    return _Blocked("xla", *_block_sizes("xla", block_q, block_k))(q, k, v, *ids)


def _layout(q, k, segment_ids, kv_segment_ids, q_positions, kv_positions):
    """The four id arrays of blocks.Layout, int32, their defaults filled in."""
    b, t = q.shape[:2]
    s = k.shape[1]
    segment_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
    if kv_segment_ids is None:
        if s != t:
            raise ValueError(f"kv_segment_ids is needed when keys ({s}) and queries ({t}) differ")
        kv_segment_ids = segment_ids
    q_positions = _positions(q_positions, b, t)
    kv_positions = _positions(kv_positions, b, s)
    return tuple(x.astype(jnp.int32) for x in (segment_ids, kv_segment_ids, q_positions,
                                               kv_positions))


def _positions(positions, b, n):
    if positions is None:
        return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    return positions


def _check(q, k, v, ids, implementation):
    if implementation not in (*IMPLEMENTATIONS, None):
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, "
                         f"got {implementation!r}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [B, T, H, D] and k, v [B, S, K, D], got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape} differ in batch or head_dim, or "
                         "query heads are not a multiple of kv heads")
    want = [q.shape[:2], k.shape[:2], q.shape[:2], k.shape[:2]]
    names = ("segment_ids", "kv_segment_ids", "q_positions", "kv_positions")
    for name, x, shape in zip(names, ids, want, strict=True):
        if x.shape != shape:
            raise ValueError(f"{name} must be {shape}, got {x.shape}")


def _block_sizes(name, block_q, block_k):
    for size in (block_q, block_k):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"block sizes must be positive integers, got {block_q}, {block_k}")
    default_q, default_k = BLOCKS.get(f"{name}/{jax.default_backend()}", BLOCKS[name])
    return block_q or default_q, block_k or default_k


def _pad(x, multiple):
    """Pads axis 1 to a multiple; padded tokens are segment 0, which nothing reads."""
    extra = -x.shape[1] % multiple
    if not extra:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class _Blocked:
    """One implementation at given block sizes, on inputs padded to whole blocks.
    Hashable by value, so compile checks are cached per kernel and shape."""

    name: str
    block_q: int
    block_k: int
    interpret: bool = False

    def __call__(self, q, k, v, *ids):
        """ids: q_seg, kv_seg, q_pos, kv_pos (blocks.Layout)."""
        q_seg, kv_seg, q_pos, kv_pos = ids
        (b, t, h, d), s = q.shape, k.shape[1]
        bq = min(self.block_q, _next_power_of_2(t))
        bk = min(self.block_k, _next_power_of_2(s))
        q, q_seg, q_pos = (_pad(x, bq) for x in (q, q_seg, q_pos))
        k, v, kv_seg, kv_pos = (_pad(x, bk) for x in (k, v, kv_seg, kv_pos))
        ids = Layout(q_seg, kv_seg, q_pos, kv_pos)
        if self.name == "pallas":
            o = attention_pallas(q, k, v, ids, (bq, bk, self.interpret))
        else:
            grouped = q.reshape(b, q.shape[1], k.shape[2], h // k.shape[2], d)
            o = attention_xla(grouped, k, v, ids, bq, bk).reshape(q.shape)
        return o[:, :t]

    def forward_backward(self, q, k, v, *ids):
        o, vjp = jax.vjp(lambda q, k, v: self(q, k, v, *ids), q, k, v)
        return o, vjp(o)
