"""transformers' Qwen3ForCausalLM as a reference, in a process of its own.

The project's top-level package `kernels` shadows the PyPI `kernels` library that
transformers 5 imports, in any process with the repository root on `sys.path`. Tests
therefore never import transformers; they run this script as `python -P <path>` from a
directory outside the repository (`-P`: the script's directory is not put on
`sys.path` either), passing one JSON request as argv[1] and reading one JSON answer on
stdout. Arrays travel as .npy files.

Requests:
  {"op": "make", "config": {...Qwen3Config kwargs}, "dir": D, "max_shard_size": S|null,
   "tokens": T.npy, "logits": L.npy}
      a randomly initialised model (seed 0, norm weights perturbed so a misplaced norm
      shows) saved to D with save_pretrained, and its logits on T written to L.
  {"op": "load", "dir": D, "tokens": T.npy, "logits": L.npy}
      the model in D loaded with from_pretrained, its logits on T written to L.
Answer: {"rope_theta": float, "transformers": version}.
"""

import json
import sys

import numpy as np
import torch
import transformers


def _make(request):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**request["config"])
    model = transformers.Qwen3ForCausalLM(config).eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": request["max_shard_size"]} if request.get("max_shard_size") else {}
    model.save_pretrained(request["dir"], safe_serialization=True, **kwargs)
    return model


def main(request):
    if request["op"] == "make":
        model = _make(request)
    else:
        model = transformers.Qwen3ForCausalLM.from_pretrained(request["dir"]).eval()
    tokens = torch.tensor(np.load(request["tokens"]), dtype=torch.long)
    with torch.no_grad():
        np.save(request["logits"], model(tokens).logits.numpy())
    rope = getattr(model.config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(model.config, "rope_theta", None))
    return {"rope_theta": theta, "transformers": transformers.__version__}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
