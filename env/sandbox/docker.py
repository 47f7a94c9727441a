"""A sandbox in a Docker container, one container per episode.

The container runs `sleep infinity` as PID 1 with SIGCHLD ignored, so the kernel
reaps every orphan at once (a plain `sleep` never reaps, and zombies would hold the
pids limit) and PID 1 survives `kill -9 -1`. It has no network, and memory (no swap),
CPU and pids limits. Each command runs as
`timeout -s KILL N bash -c CMD` inside a wrapper that afterwards kills every other
process in the container (`kill -9 -1`), so a call never leaves background processes
behind (a fork bomb included) and the exec stream ends as soon as the command does.
A host-side deadline of N + `HOST_GRACE_S` guards against a stuck engine. Commands
over `ARGV_COMMAND_BYTES` go in as a file (execve caps an argument at 128 KiB); a
command may write files up to `file_size_bytes` (ulimit -f), the writable layer is
capped at `disk_bytes` where the storage driver allows, and `patch()` reads at most
`max_patch_bytes` + 1 bytes.

The repository keeps only its base commit's history: at start, an image's repository
with other branches, tags, remotes, a stash or reflogs loses them and the objects they
held (shell.only_base_history), so no command can read a later commit.

Every Docker failure (engine unreachable, container gone, API error) raises
`SandboxError`; a missing file raises FileNotFoundError and a patch that does not
apply raises ValueError, as for every backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import posixpath
import select
import socket
import struct
import tarfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping

import docker
import docker.errors
import requests.exceptions

from env.paths import repo_relative
from env.sandbox import base, shell
from env.sandbox.local import EXEC_ENV, _process_identity
from env.sandbox.output import CappedOutput

log = logging.getLogger(__name__)

LABEL = "swe-rl.sandbox"
# "<hostname>:<pid>:<process start time>" of the trainer that made the container: the
# next run on that host removes the containers of exited owners (a SIGKILLed trainer).
OWNER_LABEL = "swe-rl.owner"
HOST_GRACE_S = 30.0
PID1 = ["bash", "-c", "trap '' CHLD; exec sleep infinity"]
# $1 = timeout seconds, $2 = command. The command's stderr joins its stdout in one pipe,
# so their order is kept; the wrapper's own stderr (bash's "Killed" job notices, kill's
# complaints) goes to /dev/null.
# $3 = the largest file a command may write, in KiB (bash's unit for ulimit -f).
RUN_WRAPPER = (
    'exec 2>/dev/null; ulimit -f "$3"; timeout -s KILL "$1" bash -c "$2" 2>&1; rc=$?; '
    "kill -9 -1; kill -9 -1; exit $rc"
)
# A command longer than this goes into the container as a file (execve caps one
# argument at 128 KiB), which bash reads back and evaluates.
ARGV_COMMAND_BYTES = 64 << 10
COMMAND_FILE = "/tmp/.sandbox.command"
FROM_FILE = f'eval "$(cat {COMMAND_FILE}; rm -f {COMMAND_FILE})"'
# Clients of engines whose storage driver takes no per-container size (overlay2 off
# xfs with pquota).
_NO_SIZE_OPTION: weakref.WeakSet[docker.DockerClient] = weakref.WeakSet()
_NO_SIZE_LOCK = threading.Lock()
GIT = "git -c safe.directory=* -c user.name=sandbox -c user.email=sandbox@localhost"
PATCH_FILE = "/tmp/.sandbox.patch"
# $1 = workdir, $2 = base commit ("": HEAD), $3 = exclude lines, $4 = "1": create the workdir.
# Exit 90: no workdir; 91: base commit given but no repository; 93: no such base commit;
# 95: the history after the base could not be removed. An image's repository keeps only
# its base commit's history (shell.only_base_history): no later commit reaches a command.
INIT_GIT = f"""
[ -z "$4" ] || mkdir -p -- "$1" || exit 92
cd -- "$1" || exit 90
new=""
if ! {GIT} rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  [ -z "$2" ] || exit 91
  {GIT} init -q && {GIT} add -A && {GIT} commit -q --allow-empty --no-verify --no-gpg-sign \\
    -m base || exit 92
  new=1
