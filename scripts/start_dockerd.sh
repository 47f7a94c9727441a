#!/usr/bin/env bash
# Starts a Docker engine in the background when none answers, then waits for it.
#
#   scripts/start_dockerd.sh            # idempotent; exits 0 once `docker info` works
#
# Tries the overlay2 storage driver first and falls back to vfs (slower, but works
# on any filesystem, e.g. when the root is itself an overlay); for each, first with
# default networking, then without iptables and the default bridge (enough for the
# sandboxes, which run with --network none). Needs root. Installs docker.io with apt
# when dockerd is missing (fresh CI machines). dockerd runs in its own session, so it
# outlives the calling shell.
# Env: DOCKERD_LOG (default /tmp/dockerd.log), DOCKERD_WAIT_S (default 60 per attempt),
#      DOCKERD_STORAGE_DRIVERS (default "overlay2 vfs").
set -euo pipefail

log=${DOCKERD_LOG:-/tmp/dockerd.log}
wait_s=${DOCKERD_WAIT_S:-60}
drivers=${DOCKERD_STORAGE_DRIVERS:-"overlay2 vfs"}

engine_answers() { timeout 10 docker info >/dev/null 2>&1; }

if command -v docker >/dev/null && engine_answers; then
  echo "docker engine already answers" >&2
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "error: no docker engine answers and starting dockerd needs root" >&2
  exit 1
fi
if ! command -v dockerd >/dev/null; then
  echo "dockerd missing: installing docker.io" >&2
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >&2
fi

start_with() {  # $1 = storage driver, $2 = extra flags; returns 0 once the engine answers
  local driver=$1 flags=$2 pid
  echo "starting dockerd (storage driver $driver${flags:+, $flags}; log $log)" >&2
  # shellcheck disable=SC2086
  setsid dockerd --storage-driver="$driver" $flags </dev/null >>"$log" 2>&1 &
  pid=$!
  for _ in $(seq "$wait_s"); do
    if engine_answers; then
      echo "dockerd running (pid $pid, storage driver $driver${flags:+, $flags})" >&2
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "dockerd exited (storage driver $driver${flags:+, $flags})" >&2
      return 1
    fi
    sleep 1
  done
  echo "dockerd did not answer within ${wait_s}s with storage driver $driver" >&2
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  return 1
}

for driver in $drivers; do
  for flags in "" "--iptables=false --bridge=none"; do
    if start_with "$driver" "$flags"; then
      exit 0
    fi
  done
done
echo "error: could not start dockerd with any of: $drivers; last lines of $log:" >&2
tail -n 20 "$log" >&2
exit 1
