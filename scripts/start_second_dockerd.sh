#!/usr/bin/env bash
# Starts one more Docker engine beside the default one, with its own socket, data root
# and exec root (and so its own containerd), then loads the sandbox image into it.
#
#   scripts/start_second_dockerd.sh [NAME]      # NAME default "docker-2"
#   scripts/start_second_dockerd.sh --stop [NAME]
#
# The engine answers at unix:///var/run/NAME.sock; data in /var/lib/NAME, exec root
# /var/run/NAME, pid file /var/run/NAME.pid, log /tmp/NAME.log. Idempotent: an engine
# already answering there is left as it is. No bridge and no iptables (the sandboxes
# run with --network none). --stop SIGKILLs it, as a crashed engine, and waits until
# it is gone. Env: SANDBOX_IMAGE (default swe-sandbox:test), copied from the default
# engine when missing. Needs root.
set -euo pipefail

stop=0
if [[ ${1:-} == --stop ]]; then stop=1; shift; fi
name=${1:-docker-2}
sock=/var/run/$name.sock
pidfile=/var/run/$name.pid
image=${SANDBOX_IMAGE:-swe-sandbox:test}
answers() { timeout 10 docker -H "unix://$sock" info >/dev/null 2>&1; }

if [[ $stop == 1 ]]; then
  if [[ -f $pidfile ]] && pid=$(cat "$pidfile") && kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
  rm -f "$pidfile"
  echo "$name stopped" >&2
  exit 0
fi

if ! answers; then
  rm -f "$pidfile"  # a killed engine leaves its pid file, which dockerd refuses
  mkdir -p "/var/lib/$name" "/var/run/$name"
  setsid dockerd -H "unix://$sock" --data-root "/var/lib/$name" --exec-root "/var/run/$name" \
    --pidfile "$pidfile" --iptables=false --bridge=none --storage-driver=overlay2 \
    </dev/null >>"/tmp/$name.log" 2>&1 &
  for _ in $(seq 60); do
    answers && break
    sleep 1
  done
  answers || { echo "error: $name did not answer; tail of /tmp/$name.log:" >&2;
               tail -n 20 "/tmp/$name.log" >&2; exit 1; }
fi
if ! docker -H "unix://$sock" image inspect "$image" >/dev/null 2>&1; then
  docker save "$image" | docker -H "unix://$sock" load >&2
fi
echo "unix://$sock"
