"""Qwen3 dense decoder in Flax NNX.

Architecture (HF `Qwen3ForCausalLM`): token embedding; per layer
`x += o_proj(attn(q_norm(q_proj(rms(x))), k_norm(k_proj(rms(x))), v_proj(rms(x))))` then
`x += down_proj(silu(gate_proj(rms(x))) * up_proj(rms(x)))`; a final RMSNorm. Attention is
grouped-query (num_heads query heads share num_kv_heads key/value heads), q and k are
RMS-normalised per head before RoPE, and head_dim is independent of hidden_size.

Parameters are stored as `[in, out]` kernels (HF stores `[out, in]`); attribute names follow
HF so `hf_io` maps them one to one. Norms, RoPE and softmax run in float32 whatever the
compute dtype.

Two call paths share the layers:
  `model(tokens, positions, segment_ids)` for training / scoring on (packed) rows, and
  `model.decode(tokens, positions, cache)` for prefill and incremental decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from kernels.attention import attention
from models.sharding import constrain_rows

_HF_ARCH = "Qwen3ForCausalLM"
# Rematerialisation policies by name (None = recompute everything but the layer input;
# "nested" is "full" within groups of layers, see _scan_layers).
REMAT_POLICIES = {"none": None, "full": None, "nested": None,
                  "save-dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
ATTENTION_IMPLS = ("auto", "xla", "pallas", "reference")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Shape and numerics of a Qwen3 model.

    vocab_size: rows of the embedding / columns of the output head.
    hidden_size: model width d.
    intermediate_size: SwiGLU width.
    num_layers: decoder layers.
    num_heads / num_kv_heads: query heads / key-value heads (num_heads % num_kv_heads == 0).
    head_dim: per-head width (128 for all released Qwen3 sizes, not hidden_size / num_heads).
    rope_theta: RoPE base.
    rms_norm_eps: epsilon of every RMSNorm.
    tie_word_embeddings: output head is the transposed embedding.
    max_position_embeddings: longest position the model was trained for (informational).
    dtype: compute dtype of matmuls and activations ("float32" | "bfloat16").
    param_dtype: storage dtype of parameters ("float32" | "bfloat16").
    remat: what the backward pass recomputes per layer (not saved to HF): "none" stores
      every activation; "full" stores only each layer's input (memory O(layers * B*T*d));
      "save-dots" also keeps the projections' matmul outputs (recomputes norms, RoPE,
      attention and activations); "nested" stores only the input of each group of
      `remat_group(num_layers)` layers and recomputes a group's layer inputs in its backward
      pass (memory O((layers / group + group) * B*T*d), one more forward pass of the layers).
    attention: kernels.attention implementation: "auto" (blockwise XLA on CPU, Pallas
      elsewhere when it compiles, logged when not), "xla", "pallas" (required) or
      "reference" (dense [T, T] scores).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"

    def __post_init__(self):
        for name, allowed in (("remat", REMAT_POLICIES), ("attention", ATTENTION_IMPLS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Qwen3Config.{name} must be one of {sorted(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"Qwen3Config.{name} must be float32 or bfloat16, "
                                 f"got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides) -> Qwen3Config:
        """Builds a config from an HF `config.json` dict; `overrides` set dtype/param_dtype."""
        if hf.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"expected model_type 'qwen3', got {hf.get('model_type')!r}")
        if hf.get("attention_bias", False):
            raise ValueError("attention_bias=true is not a Qwen3 dense model")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {hf['hidden_act']!r}")
        if hf.get("use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling")
        rope_type = rope.get("rope_type", (scaling or {}).get("rope_type", "default"))
        if rope_type != "default" or (scaling and scaling.get("rope_type") != "default"):
            raise ValueError(f"only default RoPE is supported, config has {rope or scaling}")
        theta = hf.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
            **overrides,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict (loadable by transformers and SGLang)."""
        return {
            "architectures": [_HF_ARCH],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_layers,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": self.param_dtype,
        }


def _preset(hidden, inter, layers, heads, tied):
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128,
                       tie_word_embeddings=tied)


