"""The project beside google-tunix 0.1.7 (the JAX peer) on this machine, one process each.

  python -m bench.vs_tunix [--venv /work/venv_tunix] [--repeats 3] [--only logprob,...]

tunix is not in the lock: the first run makes `--venv` from requirements.lock and adds
TUNIX and the modules its `tunix.rl.common` imports that its wheel does not declare
(TUNIX_EXTRAS), without their dependencies. Both sides run in that venv.

Protocol: each measurement runs in a process of its own (`--one NAME --side SIDE`, which
compiles, warms up and prints the best of `--calls` timed calls), the two sides
alternating project, tunix, project, tunix, ...; a side's figure is the median over its
`--repeats` processes. ratio = tunix seconds / project seconds (> 1: the project is
faster). Both sides share the shapes of one small Qwen3 (V 32768, d 256, 2 layers, GQA
4/2, head_dim 64, MLP 768, untied head, float32), each initialised randomly in its own
layout: timings do not depend on the weights' values.

  logprob, logprob_masked   forward + backward of sum(g * logp) at N=4096 d=512 V=32768,
                            (masked: half the rows off the loss mask): the project's
                            kernels.logprob against tunix's selective_log_softmax over
                            the logits h @ w
  train_t512, train_t2048   one optimizer step on B=4 rows of T tokens (loss on the last
                            three quarters): rl.learner's train_step (PPO loss, AdamW,
                            clipping) against tunix's Qwen3, selective_log_softmax and its
                            GRPO per-token loss (beta 0, one iteration) under the same
                            optax chain, jitted as one step
  decode_b1, _b8, _b32      greedy generation of 64 tokens after a 32-token prompt for
                            B requests, prefill included: the embedded engine
                            (inference.embedded, bench.engine's options, no log-probs)
                            against tunix's generate.Sampler (one jitted prefill and
                            decode loop, a 96-position cache)
Prints one JSON object: each measurement's ratio from wall time and `cpu_ratio` from
process CPU time (on a machine shared with other work the wall ratio also measures who
waited for a core), the seconds of every process, and the 1-minute load average when the
run started and before each measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TUNIX = "google-tunix==0.1.7"
TUNIX_EXTRAS = ("google-metrax", "clu", "wrapt", "tensorboardX", "jaxtyping", "wadler_lindig",
                "sentencepiece", "perfetto", "pandas", "python-dateutil", "pytz", "tzdata")
ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(vocab=32768, d=256, layers=2, heads=4, kv_heads=2, head_dim=64, mlp=768)
LOGPROB_SHAPE = dict(n=4096, d=512, v=32768)
BATCH_ROWS = 4
DECODE = dict(prompt_len=32, new_tokens=64)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_tunix(venv: Path) -> Path:
    """The venv's python, with the lock, tunix and its undeclared imports installed."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import tunix.rl.common, tunix.models.qwen3.model"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    _log(f"installing {TUNIX} into {venv}")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-r", str(ROOT / "requirements.lock")], check=True)
    subprocess.run([*pip, "--no-deps", TUNIX, *TUNIX_EXTRAS], check=True)
    subprocess.run(probe, check=True)
    return python


# --------------------------------------------------------------------------- one side


