"""A sandbox in a temporary directory on this machine.

Layout of one sandbox: `<tmp>/sandbox-XXXX/{repo,home,tmp}`; `repo` is a git checkout
whose base commit `patch()` diffs against.

Isolation: every command runs under the sandbox's supervisor (supervisor_main.py, one
long-lived process per sandbox, forked with it; env.sandbox.supervisor talks to it),
with the sandbox's own environment (PATH, HOME, TMPDIR, LANG: nothing of the trainer's)
and rlimits (CPU seconds, address space, file size, processes). As root (required unless
`allow_unisolated`), each command runs as a uid of its own, drawn at random from a range
no account uses and owning the sandbox directory, in the supervisor's mount, PID and
network namespaces, with a root of its own: the sandbox directory, the host's toolchain
(/usr and the links into it, `supervisor.TOOLCHAIN`) and any `read_only` paths, a few
names of /etc (no accounts: a passwd of its own), a few devices; a link to any other
host path (`ln -s /etc/passwd`) finds nothing. Every mount but the sandbox directory is
read-only, and every mount nosuid; commands run under no_new_privs (isolated or not), so
a setuid program (su, passwd) runs with the command's uid; /proc shows only the
sandbox's processes (no trainer to read or signal), and the loopback is its own (no
inference server to call). RLIMIT_NPROC is counted per uid and not enforced for root, so
only a dedicated uid makes the process limit hold (a fork bomb stays bounded) without
touching other users' count. The sandbox directory is a tmpfs of `disk_bytes`, which
bounds everything it holds. The command text reaches bash through a memfd (see
supervisor_main.py), so its length is not bounded by argv. Commands of one sandbox run
one at a time. A supervisor that dies or stops answering is a SandboxError for that
command and every later one.

Where isolation cannot be had (no root, no namespaces), the constructor raises
IsolationUnavailable unless `allow_unisolated`: commands then run as the calling
user, with RLIMIT_NPROC set to that user's current process count plus the limit, and
can see and write what that user can.

Memory: each process is bounded by its address space (`LocalLimits.memory_bytes`), and
all of an isolated sandbox's processes together by a memory cgroup of
`total_memory_bytes` (env.sandbox.cgroup; v2 or v1), where the host lets root make one.
Where it does not (`cgroup.available()` is False: no writable cgroupfs, or a cgroup v2
parent that does not delegate memory, as in many containers), there is no total bound:
a warning says so once per process, and the factory counts such sandboxes in its metrics
(`env/no_memory_cgroup`); use the docker backend where that matters.

After every command, processes it left in the background are killed: each call of
`run` is self-contained, so an episode never leaks processes between steps.

`read_file` and `write_file` open a regular file from the host, beneath the repository
and with the sandbox uid's permissions (env.sandbox.fsread), and run `cat` under the
supervisor only where that could see something else (a link out of the repository, a
denied permission, a FIFO, a missing directory): most reads and writes cost no command.

A repository made from files is committed by git once per set of files: later sandboxes
of the same files get its `.git` written from memory (`_BaseRepos`), the same base
commit.

A sandbox directory records its owner (pid and process start time) in `.owner`;
`reap_stale` removes the directories of owners that no longer run, which a killed
trainer leaves behind (`close` never ran).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from env.paths import repo_relative
from env.sandbox import base, cgroup, fsread, shell
from env.sandbox.supervisor import TOOLCHAIN, Completed, Confinement, RootView, Supervisor

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
GIT_IDENTITY = ["-c", "user.name=sandbox", "-c", "user.email=sandbox@localhost"]
# Bytecode caches go stale when a file is rewritten within the mtime granularity at the
# same size (an edit flipping `-` to `+`), and they would clutter patches.
EXEC_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
# Dedicated uids are drawn from here; far above login (1000+) and subuid (100000+) ranges.
UID_RANGE = (1_000_000_000, 1_500_000_000)
PREFIX, OWNER_FILE = "sandbox-", ".owner"
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LocalLimits:
    """Per-command resource limits (None: not limited)."""

    cpu_seconds: int | None = 600  # RLIMIT_CPU of each process
    memory_bytes: int | None = 2 << 30  # RLIMIT_AS of each process
    file_size_bytes: int | None = 256 << 20  # RLIMIT_FSIZE: largest file a command may write
    max_processes: int | None = 256  # RLIMIT_NPROC: live processes of the sandbox's uid
    # All the sandbox's processes together (and the tmpfs pages they write): a memory
    # cgroup (env.sandbox.cgroup) where the host allows one, else no bound.
    total_memory_bytes: int | None = 4 << 30

    def rlimits(self) -> dict[str, int]:
        named = {
            "RLIMIT_CPU": self.cpu_seconds,
            "RLIMIT_AS": self.memory_bytes,
            "RLIMIT_FSIZE": self.file_size_bytes,
            "RLIMIT_NPROC": self.max_processes,
        }
        return {name: int(v) for name, v in named.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class LocalOptions:
    """How local sandboxes are made (a factory's defaults; the task gives the Source).

    limits: per-command rlimits.
    max_output_bytes: cap on the output kept per `run` (head and tail halves).
    max_patch_bytes: cap on `patch()` (PatchTooLarge beyond it).
    env: extra environment variables for commands.
    root_dir: where the temp directory is created (default: the system temp dir).
    allow_unisolated: where isolation cannot be had (no root, no namespaces), run
      commands anyway, with the calling user's rights; otherwise IsolationUnavailable.
    disk_bytes: cap on everything the sandbox directory holds (a tmpfs of that size;
      isolated sandboxes only: the mount needs root).
    read_only: host paths an isolated command sees (read-only) besides the toolchain,
      e.g. an environment that `env_setup` activates.
    """

    limits: LocalLimits = LocalLimits()
    max_output_bytes: int = 1 << 20
    max_patch_bytes: int = base.MAX_PATCH_BYTES
    env: Mapping[str, str] | None = None
    root_dir: str | None = None
    allow_unisolated: bool = False
    disk_bytes: int | None = 1 << 30
    read_only: Sequence[str] = ()


class LocalSandbox(base.Sandbox):
    """A git checkout in a temp directory; commands run under its supervisor.

    source: the repository, from `repo_files` or `repo_dir` (with `base_commit`), and its
    `env_setup` (base.Source); options: how the sandbox is made and bounded.
    """

    SOURCE_KEYS = ("repo_files", "repo_dir", "base_commit", "env_setup")
    Options = LocalOptions

    def __init__(self, source: base.Source, options: LocalOptions = LocalOptions()):
        self.isolated = isolation_available()
        if not self.isolated and not options.allow_unisolated:
            raise IsolationUnavailable(
                "the local sandbox cannot isolate commands here (it needs root and Linux "
                "mount/PID/network namespaces): they would run with the trainer's rights. "
                "Use the docker backend, or accept running untrusted code unisolated "
                "(env.local_allow_unisolated=True, LocalOptions(allow_unisolated=True)).")
        if (source.repo_files is None) == (source.repo_dir is None):
            raise ValueError("give exactly one of repo_files and repo_dir")
        if source.base_commit is not None and source.repo_dir is None:
            raise ValueError("base_commit needs repo_dir (repo_files start a new history)")
        if source.image is not None:
            raise ValueError("the local backend takes no image")
        self.view = RootView(read_only=TOOLCHAIN + _extra_paths(options.read_only))
        self.limits = options.limits
        self.max_output_bytes = options.max_output_bytes
        self.max_patch_bytes = options.max_patch_bytes
        self.env_setup = source.env_setup
        self._lock = threading.Lock()
        # The supervisor while a command runs (its process group holds the command's).
        self._running: set = set()
        self._repo_fd: int | None = None
        self._closed = False
        # The tree is the base commit it was made as (_commit_all) until a command runs or
        # a file is written: its patch is empty.
        self._pristine = False
        self._supervisor: Supervisor | None = None
        self._memory: cgroup.MemoryGroup | None = None
        # A total memory bound was asked for (limits.total_memory_bytes) but no memory
        # cgroup holds the sandbox's processes: each is bounded by its address space only.
        self.no_memory_cgroup = False
        self._uid = secrets.randbelow(UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0]
        if os.geteuid() != 0:
            self._uid = None
        self.root = tempfile.mkdtemp(prefix=PREFIX, dir=options.root_dir)
        try:
            self._setup(source, options)
        except BaseException:
            self.close()
            raise

    # -- setup ------------------------------------------------------------------------

    def _setup(self, source: base.Source, options: LocalOptions) -> None:
        """The sandbox directory, its repository and its supervisor."""
        if self.isolated and options.disk_bytes:
            _mount_quota(self.root, options.disk_bytes)
        with open(os.path.join(self.root, OWNER_FILE), "w") as f:
            json.dump({"owner": _process_identity(os.getpid())}, f)
        self.repo = os.path.join(self.root, "repo")
        self._env = self._make_env(options.env)
        if source.repo_files is not None:
            self.base_commit = self._init_from_files(source.repo_files)
        else:
            self.base_commit = self._init_from_dir(source.repo_dir, source.base_commit)
        os.makedirs(os.path.join(self.repo, ".git", "info"), exist_ok=True)
        with open(os.path.join(self.repo, ".git", "info", "exclude"), "a+") as f:
            f.write(shell.GIT_EXCLUDES)
            f.seek(0)
            self._excludes = f.read()  # as made: `patch` writes it back (shell.py)
        # The directory commands run in, as it was before any ran (a command may
        # rename it): where read_file reads, and its path with links resolved (the
        # same inside the supervisor's namespaces: a bind mount onto itself).
        self._repo_fd = fsread.open_root(self.repo)
        self._real_root = os.path.realpath(self.repo)
        if self._uid is not None:
            self._check_traversable()
            _chown_tree(self.root, self._uid)
        limits = options.limits
        if self.isolated and limits.total_memory_bytes:
            self._memory = cgroup.MemoryGroup.create(os.path.basename(self.root),
                                                     limits.total_memory_bytes)
        if limits.total_memory_bytes and self._memory is None:
            self.no_memory_cgroup = True
            _warn_no_memory_cgroup(self.isolated)
        self._supervisor = Supervisor(self.repo, self._env, Confinement(
            self._uid, limits.rlimits(), self.root if self.isolated else None, self.view,
            self._memory and self._memory.procs))

    def _make_env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        home, tmp = os.path.join(self.root, "home"), os.path.join(self.root, "tmp")
        os.makedirs(home)
        os.makedirs(tmp)
        with open(os.path.join(home, ".gitconfig"), "w") as f:
            f.write("[user]\n\tname = sandbox\n\temail = sandbox@localhost\n")
        env = {"PATH": SAFE_PATH, "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8", **EXEC_ENV}
        env.update(extra or {})
        return env

    def _init_from_files(self, files: Mapping[str, str]) -> str:
        os.makedirs(self.repo)
        for path, content in files.items():
            target = os.path.join(self.repo, repo_relative(path))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w", encoding="utf-8", newline="") as f:
                f.write(content)
        key = _BASE_REPOS.key(files, os.path.dirname(self.root), os.path.ismount(self.root))
        commit = _BASE_REPOS.restore(key, self.repo)
        if commit is None:
            commit = self._commit_all()
            _BASE_REPOS.keep(key, self.repo, commit)
        self._pristine = True
        return commit

    def _init_from_dir(self, src: str, base_commit: str | None) -> str:
        if not os.path.isdir(src):
            raise ValueError(f"repo_dir {src!r} is not a directory")
        is_git = subprocess.run(
            ["git", "-c", "safe.directory=*", "-C", src, "rev-parse", "--git-dir"],
            capture_output=True,
        ).returncode == 0
        if not is_git:
            if base_commit is not None:
                raise ValueError(f"base_commit given but repo_dir {src!r} is not a git repo")
            shutil.copytree(src, self.repo, symlinks=True)
            return self._commit_all()
        try:
            sha = self._git_host(["-c", "safe.directory=*", "-C", os.path.abspath(src),
                                  "rev-parse", "--verify", f"{base_commit or 'HEAD'}^{{commit}}"],
                                 cwd=self.root).strip()
        except base.SandboxError as e:
            raise ValueError(f"cannot check out {base_commit!r} of {src!r}: {e}") from None
        # Only the base commit's history is fetched: no later commit (the fix), branch,
        # tag or reflog of `src` is there for a command to read.
        os.makedirs(self.repo)
        self._git_host(["init", "-q", "--template="],
                       ["-c", "safe.directory=*", "-c", "uploadpack.allowAnySHA1InWant=true",
                        "fetch", "-q", "--no-tags", os.path.abspath(src), sha],
                       ["-c", "core.logAllRefUpdates=false", "checkout", "-q", "--detach", sha])
        os.remove(os.path.join(self.repo, ".git", "FETCH_HEAD"))
        return sha

    def _commit_all(self) -> str:
        """Commits the tree as the base of a new repository; returns the commit's id.
        No template: git's sample hooks (inactive) cost a third of the setup's time."""
        commit = self._git_host(
            ["init", "-q", "--template="], ["add", "-A"],
            [*GIT_IDENTITY, "commit", "-q", "--allow-empty", "--no-verify", "--no-gpg-sign",
             "-m", "base"],
            ["rev-parse", "HEAD"]).strip()
        self._pristine = True
        return commit

    def _git_host(self, *commands: list[str], cwd: str | None = None) -> str:
        """git commands (argv after `git`) as the calling user, for setup before any
        command ran in the sandbox; their stdout. One bash runs them all, stopping at the
        first failure: one process started from this (large) one, not one per command."""
        script = " && ".join(shlex.join(["git", *args]) for args in commands)
        res = subprocess.run(["bash", "-c", script], cwd=cwd or self.repo, env=self._env,
                             capture_output=True, text=True, errors="replace")
        if res.returncode != 0:
            raise base.SandboxError(f"{script} failed: {res.stderr.strip()}")
        return res.stdout

    def _check_traversable(self) -> None:
        path = os.path.dirname(self.root)
        while True:
            if not os.stat(path).st_mode & 0o001:
                raise ValueError(f"{path} is not searchable by other users; sandboxes running "
                                 "as a dedicated uid need root_dir under e.g. /tmp")
            if path == os.path.dirname(path):
                return
            path = os.path.dirname(path)

    # -- execution --------------------------------------------------------------------

    def _exec(self, argv: list[str], timeout: float, stdin: bytes | None = None,
              merge: bool = True, cap: int | None = None, script: str | None = None,
              ) -> Completed:
        with self._lock:
            if self._closed:
                raise base.SandboxError("sandbox is closed")
            self._running.add(self._supervisor.proc)
        try:
            done = self._supervisor.run(argv, timeout, stdin, merge, cap, script)
        except base.SandboxError:
            if self._uid is not None:  # a dead supervisor's processes may still be dying
                kill_uid_processes(self._uid)
            if self._closed:
                raise base.SandboxError("sandbox was closed while the command ran") from None
            raise
        finally:
            with self._lock:
                self._running.discard(self._supervisor.proc)
        if self._closed:
            raise base.SandboxError("sandbox was closed while the command ran")
        return done

    def run(self, cmd: str, timeout: float = 60.0) -> base.ExecResult:
        """Runs `bash -c cmd` in the repository root; see the module docstring for limits."""
        cmd = f"{self.env_setup}\n{cmd}" if self.env_setup else cmd
        self._pristine = False
        done = self._exec([], timeout, cap=self.max_output_bytes, script=cmd)
        return base.ExecResult(exit_code=done.exit_code, output=done.stdout.text(),
                               timed_out=done.timed_out, truncated=done.stdout.truncated)

    def _checked(self, argv: list[str], what: str, stdin: bytes | None = None,
                 timeout: float = 120.0) -> bytes:
        done = self._exec(argv, timeout, stdin=stdin, merge=False)
        if done.timed_out:
            raise base.SandboxError(f"{what} timed out after {timeout}s")
        if done.exit_code != 0:
            raise _FailedCommand(done.exit_code,
                                 bytes(done.stderr).decode(errors="replace").strip())
        return bytes(done.stdout)

    def read_file(self, path: str, errors: str = "replace") -> str:
        """The file's text: opened from here where that sees what `cat` in the sandbox
        sees (env.sandbox.fsread), else read by `cat`."""
        path = repo_relative(path)
        try:
            with self._lock:  # close() closes the descriptor under the lock
                if self._closed:  # the checks a command makes first, in its order
                    raise base.SandboxError("sandbox is closed")
                if self._supervisor.broken:
                    raise base.SandboxError(self._supervisor.broken)
                data = fsread.read_beneath(self._repo_fd, path, self._uid)
            if data is None:
                data = self._checked(["cat", "--", path], f"reading {path}")
        except FileNotFoundError:
            raise _file_error("No such file", path) from None
        except IsADirectoryError:
            raise _file_error("Is a directory", path) from None
        except _FailedCommand as e:
            raise _file_error(str(e), path) from None
        return data.decode("utf-8", errors=errors)

    def real_root(self) -> str:
        return self._real_root

    def write_file(self, path: str, content: str) -> None:
        """Writes from here where fsread.write_beneath can (the file's directory exists,
        within the repository), else by `cat` as the sandbox's uid."""
        path = repo_relative(path)
        self._pristine = False
        data = content.encode("utf-8")
        limit = self.limits.file_size_bytes
        with self._lock:
            if self._closed:
                raise base.SandboxError("sandbox is closed")
            if self._supervisor.broken:
                raise base.SandboxError(self._supervisor.broken)
            if (limit is None or len(data) <= limit) and fsread.write_beneath(
                    self._repo_fd, path, data, self._uid):
                return
        script = shell.RESOLVE_IN_REPO + 'mkdir -p -- "$(dirname -- "$t")" && cat > "$t"'
        try:
            self._checked(["bash", "-c", script, "write", path], f"writing {path}", stdin=data)
        except _FailedCommand as e:
            if e.code == 3:
                raise shell.outside_repo_error(path, e.stderr) from None
            raise _file_error(e.stderr, path) from None

    def patch(self) -> str:
        """`git diff --binary` of the tree (untracked files included) against the base.

        Decoded with errors="surrogateescape", so `apply_patch` restores non-UTF-8 bytes.
        PatchTooLarge past `max_patch_bytes`. Empty, without running git, while the tree
        is the base commit it was created as.
        """
        if self._pristine:
            return ""
        try:
            data = self._checked(["bash", "-c", shell.capped_patch(), "patch", self.base_commit,
                                  str(self.max_patch_bytes), self._excludes], "git diff")
        except _FailedCommand as e:
            raise base.SandboxError(f"git diff failed: {e}") from None
        if len(data) > self.max_patch_bytes:
            raise base.PatchTooLarge(f"the repository's changes make a patch over the cap of "
                                     f"{self.max_patch_bytes} bytes")
        return data.decode("utf-8", errors="surrogateescape")

    def apply_patch(self, patch: str) -> None:
        if not patch.strip():
            return
        self._pristine = False
        try:
            self._checked(["git", "apply", "--whitespace=nowarn", "-"], "git apply",
                          stdin=patch.encode("utf-8", errors="surrogateescape"))
        except _FailedCommand as e:
            raise ValueError(f"patch does not apply: {e}") from None

    # -- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._repo_fd is not None:  # before the unmount: it would hold the tmpfs
                os.close(self._repo_fd)
                self._repo_fd = None
        # An isolated supervisor that exited by itself ended its PID namespace, and every
        # process of the uid with it: no scan of /proc for them is needed then.
        ended = self._supervisor is None or (self._supervisor.stop() and self.isolated)
        if self._uid is not None and not ended:
            kill_uid_processes(self._uid)
        if self._memory is not None and not self._memory.remove():
            log.warning("memory cgroup %s still has processes; left in place", self._memory.path)
        _remove(self.root)

    def oom_kills(self) -> int:
        """Commands' processes the kernel killed for the sandbox's total memory bound."""
        return self._memory.oom_kills() if self._memory is not None else 0


@functools.cache
def _warn_no_memory_cgroup(isolated: bool) -> None:
    """Logged once per process (per reason): local sandboxes have no total memory bound."""
    why = ("no memory cgroup can be made here (it needs root and a writable cgroupfs: v1, "
           "or a v2 parent that delegates memory)" if isolated else "they run unisolated")
    log.warning("local sandboxes have no total memory bound (LocalLimits.total_memory_bytes): "
                "%s; each process is bounded by its address space only. Use the docker "
                "backend where that matters (counted as env/no_memory_cgroup).", why)


def _mount_quota(path: str, size: int) -> None:
    """A tmpfs of `size` bytes on `path`: everything the sandbox writes counts against it
    (writes past it fail with ENOSPC, an error the command sees)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                  f"size={size},mode=0700".encode()) != 0:
        err = ctypes.get_errno()
        raise base.SandboxError(f"cannot mount the sandbox's {size}-byte tmpfs on {path}: "
                                f"{os.strerror(err)}")


def _remove(path: str) -> None:
    """Removes a sandbox directory. Its tmpfs is unmounted (lazily: a process still
    holding a file in it does not keep the directory), which frees what it holds at
    once; what is left (no tmpfs) is removed file by file."""
    if os.path.ismount(path):
        ctypes.CDLL(None, use_errno=True).umount2(path.encode(), MNT_DETACH)
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(path)


class _BaseRepos:
    """The `.git` directories of repositories made from files, in memory (least recently
    used first out): a sandbox made again from the same files, on the same kind of
    directory, writes these bytes instead of running git init, add and commit (half of
    a sandbox's start). Its base commit is then the first one's, to the byte."""

    def __init__(self, size: int):
        self.size = size
        self._kept: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(files: Mapping[str, str], parent: str, own_mount: bool) -> bytes:
        digest = hashlib.sha256(f"{parent}\0{own_mount}".encode())
        for path, content in files.items():
            for part in (path, content):
                data = part.encode("utf-8", "surrogatepass")
                digest.update(len(data).to_bytes(8, "little") + data)
        return digest.digest()

    def keep(self, key: bytes, repo: str, commit: str) -> None:
        git = os.path.join(repo, ".git")
        dirs, files = [], []
        for dirpath, dirnames, filenames in os.walk(git):
            rel = os.path.relpath(dirpath, git)
            dirs += [os.path.normpath(os.path.join(rel, d)) for d in sorted(dirnames)]
            for name in filenames:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    files.append((os.path.normpath(os.path.join(rel, name)), f.read(),
                                  os.stat(path).st_mode & 0o7777))
        with self._lock:
            self._kept[key] = (commit, dirs, files)
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)

    def restore(self, key: bytes, repo: str) -> str | None:
        """Writes the kept `.git` into `repo`; its commit, or None when none is kept."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
        if kept is None:
            return None
        commit, dirs, files = kept
        git = os.path.join(repo, ".git")
        os.mkdir(git)
        for rel in dirs:
            os.mkdir(os.path.join(git, rel))
        for rel, data, mode in files:
            fd = os.open(os.path.join(git, rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with open(fd, "wb") as f:
                f.write(data)
        return commit


_BASE_REPOS = _BaseRepos(size=1024)


class IsolationUnavailable(RuntimeError):
    """Commands could not be isolated here, and running them unisolated was not allowed."""


def _extra_paths(paths: Sequence[str]) -> tuple[str, ...]:
    """`read_only` paths, checked: absolute, normalised, and not / (all of the host)."""
    if isinstance(paths, str):
        raise ValueError(f"read_only must be a list of paths, got the string {paths!r}")
    out = []
    for path in paths:
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ValueError(f"read_only paths must be absolute, got {path!r}")
        if os.path.normpath(path) == "/":
            raise ValueError("read_only cannot be / (that is the whole host)")
        out.append(os.path.normpath(path))
    return tuple(out)


@functools.cache
def isolation_available() -> bool:
    """Whether commands can run isolated: as root, in new namespaces (probed once by
    running `true` under a supervisor, as every command runs)."""
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as root:
        try:
            probe = Supervisor(root, {"PATH": SAFE_PATH}, Confinement(isolate=root))
        except base.SandboxError:
            return False
        try:
            return probe.run(["true"], 30).exit_code == 0
        except base.SandboxError:
            return False
        finally:
            probe.stop()


class _FailedCommand(Exception):
    def __init__(self, code: int, stderr: str):
        super().__init__(stderr)
        self.code, self.stderr = code, stderr


def _file_error(message: str, path: str) -> OSError:
    if "No such file" in message:
        return FileNotFoundError(f"{path}: no such file in the repository")
    if "Is a directory" in message:
        return IsADirectoryError(f"{path} is a directory")
    return OSError(f"{path}: {message}")


def _chown_tree(root: str, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, uid)
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def uid_processes(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is `uid`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if fields["State"].split()[0] != "Z" and int(fields["Uid"].split()[0]) == uid:
            found.append(int(name))
    return found


def _process_identity(pid: int) -> str | None:
    """"pid:start-time" (clock ticks since boot) of a running process, None if none runs:
    unlike the pid alone, never the same for a later process that reuses the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return f"{pid}:{fields[19]}" if fields[0] != "Z" else None


def reap_stale(root_dir: str | None = None) -> list[str]:
    """Removes the sandbox directories under `root_dir` (default: the temp dir) whose
    owning process has exited, killing what still runs as their uid; returns them.
    Directories without an owner record (being created, or of another program) stay."""
    root_dir = root_dir or tempfile.gettempdir()
    reaped = []
    for name in sorted(os.listdir(root_dir)):
        path = os.path.join(root_dir, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                record = json.load(f)
            pid = int(str(record["owner"]).split(":")[0])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _process_identity(pid) == record["owner"]:
            continue  # its owner is alive
        uid = os.stat(path).st_uid  # a dedicated uid owns the directory (root only)
        if os.geteuid() == 0 and UID_RANGE[0] <= uid < UID_RANGE[1]:
            kill_uid_processes(uid)
        _remove(path)
        reaped.append(path)
    cgroup.remove_stale({os.path.basename(p) for p in reaped})
    return reaped


def kill_uid_processes(uid: int, rounds: int = 200) -> None:
    """SIGKILLs every process of `uid` until none is left (only for a sandbox's own uid)."""
    for _ in range(rounds):
        pids = uid_processes(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
