"""The host's end of a sandbox's supervisor (supervisor_main.py): one process per sandbox,
forked by supervisor_main.py's fork server, that runs each command sent to it.

`Supervisor.run` sends one command with its stdin, stdout and stderr (pipes this
process reads) and collects the output until the supervisor's status line and end of
file on every pipe. Commands of one supervisor run one at a time. Anything that makes
the status unknowable (the supervisor died, was killed, or missed its deadline by
GRACE_S) raises SandboxError and leaves the supervisor broken: every later command
raises the same error, since its processes can no longer be vouched for.

The fork server is started once per process, on the first sandbox, and again if it
dies (or after a fork of this process). A supervisor is its child, not ours: it is
watched and signalled through a pidfd, and reaped only once `stop` has seen it exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from env.sandbox import base
from env.sandbox.output import CappedOutput

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor_main.py")
# Extra wall time the supervisor gets beyond the command timeout before it counts as broken.
GRACE_S = 15.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0


# The toolchain an isolated command sees of the host (read-only), beside its sandbox.
TOOLCHAIN = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Names of /etc it sees (fnmatch patterns): the linker's, TLS roots, Debian's alternatives
# (`awk` is a link through them), Python's and the shells' settings; no accounts.
ETC = ("alternatives", "ssl", "ca-certificates*", "ld.so.*", "localtime", "timezone", "hosts",
       "host.conf", "nsswitch.conf", "protocols", "services", "mime.types", "python3*",
       "bash.bashrc", "inputrc", "profile", "gitconfig", "locale.alias", "debian_version",
       "os-release")


@dataclasses.dataclass(frozen=True)
class RootView:
    """What an isolated command's root holds besides its sandbox directory: the host
    paths `read_only` (the toolchain and any extra ones, e.g. an environment under
    /opt), the names of /etc matching `etc`, and accounts of its own (root, nobody and
    `sandbox`, the command's uid, with the sandbox's home)."""

    read_only: tuple[str, ...] = TOOLCHAIN
    etc: tuple[str, ...] = ETC

    def config(self, uid: int | None, home: str) -> dict:
        """The supervisor's `view` config (supervisor_main.py) for commands run as `uid`."""
        passwd, group = ["root:x:0:0:root:/root:/bin/bash"], ["root:x:0:"]
        if uid is not None:
            passwd.append(f"sandbox:x:{uid}:{uid}::{home}:/bin/bash")
            group.append(f"sandbox:x:{uid}:")
        passwd.append("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin")
        group.append("nogroup:x:65534:")
        return {"read_only": list(self.read_only), "etc": list(self.etc),
                "passwd": "\n".join(passwd) + "\n", "group": "\n".join(group) + "\n"}


@dataclasses.dataclass
class Completed:
    exit_code: int
    timed_out: bool
    stdout: CappedOutput | bytearray
    stderr: bytearray


@dataclasses.dataclass(frozen=True)
class Confinement:
    """What confines a supervisor's commands (supervisor_main.py).

    uid: the uid commands run as (None: the caller's). rlimits: per-command rlimits by
    name. isolate: the sandbox directory, to run in new namespaces (None: not), with a
    root that holds only it and `view`. cgroup: the `cgroup.procs` file of the memory
    cgroup the supervisor and its commands join (None: none).
    """

    uid: int | None = None
    rlimits: Mapping[str, int] = dataclasses.field(default_factory=dict)
    isolate: str | None = None
    view: RootView = RootView()
    cgroup: str | None = None

    def config(self, home: str) -> dict:
        """The supervisor's config, its commands' home directory being `home`."""
        return {"uid": self.uid, "gid": self.uid, "rlimits": dict(self.rlimits),
                "isolate": self.isolate, "view": self.view.config(self.uid, home),
                "cgroup": self.cgroup}