fi
sha=$({GIT} rev-parse --verify "${{2:-HEAD}}^{{commit}}") || exit 93
[ "$({GIT} rev-parse HEAD)" = "$sha" ] || {GIT} checkout -q -f --detach "$sha" || exit 94
[ -n "$new" ] || ( {shell.only_base_history(GIT)} ) >&2 || exit 95
gd=$({GIT} rev-parse --git-dir) && mkdir -p "$gd/info" && printf %s "$3" >> "$gd/info/exclude" \\
  || exit 94
echo "$sha" && cat "$gd/info/exclude"
"""


def docker_host() -> str:
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


@contextlib.contextmanager
def docker_errors(what: str, engine: str | None = None) -> Iterator[None]:
    """Turns every Docker SDK / transport failure inside the block into SandboxError
    (naming `engine`, default $DOCKER_HOST's, when it did not answer)."""
    try:
        yield
    except docker.errors.ImageNotFound as e:
        raise base.SandboxError(f"{what}: image not found ({e.explanation})") from e
    except docker.errors.NotFound as e:
        raise base.SandboxError(f"{what}: the container no longer exists ({e.explanation})") from e
    except docker.errors.APIError as e:
        raise base.SandboxError(f"{what}: docker engine error: {e.explanation or e}") from e
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
        raise base.SandboxError(f"{what}: docker engine at {engine or docker_host()} failed: "
                                f"{e}") from e


def connect(timeout: float = 60.0) -> docker.DockerClient:
    """A client for the engine at $DOCKER_HOST (SandboxError naming it when unreachable)."""
    with docker_errors("connecting to the docker engine"):
        client = docker.from_env(timeout=timeout)
        client.ping()
    return client


def remove_containers(labels: Mapping[str, str], client: docker.DockerClient | None = None) -> int:
    """Force-removes every container carrying all of `labels`; returns how many."""
    client = client or connect()
    filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
    removed = 0
    with docker_errors("listing labelled containers"):
        containers = client.containers.list(all=True, filters=filters)
    for container in containers:
        _remove_container(client, container.id)
        removed += 1
    return removed


def owner_identity(pid: int | None = None) -> str:
    """"<hostname>:<pid>:<start time>" of a running process (default: this one)."""
    return f"{socket.gethostname()}:{_process_identity(pid or os.getpid())}"


def exited_owners(owners: Iterable[str]) -> set[str]:
    """The owners (OWNER_LABEL values) that ran on this host and have exited; owners on
    other hosts are never judged here."""
    host, exited = socket.gethostname(), set()
    for owner in owners:
        owner_host, _, identity = owner.partition(":")
        pid = identity.split(":")[0]
        if owner_host == host and identity and (
                not pid.isdigit() or _process_identity(int(pid)) != identity):
            exited.add(owner)
    return exited


def container_owners(client: docker.DockerClient) -> set[str]:
    """The OWNER_LABEL values of the engine's containers."""
    with docker_errors("listing sandbox containers"):
        containers = client.api.containers(all=True, filters={"label": OWNER_LABEL})
    return {c["Labels"][OWNER_LABEL] for c in containers}


def remove_owned(client: docker.DockerClient, owners: Iterable[str]) -> int:
    """Removes every container of `owners`; returns how many."""
    return sum(remove_containers({OWNER_LABEL: owner}, client) for owner in owners)


def reap_exited_owners(client: docker.DockerClient) -> int:
    """Removes the containers whose owner ran on this host and has exited; returns how
    many. Containers of other hosts' processes are left alone."""
    return remove_owned(client, exited_owners(container_owners(client)))


def _remove_container(client: docker.DockerClient, container_id: str,
                      wait_s: float = 30.0, engine: str | None = None) -> None:
    """Force-removes a container; also waits out a removal another thread started."""
    deadline = time.monotonic() + wait_s
    with docker_errors(f"removing container {container_id[:12]}", engine):
        try:
            client.api.remove_container(container_id, force=True, v=True)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as e:
            if e.status_code != 409 or "in progress" not in str(e.explanation):
                raise
        while time.monotonic() < deadline:
            try:
                client.api.inspect_container(container_id)
            except docker.errors.NotFound:
                return
            time.sleep(0.05)
    raise base.SandboxError(f"container {container_id[:12]} was still there after {wait_s}s")


@dataclasses.dataclass(frozen=True)
class DockerOptions:
    """How Docker sandboxes are made (a factory's defaults; the task gives the Source).

    mem_limit: memory limit in bytes or a docker size string ("2g"); swap is disabled.
    nano_cpus: CPU quota in 1e-9 CPUs.
    pids_limit: maximum number of processes in the container.
    max_output_bytes: cap on the output kept per `run` (head and tail halves).
    max_patch_bytes: cap on `patch()` (PatchTooLarge beyond it).
    file_size_bytes: the largest file a command may write ("File size limit exceeded").
    disk_bytes: cap on the container's writable layer, where the storage driver allows.
    labels: extra container labels (LABEL=1 is always set).
    client: docker client (default: `connect()`).
    engine: the engine's name in logs (default: the client's base URL).
    """

    mem_limit: int | str = "2g"
    nano_cpus: int = 2_000_000_000
    pids_limit: int = 256
    max_output_bytes: int = 1 << 20
    max_patch_bytes: int = base.MAX_PATCH_BYTES
    file_size_bytes: int = 256 << 20
    disk_bytes: int | None = 4 << 30
    labels: Mapping[str, str] | None = None
    client: docker.DockerClient | None = None
    engine: str = ""


class DockerSandbox(base.Sandbox):
    """One container of `source.image` holding the task repository at `source.workdir`.

    source: the image, and in it the repository: the image's own at `workdir` (from
    `base_commit`, default HEAD; a directory that is no git repository is committed as it
    is), or `repo_files` written to a fresh `workdir`; and its `env_setup`, the image's
    environment activation (official images activate theirs only in an interactive
    `.bashrc`) (base.Source). options: the container's limits and engine.
    """

    SOURCE_KEYS = ("image", "workdir", "base_commit", "repo_files", "env_setup")
    Options = DockerOptions

    def __init__(self, source: base.Source, options: DockerOptions = DockerOptions()):
        workdir, image = source.workdir, source.image
        if not image:
            raise ValueError("a docker sandbox needs an image")
        if source.repo_dir is not None:
            raise ValueError("the docker backend takes an image or repo_files, not repo_dir")
        if not posixpath.isabs(workdir):
            raise ValueError(f"workdir must be an absolute path, got {workdir!r}")
        if source.repo_files is not None and source.base_commit is not None:
            raise ValueError("base_commit cannot be combined with repo_files (new history)")
        self.workdir = workdir
        self.max_output_bytes = options.max_output_bytes
        self.max_patch_bytes = options.max_patch_bytes
        self.file_size_bytes = options.file_size_bytes
        self.env_setup = source.env_setup
        self.container_id: str | None = None
        self._client = options.client or connect()
        self.engine = options.engine or self._client.api.base_url  # (for logs and metrics)
        limits = dict(detach=True, network_mode="none", mem_limit=options.mem_limit,
                      memswap_limit=options.mem_limit, nano_cpus=options.nano_cpus,
                      pids_limit=options.pids_limit,
                      labels={LABEL: "1", **(options.labels or {})})
        container = self._create(image, limits, options.disk_bytes)
        self.container_id = container.id
        try:
            with docker_errors("starting the container", self.engine):
                container.start()
            if source.repo_files is not None:  # tar extraction creates the missing directories
                root = workdir.strip("/")
                self._put_files("/", {posixpath.join(root, repo_relative(p)): c.encode()
                                      for p, c in source.repo_files.items()})
            self.base_commit = self._init_git(source.base_commit,
                                              mkdir=source.repo_files is not None)
        except BaseException:
            self.close()
            raise

    # -- setup ------------------------------------------------------------------------

    def _create(self, image: str, options: dict, disk_bytes: int | None):
        """The container, its writable layer capped at `disk_bytes` where the engine's
        storage driver can (overlay2 on xfs with pquota, btrfs, zfs); elsewhere only the
        per-file cap holds, which is logged once per engine."""
        if disk_bytes and self._client not in _NO_SIZE_OPTION:
            try:
                with docker_errors(f"creating a container from {image}", self.engine):
                    return self._client.containers.create(
                        image, PID1, storage_opt={"size": str(disk_bytes)}, **options)
            except base.SandboxError as e:
                if "storage-opt" not in str(e) and "storage_opt" not in str(e):
                    raise
                with _NO_SIZE_LOCK:  # logged once per engine
                    known = self._client in _NO_SIZE_OPTION
                    _NO_SIZE_OPTION.add(self._client)
                if not known:
                    log.warning("docker engine %s cannot cap a container's disk use (%s); only "
                                "the per-file size limit bounds it", self.engine, e)
        with docker_errors(f"creating a container from {image}", self.engine):
            return self._client.containers.create(image, PID1, **options)

    def _init_git(self, base_commit: str | None, mkdir: bool) -> str:
        """Commits a workdir that is no git repository as the base, checks out the base
        commit and ignores caches (keeping the info/exclude made, for `patch`); one exec,
        since each costs the engine a process start."""
        code, out, err = self._exec(["bash", "-c", INIT_GIT, "init", self.workdir,
                                     base_commit or "", shell.GIT_EXCLUDES, "1" if mkdir else ""],
                                    120, cwd="/")
        if code == 90:
            raise ValueError(f"{self.workdir} does not exist in the container")
        if code == 91:
            raise ValueError(f"base_commit given but {self.workdir} is not a git repository")
        if code == 93:
            raise ValueError(f"base commit {base_commit!r} not found in {self.workdir}: "
                             f"{_text(err)}")
        if code != 0:
            raise base.SandboxError(f"setting up the repository failed (exit {code}): "
                                    f"{_text(err)}")
        sha, _, self._excludes = _text(out).partition("\n")
        return sha

    # -- execution --------------------------------------------------------------------

    def _exec(self, argv: list[str], timeout: float, cap: int | None = None,
              cwd: str | None = None, confirm: bool = True,
              ) -> tuple[int, CappedOutput | bytearray, bytearray]:
        """Runs argv in the container; returns (exit code, stdout, stderr).

        With a `cap`, stdout is a CappedOutput that stderr is interleaved into (the model
        sees one stream) and the returned stderr is empty. A container killed or removed
        from outside can still be listed as running when its exec ends with an ordinary
        looking code: 137 (killed with it) or 126 (could not start in it). With `confirm`,
        such a code (a signal exit, 126, 127) is only returned once a probe exec shows the
        container alive; otherwise SandboxError: a killed container is no task outcome.
        """
        if self.container_id is None:
            raise base.SandboxError("sandbox is closed")
        api = self._client.api
        out = CappedOutput(cap) if cap is not None else bytearray()
        err = bytearray()
        with docker_errors("running a command in the container", self.engine):
            exec_id = api.exec_create(self.container_id, argv, workdir=cwd or self.workdir,
                                      environment=EXEC_ENV)["Id"]
            sock = api.exec_start(exec_id, socket=True)
            try:
                deadline = time.monotonic() + timeout + HOST_GRACE_S
                if not _read_frames(sock, out, out if cap is not None else err, deadline,
                                    _read_ahead(sock)):
                    raise base.SandboxError(f"the container did not finish a {timeout:.0f}s "
                                            f"command within {HOST_GRACE_S:.0f}s of grace")
            finally:
                sock.close()
            info = api.exec_inspect(exec_id)
            for _ in range(100):  # the stream may end a moment before the exit is recorded
                if not info["Running"]:
                    break
                time.sleep(0.01)
                info = api.exec_inspect(exec_id)
        if info["Running"] or info["ExitCode"] is None:
            raise base.SandboxError(f"no exit code for {argv[0]!r} in the container")
        code = info["ExitCode"]
        if confirm and (code < 0 or code >= 126) and not self._alive():
            raise base.SandboxError(f"the container stopped while {argv[0]!r} ran "
                                    f"(exit {code})")
        return code, out, err

    def _alive(self) -> bool:
        """Whether a new exec runs in the container; none starts once its PID 1 is gone,
        even while the engine still lists it as running."""
        try:
            return self._exec(["true"], 10, cwd="/", confirm=False)[0] == 0
        except base.SandboxError:
            return False

    def _sh(self, script: str, what: str, cwd: str | None = None,
            args: list[str] = ()) -> bytes:
        code, out, err = self._exec(["bash", "-c", script, "sh", *args], 120, cwd=cwd)
        if code != 0:
            raise base.SandboxError(f"{what} failed (exit {code}): {_text(err)}")
        return bytes(out)

    def _put_files(self, directory: str, files: Mapping[str, bytes], mode: int = 0o644) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path, data in files.items():
                info = tarfile.TarInfo(path)
                info.size, info.mode, info.mtime = len(data), mode, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        with docker_errors("copying files into the container", self.engine):
            ok = self._client.api.put_archive(self.container_id, directory, buf.getvalue())
        if not ok:
            raise base.SandboxError(f"copying files into {directory} failed")

    def run(self, cmd: str, timeout: float = 60.0) -> base.ExecResult:
        """Runs `bash -c cmd` in `workdir`; see the module docstring for limits and cleanup."""
        start = time.monotonic()
        cmd = f"{self.env_setup}\n{cmd}" if self.env_setup else cmd
        data = cmd.encode("utf-8", "surrogateescape")
        if len(data) > ARGV_COMMAND_BYTES:
            directory, name = posixpath.split(COMMAND_FILE)
            self._put_files(directory, {name: data})
            cmd = FROM_FILE
        code, out, _ = self._exec(["bash", "-c", RUN_WRAPPER, "sandbox", f"{timeout:g}", cmd,
                                   str(self.file_size_bytes >> 10)],
                                  timeout, cap=self.max_output_bytes)
        # `timeout -s KILL` exits 137 (bash: 128 + SIGKILL); an OOM kill exits 137 too,
        # but long before the deadline.
        timed_out = code in (124, 137) and time.monotonic() - start >= timeout
        return base.ExecResult(exit_code=-1 if timed_out else code, output=out.text(),
                               timed_out=timed_out, truncated=out.truncated)

    def read_file(self, path: str, errors: str = "replace") -> str:
        path = repo_relative(path)
        code, out, err = self._exec(["cat", "--", path], 120)
        if code != 0:
            if b"No such file" in err:
                raise FileNotFoundError(f"{path}: no such file in the repository")
            if b"Is a directory" in err:
                raise IsADirectoryError(f"{path} is a directory")
            raise OSError(f"{path}: {_text(err)}")
        return out.decode("utf-8", errors=errors)

    def write_file(self, path: str, content: str) -> None:
        path = repo_relative(path)
        # The target with links resolved, and the mode of a file being overwritten (an
        # executable script stays executable).
        code, out, err = self._exec(["bash", "-c", shell.RESOLVE_IN_REPO + 'mkdir -p -- '
                                     '"$(dirname -- "$t")" && printf "%s\\n" "$t" && '
                                     '{ stat -c %a -- "$t" 2>/dev/null || echo 644; }',
                                     "w", path], 60)
        if code == 3:
            raise shell.outside_repo_error(path, _text(err))
        if code != 0:
            raise OSError(f"{path}: {_text(err)}")
        target, mode = _text(out).rsplit("\n", 1)
        parent, name = posixpath.split(target)
        self._put_files(parent, {name: content.encode("utf-8")}, mode=int(mode, 8))

    def patch(self) -> str:
        """`git diff --binary` of the tree (untracked files included) against the base.

        Decoded with errors="surrogateescape", so `apply_patch` restores non-UTF-8 bytes.
        PatchTooLarge past `max_patch_bytes`.
        """
        diff = self._sh(shell.capped_patch(GIT), "git diff",
                        args=[self.base_commit, str(self.max_patch_bytes), self._excludes])
        if len(diff) > self.max_patch_bytes:
            raise base.PatchTooLarge(f"the repository's changes make a patch over the cap of "
                                     f"{self.max_patch_bytes} bytes")
        return diff.decode("utf-8", errors="surrogateescape")

    def apply_patch(self, patch: str) -> None:
        if not patch.strip():
            return
        self._put_files(posixpath.dirname(PATCH_FILE),
                        {posixpath.basename(PATCH_FILE): patch.encode("utf-8", "surrogateescape")})
        code, _, err = self._exec(["bash", "-c", f"{GIT} apply --whitespace=nowarn {PATCH_FILE}; "
                                   f"rc=$?; rm -f {PATCH_FILE}; exit $rc"], 120)
        if code != 0:
            raise ValueError(f"patch does not apply: {_text(err)}")

    # -- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        """Force-removes the container; retried by a later close() if the engine failed."""
        if self.container_id is not None:
            _remove_container(self._client, self.container_id, engine=self.engine)
            self.container_id = None


def _text(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace").strip()


def _read_ahead(sock) -> bytes:
    """Stream bytes the HTTP client already buffered while reading the response headers.

    docker-py hands out the raw socket under a buffered reader; a fast command's output
    can arrive with the headers and sit in that buffer, lost to reads of the socket
    (docker-py issue 3332: empty exec output under load). Takes them out of the buffer
    without blocking.
    """
    fp = getattr(getattr(getattr(getattr(sock, "_response", None), "raw", None), "_fp", None),
                 "fp", None)
    raw = getattr(sock, "_sock", None)
    if fp is None or raw is None or not hasattr(fp, "peek"):
        return b""
    raw.setblocking(False)
    try:
        data = fp.peek()  # the buffer, or one non-blocking read when it is empty
    except OSError:
        data = b""
    finally:
        raw.setblocking(True)
    return fp.read(len(data)) if data else b""


def _read_frames(sock, out, err, deadline: float, initial: bytes = b"") -> bool:
    """Demultiplexes docker's attach stream (8-byte headers: stream id, length) until EOF,
    starting with `initial` bytes already taken from it.

    Returns False when `deadline` passes first.
    """
    raw = getattr(sock, "_sock", sock)
    buf = bytearray(initial)
    sinks = {1: out.add if isinstance(out, CappedOutput) else out.extend,
             2: err.add if isinstance(err, CappedOutput) else err.extend}
    while True:
        while len(buf) >= 8:
            stream, size = struct.unpack(">BxxxL", buf[:8])
            if len(buf) < 8 + size:
                break
            sinks.get(stream, sinks[1])(bytes(buf[8 : 8 + size]))
            del buf[: 8 + size]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        pending = getattr(raw, "pending", lambda: 0)()
        if not pending and not select.select([raw], [], [], min(remaining, 1.0))[0]:
            continue
        chunk = raw.recv(1 << 16)
        if not chunk:
            return True
        buf += chunk
