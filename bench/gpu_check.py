"""GPU check: compiled Pallas kernels, the 16k train step, decode against HF `generate`
and weight sync, in one command that writes one JSON object and a short log.

  python -m bench.gpu_check all --out DIR             # one GPU, within --budget-s (480)
  python -m bench.gpu_check all --out DIR --tiny      # every part on CPU at tiny shapes
  python -m bench.gpu_check all --out DIR --only step/qwen3-1.7b,sync   # some jobs
  python -m bench.gpu_check kernels|step|decode --json FILE [options]   # one part

`all` runs the jobs of `plan()` one after another, each in its own process group with a
time limit (its cap, or what is left of the budget): a job that fails, hangs or runs out
of memory records its error and the next one runs, and each process's peak memory is its
own; the kernel cases a stopped job finished are kept beside its error. It writes
DIR/gpu_check.json ({"jobs": each job's JSON and/or error, "summary": the headline
figures and the goals below}) and DIR/gpu_check.log (each job's last lines of output),
and exits 1 when a job failed or a kernel exceeded its tolerance.

kernels: the attention and log-prob Pallas kernels (implementation="pallas": compiled, a
  kernel that does not compile is an error; interpreted only where JAX sees no GPU)
  against the dense references at "highest" matmul precision on the same inputs cast to
  float32: float32 and bfloat16; GQA (16 query heads on 8 and on 1 key/value head); rows
  packed with odd segment lengths (1 token among them), a partly padded row and an empty
  one; LM heads of d = 1024, 4096 and 5120 (Qwen3-0.6B, 8B, 14B/32B) and Qwen3's
  vocabulary V = 151936, 60% of tokens masked in. Each output and input gradient (under
  a random cotangent) reports max |pallas - reference| / max |reference|, against
  TOLERANCE of its dtype.
step: rl.learner's train step (compiled once, state donated) at a preset's shapes on
  one row of --row-len tokens packed with --segments equal trajectories: bf16 compute,
  f32 parameters and Adam state, remat="full", log-probs by the default implementation
  (a Pallas fallback is listed in `kernel_fallbacks`). MFU = model FLOPs (bench.learner:
  6 x matmul parameters per token plus causal attention) / step seconds / the device's
  bf16 dense peak; `xla_flops` is XLA's cost_analysis of the compiled step beside it
  (remat's recomputation included; a while loop that the compiler keeps, such as the
  scan over layers, may be counted once: `xla_over_formula` shows which). Peak memory
  is the device's peak_bytes_in_use.
decode: the embedded engine against HF `generate` on the same random weights, greedy,
  exactly --new-tokens each, tokens/s over whole calls (best of --repeats after a
  warm-up), their ratio and the share of equal tokens. HF runs in an isolated
  interpreter of its own (bench/hf_generate.py), on the GPU when torch sees one.
  float32 runs at "highest" precision on both sides (no TF32).
sync: `python -m bench.weight_sync` (export to HF safetensors + reload of the
  SGLang-protocol inference.server) per preset; per update: export seconds and bytes,
  reload seconds.

On the GPU machine (JAX with CUDA, torch and transformers installed; ml-collections is
not), the wheels of scripts/gpu_check_wheels.sh travel with the tree:
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && PYTHONPATH=/tmp/site python3 -m bench.gpu_check all --out results/gpu
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.engine import HFGenerate, options
from bench.learner import model_flops
from configs import common
from inference.embedded import EmbeddedEngine
from inference.engine import GenerateRequest
from kernels.attention import attention
from kernels.logprob import token_logprobs
from models import hf_io
from models.qwen3 import PRESETS, Qwen3
from rl import learner
from rl.batch import Batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Largest error relative to the output's scale that a compiled kernel may show.
TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2}
# bf16 dense (no sparsity) peak FLOP/s from the data sheets (SXM parts); the first
# name found in the device kind wins.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H200", 989.4), ("H100", 989.4), ("A100", 312.0))


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def device_info() -> dict:
    device = jax.devices()[0]
    return {"jax": jax.__version__, "flax": flax.__version__,
            "backend": jax.default_backend(), "device": device.device_kind}


# ----------------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """Shapes of the kernel checks. segments: per row of `row_len` tokens, the lengths of
    its segments (the rest is padding); heads: (query heads, kv heads, head_dim) cases;
    tokens x dims x vocab: the log-prob cases; d_block: chunks of d (None: the kernel's
    shared-memory model picks)."""

    row_len: int
    segments: tuple[tuple[int, ...], ...]
    heads: tuple[tuple[int, int, int], ...]
    tokens: int
    dims: tuple[int, ...]
    vocab: int
    d_block: int | None = None


GPU_KERNELS = KernelShapes(1024, ((301, 77, 1, 509, 130), (1017,), ()),
                           ((16, 8, 128), (16, 1, 64)), 4099, (1024, 4096, 5120), 151936)
TINY_KERNELS = KernelShapes(128, ((37, 9, 1, 50), (101,), ()), ((4, 2, 32),), 67, (160,), 1000,
                            d_block=32)


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|: the error relative to the output's scale."""
    actual, expected = (np.asarray(x, np.float32) for x in (actual, expected))
    return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))),
                                                          1e-30))


