"""Chunked token log-probs against the naive [N, V] reference, side by side in one run.

  python -m bench.kernels                       # N=4096, d=1024, V=151936, float32
  python -m bench.kernels --n 1024 --v 32768    # smaller

Prints one JSON object:
  mem_ratio        temp bytes of jitted forward+backward, naive / xla (memory beyond the
                   inputs and the returned gradients, from compiled.memory_analysis())
  mem_ratio_with_outputs   same with output bytes added (dW [d, V] is in both)
  time_ratio       xla / naive wall time, no masked rows
  speedup_masked   naive / xla wall time, half of the rows masked
  matmul_fraction  FLOP/s of xla forward+backward (8 N d V: forward, recompute, two
                   gradient matmuls) over FLOP/s of one jnp.dot [N, d] @ [d, V]
Every function is compiled ahead of time, so each timed call is a steady-state run.
"""

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

from kernels.logprob.api import token_logprobs


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _time(fn, args, repeats: int) -> float:
    """Best wall time of a compiled fn(*args) over repeats."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


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

    times = {}
    for name, fn, mask in (("xla", xla, full), ("naive", naive, full),
                           ("xla_masked", xla, half), ("naive_masked", naive, half)):
        times[name] = _time(fn, inputs(mask), args.repeats)
        _log(f"{name}: {times[name]:.3f} s")
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    matmul = matmul.lower(hidden, lm_head).compile()
    times["matmul"] = _time(matmul, (hidden, lm_head), args.repeats)
    _log(f"matmul: {times['matmul']:.3f} s")

    flops = 8 * n * d * v
    result = {
        "shape": {"n": n, "d": d, "v": v, "dtype": args.dtype},
        "blocks": {"row_block": args.row_block, "vocab_block": args.vocab_block},
        "backend": jax.default_backend(),
        "mem_ratio": naive_temp / xla_temp,
        "mem_ratio_with_outputs": (naive_temp + naive_out) / (xla_temp + xla_out),
        "temp_bytes": {"naive": naive_temp, "xla": xla_temp},
        "output_bytes": xla_out,
        "time_ratio": times["xla"] / times["naive"],
        "speedup_masked": times["naive_masked"] / times["xla_masked"],
        "matmul_fraction": (flops / times["xla"]) / (2 * n * d * v / times["matmul"]),
        "seconds": times,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
