"""Chunked token log-probs against the naive [N, V] reference, side by side in one run.

  python -m bench.kernels                       # N=4096, d=1024, V=151936, float32
  python -m bench.kernels --n 1024 --v 32768    # smaller

Prints one JSON object:
  mem_ratio        temp bytes of jitted forward+backward, naive / xla (memory beyond the
                   inputs and the returned gradients, from compiled.memory_analysis())
  mem_ratio_with_outputs   same with output bytes added (dW [d, V] is in both)
  time_ratio       xla / naive time, no masked rows
  speedup_masked   naive / xla time, half of the rows masked
  matmul_fraction  FLOP/s of xla forward+backward (8 N d V: forward, recompute, two
                   gradient matmuls; 6 N d V where the engine keeps the logits for the
                   backward, `logits_kept`) over FLOP/s of one jnp.dot [N, d] @ [d, V]
At --n 4096 --d 512 --v 32768, time_ratio is the unmasked kernel against what
bench.vs_tunix's tunix side computes (autodiff through [N, V] logits), without tunix.
The three time ratios use process CPU time (the machine may be shared); "wall_clock"
repeats them from wall time. Every function is compiled ahead of time.
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from kernels.logprob.api import token_logprobs
from kernels.logprob.rows import padded_rows
from kernels.logprob.xla import XlaEngine


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _time(fn, args, repeats: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of a compiled fn(*args), best of repeats.

    CPU time sums all of XLA's threads; on a machine shared with other work it measures the
    work done, where wall time also counts time spent waiting for a core.
    """
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu


def _forward_backward(implementation: str, row_block: int, vocab_block: int):
    """jit of (hidden, lm_head, ...) -> grads of sum(g_logp logp + g_ent entropy)."""
    blocks = {} if implementation == "reference" else {"row_block": row_block,
                                                       "vocab_block": vocab_block}

    def loss(hidden, lm_head, targets, mask, g_logp, g_ent):
        logp, entropy = token_logprobs(hidden, lm_head, targets, mask,
                                       implementation=implementation, **blocks)
        return jnp.sum(logp * g_logp + entropy * g_ent)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _memory(compiled) -> tuple[int, int]:
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes, stats.output_size_in_bytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--row-block", type=int, default=1024)
    parser.add_argument("--vocab-block", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)

    n, d, v = args.n, args.d, args.v
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    hidden = jax.random.normal(keys[0], (n, d), args.dtype)
    lm_head = (jax.random.normal(keys[1], (d, v)) * d**-0.5).astype(args.dtype)
    targets = jax.random.randint(keys[2], (n,), 0, v)
    g_logp, g_ent = jax.random.normal(keys[3], (2, n))
    full = jnp.ones((n,), bool)
    half = jnp.arange(n) % 2 == 0
    inputs = lambda mask: (hidden, lm_head, targets, mask, g_logp, g_ent)
    naive, xla = (_forward_backward(name, args.row_block, args.vocab_block)
                  .lower(*inputs(full)).compile() for name in ("reference", "xla"))
    naive_temp, naive_out = _memory(naive)
    xla_temp, xla_out = _memory(xla)
    _log(f"temp bytes naive {naive_temp:.3e} xla {xla_temp:.3e}; outputs {xla_out:.3e}")

    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    matmul = matmul.lower(hidden, lm_head).compile()
    runs = (("matmul", matmul, (hidden, lm_head)), ("xla", xla, inputs(full)),
            ("naive", naive, inputs(full)), ("naive_masked", naive, inputs(half)),
            ("xla_masked", xla, inputs(half)))
    wall, cpu = {}, {}
    for name, fn, fn_args in runs:  # compared pairs run back to back
        wall[name], cpu[name] = _time(fn, fn_args, args.repeats)
        _log(f"{name}: {wall[name]:.3f} s wall, {cpu[name]:.3f} s cpu")

    engine = XlaEngine(args.row_block, args.vocab_block)
    kept = engine.keeps_logits(padded_rows(n, engine.rows_per_block(n)), v)
    passes = 3 if kept else 4  # logit-sized matmuls: forward, [recompute,] dh, dW

    def ratios(t):
        return {
            "time_ratio": t["xla"] / t["naive"],
            "speedup_masked": t["naive_masked"] / t["xla_masked"],
            # (2 passes N d V / t_xla) / (2 N d V / t_matmul)
            "matmul_fraction": passes * t["matmul"] / t["xla"],
        }

    result = {
        "shape": {"n": n, "d": d, "v": v, "dtype": args.dtype},
        "blocks": {"row_block": args.row_block, "vocab_block": args.vocab_block},
        "backend": jax.default_backend(),
        "logits_kept": kept,
        "mem_ratio": naive_temp / xla_temp,
        "mem_ratio_with_outputs": (naive_temp + naive_out) / (xla_temp + xla_out),
        "temp_bytes": {"naive": naive_temp, "xla": xla_temp},
        "output_bytes": xla_out,
        **ratios(cpu),
        "wall_clock": ratios(wall),
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