def compare(run, dtype) -> dict:
    """run(implementation, dtype) -> {name: array}; Pallas in `dtype` against the reference
    in float32 on the same (rounded) inputs, each output's error and the verdict."""
    name = jnp.dtype(dtype).name
    try:
        actual = run("pallas", dtype)
        with jax.default_matmul_precision("highest"):
            expected = run("reference", jnp.float32)
        errors = {k: rel_err(actual[k], expected[k]) for k in actual}
    except Exception as e:  # noqa: BLE001 - a kernel that fails is this case's result
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "ok": False}
    worst = max(errors.values())
    return {**{k: float(f"{v:.3g}") for k, v in errors.items()}, "max": float(f"{worst:.3g}"),
            "tolerance": TOLERANCE[name], "ok": bool(worst <= TOLERANCE[name])}


def attention_case(shapes: KernelShapes, heads: int, kv_heads: int, head_dim: int,
                   interpret: bool):
    """run(implementation, dtype) of attention's output and (dq, dk, dv) on packed rows."""
    rows, t = len(shapes.segments), shapes.row_len
    seg = np.zeros((rows, t), np.int32)
    for row, lengths in enumerate(shapes.segments):
        seg[row, :sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (rows, t, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(x, (rows, t, kv_heads, head_dim), jnp.bfloat16)
            for x in keys[1:3])
    cot = jax.random.normal(keys[3], q.shape)

    def run(impl, dtype):
        def loss(q, k, v):
            o = attention(q, k, v, jnp.asarray(seg), implementation=impl,
                          interpret=interpret and impl == "pallas")
            return jnp.sum(o.astype(jnp.float32) * cot), o
        (_, o), (dq, dk, dv) = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
            *(x.astype(dtype) for x in (q, k, v)))
        return {"out": o, "dq": dq, "dk": dk, "dv": dv}

    return run


def logprob_case(shapes: KernelShapes, d: int, interpret: bool):
    """run(implementation, dtype) of token_logprobs' (logp, entropy) and their gradients
    with respect to the hidden states and the LM head."""
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    n, vocab = shapes.tokens, shapes.vocab
    hidden = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    head = (jax.random.normal(keys[1], (d, vocab)) * 0.8 / d ** 0.5).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (n,), 0, vocab)
    mask = jax.random.uniform(keys[3], (n,)) < 0.6
    cot = jax.random.normal(keys[4], (2, n))

    def run(impl, dtype):
        options = dict(d_block=shapes.d_block, interpret=interpret) if impl == "pallas" else {}

        def loss(h, w):
            logp, entropy = token_logprobs(h, w, targets, mask, implementation=impl, **options)
            return jnp.sum(logp * cot[0] + entropy * cot[1]), (logp, entropy)
        (_, (logp, entropy)), (dh, dw) = jax.jit(jax.value_and_grad(
            loss, (0, 1), has_aux=True))(hidden.astype(dtype), head.astype(dtype))
        return {"logp": logp, "entropy": entropy, "d_hidden": dh, "d_head": dw}

    return run


