"""transformers' greedy `generate`, served to a benchmark from a process of its own.

The project's top-level package `kernels` shadows the PyPI `kernels` library that
transformers 5 imports, in any process with the repository root on `sys.path`, so a
benchmark never imports transformers itself: it starts this script isolated
(`python -I bench/hf_generate.py HF_DIR`: neither the script's directory nor
PYTHONPATH on sys.path) and sends one JSON request per line on stdin,
`{"prompts": [[ids]], "new_tokens": n}`; each answer is one JSON line,
`{"tokens": [[ids]], "seconds": s}`, timed inside this process (no pipe in it).
The first line written is `{"ready": true, "torch_threads": n}`. The model runs on the
GPU when torch sees one, in the dtype its config.json names (models.hf_io.save_hf
writes the one it saved); float32 without TF32, as the JAX side computes it.
"""

import json
import sys
import time

import torch
import transformers


def main(hf_dir: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype="auto")
    model.to(device).eval()
    print(f"HF generate: {model.dtype} on {device}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}", file=sys.stderr, flush=True)
    print(json.dumps({"ready": True, "torch_threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        ids = torch.tensor(request["prompts"], dtype=torch.long, device=device)
        n = request["new_tokens"]
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                 eos_token_id=None)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(json.dumps({"tokens": out[:, ids.shape[1]:].tolist(), "seconds": seconds}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
