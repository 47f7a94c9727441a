"""The program of a sandbox's supervisor (its host end is env.sandbox.supervisor): one
long-lived process that runs every command sent to it and leaves no process of a command
behind.

Supervisors are forked from a fork server: env.sandbox.supervisor starts `python -I -S
supervisor_main.py SERVER_FD` once per process, and the server forks one supervisor per
sandbox (a fork of an interpreter that has imported this module, not a new
interpreter: a sandbox's start costs a fork). A request to the server on SERVER_FD (a
Unix stream socket) is a 4-byte big-endian length and its JSON, `{"cwd", "env",
"config"}`, with two file descriptors (SCM_RIGHTS): the new supervisor's control socket
and its stderr. The server answers with the supervisor's pid (4 bytes) and a pidfd of
it, through which the host waits for it and signals it; the server reaps the
supervisor only when the host sends `{"reap": pid}`, so the pid is not reused while
the host may still signal its process group, and answers with its exit code (4 bytes,
signed: -N for signal N, -255 for no such child). End of file on SERVER_FD ends the server
(its supervisors run on).

A supervisor is a new session leader, in the repository root (`cwd`), with the
sandbox's environment (`env`). It serves requests on its control socket one at a time:
a 4-byte big-endian length, the request's JSON, and three file descriptors passed with
the length (SCM_RIGHTS): the command's stdin, stdout and stderr. The command's text
travels in the request, so its length is not bounded by argv (see ARGV_SCRIPT_CHARS).
For each request it forks the command (a fork of this process that execs at once),
waits for it with a wall-clock deadline, kills every process the command left, and
answers "EXIT_CODE TIMED_OUT CLEAN\n". End of file on the control socket (the sandbox
closed, or its owner died) ends the supervisor after the same clean-up.

Isolated (`isolate` is the sandbox directory): the starting process enters new mount,
PID and network namespaces and a root of its own (`view`, _new_root): the sandbox
directory and the host paths the view names (the toolchain), a few names of /etc, a
passwd and group of its own, and a few devices; no other host path is there to read,
through a link or otherwise. Every mount is read-only except the sandbox directory (and
a small tmpfs on /dev/shm, fresh for every command), so no host path is writable,
whatever its permissions; and nosuid. Every command (isolated or not) runs under
no_new_privs: a setuid program of the toolchain runs with the command's uid. The
starting process's child, the PID namespace's init, is the server: it mounts the
namespace's own /proc (commands see only the sandbox's processes, none of the trainer's)
and brings up a loopback of its own. Every process in the namespace but the server is a
command's, so after a command `kill(-1, SIGKILL)` ends them all; if the server dies, the
kernel kills every process in the namespace. The starting process waits for the server
and exits with it; the server gets SIGKILL if the starting process dies.

Not isolated: the server marks itself a child subreaper (prctl), so every orphaned
descendant is re-parented to it rather than to PID 1, and after each command SIGKILLs
every remaining descendant, repeating until none is left (a fork bomb keeps forking
while it is being killed; RLIMIT_NPROC bounds it), and reaps them all.

The command's process drops to the sandbox's uid (when one is given) and lowers its
rlimits before exec. Exit codes follow the shell: 128+N when the command died from
signal N, -1 on timeout. SIGTERM/SIGINT end the server after the clean-up.

Config keys (`config`): uid/gid (int | null: keep the caller's), rlimits ({"RLIMIT_CPU":
n, ...}; "RLIMIT_NPROC" counts on top of the uid's running processes when uid is null,
since the count is per user), isolate (str | null), view ({"read_only": [host paths],
"etc": [name patterns of /etc], "passwd": text, "group": text}; with isolate), cgroup
(str | null: the `cgroup.procs` file of a memory cgroup to join, env.sandbox.cgroup).
Request keys: argv (list[str]), script (str | null: when given, bash runs it instead of
argv), timeout (s).
"""

