"""Runs one sandbox command under a supervisor that leaves no process behind.

Invoked by LocalSandbox as `python -I -S supervise.py CONFIG_FD`, as a new session
leader; it reads its JSON config from that pipe (a command of any length fits: it
never passes through argv, which execve caps at 128 KiB per string).

Isolated (`isolate` is the sandbox directory): the supervisor enters new mount, PID
and network namespaces. Every mount is made read-only except a bind of the sandbox
directory (and a small tmpfs on /dev/shm), so no host path outside the sandbox is
writable, whatever its permissions; the command gets its own /proc, sees only its own
processes (none of the trainer's), and only a loopback interface of its own. The
command is the PID namespace's init, so when it exits or is killed every process it
started dies with it.

Not isolated: the supervisor marks itself a child subreaper (prctl), so every orphaned
descendant is re-parented to it rather than to PID 1, and after the command SIGKILLs
every remaining descendant, repeating until none is left (a fork bomb keeps forking
while it is being killed; RLIMIT_NPROC bounds it), and reaps them all.

Either way the command is forked (optionally dropping to an unprivileged uid and always
lowering rlimits in the child) and waited for with a wall-clock deadline. Finally the
supervisor writes "EXIT_CODE TIMED_OUT CLEAN" to the status fd.

Exit codes follow the shell: 128+N when the command died from signal N, -1 on timeout.
SIGTERM/SIGINT to the supervisor end the command like a timeout.

Config keys: argv (list[str]), script (str | null: when given, bash runs it, read from
fd 3, instead of argv), timeout (s), status_fd (int), uid/gid (int | null: keep the
caller's), rlimits ({"RLIMIT_CPU": n, ...}; "RLIMIT_NPROC" counts on top of the uid's
running processes when uid is null, since the count is per user), isolate (str | null).
"""

import contextlib
import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys
import time
import warnings  # noqa: F401 - os.execvp imports it; after setuid the stdlib may be unreadable

PR_SET_CHILD_SUBREAPER = 36
KILL_ROUNDS = 2000
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
SYS_MOUNT_SETATTR, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, 0x8000, 0x1
SIOCSIFFLAGS, IFF_UP = 0x8914, 0x1
# bash runs the script from fd 3 (`$(...)` reads it before fd 3 is closed for the command).
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


def _set_readonly(path, readonly):
    """mount_setattr(2) on `path` and every mount below it."""
    attr = struct.pack("QQQQ", MOUNT_ATTR_RDONLY if readonly else 0,
                       0 if readonly else MOUNT_ATTR_RDONLY, 0, 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, -100, path.encode(), AT_RECURSIVE, attr, len(attr)),
           f"mount_setattr {path}")


def _enter_namespaces(sandbox_dir):
    """New mount, PID (for the children) and network namespaces; the mount tree read-only
    but for the sandbox directory and a private /dev/shm."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount(sandbox_dir, sandbox_dir, None, MS_BIND | MS_REC)
    _set_readonly("/", True)
    _set_readonly(sandbox_dir, False)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")


def _in_new_pid_namespace():
    """In the child, the PID namespace's init: its own /proc and a loopback that is up."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", IFF_UP))
    os.chdir(os.getcwd())  # the working directory through the writable bind, not under it


class _Stop(Exception):
    pass


def _stop(signum, frame):
    raise _Stop


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
    for _ in range(KILL_ROUNDS):
        pids = _live_descendants(os.getpid())
        if not pids:
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


def _exec_child(cfg, status_fd):
    try:
        os.close(status_fd)
        # Python ignores SIGPIPE and SIGXFSZ, and exec keeps ignored signals: the command
        # gets the defaults (`yes | head` ends quietly, an oversized write kills).
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        if cfg["isolate"]:
            _in_new_pid_namespace()
        argv = cfg["argv"]
        if cfg["script"] is not None:
            fd = os.memfd_create("command", 0)
            os.write(fd, cfg["script"].encode("utf-8", "surrogateescape"))
            os.lseek(fd, 0, os.SEEK_SET)
            os.dup2(fd, 3)
            argv = ["bash", "-c", RUN_SCRIPT]
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
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


def _read_config(fd):
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


def main():
    cfg = _read_config(int(sys.argv[1]))
    status_fd = cfg["status_fd"]
    if cfg["isolate"]:
        _enter_namespaces(cfg["isolate"])
    else:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGALRM, _stop)
    timed_out, code, child = False, -1, None
    try:
        signal.setitimer(signal.ITIMER_REAL, max(cfg["timeout"], 0.001))
        child = os.fork()
        if child == 0:
            _exec_child(cfg, status_fd)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                child = None  # reaped: its pid may be reused from now on
                code = os.waitstatus_to_exitcode(status)
                code = 128 - code if code < 0 else code
                break
    except _Stop:
        timed_out = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cfg["isolate"]:  # the namespace's init gone, so is every process in it
        if child is not None:
            os.kill(child, signal.SIGKILL)
        clean = True
    else:
        clean = _kill_descendants()
    while clean:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    os.write(status_fd, f"{-1 if timed_out else code} {int(timed_out)} {int(clean)}".encode())


if __name__ == "__main__":
    main()
