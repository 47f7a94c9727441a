"""Export + reload time of one weight update, learner to server, as a GPU pod runs it.

This process holds a random Qwen3 of a preset's shape (qwen3-0.6b by default) on its
JAX device, as the learner does; a server launched beside it (`inference.server`, or
real SGLang with --command) serves the same shape. Each of `--updates` updates
perturbs the parameters, exports them through `SGLangClient.update_weights` (HF
safetensors in --dtype into a rotating directory) and reloads the server (pause,
/update_weights_from_disk, continue), then checks that a greedy request is served and
that its output follows the new weights. Reported per update: export seconds and bytes,
reload seconds, the whole update's seconds; the first update is reported too but
includes the server's first load of a new file.

    python -m bench.weight_sync                           # qwen3-0.6b, 3 updates
    python -m bench.weight_sync --preset tiny --updates 2 --out /tmp/ws.json
    python -m bench.weight_sync --command "{python} -m sglang.launch_server ..."  # SGLang

The server and this process share the device: each JAX process is held to
--mem-fraction of its memory. Prints one JSON object (and writes it to --out);
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

SERVER = ("{python} -m inference.server --model-path {model_path} --port {port} --host {host} "
          "--context-length {context_length} --max-batch 8 --min-batch 8 --min-len 64")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="exported tensors (the server's)")
    p.add_argument("--command", default=SERVER, help="server command template "
                   "(inference.launcher.LauncherConfig.command)")
    p.add_argument("--mem-fraction", type=float, default=0.4,
                   help="XLA_PYTHON_CLIENT_MEM_FRACTION of this process and of the server")
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction))
    result = asyncio.run(measure(args))
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


async def measure(args) -> dict:
    import jax
    from flax import nnx

    from configs import common
    from inference import launcher as launchers
    from inference import sglang
    from models import hf_io, qwen3

    cfg = qwen3.PRESETS[args.preset]
    t0 = time.perf_counter()
    params = nnx.state(qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    jax.block_until_ready(params)
    _log(f"{args.preset}: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.0f}M params "
         f"on {jax.devices()[0]} in {time.perf_counter() - t0:.1f} s")
    workdir = tempfile.mkdtemp(prefix="weight_sync_")
    init = os.path.join(workdir, "init")
    hf_io.save_hf(params, cfg, init, dtype=args.dtype)
    section = sglang.SGLangConfig(**{**common.sglang_defaults(), "export_dtype": args.dtype,
                                     "export_dir": os.path.join(workdir, "exports")})
    launcher = launchers.SGLangLauncher(dataclasses.replace(
        launchers.LauncherConfig.from_section(section, init, 0, args.context_length),
        command=args.command, startup_timeout=args.startup_timeout,
        log_path=os.path.join(workdir, "server.log"),
        env={"XLA_PYTHON_CLIENT_MEM_FRACTION": str(args.mem_fraction),
             # the project's own server imports this repository (LauncherConfig)
             **({"PYTHONPATH": launchers.REPOSITORY} if "-m inference.server" in args.command
                else {})}))
    t0 = time.perf_counter()
    launcher.start()  # a server that fails to start is closed there
    _log(f"server healthy in {time.perf_counter() - t0:.0f} s (log {launcher.log_path})")
    try:  # the server and the exported files go whatever fails
        info = launchers.server_info(launcher.url)
        client = sglang.SGLangClient([launcher.url], section, model_config=cfg,
                                     launchers=[launcher])
        try:
            updates, outputs = await _updates(client, params, args.updates)
        finally:
            await client.aclose()
        exports = sorted(os.listdir(os.path.join(workdir, "exports")))
    finally:
        launcher.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"preset": args.preset, "dtype": args.dtype, "device": str(jax.devices()[0]),
            "server": args.command.split(" -m ")[-1].split()[0],
            "server_version": info.get("version"),
            "real_sglang": "sglang.launch_server" in args.command,
            "updates": updates, "outputs_changed": [a != b for a, b in
                                                    zip(outputs, outputs[1:], strict=False)],
            "exports_left": exports}


async def _updates(client, params, count: int) -> tuple[list[dict], list[list[int]]]:
    """`count` timed updates of perturbed parameters; (per-update stats, the greedy
    output of a probe request before the first update and after each)."""
    import jax

    from inference.engine import GenerateRequest

    probe = GenerateRequest(list(range(1, 17)), 8, temperature=0.0)
    updates, outputs = [], [(await client.generate([probe]))[0].output_ids]
    for i in range(count):
        params = jax.tree.map(lambda x, i=i: x * (1.0 + 0.5 * (i + 1)), params)
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        await client.update_weights(params)
        total = time.perf_counter() - t0
        outputs.append((await client.generate([probe]))[0].output_ids)
        stats = client.update_stats()
        updates.append({"total_s": total, **{k.removeprefix("sync/"): v
                                             for k, v in stats.items()}})
        _log(f"update {i + 1}: {json.dumps(updates[-1])}")
    return updates, outputs


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
