"""Generation throughput of the embedded JAX engine vs HF transformers `generate` (CPU).

Both run the same random tiny Qwen3 (models.qwen3.PRESETS["tiny"]) in float32: the JAX
weights are exported with models.hf_io.save_hf and loaded by transformers. Each batch
size generates exactly `new_tokens` greedy tokens after a `prompt_len`-token prompt;
tokens/s counts generated tokens over the wall time of the whole call (prefill
included), best of `repeats` runs after a warm-up (compilation excluded), the two
engines interleaved so machine load affects both alike.

    python -m bench.engine [--batch-sizes 1,8,32] [--new-tokens 64] [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

import numpy as np
from flax import nnx

from inference.embedded import EmbeddedEngine
from inference.engine import GenerateRequest
from models import hf_io, qwen3


def _log(*args):
    print(*args, file=sys.stderr, flush=True)


def _jax_runner(engine: EmbeddedEngine, prompts: np.ndarray, new_tokens: int):
    requests = [GenerateRequest(p.tolist(), new_tokens, temperature=0.0) for p in prompts]

    def run():
        results = asyncio.run(engine.generate(requests))
        return np.array([r.output_ids for r in results])

    return run


def _hf_runner(model, torch, prompts: np.ndarray, new_tokens: int):
    ids = torch.tensor(prompts, dtype=torch.long)

    def run():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0, eos_token_id=None)
        return out[:, ids.shape[1]:].numpy()

    return run


def _best(run, repeats: int) -> tuple[float, np.ndarray]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return min(times), out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch
    import transformers

    cfg = qwen3.PRESETS["tiny"]
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(args.seed))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = EmbeddedEngine(model, max_batch=max(batch_sizes),
                            max_len=args.prompt_len + args.new_tokens, seed=args.seed)
    with tempfile.TemporaryDirectory() as hf_dir:
        hf_io.save_hf(model, cfg, hf_dir)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(args.seed)
    rows = {}
    for batch in batch_sizes:
        prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len))
        runners = {"embedded": _jax_runner(engine, prompts, args.new_tokens),
                   "hf": _hf_runner(hf_model, torch, prompts, args.new_tokens)}
        for run in runners.values():
            run()  # warm-up: compilation, allocator
        best = {name: (float("inf"), None) for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                t, out = _best(run, 1)
                best[name] = min(best[name], (t, out), key=lambda x: x[0])
        tokens = batch * args.new_tokens
        tps = {name: tokens / t for name, (t, _) in best.items()}
        agree = float(np.mean(best["embedded"][1] == best["hf"][1]))
        rows[str(batch)] = {"embedded_tokens_per_s": round(tps["embedded"], 1),
                            "hf_tokens_per_s": round(tps["hf"], 1),
                            "speedup_vs_hf": round(tps["embedded"] / tps["hf"], 2),
                            "greedy_token_agreement": round(agree, 3)}
        _log(f"batch {batch}: {rows[str(batch)]}")
    engine.close()
    result = {"model": "tiny", "dtype": "float32", "device": "cpu", "torch_threads":
              torch.get_num_threads(), "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "batches": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
