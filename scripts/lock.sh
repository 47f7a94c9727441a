#!/usr/bin/env bash
# Refreshes the locks from the supported ranges, with hashes:
#   requirements.lock      <- requirements.txt      (python train.py)
#   requirements-dev.lock  <- requirements-dev.txt  (tests and benchmarks)
#
#   scripts/lock.sh            # newest releases within the ranges
#   scripts/lock.sh -P NAME    # move one package only (pip-compile's --upgrade-package)
#
# Then, before committing the new locks, run the test command in a new virtual
# environment from them (README, first lines). The two locks must agree on every package
# they share; this script fails when they do not. torch is the CPU build (a test
# reference only); a GPU host installs its own accelerator JAX over the lock (README).
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install -q "pip-tools>=7.4"
upgrade=(--upgrade)
[[ ${1:-} == -P ]] && upgrade=(--upgrade-package "$2")
for name in requirements requirements-dev; do
  python -m piptools compile -q "${upgrade[@]}" --generate-hashes --allow-unsafe \
    --strip-extras --no-emit-index-url --no-emit-find-links -o "$name.lock" "$name.txt"
done

# Every runtime pin must be in the dev lock as it is (the dev ranges include the runtime's).
pins() { grep -E '^[A-Za-z0-9_.-]+==' "$1" | sed 's/ .*//' | tr 'A-Z_' 'a-z-' | sort; }
differ=$(comm -23 <(pins requirements.lock) <(pins requirements-dev.lock))
if [[ -n $differ ]]; then
  echo "requirements-dev.lock differs from requirements.lock on: $differ" >&2
  echo "(run scripts/lock.sh again, or pin the package in requirements.txt)" >&2
  exit 1
fi
