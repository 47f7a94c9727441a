"""Shell snippets both backends run inside the sandbox, so both behave alike."""

from __future__ import annotations

# $1 = a path relative to the repository root (the working directory). Sets $t to it
# with every symbolic link resolved, and exits 3 (the resolved path on stderr) when
# that leads out of the repository: an edit follows a link only within the repository.
RESOLVE_IN_REPO = """
t=$(realpath -m -- "$1") || exit 2
case "$t" in "$(pwd -P)"/*) ;; *) printf '%s' "$t" >&2; exit 3 ;; esac
"""

def capped_patch(git: str = "git") -> str:
    """Script: $1 = base commit, $2 = cap in bytes. Prints at most cap + 1 bytes of
    `git diff --binary` (untracked files included): a patch over the cap is never
    copied out whole. `git` is the command line that runs git. Objects stay compressed:
    uncompressed, a file near the per-file size cap would exceed it as a git object, and
    patch capture would fail where the agent's own write succeeded."""
    return f"""
{git} add -A || exit $?
{git} diff --cached --binary "$1" | head -c "$(($2 + 1))"
s=("${{PIPESTATUS[@]}}")
[ "${{s[0]}}" = 0 ] || [ "${{s[0]}}" = 141 ] || exit "${{s[0]}}"  # 141: cut off by head
"""


def outside_repo_error(path: str, target: str) -> ValueError:
    return ValueError(f"{path} is a symbolic link to {target}, outside the repository; "
                      "not edited")
