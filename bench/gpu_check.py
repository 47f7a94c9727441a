"""GPU checks: compiled Pallas kernels against the references, and a train step's time.

  python -m bench.gpu_check kernels               # attention and logprob, Pallas vs reference
  python -m bench.gpu_check step --attention pallas   # Qwen3-0.6B shapes, one 16k row

Each prints one JSON object. `kernels` runs the Pallas kernels compiled (not interpreted;
implementation="pallas" makes a kernel that does not compile an error) on packed rows with
odd segment lengths, GQA and a padded row, in float32 and bfloat16, and reports the largest
error of outputs and input gradients against the dense references computed at "highest"
matmul precision. `step` times rl.learner's train step (bf16 compute, f32 parameters and
Adam state, remat=full) on one row of --row-len tokens packed with --segments trajectories,
and reads the device's peak memory.

The logprob kernels tile the hidden dimension d (kernels/logprob/pallas.py) so that their
shared memory no longer grows with d; `kernels` checks them at Qwen3-0.6B's and 8B's
d = 1024 and 4096 with Qwen3's vocabulary. That version has not run on a GPU yet (none
was available): it was checked against the reference in interpret mode and lowered for
CUDA on CPU only. Run `python -m bench.gpu_check kernels` on a GPU before relying on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import common
from kernels.attention import attention
from kernels.logprob import token_logprobs
from models.qwen3 import PRESETS, Qwen3
from rl import learner
from rl.batch import Batch


def _max_err(actual, expected) -> float:
    actual, expected = (np.asarray(x, np.float32) for x in (actual, expected))
    return float(np.max(np.abs(actual - expected)) / max(1.0, np.max(np.abs(expected))))


def _attention_case(dtype, heads, kv_heads, head_dim):
    lengths = [[301, 77, 1, 509, 130], [1017], []]
    t = 1024
    seg = np.zeros((len(lengths), t), np.int32)
    for row, segs in enumerate(lengths):
        seg[row, :sum(segs)] = np.repeat(np.arange(1, len(segs) + 1), segs)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (len(lengths), t, heads, head_dim), dtype)
    k, v = (jax.random.normal(x, (len(lengths), t, kv_heads, head_dim), dtype)
            for x in keys[1:3])
    return q, k, v, jnp.asarray(seg), jax.random.normal(keys[3], q.shape)


def _attention_grads(impl, q, k, v, seg, cot):
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, seg, implementation=impl).astype(
        jnp.float32) * cot)
    return jax.jit(jax.value_and_grad(lambda *a: (loss(*a), attention(
        *a, seg, implementation=impl)), (0, 1, 2), has_aux=True))(q, k, v)


def _logprob_grads(impl, hidden, head, targets, mask):
    f = lambda h, w: jnp.sum(sum(token_logprobs(h, w, targets, mask, implementation=impl)))
    return jax.jit(jax.value_and_grad(f, (0, 1)))(hidden, head)


def check_kernels() -> dict:
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        for heads, kv_heads, head_dim in ((16, 8, 128), (8, 1, 64)):
            q, k, v, seg, cot = _attention_case(dtype, heads, kv_heads, head_dim)
            (_, o), g = _attention_grads("pallas", q, k, v, seg, cot)
            with jax.default_matmul_precision("highest"):
                f32 = [x.astype(jnp.float32) for x in (q, k, v)]
                (_, o_ref), g_ref = _attention_grads("reference", *f32, seg, cot)
            name = f"attention_{jnp.dtype(dtype).name}_h{heads}_kv{kv_heads}_d{head_dim}"
            out[name] = {"out": _max_err(o, o_ref),
                         "grads": max(_max_err(a, b) for a, b in zip(g, g_ref, strict=True))}
            _progress(name, out[name])
    for dtype, d in ((jnp.float32, 1024), (jnp.bfloat16, 1024), (jnp.bfloat16, 4096)):
        keys = jax.random.split(jax.random.PRNGKey(1), 4)
        n, vocab = 4099, 151936  # Qwen3-0.6B (d = 1024) and 8B (d = 4096) LM heads
        hidden = jax.random.normal(keys[0], (n, d), dtype)
        head = (jax.random.normal(keys[1], (d, vocab)) * 0.8 / d ** 0.5).astype(dtype)
        targets = jax.random.randint(keys[2], (n,), 0, vocab)
        mask = jax.random.uniform(keys[3], (n,)) < 0.6

        value, grads = _logprob_grads("pallas", hidden, head, targets, mask)
        with jax.default_matmul_precision("highest"):
            value_ref, grads_ref = _logprob_grads("reference", hidden.astype(jnp.float32),
                                                  head.astype(jnp.float32), targets, mask)
        name = f"logprob_{jnp.dtype(dtype).name}_d{d}"
        out[name] = {"sum": _max_err(value, value_ref),
                     "grads": max(_max_err(a, b) for a, b in zip(grads, grads_ref, strict=True))}
        _progress(name, out[name])
    return out


def _progress(name, value):
    print(json.dumps({name: value}), file=sys.stderr, flush=True)


def packed_row(vocab: int, row_len: int, segments: int) -> Batch:
    """One row of `segments` equal trajectories; the second half of each is generated."""
    n = row_len // segments
    rng = np.random.default_rng(0)
    pos = np.tile(np.arange(n), segments)[None].astype(np.int32)
    mask = (pos >= n // 2).astype(np.float32)
    return Batch(tokens=rng.integers(0, vocab, (1, row_len)).astype(np.int32), positions=pos,
                 segment_ids=np.repeat(np.arange(1, segments + 1), n)[None].astype(np.int32),
                 loss_mask=mask, old_logprobs=-mask, advantages=np.ones_like(mask),
                 seq_num_tokens=mask * (n - n // 2))


def time_step(preset: str, attention_impl: str, row_len: int, segments: int, steps: int
              ) -> dict:
    cfg = dataclasses.replace(PRESETS[preset], dtype="bfloat16", param_dtype="float32",
                              remat="full", attention=attention_impl)
    lcfg = common.learner_defaults()
    graphdef, state = learner.init_train_state(Qwen3(cfg, rngs=nnx.Rngs(0)), lcfg)
    train_step = learner.make_train_step(graphdef, lcfg)
    batch = jax.device_put(packed_row(cfg.vocab_size, row_len, segments))
    start = time.perf_counter()
    state, metrics = train_step(state, batch)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / steps
    stats = jax.devices()[0].memory_stats() or {}
    return dict(preset=preset, attention=attention_impl, row_len=row_len, segments=segments,
                compile_and_first_step_s=round(first, 1), step_s=round(step_s, 4),
                tokens_per_s=round(row_len / step_s), loss=float(metrics["loss"]),
                peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2 ** 30, 2),
                device=str(jax.devices()[0]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("kernels", "step"))
    p.add_argument("--attention", default="pallas")
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--row-len", type=int, default=16384)
    p.add_argument("--segments", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.part == "kernels":
        if jax.default_backend() != "gpu":
            raise SystemExit(f"the compiled kernels need a GPU, JAX sees {jax.devices()}")
        result = check_kernels()
    else:
        result = time_step(args.preset, args.attention, args.row_len, args.segments,
                           args.steps)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