def _best_seconds(fn, args, calls: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of fn(*args), the best of `calls` each."""
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    best_wall = best_cpu = float("inf")
    for _ in range(calls):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        best_wall = min(best_wall, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    return best_wall, best_cpu


def logprob_seconds(side: str, masked: bool, calls: int) -> tuple[float, float]:
    import jax
    import jax.numpy as jnp

    n, d, v = LOGPROB_SHAPE.values()
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    hidden = jax.random.normal(keys[0], (n, d))
    lm_head = jax.random.normal(keys[1], (d, v)) * d**-0.5
    targets = jax.random.randint(keys[2], (n,), 0, v)
    g = jax.random.normal(keys[3], (n,))
    mask = (jnp.arange(n) % 2 == 0) if masked else jnp.ones((n,), bool)
    if side == "project":
        from kernels.logprob.api import token_logprobs

        logp = lambda h, w: token_logprobs(h, w, targets, mask)[0]
    else:
        from tunix.rl.common import selective_log_softmax

        logp = lambda h, w: selective_log_softmax(h @ w, targets) * mask
    grad = jax.jit(jax.grad(lambda h, w: jnp.sum(g * logp(h, w)), (0, 1)))
    return _best_seconds(grad, (hidden, lm_head), calls)


def _train_batch(row_len: int):
    """(tokens [B,T], loss_mask [B,T], advantages [B]) of B full rows, loss on the last
    three quarters."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL["vocab"], (BATCH_ROWS, row_len)).astype(np.int32)
    mask = np.zeros((BATCH_ROWS, row_len), np.int32)
    mask[:, row_len // 4:] = 1
    return tokens, mask, rng.normal(size=BATCH_ROWS).astype(np.float32)


def _project_model():
    from flax import nnx

    from models.qwen3 import Qwen3, Qwen3Config

    m = MODEL
    cfg = Qwen3Config(vocab_size=m["vocab"], hidden_size=m["d"], intermediate_size=m["mlp"],
                      num_layers=m["layers"], num_heads=m["heads"],
                      num_kv_heads=m["kv_heads"], head_dim=m["head_dim"],
                      rope_theta=10_000.0, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    return Qwen3(cfg, rngs=nnx.Rngs(0))


def _tunix_model():
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    m = MODEL
    cfg = qwen3.ModelConfig(num_layers=m["layers"], vocab_size=m["vocab"], embed_dim=m["d"],
                            hidden_dim=m["mlp"], num_heads=m["heads"], head_dim=m["head_dim"],
                            num_kv_heads=m["kv_heads"], rope_theta=10_000, norm_eps=1e-6)
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))


def _project_train_step(row_len: int):
    import numpy as np

    from configs import common
    from rl import learner
    from rl.batch import pack_arrays

    lcfg = common.learner_defaults()
    graphdef, state = learner.init_train_state(_project_model(), lcfg)
    step = learner.make_train_step(graphdef, lcfg)
    tokens, mask, adv = _train_batch(row_len)
    seqs = [(t, mk, np.where(mk == 1, -1.0, 0.0).astype(np.float32))
            for t, mk in zip(tokens, mask, strict=True)]
    batch, _ = pack_arrays(seqs, adv, buckets=[row_len], row_multiple=BATCH_ROWS)
    holder = {"state": state}

    def run(batch):
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    return run, (batch,)


def _tunix_train_step(row_len: int):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.rl.common import selective_log_softmax

    from configs import common
    from rl.learner import make_optimizer

    graphdef, params = nnx.split(_tunix_model())
    optimizer = make_optimizer(common.learner_defaults())  # the same optax chain
    opt_state = optimizer.init(params)
    tokens, mask, adv = _train_batch(row_len)
    positions = jnp.broadcast_to(jnp.arange(row_len), tokens.shape)
    causal = jnp.tril(jnp.ones((row_len, row_len), bool))[None].repeat(BATCH_ROWS, 0)

    def loss_fn(params, tokens, mask, adv):
        logits, _ = nnx.merge(graphdef, params)(tokens, positions, None, causal)
        logp = selective_log_softmax(logits[:, :-1], tokens[:, 1:])
        # tunix.rl.grpo's per-token loss with beta 0 and one iteration (old = current).
        ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
        per_token = -jnp.minimum(ratio * adv[:, None],
                                 jnp.clip(ratio, 0.8, 1.28) * adv[:, None])
        loss_mask = mask[:, 1:]
        return jnp.sum(per_token * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1)

    @jax.jit
    def update(params, opt_state, tokens, mask, adv):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, adv)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    holder = {"params": params, "opt_state": opt_state}

    def run(tokens, mask, adv):
        holder["params"], holder["opt_state"], loss = update(
            holder["params"], holder["opt_state"], tokens, mask, adv)
        return loss

    return run, (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(adv))


def train_seconds(side: str, row_len: int, calls: int) -> tuple[float, float]:
    make = _project_train_step if side == "project" else _tunix_train_step
    run, args = make(row_len)
    return _best_seconds(run, args, calls)


class _IdTokenizer:
    """Token ids written as decimal text: what tunix's Sampler needs of a tokenizer (ids
    go in and come out unchanged; 0 is padding, no BOS)."""

    encode = staticmethod(lambda text: [int(t) for t in text.split()])
    decode = staticmethod(lambda ids: " ".join(map(str, ids)))
    bos_id = staticmethod(lambda: 0)
    eos_id = staticmethod(lambda: 0)
    pad_id = staticmethod(lambda: 0)


def _decode_prompts(batch: int):
    import numpy as np

    rng = np.random.default_rng(0)  # ids from 1: tunix's sampler reads 0 as padding
    return rng.integers(1, MODEL["vocab"], (batch, DECODE["prompt_len"]))