import contextlib
import ctypes
import fcntl
import fnmatch
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import warnings  # noqa: F401 - os.execvp imports it; after setuid the stdlib may be unreadable

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
KILL_ROUNDS = 2000
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH, MS_MOVE = 2, 8192
# An isolated sandbox's root (_new_root): a tmpfs first mounted here, then moved onto /.
NEW_ROOT, ROOT_OPTIONS = "/tmp", "size=4m,mode=755"
OOM_SCORE_ADJ = 1000  # a command's: the first the OOM killer ends, in its cgroup or the host's
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEVICE_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                "stderr": "/proc/self/fd/2"}
SYS_MOUNT_SETATTR, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 442, 0x8000, 0x1, 0x2
SIOCSIFFLAGS, IFF_UP = 0x8914, 0x1
SHM_OPTIONS = "size=64m,mode=1777"
MAX_FDS = 1 << 20
# A script this short (at most 4 bytes a character) fits in one argv string, which
# execve caps at 128 KiB: bash gets it with -c, as `eval` of it would run it.
ARGV_SCRIPT_CHARS = 32 << 10
# A longer one (or one with a NUL, which argv cannot hold) bash reads from fd 3 (`$(...)`
# reads it before fd 3 is closed for the command): one more process, `cat`.
RUN_SCRIPT = 'eval "$(cat <&3)" 3<&-'
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda v: v.encode() if isinstance(v, str) else v  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {target}")


def _set_mount_attr(path, set_flags, clear_flags):
    """mount_setattr(2) on `path` and every mount below it."""
    attr = struct.pack("QQQQ", set_flags, clear_flags, 0, 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, -100, path.encode(), AT_RECURSIVE, attr, len(attr)),
           f"mount_setattr {path}")


# -- namespaces (isolated) ------------------------------------------------------------


