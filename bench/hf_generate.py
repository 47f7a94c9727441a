"""Greedy HF transformers `generate` timed per batch size, for bench.gpu_check's decode part.

  python -P bench/hf_generate.py REQUEST.json RESULT.json     # cwd outside the repository

Imports nothing from this repository and must run without it on sys.path (`-P`, and a
working directory elsewhere): its top-level package `kernels` has the name of a PyPI
library that transformers imports when it is installed. REQUEST.json: {"model_dir": an
HF directory written by models.hf_io.save_hf, "dtype": "float32" | "bfloat16",
"prompts": [[ids]] (the first b rows serve batch b), "batch_sizes", "new_tokens",
"repeats"}. Each batch generates exactly `new_tokens` greedy tokens (no EOS), after a
short warm-up of the same batch; its time is the best of `repeats` whole calls.
RESULT.json: {"device", "torch", "transformers", "batches": {b: {"seconds",
"tokens_per_s", "output_ids"}}}.
"""

import json
import sys
import time

import torch
import transformers


def _generate(model, ids, new_tokens: int):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0, eos_token_id=None)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out[:, ids.shape[1]:]


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32, as in JAX's check
    model = transformers.AutoModelForCausalLM.from_pretrained(
        request["model_dir"], dtype=getattr(torch, request["dtype"])).to(device).eval()
    batches = {}
    for batch in request["batch_sizes"]:
        ids = torch.tensor(request["prompts"][:batch], dtype=torch.long, device=device)
        _generate(model, ids, min(8, request["new_tokens"]))
        best, out = float("inf"), None
        for _ in range(request["repeats"]):
            start = time.perf_counter()
            out = _generate(model, ids, request["new_tokens"])
            best = min(best, time.perf_counter() - start)
        batches[str(batch)] = {"seconds": best,
                               "tokens_per_s": batch * request["new_tokens"] / best,
                               "output_ids": out.cpu().tolist()}
        print(f"hf batch {batch}: {batches[str(batch)]['tokens_per_s']:.1f} tokens/s",
              file=sys.stderr, flush=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "batches": batches}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