def _project_decode(batch: int):
    import asyncio

    from bench.engine import options
    from inference.embedded import EmbeddedEngine
    from inference.engine import GenerateRequest

    engine = EmbeddedEngine(_project_model(), options(batch, sum(DECODE.values())), seed=0)
    loop = asyncio.new_event_loop()
    requests = [GenerateRequest(p.tolist(), DECODE["new_tokens"], temperature=0.0,
                                return_logprob=False) for p in _decode_prompts(batch)]
    run = lambda: [r.output_ids for r in loop.run_until_complete(engine.generate(requests))]
    return run, ()


def _tunix_decode(batch: int):
    from tunix.generate import sampler as tunix_sampler

    m = MODEL
    cache = tunix_sampler.CacheConfig(cache_size=sum(DECODE.values()), num_layers=m["layers"],
                                      num_kv_heads=m["kv_heads"], head_dim=m["head_dim"])
    sampler = tunix_sampler.Sampler(_tunix_model(), _IdTokenizer(), cache)
    prompts = [" ".join(map(str, p)) for p in _decode_prompts(batch)]
    # eos -1 never matches: every row runs all new_tokens steps, as the project's does.
    run = lambda: sampler(prompts, DECODE["new_tokens"], max_prompt_length=DECODE["prompt_len"],
                          temperature=0.0, eos_tokens=[-1]).tokens
    return run, ()


def decode_seconds(side: str, batch: int, calls: int) -> tuple[float, float]:
    make = _project_decode if side == "project" else _tunix_decode
    run, args = make(batch)
    return _best_seconds(run, args, calls)


MEASUREMENTS = {
    "logprob": lambda side, calls: logprob_seconds(side, False, calls),
    "logprob_masked": lambda side, calls: logprob_seconds(side, True, calls),
    "train_t512": lambda side, calls: train_seconds(side, 512, calls),
    "train_t2048": lambda side, calls: train_seconds(side, 2048, calls),
    **{f"decode_b{b}": functools.partial(lambda side, calls, b: decode_seconds(side, b, calls),
                                          b=b) for b in (1, 8, 32)},
}


# --------------------------------------------------------------------------- protocol


def _one_process(python: Path, name: str, side: str, calls: int) -> tuple[float, float]:
    out = subprocess.run([str(python), "-m", "bench.vs_tunix", "--one", name, "--side", side,
                          "--calls", str(calls)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{name} ({side}) failed:\n{out.stderr[-3000:]}")
    answer = json.loads(out.stdout.splitlines()[-1])
    return answer["seconds"], answer["cpu_seconds"]


def compare(python: Path, names, repeats: int, calls: int) -> dict:
    result = {"tunix": TUNIX, "load_average_at_start": os.getloadavg()[0],
              "model": MODEL, "logprob_shape": LOGPROB_SHAPE, "rows": BATCH_ROWS}
    for name in names:
        seconds, cpu = {"project": [], "tunix": []}, {"project": [], "tunix": []}
        load = os.getloadavg()[0]
        for _ in range(repeats):
            for side in ("project", "tunix"):
                wall, cpu_s = _one_process(python, name, side, calls)
                seconds[side].append(wall)
                cpu[side].append(cpu_s)
                _log(f"{name} {side}: {wall:.3f} s, {cpu_s:.3f} s CPU "
                     f"(load {os.getloadavg()[0]:.2f})")
        result[name] = {"ratio": _ratio(seconds), "cpu_ratio": _ratio(cpu),
                        "seconds": seconds, "cpu_seconds": cpu, "load_average": load}
    return result


def _ratio(seconds: dict) -> float:
    """tunix's median over the project's (> 1: the project is faster)."""
    return statistics.median(seconds["tunix"]) / statistics.median(seconds["project"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/work/venv_tunix"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per process")
    parser.add_argument("--only", default=",".join(MEASUREMENTS))
    parser.add_argument("--one", choices=sorted(MEASUREMENTS), help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=("project", "tunix"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        wall, cpu = MEASUREMENTS[args.one](args.side, args.calls)
        print(json.dumps({"seconds": wall, "cpu_seconds": cpu}))
        return
    names = args.only.split(",")
    unknown = sorted(set(names) - set(MEASUREMENTS))
    if unknown:
        raise SystemExit(f"--only: unknown measurements {unknown}; known: {sorted(MEASUREMENTS)}")
    print(json.dumps(compare(ensure_tunix(args.venv), names, args.repeats, args.calls)))


if __name__ == "__main__":
    main()
