"""Shell snippets both backends run inside the sandbox, so both behave alike."""

from __future__ import annotations

# $1 = a path relative to the repository root (the working directory). Sets $t to it
# with every symbolic link resolved, and exits 3 (the resolved path on stderr) when
# that leads out of the repository: an edit follows a link only within the repository.
RESOLVE_IN_REPO = """
t=$(realpath -m -- "$1") || exit 2
case "$t" in "$(pwd -P)"/*) ;; *) printf '%s' "$t" >&2; exit 3 ;; esac
"""

# What a patch leaves out (bytecode and test caches): the repository's info/exclude.
GIT_EXCLUDES = "__pycache__/\n*.pyc\n.pytest_cache/\n"


def unpatched_paths(cap: int) -> str:
    """Script: the paths of the tree that capped_patch's `git add -A` leaves out, so no
    patch carries them: ignored files and directories (the repository's ignore rules and
    GIT_EXCLUDES; a wholly ignored directory as `dir/`) and empty directories (`dir/`),
    one a line, at most `cap`."""
    return f"""
{{ git -c safe.directory=* -c core.excludesFile=/dev/null ls-files --others --ignored \\
    --exclude-standard --directory
  find . -path ./.git -prune -o -type d -empty -printf '%P/\\n'
}} | sort -u | head -n {int(cap)}
"""


def capped_patch(git: str = "git") -> str:
    """Script: $1 = base commit, $2 = cap in bytes, $3 = the repository's info/exclude as
    it was made (the image's lines and GIT_EXCLUDES). Prints at most cap + 1 bytes of
    `git diff --binary` (untracked files included): a patch over the cap is never
    copied out whole. `git` is the command line that runs git. Objects stay compressed:
    uncompressed, a file near the per-file size cap would exceed it as a git object, and
    patch capture would fail where the agent's own write succeeded.

    Nothing a command did hides a change from it: info/exclude is written again as $3,
    a user excludes file (core.excludesFile, ~/.config/git/ignore) is not
    read, and no file keeps an assume-unchanged or skip-worktree bit. Ignore rules in the
    repository's own .gitignore files apply, as in the harnesses' `git diff`."""
    return f"""
d=$({git} rev-parse --git-dir) && mkdir -p "$d/info" || exit $?
printf %s "$3" > "$d/info/exclude" || exit $?
for bit in "[a-z] assume-unchanged" "S skip-worktree"; do  # one bit per update-index
  {git} ls-files -z -v | grep -z "^${{bit% *}}" | cut -z -c3- \
    | xargs -0 -r {git} update-index "--no-${{bit#* }}" -- || exit $?
done
{git} -c core.excludesFile=/dev/null add -A || exit $?
{git} diff --cached --binary "$1" | head -c "$(($2 + 1))"
s=("${{PIPESTATUS[@]}}")
[ "${{s[0]}}" = 0 ] || [ "${{s[0]}}" = 141 ] || exit "${{s[0]}}"  # 141: cut off by head
"""


def only_base_history(git: str = "git") -> str:
    """Script, in a repository whose HEAD is at its base commit: leaves only the base
    commit and its history reachable, so no command can read a later commit (a fix).
    HEAD is detached at the base; every other ref (branches, tags, remotes, stash,
    notes, replace refs), remote, reflog, `*_HEAD` file and alternate object store is
    removed, and the objects nothing reaches any more are pruned. A repository that
    holds none of these (one the project built) costs one listing, no repacking.
    Exit 95 when it fails."""
    return f"""
d=$({git} rev-parse --git-dir) && sha=$({git} rev-parse --verify HEAD^{{commit}}) || exit 95
{git} -c core.logAllRefUpdates=false update-ref --no-deref HEAD "$sha" || exit 95
refs=$({git} for-each-ref --format='%(refname)')
extra=$(cd "$d" && ls -d logs packed-refs objects/info/alternates ./*_HEAD 2>/dev/null)
[ -z "$refs$({git} remote)$extra" ] && exit 0
for r in $({git} remote); do {git} remote remove "$r" >/dev/null 2>&1; done
{git} for-each-ref --format='delete %(refname)' | {git} update-ref --stdin || exit 95
(cd "$d" && rm -rf logs packed-refs ./*_HEAD) || exit 95
{git} -c repack.writeBitmaps=false repack -a -d -q || exit 95
rm -f "$d/objects/info/alternates" && {git} prune --expire=now || exit 95
"""


def outside_repo_error(path: str, target: str) -> ValueError:
    return ValueError(f"{path} is a symbolic link to {target}, outside the repository; "
                      "not edited")
