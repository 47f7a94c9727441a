#!/usr/bin/env bash
# The test command: lint, make a Docker engine and the sandbox image available, run pytest.
# With REQUIRE_ALL=1 (CI) a missing Docker engine or torch reference fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."

ruff check .
if [[ $(id -u) == 0 || -S /var/run/docker.sock ]]; then
  bash scripts/start_dockerd.sh
  bash scripts/build_sandbox_image.sh
elif [[ ${REQUIRE_ALL:-0} == 1 ]]; then
  echo "REQUIRE_ALL=1 but no Docker engine can be started (not root, no /var/run/docker.sock)" >&2
  exit 1
fi
exec python -m pytest "$@"
