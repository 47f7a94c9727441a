"""Learner memory and compile time at real model sizes, compiled only (nothing allocated).

  python -m bench.scale                  # the recipes' presets, 8 fake CPU devices
  python -m bench.scale --quick          # qwen3-8b at 2 / 4 layers, 2k / 4k (smoke)
  python -m bench.scale --key-rows       # only qwen3-8b at 36 layers, 8k and 32k
  python -m bench.scale --remat full     # every row with this remat policy, not the recipe's

Each row lowers and compiles the full train step of rl.learner (loss, gradients, optimizer
update; the recipe's learner section with one micro-batch and one row per device) on
abstract inputs over N fake CPU devices (--xla_force_host_platform_device_count), with the
recipe's model numerics (bf16 compute, f32 parameters and Adam state, its remat policy and
attention implementation) and mesh, and reads the compiled program's memory_analysis().
Prints one JSON object:
  rows                [{preset, layers, mesh, row_len, remat, args_gib, temp_gib,
                        total_gib, compile_s}] per device; total = arguments + temporaries + outputs
                       not aliased to (donated) arguments
  total_gib_8b_32k    qwen3-8b, fsdp=8, one 32k row per device: total_gib
  temp_ratio_32k_8k   the same model: temp_gib at 32k over temp_gib at 8k (linear: 4)
  compile_ratio_36_4  qwen3-8b compile_s at 36 layers over 4 layers (8k rows; not with
                       --key-rows)
  peak_host_gib       this process's peak resident memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from configs import common  # noqa: E402
from models.qwen3 import PRESETS, REMAT_POLICIES, Qwen3  # noqa: E402
from models.sharding import data_sharding, make_mesh  # noqa: E402
from rl import learner  # noqa: E402
from rl.batch import Batch  # noqa: E402

GIB = 2 ** 30
# preset -> the recipe that trains it
RECIPES = {"qwen3-8b": "configs/spo_qwen3_8b.py", "qwen3-14b": "configs/ps_qwen3_14b_swe.py",
           "qwen3-32b": "configs/ps_qwen3_32b_swe.py"}
_MODEL_KEYS = ("dtype", "param_dtype", "remat", "attention")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def abstract_batch(rows: int, row_len: int, mesh) -> Batch:
    """A Batch of ShapeDtypeStructs, rows split over data x fsdp like learner.shard_batch."""
    sharding = data_sharding(mesh)
    spec = lambda dtype: jax.ShapeDtypeStruct((rows, row_len), dtype, sharding=sharding)
    i32, f32 = jnp.int32, jnp.float32
    return Batch(tokens=spec(i32), positions=spec(i32), segment_ids=spec(i32),
                 loss_mask=spec(f32), old_logprobs=spec(f32), advantages=spec(f32),
                 seq_num_tokens=spec(f32))


def measure(preset: str, layers: int, row_len: int, remat: str | None = None) -> dict:
    """Compiles one train step; per-device memory (GiB) and compile seconds. remat: the
    policy to use instead of the recipe's."""
    config = common.load_config(RECIPES[preset])
    model_keys = {k: config.model[k] for k in _MODEL_KEYS if k in config.model}
    if remat:
        model_keys["remat"] = remat
    cfg = dataclasses.replace(PRESETS[preset], num_layers=layers, **model_keys)
    mesh = make_mesh(**config.mesh)
    lcfg = dataclasses.replace(learner.LearnerConfig.from_section(config.learner),
                               num_minibatches=1, num_microbatches=1)
    graphdef, state = learner.abstract_train_state(nnx.eval_shape(lambda: Qwen3(cfg)), lcfg,
                                                   mesh)
    step = learner.make_train_step(graphdef, lcfg, mesh).step_fn
    batch = abstract_batch(mesh.shape["data"] * mesh.shape["fsdp"], row_len, mesh)
    start = time.perf_counter()
    with jax.set_mesh(mesh):  # models.sharding.constrain_rows reads it
        compiled = jax.jit(step, donate_argnums=0).lower(state, batch, None).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    args, temp = mem.argument_size_in_bytes / GIB, mem.temp_size_in_bytes / GIB
    out = (mem.output_size_in_bytes - mem.alias_size_in_bytes) / GIB
    row = dict(preset=preset, layers=layers, mesh=dict(mesh.shape), row_len=row_len,
               remat=cfg.remat,
               args_gib=round(args, 2), temp_gib=round(temp, 2),
               total_gib=round(args + temp + out, 2), compile_s=round(compile_s, 1))
    _log(json.dumps(row))
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small smoke run (2/4 layers, 2k/4k)")
    p.add_argument("--key-rows", action="store_true",
                   help="only the rows of total_gib_8b_32k and temp_ratio_32k_8k")
    p.add_argument("--remat", choices=sorted(REMAT_POLICIES),
                   help="remat policy of every row (default: each recipe's)")
    args = p.parse_args(argv)
    if len(jax.devices()) != DEVICES:
        raise RuntimeError(f"expected {DEVICES} fake CPU devices, got {jax.devices()}")
    if args.quick:
        lengths, long, depths, big = (2048, 4096), 4096, (4, 2), ()
    elif args.key_rows:
        lengths, long, depths, big = (8192, 32768), 32768, (36,), ()
    else:
        lengths, long, depths, big = (8192, 16384, 32768, 65536), 32768, (36, 4), (
            "qwen3-14b", "qwen3-32b")
    rows = [measure("qwen3-8b", depths[0], n, args.remat) for n in lengths]
    rows += [measure("qwen3-8b", d, lengths[0], args.remat) for d in depths[1:]]
    rows += [measure(preset, PRESETS[preset].num_layers, long, args.remat) for preset in big]
    by = {(r["preset"], r["layers"], r["row_len"]): r for r in rows}
    full, short = by[("qwen3-8b", depths[0], long)], by[("qwen3-8b", depths[0], lengths[0])]
    result = dict(rows=rows, total_gib_8b_32k=full["total_gib"],
                  temp_ratio_32k_8k=round(full["temp_gib"] / short["temp_gib"], 2))
    if len(depths) > 1:
        result["compile_ratio_36_4"] = round(
            short["compile_s"] / by[("qwen3-8b", depths[1], lengths[0])]["compile_s"], 2)
    result["peak_host_gib"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
