"""Reading and writing a sandbox's regular files from the host, with the sandbox uid's
permissions.

A file read through the sandbox's supervisor (`cat` as the sandbox's uid) costs a
command: a fork, an exec and the namespace's clean-up, about 5 ms of CPU. Most reads
are of plain files under the repository, which the host can open directly as long as
it sees exactly what `cat` would:

- The path is resolved by openat2 with RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS below the
  repository's directory, held open since before any command ran (the directory the
  commands run in, even if one renamed it or put a link in its place): a `..` or a
  symbolic link that leads out of it (which `cat` would follow, into the host's
  read-only tree) is refused by the kernel, and the caller falls back to `cat`.
- The open runs with the sandbox's uid and gid as this thread's filesystem ids
  (setfsuid/setfsgid are per thread; leaving uid 0 drops the capabilities that bypass
  file modes, and returning to it restores them): the kernel checks every directory's
  search bit and the file's read bit as it does for `cat`.
- O_NONBLOCK keeps a FIFO from blocking the open; anything but a regular file (a FIFO,
  a socket) is left to `cat`.

`read_beneath` returns the bytes, raises FileNotFoundError or IsADirectoryError where
`cat` would fail so, and returns None for everything else (a refused resolution, a
denied permission, not a regular file, no openat2): `cat` then runs, and its error is
the one the caller reports, word for word.

`write_beneath` is the same for `cat > path`: it opens (creating or truncating) with
the same resolution and ids, writes only to a regular file, and returns False, for the
shell to write or fail, where anything else would happen.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat

# openat2(2), Linux 5.6: the same number in every architecture's table but alpha's (where
# it fails, or any kernel lacks it, reads go to `cat`).
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS, RESOLVE_BENEATH = 0x02, 0x08
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def _openat2(dirfd: int, path: str, flags: int = os.O_RDONLY, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode,
                   RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd),
                       ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


@contextlib.contextmanager
def _filesystem_ids(uid: int | None):
    """This thread's filesystem uid and gid set to `uid` (None: unchanged)."""
    if uid is None:
        yield
        return
    previous_uid, previous_gid = _libc.setfsuid(-1), _libc.setfsgid(-1)  # -1: a query
    try:
        _libc.setfsgid(uid)
        _libc.setfsuid(uid)
        if _libc.setfsuid(-1) != uid or _libc.setfsgid(-1) != uid:
            raise OSError(errno.EPERM, "cannot take the sandbox's filesystem ids")
        yield
    finally:
        _libc.setfsuid(previous_uid)
        _libc.setfsgid(previous_gid)


def open_root(path: str) -> int:
    """A descriptor of directory `path` to read beneath (O_PATH: it grants no access)."""
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def read_beneath(root_fd: int, path: str, uid: int | None) -> bytes | None:
    """The bytes of regular file `path` (relative, normalised) below the directory
    `root_fd` (open_root), opened as `uid` (None: as this process); None where `cat` in
    the sandbox must decide."""
    try:
        with _filesystem_ids(uid):
            fd = _openat2(root_fd, path)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
        return None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            return None
        return f.read()


def write_beneath(root_fd: int, path: str, data: bytes, uid: int | None) -> bool:
    """Writes `data` to `path` below `root_fd` as `uid` would with `cat > path`: creates
    it (mode 0666 less the umask, owned by uid) or truncates it. True when written; False
    where the shell must decide (a missing directory, a link out of the tree, a denied
    permission, not a regular file, a full disk: the shell then writes, or fails with its
    own words)."""
    try:
        with _filesystem_ids(uid):
            fd = _openat2(root_fd, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