# Sizes from the released HF config.json files; "tiny" is the CPU model trained from scratch.
PRESETS: dict[str, Qwen3Config] = {
    "tiny": Qwen3Config(vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0,
                        max_position_embeddings=4096),
    "qwen3-0.6b": _preset(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _preset(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _preset(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _preset(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": _preset(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": _preset(5120, 25600, 64, 64, tied=False),
}


# ----------------------------------------------------------------------------- maths


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """y = scale * x / sqrt(mean(x^2, -1) + eps), computed in float32, returned in x.dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * y).astype(x.dtype)


def rope_angles(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos(a), sin(a)) [B,T,1,D] float32 of the rotary angles a = p*f for positions [B,T]:
    f_i = theta^(-2i/D) for i < D/2, repeated to length D (HF's layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angle = positions.astype(jnp.float32)[..., None] * inv_freq          # [B,T,D/2]
    angle = jnp.concatenate([angle, angle], axis=-1)[:, :, None, :]      # [B,T,1,D]
    return jnp.cos(angle), jnp.sin(angle)


def _rope_lookup(positions: jax.Array, length: int, dim: int,
                 theta: float) -> tuple[jax.Array, jax.Array]:
    """rope_angles(positions, dim, theta) for positions [B,T] in [0, length) (others
    clipped), gathered from a table of every position below `length`: computed from the
    positions themselves, XLA fused cos and sin into each layer's q and k and evaluated
    them per head and element (on CPU, 40% of a [32, 32] prefill's q and k rotation)."""
    cos, sin = rope_angles(jnp.arange(length)[None], dim, theta)  # [1,length,1,D]
    at = jnp.clip(positions, 0, length - 1)
    return cos[0][at], sin[0][at]


def rope(x: jax.Array, positions: jax.Array, theta: float,
         angles: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Rotary embedding, HF rotate_half layout.

    x: [B,T,H,D], positions: [B,T]; angles: `rope_angles(positions, D, theta)` when the
    caller shares them between calls (None: computed here).
    y = x*cos(a) + rotate_half(x)*sin(a), rotate_half(x) = [-x2, x1].
    """
    cos, sin = rope_angles(positions, x.shape[-1], theta) if angles is None else angles
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


# ----------------------------------------------------------------------------- cache


@flax.struct.dataclass
class KVCache:
    """Keys and values, one buffer per layer, one slot per position.

    k: num_layers arrays [B,K,D,S], v: num_layers arrays [B,K,S,D] (compute dtype), laid
    out for a decode step's two matmuls per (row, kv head), scores q [G,D] @ k [D,S] and
    output p [G,S] @ v [S,D], each over contiguous slots. Separate buffers per layer let
    a step update and read its layer's cache in place; slicing one stacked [L,...]
    buffer copied it every step. (On CPU, at 64 rows x 1024 slots, a decode step of the
    default model takes 8.1 ms against 13.1 ms with [L,B,S,K,D] caches.)
    valid: [B,S] bool, slot s holds position s of row b; lengths: [B] int32, one past
    the largest position written in each row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    lengths: jax.Array


# ----------------------------------------------------------------------------- layers


def _init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * std)


@jax.custom_vjp
def linear(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., in] @ kernel [in, out], whose kernel gradient reads x transposed.

    Autodiff's kernel gradient contracts x and dy over their leading (token) axes; XLA:CPU
    then fuses x's producer (silu(gate) * up, a norm) into a transposing copy that reads
    it column-wise, or runs the dot at about half speed. Transposing x first gives the
    same gradients up to float rounding (the dot library may sum in another order: at
    most 6e-7 relative in tests/test_qwen3.py) and takes a fifth to a third off an MLP
    layer's forward + backward on CPU (tiny preset: 140 -> 99 ms of CPU at 4096 tokens;
    d 256, MLP 768: 208 -> 149 ms at 2048). Other backends fold the transpose back
    into the dot.
    """
    return jnp.dot(x, kernel)


def _linear_fwd(x, kernel):
    return jnp.dot(x, kernel), (x, kernel)


def _linear_bwd(residuals, dy):
    x, kernel = residuals
    dx = lax.dot_general(dy, kernel, (((dy.ndim - 1,), (1,)), ((), ())))
    rows = lambda a: a.reshape(-1, a.shape[-1])
    return dx, jnp.dot(rows(x).T, rows(dy))


linear.defvjp(_linear_fwd, _linear_bwd)


class Linear(nnx.Module):
    """y = x @ kernel, kernel [in, out] stored in param_dtype, applied in compute dtype."""

    def __init__(self, d_in: int, d_out: int, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.kernel = _init(rngs, (d_in, d_out), jnp.dtype(cfg.param_dtype))
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x.astype(self.dtype), self.kernel[...].astype(self.dtype))


def project(x: jax.Array, linears: Sequence[Linear]) -> list[jax.Array]:
    """[lin(x) for lin in linears] of x [B,T,in]; at one token per row (a decode step)
    as one matmul with their kernels side by side. There the separate matmuls are small
    and each costs more than its arithmetic; inside a decode loop XLA hoists the
    concatenation out of it (on CPU, q/k/v and gate/up fused so: 10-15% of a decode step
    of the tiny preset at 32 rows). Longer inputs (training, prefill) keep the separate
    matmuls."""
    if x.shape[1] != 1:
        return [lin(x) for lin in linears]
    dtype = linears[0].dtype
    kernel = jnp.concatenate([lin.kernel[...] for lin in linears], axis=1).astype(dtype)
    y = jnp.dot(x.astype(dtype), kernel)
    cuts = np.cumsum([lin.kernel.shape[1] for lin in linears])[:-1]
    return jnp.split(y, cuts, axis=-1)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: Qwen3Config):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.dtype(cfg.param_dtype)))
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Embed(nnx.Module):
    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.embedding = _init(rngs, (cfg.vocab_size, cfg.hidden_size), jnp.dtype(cfg.param_dtype))
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(d, cfg.num_heads * hd, cfg, rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, cfg, rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, cfg, rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, cfg, rngs)
        self.q_norm = RMSNorm(hd, cfg)
        self.k_norm = RMSNorm(hd, cfg)
        self.head_dim = hd
        self.theta = cfg.rope_theta

    def qkv(self, x, positions, angles=None):
        """x [B,T,d] -> q [B,T,H,D], k, v [B,T,K,D] (normed and rotated; angles: see rope)."""
        b, t, _ = x.shape
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        q = self.q_norm(q.reshape(b, t, -1, self.head_dim))
        k = self.k_norm(k.reshape(b, t, -1, self.head_dim))
        v = v.reshape(b, t, -1, self.head_dim)
        return (rope(q, positions, self.theta, angles), rope(k, positions, self.theta, angles),
                v)

    def out(self, o: jax.Array) -> jax.Array:
        return self.o_proj(o.reshape(*o.shape[:2], -1))


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg, rngs)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg, rngs)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg, rngs)
        self.impl = None if cfg.attention == "auto" else cfg.attention

    def __call__(self, x, positions, segment_ids):
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions)
        o = attention(q, k, v, segment_ids, implementation=self.impl)
        x = x + self.self_attn.out(o)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x, positions, slots, cache, filled, angles=None):
        """Writes this step's k/v into this layer's cache buffers (KVCache's layout) in
        place and attends over the filled slots at or before each token's position.

        slots: [B,T] cache index per token (S for padding: dropped); cache: this layer's
        (k, v) buffers, returned updated; filled: [B,S] bool.
        One token per row (T = 1), or T x S <= _DENSE_SCORES, attends densely over the
        cache; a longer prefill chunk goes through kernels.attention (on the cache
        transposed to [B,S,K,D]), which skips whole empty blocks of _CACHE_BLOCK_K
        slots. angles: the positions' rope_angles.
        """
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions, angles)
        cache_k, cache_v = cache
        rows = jnp.arange(x.shape[0])[:, None]
        # Advanced indices split by slices: the [B,T] index dims lead, then K, D.
        cache_k = cache_k.at[rows, :, :, slots].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[rows, :, slots].set(v.astype(cache_v.dtype), mode="drop")
        if x.shape[1] == 1 or x.shape[1] * filled.shape[1] <= _DENSE_SCORES:
            visible = filled[:, None] & (jnp.arange(filled.shape[1]) <= positions[..., None])
            o = _attend_dense(q, cache_k, cache_v, visible)
        else:
            k, v = jnp.transpose(cache_k, (0, 3, 1, 2)), jnp.transpose(cache_v, (0, 2, 1, 3))
            o = attention(q, k, v, (positions >= 0).astype(jnp.int32),
                          kv_segment_ids=filled.astype(jnp.int32), q_positions=positions,
                          implementation=self.impl, block_q=_CACHE_BLOCK_Q,
                          block_k=_CACHE_BLOCK_K)
        x = x + self.self_attn.out(o)
        return x + self.mlp(self.post_attention_layernorm(x)), cache_k, cache_v


# Scores per row up to which a decode call attends densely (every token against every
# slot of the window, in two batched matmuls), not through kernels.attention's blocks:
# a decode step always, and a prefill of up to 64 tokens against 1024 slots, 128
# against 512, ... . The blocks skip slots past a row's length, but on CPU their
# online softmax costs more per score than the dense one: an agent turn's observation
# ([8, 64] tokens against 768 slots, 564 filled) takes 11 ms densely against 19 ms in
# blocks, [4, 128] against 768 10 against 22. Past this, a call whose window is mostly
# empty gains from the skipping ([32, 128] against 1024 slots, 228 filled: 86 ms in
# blocks, 161 densely).
_DENSE_SCORES = 1 << 16
# Key block of prefill from a cache: a cache is filled to any length, and the blocks past
# it are skipped whole (on CPU, [8,128] tokens against 1024 slots filled to ~530: 2.2x
# faster than 512-slot blocks, the same at 256 slots).
_CACHE_BLOCK_K = 128
# Query block of prefill from a cache: rows end in padding (positions -1) up to their
# call's width, and whole query blocks of padding are skipped (at [16,512] tokens with 256
# real per row against 1024 slots, a layer's prefill attention takes 34 ms against 91 ms
# with 512-token blocks).
_CACHE_BLOCK_Q = 64


def _attend_dense(q, k, v, visible):
    """softmax(q k^T / sqrt(D)) v of T queries per row over the `visible` [B,T,S] slots.

    q: [B,T,H,D]; k: [B,K,D,S], v: [B,K,S,D] (KVCache's layout) with H = K*G (grouped
    heads) -> [B,T,H,D]. Scores, softmax and sums in float32, as two batched matmuls
    over (row, kv head).
    """
    b, t, h, d = q.shape
    kv_heads, group = k.shape[1], h // k.shape[1]
    # Queries [B,K,T*G,D]: for T = 1 a reshape, and each product a plain batched matmul
    # over (row, kv head) (as "btkgd,bkds->bkgts" a decode step took twice as long).
    q = (q.reshape(b, t, kv_heads, group, d) * d ** -0.5).transpose(0, 2, 1, 3, 4)
    q = q.reshape(b, kv_heads, t * group, d)
    scores = jnp.einsum("bkqd,bkds->bkqs", q.astype(k.dtype), k,
                        preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv_heads, t, group, -1)
    # A large finite mask value: a row that sees nothing (padding) averages v, not NaN.
    scores = jnp.where(visible[:, None, :, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).reshape(b, kv_heads, t * group, -1)
    o = jnp.einsum("bkqs,bksd->bkqd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    o = o.reshape(b, kv_heads, t, group, d).transpose(0, 2, 1, 3, 4)
    return o.astype(v.dtype).reshape(b, t, h, d)


def stacked_layers(cfg: Qwen3Config, rngs: nnx.Rngs) -> DecoderLayer:
    """One DecoderLayer whose parameters carry a leading [num_layers] axis (layer i's
    parameters are those the i-th of num_layers consecutive DecoderLayer inits draws)."""
    layers = [DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)]
    graphdef, *states = (nnx.split(layers[0])[0], *(nnx.split(m)[1] for m in layers))
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def remat_group(num_layers: int) -> int:
    """Layers per group of remat="nested": the divisor g of num_layers that minimises the
    layer inputs live in the backward pass, num_layers / g group inputs plus the g layer
    inputs of the group being differentiated (g near sqrt(num_layers); 6 for 36 layers; 1
    for a prime num_layers, which then saves no memory over "full")."""
    divisors = [g for g in range(1, num_layers + 1) if num_layers % g == 0]
    return min(divisors, key=lambda g: (num_layers // g + g, g))


def _scan_layers(layers: DecoderLayer, step, carry, xs=None, remat: str = "none"):
    """lax.scan of step(layer, carry, x) -> (carry, y) over the stacked layers.

    remat="nested" runs two scans: an outer one over groups of remat_group(L) layers whose
    body (a scan of the group's layers, each rematerialised) is itself rematerialised, so
    the forward pass keeps only each group's input.
    """
    graphdef, state = nnx.split(layers)

    def body(carry, inputs):
        layer_state, x = inputs
        return step(nnx.merge(graphdef, layer_state), carry, x)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    if remat != "nested":
        return jax.lax.scan(body, carry, (state, xs))
    num_layers = jax.tree.leaves(state)[0].shape[0]
    group = remat_group(num_layers)
    split = lambda a: a.reshape(num_layers // group, group, *a.shape[1:])
    group_body = jax.checkpoint(lambda c, inputs: jax.lax.scan(body, c, inputs),
                                prevent_cse=False)
    carry, ys = jax.lax.scan(group_body, carry, jax.tree.map(split, (state, xs)))
    return carry, jax.tree.map(lambda a: a.reshape(num_layers, *a.shape[2:]), ys)


class Qwen3(nnx.Module):
    """Qwen3ForCausalLM without the output projection (see `lm_head`).

    The decoder layers are one DecoderLayer with stacked parameters ([num_layers, ...]
    leaves), run by lax.scan in `__call__`: compile time and program size of training do
    not grow with depth.
    """

    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.embed_tokens = Embed(cfg, rngs)
        self.layers = stacked_layers(cfg, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head_proj = Linear(cfg.hidden_size, cfg.vocab_size, cfg, rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens, positions, segment_ids: [B,T] int32 -> final-normed hidden [B,T,d].

        segment_ids: tokens attend only to earlier-or-equal indices of the same nonzero id
        (several sequences packed in one row); 0 marks padding. None = one causal sequence.
        """
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens)
        step = lambda layer, x, _: (constrain_rows(layer(x, positions, segment_ids)), None)
        x = constrain_rows(self.embed_tokens(tokens))
        x, _ = _scan_layers(self.layers, step, x, remat=self.cfg.remat)
        return self.norm(x)

    def lm_head(self) -> jax.Array:
        """Output projection [d, V] in compute dtype (the embedding transposed when tied)."""
        dtype = jnp.dtype(self.cfg.dtype)
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T.astype(dtype)
        return self.lm_head_proj.kernel[...].astype(dtype)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for `batch` rows of up to `max_len` positions."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
        v_shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        layers = range(cfg.num_layers)
        return KVCache(k=tuple(jnp.zeros(k_shape, dtype) for _ in layers),
                       v=tuple(jnp.zeros(v_shape, dtype) for _ in layers),
                       valid=jnp.zeros((batch, max_len), bool),
                       lengths=jnp.zeros((batch,), jnp.int32))

    def unstacked_layers(self) -> list[DecoderLayer]:
        """The decoder layers as num_layers separate modules (slices of the stacked
        parameters). A decode loop takes them once, before its first step: sliced inside
        the loop body, the weights were copied at every step (XLA did not hoist the
        slices: 7% of a decode step of the tiny preset at 32 rows in a profile)."""
        graphdef, state = nnx.split(self.layers)
        return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
                for i in range(self.cfg.num_layers)]

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: KVCache,
               layers: Sequence[DecoderLayer] | None = None) -> tuple[jax.Array, KVCache]:
        """Prefill (T > 1) or step (T = 1) against a cache -> (hidden [B,T,d], new cache).

        Token (b, t) is stored in cache slot positions[b, t]; a negative position marks a
        padding token, which is neither stored nor meaningful in the output. A token at
        position p attends to every filled slot s <= p of its row, so rows may sit at
        different lengths and a prompt may be prefilled in several chunks. Positions must
        be below the cache's max_len (larger ones are dropped, as jit cannot raise).
        The layers run one after another in the traced program, not under lax.scan:
        each reads and writes its own cache buffers in place (see KVCache). `layers`:
        `unstacked_layers()` taken once outside a loop of decode calls (None: taken here).
        """
        max_len = cache.valid.shape[1]
        rows = jnp.arange(tokens.shape[0])[:, None]
        slots = jnp.where(positions >= 0, positions, max_len)
        valid = cache.valid.at[rows, slots].set(True, mode="drop")
        lengths = jnp.maximum(cache.lengths, jnp.max(positions, axis=1) + 1).astype(jnp.int32)

        layers = self.unstacked_layers() if layers is None else layers
        angles = _rope_lookup(positions, max_len, self.cfg.head_dim, self.cfg.rope_theta)
        x, ks, vs = self.embed_tokens(tokens), [], []
        for layer, k, v in zip(layers, cache.k, cache.v, strict=True):
            x, k, v = layer.decode(x, positions, slots, (k, v), valid, angles)
            ks.append(k)
            vs.append(v)
        cache = KVCache(k=tuple(ks), v=tuple(vs), valid=valid, lengths=lengths)
        return self.norm(x), cache
