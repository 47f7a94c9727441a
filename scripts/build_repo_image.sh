#!/usr/bin/env bash
# Builds a task image without a registry: the sandbox image (Debian + python3 + git) with
# a repository at /testbed checked out at a base commit, and its Python dependencies.
#
#   scripts/build_repo_image.sh IMAGE REPO_DIR BASE_COMMIT [PIP_REQUIREMENT...]
#   scripts/build_repo_image.sh flask-5014:local /tmp/flask 7ee9ceb71e868944a46e1ff00b506772a53a4f1d \
#       'Werkzeug==2.3.*' 'Jinja2>=3.1.2' 'itsdangerous>=2.1.2' 'click>=8.1.3' 'blinker>=1.6.2' 'pytest<8'
#
# REPO_DIR is any git checkout holding BASE_COMMIT (e.g. a clone of a `fetch`ed mirror); the
# image's repository holds BASE_COMMIT's history only.
# Wheels for the image's CPython (3.11, x86_64) come from PyPI through the host's pip and
# are unpacked into /usr/local/lib/python3.11/dist-packages; the repository is importable
# as an editable install would make it (a .pth file: /testbed/src for src layouts, else
# /testbed); `python` and `pytest` are on PATH as in the official images' environments.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
image=$1 repo=$2 base=$3
shift 3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
base_image=${SANDBOX_IMAGE:-swe-sandbox:test}
site=/usr/local/lib/python3.11/dist-packages

"$here/build_sandbox_image.sh" "$base_image"
work=$(mktemp -d /tmp/repo-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site" "$work/bin"

if [[ $# -gt 0 ]]; then
  python3 -m pip download -q --only-binary=:all: --platform manylinux2014_x86_64 \
    --python-version 3.11 --implementation cp -d "$work/wheels" "$@"
  for wheel in "$work"/wheels/*.whl; do
    python3 -m zipfile -e "$wheel" "$work/site"
  done
fi

# Only BASE_COMMIT and its history go into the image: no later commit (the fix), branch,
# tag, remote, stash or reflog of REPO_DIR is there for a command in the sandbox to read.
sha=$(git -C "$repo" rev-parse --verify "$base^{commit}")
git init -q --template= "$work/testbed"
git -C "$work/testbed" -c uploadpack.allowAnySHA1InWant=true fetch -q --no-tags "$repo" "$sha"
git -C "$work/testbed" -c core.logAllRefUpdates=false checkout -q --detach "$sha"
rm -f "$work/testbed/.git/FETCH_HEAD"
if [[ -d $work/testbed/src ]]; then src=/testbed/src; else src=/testbed; fi
echo "$src" > "$work/site/testbed.pth"
printf '#!/usr/bin/python3\nimport sys\nimport pytest\nsys.exit(pytest.console_main())\n' \
  > "$work/bin/pytest"
chmod 755 "$work/bin/pytest"
ln -s /usr/bin/python3 "$work/bin/python"

cid=$(docker create "$base_image")
trap 'docker rm -f "$cid" >/dev/null 2>&1; rm -rf "$work"' EXIT
docker cp -q "$work/site/." "$cid:$site/"
docker cp -q "$work/bin/." "$cid:/usr/local/bin/"
docker cp -q "$work/testbed" "$cid:/testbed"
docker commit --change 'WORKDIR /testbed' "$cid" "$image" >/dev/null
echo "built $image: $repo at $base" >&2
