#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels that the GPU machine's Python lacks, so
# that they travel with the tree to a machine that reaches no package index.
#
#   scripts/gpu_check_wheels.sh [NAME==VERSION ...]     # ml-collections, and any others
#
# That machine has CPython 3.12 (x86_64) with JAX (CUDA), flax, optax, orbax-checkpoint,
# aiohttp, safetensors, tokenizers, numpy, torch and transformers; of what bench.gpu_check
# imports it lacks only ml-collections (pure Python; its absl-py and PyYAML are there).
# Then, on the GPU machine, from the repository root:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 -m bench.gpu_check all --out results/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
rm -rf .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "ml-collections==1.1.0" "$@"
ls -l .whl