class Supervisor:
    """A started supervisor_main.py: `run` commands, then `stop`.

    cwd, env: the supervisor's (and so every command's) working directory and
    environment; confinement: how its commands are confined.
    """

    def __init__(self, cwd: str, env: dict[str, str], confinement: Confinement):
        config = confinement.config(env.get("HOME", "/"))
        ours, theirs = socket.socketpair()
        stderr_r, stderr_w = os.pipe()
        try:
            self.proc = _fork_server().spawn({"cwd": cwd, "env": env, "config": config},
                                             [theirs.fileno(), stderr_w], stderr_r)
        except BaseException:
            ours.close()
            os.close(stderr_r)
            raise
        finally:
            theirs.close()
            os.close(stderr_w)
        self._control = ours
        self._lock = threading.Lock()
        self.broken = ""
        try:
            if self._status_line(time.monotonic() + START_TIMEOUT_S) != b"ready":
                raise self._break("sent no ready line")
        except BaseException:
            self.stop()
            raise

    def run(self, argv: list[str], timeout: float, stdin: bytes | None = None,
            merge: bool = True, cap: int | None = None, script: str | None = None,
            ) -> Completed:
        """Runs argv (or `bash` on `script`); stderr into stdout when `merge`; stdout
        kept as CappedOutput(cap) when `cap` is given."""
        with self._lock:
            if self.broken:
                raise base.SandboxError(self.broken)
            out = CappedOutput(cap) if cap is not None else bytearray()
            err = bytearray()
            pipes = _Pipes(stdin is not None, merge)
            try:
                self._send({"argv": argv, "script": script, "timeout": timeout}, pipes.theirs())
                pipes.close_theirs()
                status = self._collect(pipes, stdin, out, err, time.monotonic() + timeout)
            finally:
                pipes.close()
        code, timed_out, _ = status.split()  # (processes left behind raised already)
        return Completed(int(code), timed_out == b"1", out, err)

    def stop(self) -> bool:
        """Ends the supervisor (it kills what runs, then exits); SIGKILL if it lingers.
        Safe from any thread, also while a command runs (that one raises SandboxError).
        True when it exited by itself with code 0, after its clean-up (isolated: after
        its PID namespace ended, so no process of the sandbox is left)."""
        self.broken = self.broken or "the sandbox's supervisor was stopped"
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_RDWR)
        killed = not self.proc.wait(STOP_TIMEOUT_S)
        if killed:
            self.proc.kill_group()
            self.proc.wait(None)
        if not self._lock.acquire(timeout=STOP_TIMEOUT_S):  # a command uses the socket
            return False
        try:
            self._control.close()
            return self.proc.release() == 0 and not killed
        finally:
            self._lock.release()

    # -- protocol ---------------------------------------------------------------------

    def _send(self, request: dict, fds: list[int]) -> None:
        try:
            _send_request(self._control, request, fds)
        except OSError as e:
            raise self._break(f"refused a command ({e})") from None

    def _collect(self, pipes: _Pipes, stdin: bytes | None, out, err: bytearray,
                 deadline: float) -> bytes:
        """Drains the command's output until its status line and end of file on every
        pipe; returns the status line."""
        sel = selectors.DefaultSelector()
        sinks = {pipes.out_r: out.add if isinstance(out, CappedOutput) else out.extend}
        if pipes.err_r is not None:
            sinks[pipes.err_r] = err.extend
        for fd in sinks:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self._control, selectors.EVENT_READ)
        if stdin is not None:
            threading.Thread(target=_feed, args=(pipes.take_stdin(), stdin), daemon=True).start()
        status = bytearray()
        try:
            while sinks or not status.endswith(b"\n"):
                remaining = deadline + GRACE_S - time.monotonic()
                if remaining <= 0:
                    raise self._break(f"did not finish a command within {GRACE_S:.0f}s of "
                                      "its timeout", kill=True)
                for key, _ in sel.select(min(remaining, 1.0)):
                    if key.fileobj is self._control:
                        self._read_status(status, sel)
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        sinks[key.fd](chunk)
                    else:
                        sel.unregister(key.fd)
                        del sinks[key.fd]
        finally:
            sel.close()
        return bytes(status)

    def _read_status(self, status: bytearray, sel: selectors.BaseSelector) -> None:
        chunk = self._receive()
        if not chunk:
            raise self._died()
        status += chunk
        if status.endswith(b"\n"):
            sel.unregister(self._control)
            if status.split()[2:] != [b"1"]:  # left processes: the output may never end
                raise self._break("could not kill the processes the command left behind")

    def _receive(self) -> bytes:
        """Up to 64 bytes from the supervisor; b"" once it is gone (a reset included:
        a killed process that had unread data resets its socket)."""
        try:
            return self._control.recv(64)
        except (ConnectionResetError, BrokenPipeError):
            return b""

    def _status_line(self, deadline: float) -> bytes:
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._break("did not start in time", kill=True)
            self._control.settimeout(remaining)
            try:
                chunk = self._receive()
            except TimeoutError:
                continue
            finally:
                self._control.settimeout(None)
            if not chunk:
                raise self._died()
            line += chunk
        return line.strip()

    # -- failures ---------------------------------------------------------------------

    def _died(self) -> base.SandboxError:
        if self.broken:  # stopped on purpose
            return base.SandboxError(self.broken)
        reason = self.proc.stderr(STOP_TIMEOUT_S).decode(errors="replace").strip()[-2000:]
        return self._break("exited" + (f": {reason}" if reason else ""), kill=True)

    def _break(self, what: str, kill: bool = False) -> base.SandboxError:
        self.broken = self.broken or f"the sandbox's supervisor {what}"
        if kill:
            self.proc.kill_group()
        return base.SandboxError(self.broken)