def check_kernels(shapes: KernelShapes, save=None) -> dict:
    """Every case; `save(result so far)` after each, so a job stopped midway keeps them."""
    interpret = jax.default_backend() == "cpu"
    cases = {}
    result = lambda: {"interpret": interpret, "shapes": dataclasses.asdict(shapes),
                      "ok": all(c["ok"] for c in cases.values()), "cases": cases}
    for dtype in (jnp.float32, jnp.bfloat16):
        runs = {f"attention_{jnp.dtype(dtype).name}_h{h}_kv{kv}_d{hd}":
                lambda h=h, kv=kv, hd=hd: attention_case(shapes, h, kv, hd, interpret)
                for h, kv, hd in shapes.heads}
        runs.update({f"logprob_{jnp.dtype(dtype).name}_d{d}_v{shapes.vocab}":
                     lambda d=d: logprob_case(shapes, d, interpret) for d in shapes.dims})
        for name, case in runs.items():
            cases[name] = compare(case(), dtype)
            _log(f"{name}: {json.dumps(cases[name])}")
            if save:
                save({**result(), "partial": True})
    return result()


# ----------------------------------------------------------------------------- train step


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


def peak_flops(device_kind: str, override_tflops: float = 0.0) -> float | None:
    """The device's bf16 dense peak FLOP/s, or None when unknown (CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    return next((tflops * 1e12 for name, tflops in PEAK_BF16_TFLOPS if name in device_kind),
                None)


class _Collect(logging.Handler):
    """Keeps the messages logged (kernels.fallback's warnings)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage()[:400])


def time_step(preset: str, attention_impl: str, row_len: int, segments: int, steps: int,
              peak_tflops: float = 0.0) -> dict:
    """rl.learner's step (its step_fn, jitted with the state donated as train_step does)
    compiled once, run once untimed, then `steps` times: seconds, tokens/s, MFU, memory."""
    cfg = dataclasses.replace(PRESETS[preset], dtype="bfloat16", param_dtype="float32",
                              remat="full", attention=attention_impl)
    fallbacks = _Collect()
    logging.getLogger("kernels").addHandler(fallbacks)
    lcfg = learner.LearnerConfig.from_section({**common.learner_defaults(),
                                               "row_buckets": (row_len,)})
    graphdef, state = learner.init_train_state(Qwen3(cfg, rngs=nnx.Rngs(0)), lcfg)
    step = jax.jit(learner.make_train_step(graphdef, lcfg).step_fn, donate_argnums=0)
    batch = jax.device_put(packed_row(cfg.vocab_size, row_len, segments))
    start = time.perf_counter()
    compiled = step.lower(state, batch, None).compile()
    compile_s = time.perf_counter() - start
    state, metrics = jax.block_until_ready(compiled(state, batch, None))
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch, None)
    jax.block_until_ready((state, metrics))
    step_s = (time.perf_counter() - start) / steps
    flops = model_flops(cfg, [row_len // segments] * segments)
    cost = compiled.cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost or {}).get("flops")
    peak = peak_flops(jax.devices()[0].device_kind, peak_tflops)
    stats = jax.devices()[0].memory_stats() or {}
    memory = compiled.memory_analysis()
    return dict(
        preset=preset, attention=attention_impl, logprob_impl=lcfg.logprob_impl,
        row_len=row_len, segments=segments, steps=steps, compile_s=round(compile_s, 1),
        step_s=round(step_s, 4), tokens_per_s=round(row_len / step_s, 1),
        loss=float(metrics["loss"]), finite=bool(metrics["finite"]),
        model_flops=flops, xla_flops=xla_flops,
        xla_over_formula=round(xla_flops / flops, 4) if xla_flops else None,
        peak_tflops=peak / 1e12 if peak else None,
        mfu=round(flops / step_s / peak, 4) if peak else None,
        xla_mfu=round(xla_flops / step_s / peak, 4) if peak and xla_flops else None,
        peak_gib=round(stats["peak_bytes_in_use"] / 2 ** 30, 2)
        if "peak_bytes_in_use" in stats else None,
        compiled_temp_gib=round(memory.temp_size_in_bytes / 2 ** 30, 3) if memory else None,
        kernel_fallbacks=fallbacks.messages)


# ----------------------------------------------------------------------------- decode


def hf_generate(model, cfg, prompts: np.ndarray, sizes, new_tokens: int, repeats: int) -> dict:
    """HF `generate` on `model`'s weights as hf_io.save_hf writes them, in transformers'
    own process (bench.engine.HFGenerate): per batch size a short warm-up, then the
    best of `repeats` calls."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_hf_") as hf_dir:
        hf_io.save_hf(model, cfg, hf_dir)
        with HFGenerate(hf_dir) as hf:
            for batch in sizes:
                hf.generate(prompts[:batch], min(8, new_tokens))
                runs = [hf.generate(prompts[:batch], new_tokens) for _ in range(repeats)]
                tokens, seconds = min(runs, key=lambda run: run[1])
                out[str(batch)] = {"seconds": seconds,
                                   "tokens_per_s": batch * new_tokens / seconds,
                                   "output_ids": tokens.tolist()}
                _log(f"hf batch {batch}: {out[str(batch)]['tokens_per_s']:.1f} tokens/s")
            threads = hf.torch_threads
    return {"torch_threads": threads, "batches": out}


def embedded_generate(model, prompts: np.ndarray, sizes, new_tokens: int, repeats: int
                      ) -> dict:
    """The embedded engine, one caller's event loop, the same requests per batch size."""
    engine = EmbeddedEngine(model, options(max(sizes), prompts.shape[1] + new_tokens), seed=0)
    loop = asyncio.new_event_loop()
    out = {}
    try:
        for batch in sizes:
            requests = [GenerateRequest(p.tolist(), new_tokens, temperature=0.0,
                                        return_logprob=False) for p in prompts[:batch]]
            run = lambda r=requests: loop.run_until_complete(engine.generate(r))
            results = run()  # warm-up: compiles every window the generation passes
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                results = run()
                best = min(best, time.perf_counter() - start)
            out[str(batch)] = {"seconds": best, "tokens_per_s": batch * new_tokens / best,
                               "output_ids": [r.output_ids for r in results]}
            _log(f"embedded batch {batch}: {out[str(batch)]['tokens_per_s']:.1f} tokens/s")
    finally:
        engine.close()
        loop.close()
    return out


def agreement(ours, theirs) -> tuple[float, float]:
    """(share of equal tokens, mean share of each row before its first difference)."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    equal = ours == theirs
    prefix = np.where(equal.all(1), equal.shape[1], np.argmin(equal, axis=1))
    return float(equal.mean()), float(prefix.mean() / equal.shape[1])


def check_decode(preset: str, dtype: str, sizes, new_tokens: int, prompt_len: int,
                 repeats: int) -> dict:
    if dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    cfg = dataclasses.replace(PRESETS[preset], dtype=dtype, param_dtype=dtype)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (max(sizes), prompt_len))
    hf = hf_generate(model, cfg, prompts, sizes, new_tokens, repeats)
    ours = embedded_generate(model, prompts, sizes, new_tokens, repeats)
    rows = {}
    for batch in map(str, sizes):
        equal, prefix = agreement(ours[batch]["output_ids"], hf["batches"][batch]["output_ids"])
        mine, theirs = ours[batch]["tokens_per_s"], hf["batches"][batch]["tokens_per_s"]
        rows[batch] = {"embedded_tokens_per_s": round(mine, 1),
                       "hf_tokens_per_s": round(theirs, 1),
                       "speedup_vs_hf": round(mine / theirs, 2),
                       "greedy_agreement": round(equal, 4), "agreed_prefix": round(prefix, 4)}
    return {"preset": preset, "dtype": dtype, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "hf_torch_threads": hf["torch_threads"], "batches": rows}


# ----------------------------------------------------------------------------- all


@dataclasses.dataclass(frozen=True)
class Job:
    """One process of `all`: `python -m <argv>` ("{json}" is its result file's path),
    at most `cap_s` seconds, with `env` added to the environment."""

    name: str
    argv: tuple[str, ...]
    cap_s: float
    env: tuple[tuple[str, str], ...] = ()


def plan(tiny: bool) -> list[Job]:
    """The jobs of `all`, most important first: each part's headline job comes before
    the second figures, so a spent budget costs the latter."""
    part = ("bench.gpu_check",)
    # The decode job's JAX leaves the GPU's other half to torch.
    half = (("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45"),)
    if tiny:
        step = (*part, "step", "--preset", "tiny", "--row-len", "256", "--steps", "1")
        decode = (*part, "decode", "--preset", "tiny", "--batch-sizes", "1,3",
                  "--new-tokens", "8", "--prompt-len", "16", "--repeats", "1")
        # CPU: the model's attention cannot run Pallas interpreted, so the step compares
        # XLA's blockwise attention with the dense reference.
        return [Job("kernels", (*part, "kernels", "--tiny", "--json", "{json}"), 150),
                Job("step/tiny/xla", (*step, "--attention", "xla", "--json", "{json}"), 150),
                Job("step/tiny/reference", (*step, "--attention", "reference",
                                            "--json", "{json}"), 150),
                Job("decode/float32", (*decode, "--dtype", "float32", "--json", "{json}"),
                    150, half),
                Job("sync/tiny", ("bench.weight_sync", "--preset", "tiny", "--updates", "2",
                                  "--out", "{json}"), 150)]
    step = lambda preset, impl, cap: Job(f"step/{preset}/{impl}", (
        *part, "step", "--preset", preset, "--attention", impl, "--json", "{json}"), cap)
    decode = lambda dtype, sizes, cap: Job(f"decode/{dtype}", (
        *part, "decode", "--dtype", dtype, "--batch-sizes", sizes, "--json", "{json}"),
        cap, half)
    sync = lambda preset: Job(f"sync/{preset}", ("bench.weight_sync", "--preset", preset,
                                                 "--updates", "3", "--out", "{json}"), 75)
    # The first six hold every goal's figure; `--only` runs in a second call what a
    # spent budget left out.
    return [Job("kernels", (*part, "kernels", "--json", "{json}"), 150),
            step("qwen3-0.6b", "pallas", 75), decode("bfloat16", "1,32,128", 110),
            sync("qwen3-0.6b"), step("qwen3-1.7b", "pallas", 80), decode("float32", "32", 60),
            step("qwen3-0.6b", "xla", 75), step("qwen3-1.7b", "xla", 80), sync("qwen3-1.7b")]


def select(jobs: list[Job], only: str) -> list[Job]:
    """The jobs whose names start with one of the comma-separated prefixes (all if none)."""
    prefixes = tuple(x.strip() for x in only.split(",") if x.strip())
    return [job for job in jobs if not prefixes or job.name.startswith(prefixes)]


# A job runs its module (`python -m` semantics) after restoring SIGINT's KeyboardInterrupt:
# started from a shell's background job (`nohup ... &`), this process inherits SIGINT
# ignored, and a Python that starts with it ignored installs no handler, so
# _stop_group's SIGINT would do nothing. (Not a preexec_fn: a fork of this multithreaded
# JAX process may deadlock before the exec.)
_JOB_MAIN = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)"
             "; sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', "
             "alter_sys=True)")


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the job's process group (Python runs its finally blocks: servers are
    closed), SIGKILL to whatever is left 15 s later."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_job(job: Job, work: str, timeout_s: float) -> tuple[dict, str]:
    """(the job's JSON, or {"error": ...}; its output) after at most timeout_s seconds."""
    path = os.path.join(work, job.name.replace("/", "_") + ".json")
    output_path = path[:-5] + ".log"
    argv = [sys.executable, "-c", _JOB_MAIN, *(a.replace("{json}", path) for a in job.argv)]
    start = time.perf_counter()
    with open(output_path, "w") as output:
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **dict(job.env)},
                                stdout=output, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        _stop_group(proc)
    with open(output_path, errors="replace") as f:
        tail = f.read()[-4000:]
    result = {}
    if os.path.exists(path):  # complete, or what a part saved before it stopped
        with open(path) as f:
            result = json.load(f)
    if code is None:
        result["error"] = f"timed out after {timeout_s:.0f} s"
    elif code != 0 or not result:
        last = [line for line in tail.splitlines() if line.strip()][-1:] or [""]
        result["error"] = f"exit code {code}: {last[0][:500]}"
    return {**result, "seconds": round(time.perf_counter() - start, 1)}, tail


def run_all(jobs: list[Job], out_dir: str, budget_s: float) -> dict:
    """Runs `jobs` within `budget_s` seconds in all; writes out_dir/gpu_check.json and
    out_dir/gpu_check.log and returns the JSON object."""
    os.makedirs(out_dir, exist_ok=True)
    start, results = time.perf_counter(), {}
    work = tempfile.mkdtemp(prefix="gpu_check_")
    with open(os.path.join(out_dir, "gpu_check.log"), "w") as log:
        for job in jobs:
            left = budget_s - (time.perf_counter() - start)
            if left < 5:
                results[job.name] = {"error": "not run: the time budget was spent"}
            else:
                results[job.name], tail = run_job(job, work, min(job.cap_s, left))
                log.write(f"== {job.name} ({results[job.name]['seconds']} s)\n"
                          + "\n".join(tail.splitlines()[-15:]) + "\n")
            log.write(f"-> {job.name}: {json.dumps(_brief(results[job.name]))}\n")
            log.flush()
            _log(f"{job.name}: {json.dumps(_brief(results[job.name]))}")
    shutil.rmtree(work, ignore_errors=True)
    result = {"host": {"python": platform.python_version(), "gpus": _nvidia_smi()},
              "budget_s": budget_s, "total_s": round(time.perf_counter() - start, 1),
              "summary": summarize(results), "jobs": results}
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _brief(result: dict) -> dict:
    keys = ("error", "ok", "tokens_per_s", "mfu", "peak_gib", "seconds")
    return {k: result[k] for k in keys if k in result}


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                           "--format=csv,noheader"], capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()


def summarize(results: dict) -> dict:
    """Headline figures per job and the goals (None where a job gave no figure)."""
    figures = {}
    for name, r in results.items():
        try:
            figures[name] = {"error": r["error"]} if "error" in r else _figures(name, r)
        except (KeyError, TypeError, ValueError) as e:
            figures[name] = {"error": f"no figures in its JSON: {type(e).__name__}: {e}"}
    return {"figures": figures, "goals": _goals(figures)}


def _figures(name: str, r: dict) -> dict:
    kind = name.split("/")[0]
    if kind == "kernels":
        cases = r["cases"]
        return {"ok": r["ok"], "interpret": r["interpret"],
                "worst": max((c["max"] for c in cases.values() if "max" in c), default=None),
                "failed": [case for case, c in cases.items() if not c["ok"]]}
    if kind == "step":
        return {k: r[k] for k in ("tokens_per_s", "mfu", "xla_mfu", "peak_gib")}
    if kind == "decode":
        return {b: {k: row[k] for k in ("speedup_vs_hf", "greedy_agreement")}
                for b, row in r["batches"].items()}
    if kind == "sync":
        later = r["updates"][1:] or r["updates"]  # the first includes a first load
        return {k: statistics.median(u[k] for u in later)
                for k in ("export_s", "export_bytes", "reload_s", "total_s")}
    return {}


def _goals(figures: dict) -> dict:
    """The speed goals on the bf16 jobs; greedy agreement on the float32 one: in bf16 two
    correct implementations part where random weights leave near-ties, at the first
    difference in summation order."""
    step = figures.get("step/qwen3-1.7b/pallas", {})
    decode = figures.get("decode/bfloat16", {}).get("32", {})
    exact = figures.get("decode/float32", {}).get("32", {})
    sync = figures.get("sync/qwen3-0.6b", {})
    reached = lambda value, test: None if value is None else bool(test(value))
    return {"mfu_1.7b_at_least_0.35": reached(step.get("mfu"), lambda x: x >= 0.35),
            "decode_3x_hf_at_batch_32": reached(decode.get("speedup_vs_hf"),
                                                lambda x: x >= 3.0),
            "decode_greedy_agreement_1_at_batch_32": reached(exact.get("greedy_agreement"),
                                                             lambda x: x == 1.0),
            "sync_0.6b_under_3_s": reached(
                None if "export_s" not in sync else sync["export_s"] + sync["reload_s"],
                lambda x: x < 3.0)}


def failed(result: dict) -> list[str]:
    """Names of the jobs that failed or gave no figures, and of the kernel cases that
    failed or exceeded their tolerance."""
    figures = result["summary"]["figures"]
    return ([name for name, f in figures.items() if "error" in f]
            + figures.get("kernels", {}).get("failed", []))


# ----------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("all", "kernels", "step", "decode"))
    p.add_argument("--out", default="", help="all: the folder of gpu_check.json and .log")
    p.add_argument("--json", default="", help="one part: write its JSON object here")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU)")
    p.add_argument("--budget-s", type=float, default=480.0, help="all: total seconds")
    p.add_argument("--only", default="", help="all: the jobs whose names start with one "
                   "of these comma-separated prefixes (e.g. step/qwen3-1.7b,sync)")
    p.add_argument("--attention", default="pallas")
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--row-len", type=int, default=16384)
    p.add_argument("--segments", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="bf16 dense peak; 0 = from the device kind")
    p.add_argument("--dtype", default="bfloat16", help="decode: weights and compute")
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    return p


