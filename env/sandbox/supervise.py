"""Runs one sandbox command under a supervisor that leaves no process behind.

Invoked by LocalSandbox as `python -I -S supervise.py CONFIG_JSON`, as a new session
leader. The supervisor marks itself a child subreaper (prctl), so every orphaned
descendant of the command is re-parented to it rather than to PID 1, which may not
reap. It forks the command (optionally dropping to an unprivileged uid and always
lowering rlimits in the child), waits for it with a wall-clock deadline, then
SIGKILLs every remaining descendant, repeating until none is left (a fork bomb keeps
forking while it is being killed; RLIMIT_NPROC bounds it), and reaps them all.
Finally it writes "EXIT_CODE TIMED_OUT" to the status fd.

Exit codes follow the shell: 128+N when the command died from signal N, -1 on timeout.
SIGTERM/SIGINT to the supervisor end the command like a timeout.

CONFIG_JSON keys: argv (list[str]), timeout (s), status_fd (int), uid/gid (int | null:
keep the caller's), rlimits ({"RLIMIT_CPU": n, ...}; "RLIMIT_NPROC" counts on top of the
uid's running processes when uid is null, since the count is per user).
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import time
import warnings  # noqa: F401 - os.execvp imports it; after setuid the stdlib may be unreadable

PR_SET_CHILD_SUBREAPER = 36
KILL_ROUNDS = 2000


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
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
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
        os.execvp(cfg["argv"][0], cfg["argv"])
    except BaseException as e:  # noqa: BLE001 - report any start failure, then exit
        os.write(2, f"sandbox: cannot start command: {e}\n".encode())
    os._exit(127)


def main():
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGALRM, _stop)
    timed_out, code = False, -1
    try:
        signal.setitimer(signal.ITIMER_REAL, max(cfg["timeout"], 0.001))
        child = os.fork()
        if child == 0:
            _exec_child(cfg, status_fd)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                code = 128 - code if code < 0 else code
                break
    except _Stop:
        timed_out = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    clean = _kill_descendants()
    while clean:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    os.write(status_fd, f"{-1 if timed_out else code} {int(timed_out)} {int(clean)}".encode())


if __name__ == "__main__":
    main()
