#!/usr/bin/env bash
# The test command against the newest releases that requirements-dev.txt's ranges admit
# (no lock), in a new virtual environment: drift in a dependency shows here before a
# user meets it. A release that breaks the suite gets an upper bound in requirements*.txt,
# with the reason in a comment, until the code supports it.
#
#   scripts/test_latest.sh [PYTEST ARGS]      # VENV=DIR to choose where the environment goes
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${VENV:-$(mktemp -d /tmp/latest-venv-XXXXXX)}
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q --upgrade -r requirements-dev.txt
"$venv/bin/pip" freeze > "$venv/versions.txt"
echo "newest releases in $venv (list: $venv/versions.txt)" >&2
# shellcheck disable=SC1091
source "$venv/bin/activate"
exec bash scripts/test.sh "$@"