class _Pipes:
    """One command's stdin, stdout and stderr: the supervisor's ends (`theirs`) are
    closed once sent, ours once the command is done."""

    def __init__(self, with_stdin: bool, merge: bool):
        self.out_r, self._out_w = os.pipe()
        self.err_r, self._err_w = os.pipe() if not merge else (None, self._out_w)
        if with_stdin:
            self._in_r, self._in_w = os.pipe()
        else:
            self._in_r, self._in_w = os.open(os.devnull, os.O_RDONLY), None
        self._ours = [self.out_r, self.err_r, self._in_w]
        self._theirs = [self._in_r, self._out_w, self._err_w]

    def theirs(self) -> list[int]:
        return list(self._theirs)

    def take_stdin(self):
        """Our end of the stdin pipe, as a file the caller closes."""
        fd, self._ours[2] = self._in_w, None
        return os.fdopen(fd, "wb")

    def close_theirs(self) -> None:
        for fd in set(self._theirs):
            os.close(fd)
        self._theirs = []

    def close(self) -> None:
        for fd in set(self._theirs) | set(self._ours):
            if fd is not None:
                os.close(fd)
        self._theirs = self._ours = []


def _feed(pipe, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError, OSError), pipe:
        pipe.write(data)


class _Forked:
    """A supervisor the fork server forked: its pid, a pidfd to wait on and signal it by,
    and the read end of its stderr."""

    def __init__(self, server: _ForkServer, pid: int, pidfd: int, stderr_r: int):
        self.pid, self._server, self._pidfd, self._stderr = pid, server, pidfd, stderr_r

    def wait(self, timeout: float | None) -> bool:
        """Whether the supervisor exited within `timeout` seconds (None: however long)."""
        if self._pidfd is None:  # released: it exited
            return True
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        return bool(ready)

    def kill_group(self) -> None:
        """SIGKILLs the supervisor's process group (a session it leads: its pid is the
        group's id, and stays unused by others until `release`)."""
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)

    def stderr(self, timeout: float) -> bytes:
        """What the supervisor wrote to stderr, read until end of file or `timeout`."""
        data, deadline = bytearray(), time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if not select.select([self._stderr], [], [], remaining)[0]:
                break
            chunk = os.read(self._stderr, 1 << 16)
            if not chunk:
                break
            data += chunk
        return bytes(data)

    def release(self) -> int | None:
        """Once it exited: has the fork server reap it and closes our descriptors; its
        exit code (None if unknown: the server died, or it was released before)."""
        if self._pidfd is None:
            return None
        code = self._server.reap(self.pid)
        os.close(self._pidfd)
        os.close(self._stderr)
        self._pidfd = None
        return code


class _ForkServer:
    """A started `supervisor_main.py SERVER_FD`: `spawn` supervisors, `reap` them."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", SCRIPT, str(theirs.fileno())], cwd="/", env={},
                start_new_session=True, pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
        except OSError as e:
            ours.close()
            raise base.SandboxError(f"cannot start the sandboxes' fork server: {e}") from e
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self.owner = os.getpid()

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def spawn(self, request: dict, fds: list[int], stderr_r: int) -> _Forked:
        with self._lock:
            try:
                _send_request(self._sock, request, fds)
                reply, pidfds, _, _ = socket.recv_fds(self._sock, 4, 1)
            except OSError as e:
                raise base.SandboxError(f"the sandboxes' fork server failed: {e}") from None
        if len(reply) < 4 or not pidfds:
            for fd in pidfds:
                os.close(fd)
            raise base.SandboxError("the sandboxes' fork server could not fork a supervisor"
                                    if len(reply) == 4 else "the sandboxes' fork server died")
        return _Forked(self, struct.unpack(">I", reply)[0], pidfds[0], stderr_r)

    def reap(self, pid: int) -> int | None:
        """Reaps an exited supervisor; its exit code (None if the server is gone)."""
        with self._lock:
            try:
                _send_request(self._sock, {"reap": pid})
                reply = _exactly(self._sock, 4)
            except OSError:
                return None
        return struct.unpack(">i", reply)[0] if reply is not None else None


def _send_request(sock: socket.socket, request: dict, fds: list[int] | tuple = ()) -> None:
    """A request as supervisor_main.py reads it: a 4-byte big-endian length, sent with `fds`
    (SCM_RIGHTS), then the request's JSON."""
    payload = json.dumps(request).encode("utf-8", "surrogateescape")
    header = struct.pack(">I", len(payload))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes from sock, None if it closes first."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


_server: _ForkServer | None = None
_server_lock = threading.Lock()


def _fork_server() -> _ForkServer:
    """This process's fork server, started (again) where none runs."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = _ForkServer()
        return _server
