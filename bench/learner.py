"""Learner throughput and packing density, measured in one run.

  python -m bench.learner                         # tiny preset, CPU-sized batch
  python -m bench.learner --model qwen3-0.6b --rows 8 --row-len 4096 --micro 4   # GPU

Prints one JSON object:
  tokens_per_s         real (non-padding) tokens through train_step per second
  model_flops_per_s    (6 N + attention) per real token, times tokens_per_s; N = matmul
                       parameters (attention, MLP, lm_head; not the embedding lookup),
                       attention = 6 * layers * heads * head_dim * n^2 per segment of
                       n tokens (causal half of PaLM's 12 L H Q T^2)
  dot_flops_per_s      FLOP/s of one jnp.dot [M, K] @ [K, N] in the model's dtype
  matmul_fraction      model_flops_per_s / dot_flops_per_s
  matmul_fraction_cpu  the same from process CPU seconds (the step's and the dot's), which
                       a machine shared with other work disturbs less than wall time;
                       load_average: the 1-minute load when the run ended
  real_token_fraction  non-padding share when packing an agent-like long tail
                       (lognormal lengths clipped to 200..8000 tokens) into the buckets
  batch_real_token_fraction  the same share for the timed batch
  dense_tokens_per_s   the same batch and steps with the dense reference attention
                       ([T, T] scores; --no-dense skips it), timed in the same run
  vs_dense             tokens_per_s / dense_tokens_per_s
  packed_attention_flops_ratio  attention work of a 2048-token row packed with 4 equal
                       segments over one dense causal 2048-token row: key blocks the
                       kernel visits (kernels.attention.blocks, 128-token blocks) over the
                       causal blocks of the dense row
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import common
from kernels.attention.blocks import block_ranges, visited_pairs
from models.qwen3 import PRESETS, Qwen3
from rl import learner
from rl.batch import pack_arrays

BUCKETS = (2048, 4096, 8192)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def agent_lengths(count: int, low: int, high: int, seed: int) -> np.ndarray:
    """Long-tailed trajectory lengths: lognormal (median high/7, sigma 0.9) clipped."""
    rng = np.random.default_rng(seed)
    median = high / 7
    return np.clip(rng.lognormal(np.log(median), 0.9, count), low, high).astype(int)


def synthetic_seqs(lengths, vocab: int, seed: int):
    """(ids, loss_mask, logprobs) per length: a prompt of a quarter, then alternating
    generated and observed stretches of 32 tokens."""
    rng = np.random.default_rng(seed)
    seqs = []
    for n in lengths:
        mask = ((np.arange(n) // 32) % 2 == 1) & (np.arange(n) >= n // 4)
        logp = np.where(mask, -rng.uniform(0.5, 3.0, n), 0.0).astype(np.float32)
        seqs.append((rng.integers(0, vocab, n).astype(np.int32), mask.astype(np.int32), logp))
    return seqs


def matmul_params(cfg) -> int:
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + cfg.hidden_size * cfg.vocab_size


def model_flops(cfg, segment_lengths) -> float:
    """Training FLOPs (forward + backward) of the given segments."""
    lengths = np.asarray(segment_lengths, np.float64)
    dense = 6.0 * matmul_params(cfg) * lengths.sum()
    attention = 6.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * np.sum(lengths ** 2)
    return dense + attention


def dot_flops_per_s(size: int, dtype, repeats: int = 5) -> tuple[float, float]:
    """FLOP per second of wall time and per second of process CPU time (best of each)."""
    a = jnp.ones((size, size), dtype)
    b = jnp.ones((size, size), dtype)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(dot(a, b))
        best_wall = min(best_wall, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    return 2.0 * size ** 3 / best_wall, 2.0 * size ** 3 / best_cpu


def packed_attention_flops_ratio(row_len: int = 2048, segments: int = 4,
                                 block: int = 128) -> float:
    """Visited block pairs of a row of `segments` equal segments / of one causal row."""
    pos = jnp.arange(row_len)[None]
    ones = jnp.ones((1, row_len), jnp.int32)
    seg = jnp.repeat(jnp.arange(1, segments + 1), row_len // segments)[None]
    pairs = lambda s: int(visited_pairs(block_ranges(s, s, pos, pos, block, block)))
    return pairs(seg) / pairs(ones)


def time_steps(model_cfg, cfg, batch, steps: int) -> tuple[float, float, float]:
    """(wall seconds per train step after the first, process CPU seconds per step, last
    loss) of a fresh train state."""
    graphdef, state = learner.init_train_state(Qwen3(model_cfg, rngs=nnx.Rngs(0)), cfg)
    train_step = learner.make_train_step(graphdef, cfg)
    start = time.perf_counter()
    state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    _log(f"attention={model_cfg.attention}: compile + first step "
         f"{time.perf_counter() - start:.1f}s")
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state, metrics = train_step(state, batch)
    jax.block_until_ready((state, metrics))
    return ((time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps,
            float(metrics["loss"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-len", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dot-size", type=int, default=None)
    parser.add_argument("--no-dense", action="store_true",
                        help="skip timing the dense reference attention")
    args = parser.parse_args(argv)

    # Packing density on the agent-like tail, at the scale of a real RL batch.
    tail = agent_lengths(512, 200, 8000, seed=0)
    tail_seqs = [(np.zeros(n, np.int32), np.ones(n, np.int32), np.zeros(n, np.float32))
                 for n in tail]
    _, tail_info = pack_arrays(tail_seqs, np.zeros(len(tail)), buckets=BUCKETS, row_multiple=8)
    _log(f"tail packing: {tail_info.num_rows} rows x {tail_info.row_len}, "
         f"real {tail_info.real_token_fraction:.3f}")

    model_cfg = PRESETS[args.model]
    section = common.learner_defaults()
    cfg = learner.LearnerConfig.from_section({
        **section, "num_microbatches": args.micro, "row_buckets": (args.row_len,),
        "optim": {**section.optim, "lr": 1e-5}})

    # The timed batch: the same tail scaled to the row length, packed to exactly `rows`.
    scale = args.row_len / 8000
    lengths = np.maximum(agent_lengths(64 * args.rows, 200, 8000, seed=1) * scale, 8).astype(int)
    seqs = synthetic_seqs(lengths, model_cfg.vocab_size, seed=2)
    chosen, total = [], 0
    for seq in seqs:  # greedily take trajectories until the rows are about full
        if total + len(seq[0]) <= 0.97 * args.rows * args.row_len:
            chosen.append(seq)
            total += len(seq[0])
    batch, info = pack_arrays(chosen, np.random.default_rng(3).normal(size=len(chosen)),
                              buckets=[args.row_len], row_multiple=args.rows * args.micro)
    _log(f"timed batch: {batch.shape}, {len(chosen)} trajectories, "
         f"real {info.real_token_fraction:.3f}")

    seconds, cpu_seconds, loss = time_steps(model_cfg, cfg, batch, args.steps)
    dense_s = None
    if not args.no_dense:
        dense_cfg = dataclasses.replace(model_cfg, attention="reference")
        dense_s, _, _ = time_steps(dense_cfg, cfg, batch, args.steps)

    tokens_per_s = info.real_tokens / seconds
    flops = model_flops(model_cfg, [n for _, _, n in info.placements])
    flops_per_s = flops / seconds
    dot_size = args.dot_size or (1024 if jax.default_backend() == "cpu" else 8192)
    dot, dot_cpu = dot_flops_per_s(dot_size, jnp.dtype(model_cfg.dtype))
    print(json.dumps({
        "model": args.model, "backend": jax.default_backend(),
        "batch_shape": list(batch.shape), "step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_s": flops_per_s, "dot_flops_per_s": dot,
        "matmul_fraction": flops_per_s / dot,
        "step_cpu_s": cpu_seconds, "matmul_fraction_cpu": flops / cpu_seconds / dot_cpu,
        "load_average": os.getloadavg()[0],
        "real_token_fraction": tail_info.real_token_fraction,
        "tail_rows": tail_info.num_rows, "tail_row_len": tail_info.row_len,
        "batch_real_token_fraction": info.real_token_fraction,
        "loss": loss,
        "dense_tokens_per_s": dense_s and info.real_tokens / dense_s,
        "vs_dense": dense_s and dense_s / seconds,
        "packed_attention_flops_ratio": packed_attention_flops_ratio(),
    }))


if __name__ == "__main__":
    main()
