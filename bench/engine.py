"""Generation throughput of the embedded JAX engine vs its matmul bound and HF `generate`.

All three run on the same random Qwen3 in float32 (the `tiny` preset by
default; --hidden/--vocab/--layers change its shape): the JAX weights are exported
with models.hf_io.save_hf and loaded by transformers in a process of its own
(bench/hf_generate.py; HF times its own calls). Each batch size generates
exactly `new_tokens` greedy tokens after a `prompt_len`-token prompt; tokens/s counts
generated tokens over the wall time of the whole call (prefill included; the engine's
calls come from one event loop, as a rollout's do, not a new loop per call), best of
`repeats` runs after a warm-up (compilation excluded), the runs interleaved so machine
load affects all alike. HF's `generate` is called without scores and the embedded
engine's requests without log-probs (`return_logprob=False`, as greedy evaluation
sends them: no log-sum-exp over the vocabulary per step); `embedded_logprobs` is the
same generation with them, as a rollout asks for them.

The matmul bound is the time of the model's weight matmuls alone at the same shapes,
measured in the same run: a jitted loop of the prefill's projections over the
batch x prompt rows, then `new_tokens - 1` decode steps of every projection and the
output head over the batch rows (no attention, norms, sampling or cache). Its
tokens/s is what the engine would reach if everything but the matmuls were free;
`fraction_of_matmul_bound` is the engine's tokens/s over it.

    python -m bench.engine [--batch-sizes 1,8,32,64] [--new-tokens 64] [--prompt-len 32]

Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.embedded import SMALLEST, EmbeddedEngine, EmbeddedOptions
from inference.engine import GenerateRequest
from models import hf_io, qwen3


def options(max_batch: int, max_len: int) -> EmbeddedOptions:
    """The engine measured here: `max_batch` rows of `max_len`, otherwise the smallest
    (inference.embedded.SMALLEST: one-row, 16-token buckets, any window, no prefix cache),
    so every batch size compiles its own shapes."""
    return dataclasses.replace(SMALLEST, max_batch=max_batch, max_len=max_len)


def _log(*args):
    print(*args, file=sys.stderr, flush=True)


def _jax_runner(engine: EmbeddedEngine, loop: asyncio.AbstractEventLoop, prompts: np.ndarray,
                new_tokens: int, logprobs: bool):
    requests = [GenerateRequest(p.tolist(), new_tokens, temperature=0.0,
                                return_logprob=logprobs) for p in prompts]

    def run():
        results = loop.run_until_complete(engine.generate(requests))
        return np.array([r.output_ids for r in results])

    return run


class HFGenerate:
    """bench/hf_generate.py in a process of its own (transformers must not share this
    process's sys.path: see there); a context manager."""

    SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_generate.py")

    def __init__(self, hf_dir: str):
        self.proc = subprocess.Popen([sys.executable, "-I", self.SCRIPT, hf_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=hf_dir)
        self.torch_threads = self._answer()["torch_threads"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench/hf_generate.py exited with code {self.proc.wait()}")
        return json.loads(line)

    def generate(self, prompts: np.ndarray, new_tokens: int) -> tuple[np.ndarray, float]:
        """Greedy tokens [batch, new_tokens] and the seconds `generate` took."""
        self.proc.stdin.write(json.dumps({"prompts": prompts.tolist(),
                                          "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        return np.asarray(answer["tokens"]), answer["seconds"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.stdin.close()
        self.proc.wait(60)


def _projections(model) -> tuple[list[tuple[jax.Array, ...]], jax.Array]:
    """Per layer (q, k, v, o, gate, up, down) kernels in compute dtype, and the head [d,V]."""
    dtype = jnp.dtype(model.cfg.dtype)
    a, m = model.layers.self_attn, model.layers.mlp  # stacked: [num_layers, in, out] kernels
    stacked = [p.kernel[...].astype(dtype) for p in (
        a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)]
    layers = [tuple(w[i] for w in stacked) for i in range(model.cfg.num_layers)]
    return layers, model.lm_head()


def _matmul_chain(layers, head, x, steps: int, with_head: bool):
    """`steps` passes of x [N,d] through every projection (and the head): the matmuls of
    `steps` forward steps of N tokens. Each output feeds the next step (cheap reductions
    keep k, v and the logits live), so nothing is computed once and reused."""

    def step(_, x):
        for wq, wk, wv, wo, wg, wu, wd in layers:
            kv = jnp.mean(x @ wk, axis=-1) + jnp.mean(x @ wv, axis=-1)
            x = x + (x @ wq) @ wo + 1e-6 * kv[:, None]
            x = x + ((x @ wg) * (x @ wu)) @ wd
        if with_head:
            x = x + 1e-6 * jnp.max((x @ head).astype(jnp.float32), axis=-1)[:, None]
        return x

    return jax.lax.fori_loop(0, steps, step, x)


def _bound_runner(model, batch: int, prompt_len: int, new_tokens: int):
    layers, head = _projections(model)
    d = model.cfg.hidden_size
    dtype = jnp.dtype(model.cfg.dtype)

    @jax.jit
    def bound(layers, head, prompt_x, step_x):
        prefill = _matmul_chain(layers, head, prompt_x, 1, with_head=False)
        decode = _matmul_chain(layers, head, step_x, new_tokens - 1, with_head=True)
        return prefill, decode

    prompt_x = jnp.full((batch * prompt_len, d), 0.01, dtype)
    step_x = jnp.full((batch, d), 0.01, dtype)
    return lambda: jax.block_until_ready(bound(layers, head, prompt_x, step_x))


def _model(args) -> qwen3.Qwen3:
    cfg = qwen3.PRESETS[args.preset]
    overrides = {k: v for k, v in (("hidden_size", args.hidden), ("vocab_size", args.vocab),
                                   ("num_layers", args.layers)) if v}
    if "hidden_size" in overrides:
        overrides["intermediate_size"] = 3 * overrides["hidden_size"]
    return qwen3.Qwen3(dataclasses.replace(cfg, **overrides), rngs=nnx.Rngs(args.seed))


def _measure(args, model, engine, hf: HFGenerate, batch_sizes: list[int]) -> dict:
    """Per batch size: best tokens/s of each runner, fraction of the bound, agreement."""
    cfg = model.cfg
    rng = np.random.default_rng(args.seed)
    loop = asyncio.new_event_loop()  # one caller's loop for every call, as a rollout has
    rows = {}
    for batch in batch_sizes:
        prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len))
        runners = {"embedded": _jax_runner(engine, loop, prompts, args.new_tokens, False),
                   "embedded_logprobs": _jax_runner(engine, loop, prompts, args.new_tokens,
                                                    True),
                   "hf": functools.partial(hf.generate, prompts, args.new_tokens),
                   "matmul_bound": _bound_runner(model, batch, args.prompt_len,
                                                 args.new_tokens)}
        outputs = {name: run() for name, run in runners.items()}  # warm-up: compilation
        outputs["hf"] = outputs["hf"][0]
        best = {name: float("inf") for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                start = time.perf_counter()
                out = run()
                elapsed = time.perf_counter() - start
                if name == "hf":  # timed inside the HF process, not across the pipe
                    out, elapsed = out
                best[name] = min(best[name], elapsed)
                if name != "matmul_bound":
                    outputs[name] = out
        tps = {name: batch * args.new_tokens / t for name, t in best.items()}
        agree = float(np.mean(outputs["embedded"] == outputs["hf"]))
        agree_logprobs = float(np.mean(outputs["embedded_logprobs"] == outputs["hf"]))
        rows[str(batch)] = {
            "embedded_tokens_per_s": round(tps["embedded"], 1),
            "embedded_logprobs_tokens_per_s": round(tps["embedded_logprobs"], 1),
            "hf_tokens_per_s": round(tps["hf"], 1),
            "matmul_bound_tokens_per_s": round(tps["matmul_bound"], 1),
            "fraction_of_matmul_bound": round(tps["embedded"] / tps["matmul_bound"], 3),
            "logprobs_fraction_of_matmul_bound": round(
                tps["embedded_logprobs"] / tps["matmul_bound"], 3),
            "speedup_vs_hf": round(tps["embedded"] / tps["hf"], 2),
            "logprobs_speedup_vs_hf": round(tps["embedded_logprobs"] / tps["hf"], 2),
            "greedy_token_agreement": round(min(agree, agree_logprobs), 3)}
        _log(f"batch {batch}: {rows[str(batch)]}")
    loop.close()
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--hidden", type=int, default=0, help="hidden size (intermediate 3x)")
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--layers", type=int, default=0)
    args = p.parse_args(argv)
    model = _model(args)
    cfg = model.cfg
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = EmbeddedEngine(model, options(max(batch_sizes), args.prompt_len + args.new_tokens),
                            seed=args.seed)
    with tempfile.TemporaryDirectory() as hf_dir:
        hf_io.save_hf(model, cfg, hf_dir)
        with HFGenerate(hf_dir) as hf:
            rows = _measure(args, model, engine, hf, batch_sizes)
    engine.close()
    result = {"model": {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                        "num_layers": cfg.num_layers, "preset": args.preset},
              "dtype": cfg.dtype, "device": jax.devices()[0].platform,
              "torch_threads": hf.torch_threads, "cpus": os.cpu_count(),
              "load_average": [round(x, 2) for x in os.getloadavg()],
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batches": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