def _enter_namespaces(sandbox_dir, view):
    """New mount, PID (for the children) and network namespaces, and a root of `view`
    (_new_root) read-only but for the sandbox directory and a private /dev/shm."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    cwd = os.getcwd()
    _new_root(sandbox_dir, view)
    # nosuid: a setuid program of the toolchain (su, passwd) runs as the command's uid.
    _set_mount_attr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
    _set_mount_attr(sandbox_dir, 0, MOUNT_ATTR_RDONLY)
    os.chdir(cwd)
    _fresh_shm()


def _new_root(sandbox_dir, view):
    """Makes the root a tmpfs that holds only the sandbox directory and `view`'s host
    paths (binds at the same paths; a host link is made again as a link), the `view`'s
    names of /etc, its own passwd and group, and a few devices: a link followed to any
    other host path finds nothing. The tmpfs is mounted on NEW_ROOT (this namespace's
    own mount: the host's is untouched), then moved onto / (as switch_root does).
    Sources are opened first: NEW_ROOT may hold them (/tmp/sandbox-XXXX)."""
    etc = [os.path.join("/etc", n) for n in sorted(os.listdir("/etc"))
           if any(fnmatch.fnmatchcase(n, pattern) for pattern in view["etc"])]
    devices = [os.path.join("/dev", n) for n in DEVICES]
    sources = {}
    for path in [*view["read_only"], *etc, *devices, sandbox_dir]:
        if os.path.islink(path):
            sources[path] = os.readlink(path)
        elif os.path.exists(path):
            sources[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, ROOT_OPTIONS)
    for name in ("proc", "tmp", "dev/shm", "etc"):
        os.makedirs(NEW_ROOT + "/" + name, exist_ok=True)
    for name, target in DEVICE_LINKS.items():
        os.symlink(target, f"{NEW_ROOT}/dev/{name}")
    for name in ("passwd", "group"):
        with open(f"{NEW_ROOT}/etc/{name}", "w") as f:
            f.write(view[name])
    for path, source in sources.items():
        _place(path, source)
    os.chdir(NEW_ROOT)
    _mount(NEW_ROOT, "/", None, MS_MOVE)
    os.chroot(".")


def _place(path, source):
    """`path` in the new root: a link to `source` (a str), or a bind of the open file."""
    target = NEW_ROOT + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if isinstance(source, str):
        os.symlink(source, target)
        return
    if os.path.isdir(f"/proc/self/fd/{source}"):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    _mount(f"/proc/self/fd/{source}", target, None, MS_BIND | MS_REC)
    os.close(source)


def _fresh_shm():
    """An empty /dev/shm: what one command left there is gone for the next."""
    if not os.path.isdir("/dev/shm"):
        return
    if os.path.ismount("/dev/shm"):
        _libc.umount2(b"/dev/shm", MNT_DETACH)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, SHM_OPTIONS)


def _as_namespace_init():
    """In the server, the PID namespace's init: its own /proc and a loopback that is up."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", IFF_UP))


def _kill_namespace():
    """SIGKILLs and reaps every process of the namespace but this one (its init)."""
    while True:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return True


# -- descendants (not isolated) -------------------------------------------------------


def _proc_table():
    """pid -> (state, ppid) for every visible process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2 :].split()
        table[int(name)] = (fields[0], int(fields[1]))
    return table


def _live_descendants(root):
    table = _proc_table()
    children = {}
    for pid, (_, ppid) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            stack.append(child)
            if table[child][0] != b"Z":
                found.append(child)
    return found


def _reap_nohang():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_descendants():
    """SIGKILLs every descendant until none is left, then reaps them; False if they
    kept coming (then nothing is waited for)."""
    for _ in range(KILL_ROUNDS):
        pids = _live_descendants(os.getpid())
        if not pids:
            while True:
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap_nohang()
        time.sleep(0.001)
    return False


def _user_process_count(uid):
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


# -- one command ----------------------------------------------------------------------


def _join_cgroup(procs):
    """Joins the sandbox's memory cgroup (env.sandbox.cgroup) before anything is forked,
    so every command's process is in it."""
    with open(procs, "w") as f:
        f.write(str(os.getpid()))


def _exec_child(cfg, request, fds):
    """In the forked child: the command's stdio, uid and rlimits, then exec."""
    try:
        # Python ignores SIGPIPE and SIGXFSZ, and exec keeps ignored signals: the command
        # gets the defaults (`yes | head` ends quietly, an oversized write kills).
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        argv, script = request["argv"], request["script"]
        if script is not None and len(script) <= ARGV_SCRIPT_CHARS and "\0" not in script:
            argv, script = ["bash", "-c", script], None
        elif script is not None:
            fd = os.memfd_create("command", 0)
            os.write(fd, script.encode("utf-8", "surrogateescape"))
            os.lseek(fd, 0, os.SEEK_SET)
            os.dup2(fd, 3)
            argv = ["bash", "-c", RUN_SCRIPT]
        os.closerange(4 if script is not None else 3, MAX_FDS)
        # The OOM killer picks a command before its supervisor (raising needs no privilege).
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        # No exec of the command's gains a privilege (setuid, setgid, file capabilities),
        # isolated or not, whatever the mounts allow.
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
        for name, value in cfg["rlimits"].items():
            if name == "RLIMIT_NPROC" and cfg["uid"] is None:
                value += _user_process_count(os.getuid())
            hard = resource.getrlimit(getattr(resource, name))[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(getattr(resource, name), (value, value))
        os.execvp(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - report any start failure, then exit
        os.write(2, f"sandbox: cannot start command: {e}\n".encode())
    os._exit(127)


class _HostGone(Exception):
    """The control socket closed: the sandbox is closing, or its owner died."""


def _wait(child, timeout, control):
    """(exit code, timed out) of `child`; _HostGone if the control socket closes first."""
    deadline = time.monotonic() + max(timeout, 0.001)
    pidfd = os.pidfd_open(child)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return -1, True
            ready, _, _ = select.select([pidfd, control], [], [], remaining)
            if control in ready and not control.recv(1, socket.MSG_PEEK):
                raise _HostGone
            if pidfd in ready:
                code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
                return (128 - code if code < 0 else code), False
    finally:
        os.close(pidfd)


def _run(cfg, request, fds, control):
    try:
        child = os.fork()
        if child == 0:
            _exec_child(cfg, request, fds)
    finally:
        for fd in fds:
            os.close(fd)
    return _wait(child, request["timeout"], control)


def _clean_up(cfg):
    """Kills every process the command left; True when none is left."""
    if not cfg["isolate"]:
        return _kill_descendants()
    clean = _kill_namespace()
    _fresh_shm()
    return clean


# -- requests -------------------------------------------------------------------------


def _receive(control, num_fds=3):
    """(request, the file descriptors sent with it) or None at end of file: a command's
    stdin, stdout and stderr, or (fork server) a new supervisor's control socket and
    stderr."""
    header, fds, _, _ = socket.recv_fds(control, 4, num_fds)
    if not header:
        return None
    if len(header) < 4:
        header += _exactly(control, 4 - len(header))
    (size,) = struct.unpack(">I", header)
    return json.loads(_exactly(control, size)), fds


def _exactly(control, size):
    chunks = []
    while size:
        chunk = control.recv(min(size, 1 << 20))
        if not chunk:
            raise _HostGone
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _serve(cfg, control):
    control.sendall(b"ready\n")
    while True:
        received = _receive(control)
        if received is None:
            return
        request, fds = received
        code, timed_out = _run(cfg, request, fds, control)
        clean = _clean_up(cfg)
        control.sendall(f"{-1 if timed_out else code} {int(timed_out)} {int(clean)}\n".encode())


def _stop(signum, frame):
    raise _HostGone


def _server(cfg, control):
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        _serve(cfg, control)
    except (_HostGone, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _clean_up(cfg)


def _supervise(cfg, control):
    """A supervisor's life, in the process forked for it; returns its exit code."""
    if cfg["cgroup"]:
        _join_cgroup(cfg["cgroup"])
    if not cfg["isolate"]:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _server(cfg, control)
        return 0
    _enter_namespaces(cfg["isolate"], cfg["view"])
    server = os.fork()
    if server == 0:
        try:
            _as_namespace_init()
            _server(cfg, control)
        except BaseException as e:  # noqa: BLE001 - say why, then end the namespace
            os.write(2, f"sandbox supervisor: {type(e).__name__}: {e}\n".encode())
            os._exit(1)
        os._exit(0)
    control.close()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = os.waitstatus_to_exitcode(os.waitpid(server, 0)[1])
    return 128 - code if code < 0 else code


# -- fork server ----------------------------------------------------------------------


def _start_supervisor(request, fds):
    """In the forked child: becomes the supervisor `request` asks for; never returns."""
    code = 1
    try:
        control, stderr = fds
        os.setsid()
        os.dup2(stderr, 2)
        os.close(stderr)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = _supervise(request["config"], socket.socket(fileno=control))
    except BaseException as e:  # noqa: BLE001 - say why; the host reads it from stderr
        os.write(2, f"sandbox supervisor: {type(e).__name__}: {e}\n".encode())
    os._exit(code)


def _fork_server(listen):
    while True:
        try:
            received = _receive(listen, 2)
        except _HostGone:
            return
        if received is None:
            return
        request, fds = received
        if "reap" in request:
            try:
                code = os.waitstatus_to_exitcode(os.waitpid(request["reap"], 0)[1])
            except ChildProcessError:
                code = -255
            listen.sendall(struct.pack(">i", code))
            continue
        try:
            pid = os.fork()
        except OSError:  # no process to be had: pid 0 and no pidfd tell the host
            pid = -1
        if pid == 0:
            listen.close()
            _start_supervisor(request, fds)
        for fd in fds:
            os.close(fd)
        pidfd = [os.pidfd_open(pid)] if pid > 0 else []
        try:
            socket.send_fds(listen, [struct.pack(">I", max(pid, 0))], pidfd)
        finally:
            for fd in pidfd:
                os.close(fd)


def main():
    _fork_server(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
