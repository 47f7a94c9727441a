"""transformers' greedy `generate`, served to a benchmark from a process of its own.

The project's top-level package `kernels` shadows the PyPI `kernels` library that
transformers 5 imports, in any process with the repository root on `sys.path`, so a
benchmark never imports transformers itself: it starts this script isolated
(`python -I bench/hf_generate.py HF_DIR`: neither the script's directory nor
PYTHONPATH on sys.path) and sends one JSON request per line on stdin,
`{"prompts": [[ids]], "new_tokens": n}`; each answer is one JSON line,
`{"tokens": [[ids]], "seconds": s}`, timed inside this process (no pipe in it).
The first line written is `{"ready": true, "torch_threads": n}`.
"""

import json
import sys
import time

import torch
import transformers


def main(hf_dir: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    print(json.dumps({"ready": True, "torch_threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        ids = torch.tensor(request["prompts"], dtype=torch.long)
        n = request["new_tokens"]
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                 eos_token_id=None)
        seconds = time.perf_counter() - start
        print(json.dumps({"tokens": out[:, ids.shape[1]:].tolist(), "seconds": seconds}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
