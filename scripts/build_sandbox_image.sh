#!/usr/bin/env bash
# Builds the sandbox test image (Debian bookworm minbase + python3 + git) without a registry.
#
#   scripts/build_sandbox_image.sh [IMAGE]      # IMAGE defaults to $SANDBOX_IMAGE or swe-sandbox:test
#
# Skips everything when IMAGE already exists. Otherwise bootstraps a root filesystem with
# debootstrap from the machine's own apt mirror, caches it as a tarball
# ($SANDBOX_CACHE_DIR, default ~/.cache/swe-rl/rootfs-bookworm.tar) so later rebuilds only
# run `docker import`, and imports it. Starts dockerd (scripts/start_dockerd.sh) and installs
# docker.io / debootstrap with apt when they are missing. Needs root for debootstrap.
set -euo pipefail

image=${1:-${SANDBOX_IMAGE:-swe-sandbox:test}}
cache_dir=${SANDBOX_CACHE_DIR:-$HOME/.cache/swe-rl}
suite=bookworm
packages=python3,git,procps
tarball=$cache_dir/rootfs-$suite.tar
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

"$here/start_dockerd.sh"
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "image $image already exists" >&2
  exit 0
fi

# The first Debian mirror in the apt sources (deb822 .sources files or one-line sources.list).
apt_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    awk '/^URIs:/ {uri=$2} /^Suites:/ {for (i=2;i<=NF;i++) if ($i=="'$suite'") {print uri; exit}}' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    awk '$1=="deb" && $0 ~ /debian/ && $3=="'$suite'" {print $2; exit}' "$f"
  done
}

if [[ ! -s $tarball ]]; then
  if ! command -v debootstrap >/dev/null; then
    echo "debootstrap missing: installing it" >&2
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2
  fi
  mirror=$(apt_mirror | head -n 1)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d /tmp/sandbox-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  echo "debootstrap $suite from $mirror into $rootfs" >&2
  debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >&2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  mkdir -p "$cache_dir"
  tar -C "$rootfs" -cf "$tarball.partial" .
  mv "$tarball.partial" "$tarball"
fi

echo "importing $tarball as $image" >&2
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["sleep", "infinity"]' \
  "$tarball" "$image" >&2
echo "built $image" >&2