def main(argv=None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.part == "all":
        if not args.out:
            p.error("all needs --out DIR")
        jobs = select(plan(args.tiny), args.only)
        if not jobs:
            p.error(f"--only {args.only!r} names none of {[j.name for j in plan(args.tiny)]}")
        result = run_all(jobs, args.out, args.budget_s)
        bad = failed(result)
        print(json.dumps(result["summary"], indent=1))
        if bad:
            raise SystemExit(f"failed: {', '.join(bad)} (see {args.out}/gpu_check.json)")
        return result
    if args.part == "kernels":
        result = check_kernels(TINY_KERNELS if args.tiny else GPU_KERNELS,
                               save=lambda partial: _write(args.json, partial))
    elif args.part == "step":
        result = time_step(args.preset, args.attention, args.row_len, args.segments,
                           args.steps, args.peak_tflops)
    else:
        result = check_decode(args.preset, args.dtype,
                              [int(b) for b in args.batch_sizes.split(",")],
                              args.new_tokens, args.prompt_len, args.repeats)
    result = _write(args.json, result)
    print(json.dumps(result))
    return result


def _write(path: str, result: dict) -> dict:
    """The result with the device's description, written to `path` (if any) whole or not
    at all (a job stopped while writing leaves the previous file)."""
    result = {**device_info(), **result}
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)
    return result


if __name__ == "__main__":
    main()
