"""Sandbox backends against real processes and a real Docker engine.

Each behaviour is checked on both backends: file hashes against hashlib, stray
processes against the host's /proc (docker exec'd processes are host processes too),
containers against the engine's own listing.
"""

import asyncio
import concurrent.futures
import hashlib
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
from sandbox_backends import IMAGE, ROOT, ensure_image

from env.sandbox import FACTORY_LABEL, SandboxError, SandboxFactory, cgroup, fsread
from env.sandbox.base import Source
from env.sandbox.docker import DockerSandbox
from env.sandbox.local import LocalLimits, LocalOptions, LocalSandbox, reap_stale, uid_processes
from env.sandbox.pool import SandboxPool

FILES = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": textwrap.dedent("""\
        import unittest
        from calc import add

        class T(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add(2, 3), 5)
        """),
    "docs/readme.txt": "calculator\n",
}
UNISOLATED = LocalOptions(allow_unisolated=True)


@pytest.fixture(scope="session")
def docker_image(request):
    """The sandbox image, built with scripts/build_sandbox_image.sh when missing."""
    if os.geteuid() == 0:  # start an engine when none answers (fresh CI machine)
        subprocess.run([os.path.join(ROOT, "scripts", "start_dockerd.sh")], check=False)
    client = request.getfixturevalue("docker_client")
    return client, ensure_image(client)


@pytest.fixture(params=["local", "docker"])
def make(request):
    """make(**kwargs) -> a sandbox of the parametrised backend, closed after the test."""
    if request.param == "docker":
        client, image = request.getfixturevalue("docker_image")
        defaults = {"image": image, "client": client, "mem_limit": "512m"}
    else:
        defaults = {"limits": LocalLimits(memory_bytes=1 << 30)}
    made = []

    def factory(**kwargs):
        sandbox = SandboxFactory(request.param).create(**{**defaults, **kwargs})
        made.append(sandbox)
        return sandbox

    factory.backend = request.param
    yield factory
    for sandbox in made:
        sandbox.close()


def host_processes(marker: str, exact: bool = False) -> list[int]:
    """Host pids whose command line (arguments joined by spaces) contains `marker`
    (zombies have none).

    exact: only processes whose argv is `marker.split()` (not the shells that run it).
    """
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and name != str(os.getpid()):
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if (cmdline.rstrip(b"\0").split(b"\0") == marker.encode().split() if exact
                    else marker.encode() in cmdline.replace(b"\0", b" ")):
                found.append(int(name))
    return found


def marker_sleep() -> str:
    """A `sleep` command no other process on the machine runs."""
    return f"sleep {secrets.randbelow(10**6) + 10**6}.5"


def tree_hashes(sandbox) -> dict[str, str]:
    out = sandbox.run("find . -path ./.git -prune -o -type f -print0 | xargs -0 sha256sum").output
    return {line[68:]: line[:64] for line in out.splitlines()}


def test_round_trip(make):
    sb = make(repo_files=FILES)
    assert sb.read_file("docs/readme.txt") == "calculator\n"
    assert sb.run("python3 -m unittest -q").exit_code != 0
    sb.write_file("calc.py", "def add(a, b):\n    return a + b\n")
    sb.write_file("new/dir/notes.md", "héllo ☃\n")
    sb.run("git rm -q docs/readme.txt && printf '\\x00\\xff\\x01' > blob.bin")
    res = sb.run("python3 -m unittest -q")
    assert res.exit_code == 0, res.output
    assert sb.read_file("new/dir/notes.md") == "héllo ☃\n"

    # The diff is against the base commit even after the agent commits.
    sb.run("git add -A && git -c user.name=a -c user.email=a@b commit -qm wip")
    patch = sb.patch()
    assert "+    return a + b" in patch and "GIT binary patch" in patch
    assert "deleted file mode" in patch and "new/dir/notes.md" in patch
    assert sb.patch() == patch

    fresh = make(repo_files=FILES)
    fresh.apply_patch(patch)
    hashes = tree_hashes(fresh)
    assert hashes == tree_hashes(sb)
    assert hashes["calc.py"] == hashlib.sha256(b"def add(a, b):\n    return a + b\n").hexdigest()
    assert hashes["blob.bin"] == hashlib.sha256(b"\x00\xff\x01").hexdigest()
    assert "docs/readme.txt" not in hashes
    assert fresh.patch() == patch
    fresh.apply_patch("")  # an empty patch is a no-op


def test_bad_input(make):
    sb = make(repo_files=FILES)
    with pytest.raises(ValueError, match="does not apply"):
        sb.apply_patch("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n"
                       "@@ -1 +1 @@\n-no such line\n+x\n")
    with pytest.raises(FileNotFoundError):
        sb.read_file("missing.py")
    for path in ["/etc/passwd", "../x", "a/../../x", ""]:
        with pytest.raises(ValueError):
            sb.read_file(path)
        with pytest.raises(ValueError):
            sb.write_file(path, "x")
    assert sb.run("echo still fine").output == "still fine\n"


def test_patch_keeps_what_git_settings_would_hide(make):
    """The recorded patch holds every change, whatever a command did to git's ignore and
    index settings: lines in .git/info/exclude, core.excludesFile in .git/config,
    assume-unchanged and skip-worktree bits. Caches stay out of it."""
    sb = make(repo_files=FILES)
    hide = ("printf 'hidden*\\nsecret/\\n' >> .git/info/exclude && "
            "echo 'viaconfig.py' > ../ignore && git config core.excludesFile \"$PWD/../ignore\" && "
            "echo x > hidden.py && mkdir secret && echo y > secret/s.py && "
            "echo w > viaconfig.py && "
            "echo '# edited' >> calc.py && git update-index --assume-unchanged calc.py && "
            "echo '# edited' >> test_calc.py && git update-index --skip-worktree test_calc.py && "
            "mkdir -p __pycache__ && echo c > __pycache__/calc.pyc")
    assert sb.run(hide).exit_code == 0
    assert sb.run("git status --porcelain").output.strip() == "", "git hides them"
    patch = sb.patch()
    for path in ("hidden.py", "secret/s.py", "viaconfig.py", "calc.py", "test_calc.py"):
        assert f"+++ b/{path}" in patch, path
    assert "__pycache__" not in patch
    fresh = make(repo_files=FILES)
    fresh.apply_patch(patch)
    assert fresh.read_file("calc.py").endswith("# edited\n")
    assert fresh.read_file("secret/s.py") == "y\n"


def test_read_file_agrees_with_cat(make):
    """read_file against `cat` run in the sandbox, path by path: the local backend opens
    most files from the host (env.sandbox.fsread), and must see what `cat` sees through
    links, missing files, directories and the sandbox's own permission bits."""
    sb = make(repo_files=FILES)
    setup = ("mkdir -p d sealed && echo in > d/f && echo s > sealed/f && ln -s d/f rel && "
             'ln -s "$PWD/d/f" abs && ln -s /etc/hostname out && ln -s ../../d/f up && '
             "ln -s missing dangling && echo x > locked && chmod 000 locked sealed && "
             "ln -s sealed/f via_sealed")
    assert sb.run(setup).exit_code == 0
    for path in ["calc.py", "d/f", "rel", "abs", "out", "up", "dangling", "missing", "d",
                 "locked", "sealed/f", "via_sealed", "d/f/x", "calc.py/x"]:
        ref = sb.run(f"cat -- {path} 2>&1")
        if ref.exit_code == 0:
            assert sb.read_file(path) == ref.output, path
            continue
        with pytest.raises(OSError) as failed:
            sb.read_file(path)
        if "No such file" in ref.output:
            assert failed.type is FileNotFoundError, path
        elif "Is a directory" in ref.output:
            assert failed.type is IsADirectoryError, path
        else:
            assert ref.output.split(": ")[-1].strip() in str(failed.value), path
    assert sb.real_root() == sb.run("pwd -P").output.strip()
    assert sb.run("echo still fine").output == "still fine\n"
    if isinstance(sb, LocalSandbox):  # the repository moved away, a link to /etc in its place
        assert sb.run("cd .. && mv repo moved && ln -s /etc repo").exit_code == 0
        assert "No such file" in sb.run("cat -- hostname 2>&1").output
        with pytest.raises(FileNotFoundError):
            sb.read_file("hostname")
        assert sb.read_file("calc.py") == FILES["calc.py"]


WRITE_SETUP = ("mkdir -p d sealed && echo in > d/f && echo s > sealed/f && ln -s d/f rel && "
               'ln -s "$PWD/d/f" abs && ln -s /etc/hostname out && ln -s missing dangling && '
               "ln -s ../../x up && echo x > locked && echo r > ro && chmod 000 locked sealed && "
               "chmod 444 ro")
WRITE_PATHS = ["calc.py", "new.txt", "d/new.txt", "deep/er/x.txt", "rel", "abs", "out", "up",
               "dangling", "locked", "ro", "sealed/f", "d", "calc.py/x"]
# Every entry but .git: path, type, mode, size, link target, whether the command's uid owns it.
LISTING = ("find . -path ./.git -prune -o -printf '%p %y %m %s %l ' -exec sh -c "
           "'[ \"$(stat -c %u \"$1\")\" = \"$(id -u)\" ] && echo own || echo other' _ {} \\;")


def test_write_file_agrees_with_the_shell(monkeypatch):
    """write_file from the host (env.sandbox.fsread) against the same sandbox writing by
    `cat` under its supervisor, path by path: the same trees (contents, modes, owners,
    links) and the same errors, through links in and out of the tree, missing
    directories, and modes that deny the sandbox's uid."""
    written, real = [], fsread.write_beneath

    def outcomes(host_writes: bool):
        def spy(root_fd, path, data, uid):
            done = host_writes and real(root_fd, path, data, uid)
            written.extend([path] if done else [])
            return done
        monkeypatch.setattr(fsread, "write_beneath", spy)
        sb = LocalSandbox(Source(repo_files=FILES), UNISOLATED)
        try:
            assert sb.run(WRITE_SETUP).exit_code == 0
            results = {}
            for path in WRITE_PATHS:
                try:
                    sb.write_file(path, f"written {path} ☃\n")
                    results[path] = "ok"
                except (OSError, ValueError) as e:
                    results[path] = f"{type(e).__name__}: {e}".replace(sb.root, "<root>")
            sb.run("chmod 755 sealed && chmod 644 locked")
            tree = sb.run(LISTING + " && find . -path ./.git -prune -o -type f -print0 "
                          "| sort -z | xargs -0 sha256sum").output
            return results, sorted(tree.replace(sb.root, "<root>").splitlines())
        finally:
            sb.close()
            monkeypatch.undo()

    host, shell = outcomes(True), outcomes(False)
    assert host == shell
    assert written == ["calc.py", "new.txt", "d/new.txt", "rel", "dangling"]
    assert host[0]["calc.py"] == "ok" and host[0]["out"] != "ok" and host[0]["locked"] != "ok"


def test_fresh_patch_is_git_s(make):
    """A sandbox's patch before any command (the local backend answers it without git)
    is what git says of the fresh tree, also with files git would ignore or convert."""
    files = {**FILES, ".gitignore": "*.log\n", "build.log": "x\n", "crlf.txt": "a\r\nb\r\n",
             ".gitattributes": "*.txt text=auto\n"}
    sb = make(repo_files=files)
    assert sb.patch() == ""
    base = sb.base_commit if hasattr(sb, "base_commit") else "HEAD"
    assert sb.run(f"git add -A 2>/dev/null && git diff --cached --binary {base}").output == ""
    sb.write_file("new.txt", "n\n")
    assert "new.txt" in sb.patch()


def test_same_files_again_reuse_the_base_repository():
    """A second local sandbox of the same files gets the first one's `.git` written from
    memory, no git run: the same base commit, a repository git finds sound and clean,
    patches equal to those of a repository git made, and a history of its own."""
    files = {**FILES, "data/crlf.txt": "a\r\nb\r\n", ".gitattributes": "*.txt text=auto\n",
             "nonce.txt": secrets.token_hex(8)}
    first = LocalSandbox(Source(repo_files=files), UNISOLATED)
    again = LocalSandbox(Source(repo_files=files), UNISOLATED)
    other = LocalSandbox(Source(repo_files={**files, "nonce.txt": "other"}), UNISOLATED)
    try:
        assert again.base_commit == first.base_commit != other.base_commit
        check = "git fsck --full --strict 2>&1 && git status --porcelain && git log --format=%H"
        for sb in (first, again):
            assert sb.run(check).output == first.base_commit + "\n"
            sb.write_file("calc.py", "def add(a, b):\n    return a + b\n")
            sb.run("rm data/crlf.txt && echo new > new.txt")
        assert again.patch() == first.patch() != ""
        again.run("git add -A && git -c user.name=a -c user.email=a@b commit -qm x")
        assert first.run("git rev-parse HEAD").output.strip() == first.base_commit
    finally:
        for sb in (first, again, other):
            sb.close()


def test_host_reads_only_what_the_sandbox_uid_may(tmp_path):
    """fsread.read_beneath decides a plain file, a missing one and a directory, and leaves
    to `cat` (None) what only the sandbox can say: links out of the tree, a FIFO (at once,
    not blocking), and, run as root, a file whose bits deny the sandbox's uid, which
    root's own rights would have read."""
    uid = 1_234_567_890 if os.geteuid() == 0 else None
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("in\n")
    (tmp_path / "mine").write_text("x")
    (tmp_path / "theirs").write_text("secret")
    os.mkfifo(tmp_path / "pipe")
    os.symlink("d/f", tmp_path / "rel")
    os.symlink("/etc/hostname", tmp_path / "out")
    os.symlink(str(tmp_path / "d" / "f"), tmp_path / "abs")
    if uid is not None:
        for p in [tmp_path, *tmp_path.rglob("*")]:
            os.lchown(p, uid, uid)
        os.chown(tmp_path / "theirs", uid + 1, uid + 1)
        os.chmod(tmp_path / "theirs", 0o600)
    root = fsread.open_root(str(tmp_path))
    assert fsread.read_beneath(root, "d/f", uid) == b"in\n"
    assert fsread.read_beneath(root, "rel", uid) == b"in\n"
    for undecided in ["out", "abs", "pipe", "mine/x"]:
        assert fsread.read_beneath(root, undecided, uid) is None, undecided
    with pytest.raises(FileNotFoundError):
        fsread.read_beneath(root, "missing", uid)
    with pytest.raises(IsADirectoryError):
        fsread.read_beneath(root, "d", uid)
    if uid is not None:
        assert fsread.read_beneath(root, "theirs", uid) is None
        assert fsread.read_beneath(root, "theirs", None) == b"secret"  # root's own rights
        with open("/proc/thread-self/status") as f:  # Uid: real, effective, saved, fs
            uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        assert uids == ["0"] * 4  # this thread's filesystem uid is back to root
    os.close(root)


def test_timeout_kills_and_sandbox_survives(make):
    sb = make(repo_files=FILES)
    sleep = marker_sleep()
    start = time.monotonic()
    res = sb.run(f"echo started; {sleep}", timeout=1)
    assert res.timed_out and res.exit_code == -1
    assert res.output == "started\n"
    assert time.monotonic() - start < 15
    assert host_processes(sleep) == []
    ok = sb.run("echo ok")
    assert (ok.exit_code, ok.output, ok.timed_out) == (0, "ok\n", False)


def test_background_processes_do_not_outlive_the_call(make):
    sb = make(repo_files=FILES)
    sleep = marker_sleep()
    start = time.monotonic()
    res = sb.run(f"{sleep} & echo bg")
    assert (res.exit_code, res.output, res.timed_out) == (0, "bg\n", False)
    assert time.monotonic() - start < 10  # not held up by the background job's open pipe
    assert host_processes(sleep) == []


def test_output_cap_and_undecodable_bytes(make):
    sb = make(repo_files=FILES, max_output_bytes=1000)
    res = sb.run("echo first; head -c 200000 /dev/zero | tr '\\0' x; echo; echo last")
    assert res.truncated and res.exit_code == 0
    assert res.output.startswith("first\n") and res.output.endswith("last\n")
    assert "bytes of output truncated" in res.output and len(res.output) < 1100
    res = sb.run("printf 'a\\xffb\\n'; printf 'err\\n' >&2")
    assert res.output == "a\ufffdb\nerr\n" and not res.truncated


def test_fork_bomb_is_contained(make):
    sb = make(repo_files=FILES, **({"pids_limit": 128} if make.backend == "docker" else
                                   {"limits": LocalLimits(max_processes=128)}))
    start = time.monotonic()
    res = sb.run(":(){ :|:& };:; sleep 3", timeout=2)
    assert time.monotonic() - start < 30
    assert res.timed_out
    after = sb.run("ps -e --no-headers | wc -l" if make.backend == "docker" else "echo ok")
    assert after.exit_code == 0
    if make.backend == "docker":
        assert int(after.output) < 10  # pid 1, the wrapper, ps, wc
    elif sb._uid is not None:  # root: commands ran as the sandbox's own uid
        assert uid_processes(sb._uid) == []


def test_memory_hog_is_contained(make):
    sb = make(repo_files=FILES)
    start = time.monotonic()
    res = sb.run("python3 -c \"b = b'x' * (4 << 30); print('allocated')\"", timeout=60)
    assert res.exit_code != 0 and not res.timed_out and "allocated" not in res.output
    assert time.monotonic() - start < 30
    assert sb.run("echo ok").output == "ok\n"


def run_in_background(sb, command: str, marker: str, count: int):
    """Runs `command` in `sb` on a thread, returning once `count` host processes named
    `marker` run (or after 10 s); (the thread, {"res": result} or {"err": SandboxError})."""
    result = {}

    def target():
        try:
            result["res"] = sb.run(command, timeout=60)
        except SandboxError as e:
            result["err"] = e

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 10
    while len(host_processes(marker, exact=True)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return thread, result


def test_close_kills_running_command_and_removes_everything(make):
    sb = make(repo_files=FILES)
    sleep = marker_sleep()
    thread, result = run_in_background(sb, sleep, sleep, 1)
    assert host_processes(sleep)
    sb.close()
    thread.join(10)
    assert not thread.is_alive() and result
    assert host_processes(sleep) == []
    sb.close()  # idempotent
    with pytest.raises(SandboxError):
        sb.run("true")
    if make.backend == "local":
        assert not os.path.exists(sb.root)


def test_a_backend_refuses_a_source_it_cannot_hold():
    """The local backend takes no image; the docker one needs an image and takes no
    repo_dir (a host directory it could not see)."""
    with pytest.raises(ValueError, match="takes no image"):
        LocalSandbox(Source(repo_files=FILES, image=IMAGE), UNISOLATED)
    with pytest.raises(ValueError, match="not repo_dir"):
        DockerSandbox(Source(image=IMAGE, repo_dir=ROOT))
    with pytest.raises(ValueError, match="needs an image"):
        DockerSandbox(Source(repo_files=FILES))


def test_a_factory_refuses_an_unknown_keyword_when_made():
    """A typo in a factory's defaults is refused at construction, naming the keyword and
    the accepted ones, not at the first episode as an env error."""
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['limit'\]; LocalSandbox "
                                        r"accepts \[.*'limits'"):
        SandboxFactory("local", limit=LocalLimits())
    with pytest.raises(TypeError, match=r"\['mem_limits'\]; DockerSandbox accepts \[.*'mem_limit'"):
        SandboxFactory("docker", image=IMAGE, mem_limits="512m")
    assert SandboxFactory("local", limits=LocalLimits(), read_only=()).defaults


def test_local_scrubbed_environment(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    with SandboxFactory("local").create(repo_files=FILES) as sb:
        env = sb.run("env").output
        assert "hunter2" not in env and "LANG=C.UTF-8" in env
        assert f"HOME={sb.root}/home" in env
        if os.geteuid() == 0:  # commands run as the sandbox's own unprivileged uid
            assert sb.run("id -u").output.strip() == str(sb._uid)
            assert sb.run("cat /root/.bashrc /etc/shadow").exit_code != 0


def test_local_root_holds_only_the_sandbox_toolchain_and_read_only_paths(isolated, open_tmp):
    """A link to any host path but the toolchain and `read_only` finds nothing: no host
    accounts (/etc/passwd is the sandbox's own), no world-readable file elsewhere."""
    secret, shared = open_tmp / "secret", open_tmp / "shared"
    for directory, text in ((secret, "hunter2"), (shared, "visible")):
        directory.mkdir()
        (directory / "f.txt").write_text(text)
        os.chmod(directory, 0o755)
        os.chmod(directory / "f.txt", 0o644)
    with open("/etc/passwd") as f:
        host_users = {line.split(":")[0] for line in f if line.strip()}
    assert host_users - {"root", "nobody"}, "the host has accounts besides root and nobody"
    with LocalSandbox(Source(repo_files=FILES), LocalOptions(read_only=[str(shared)])) as sb:
        links = f"ln -s /etc/passwd p && ln -s {secret}/f.txt s && ln -s {shared}/f.txt v"
        assert sb.run(links).exit_code == 0
        users = {line.split(":")[0] for line in sb.read_file("p").splitlines()}
        assert users == {"root", "sandbox", "nobody"}
        assert sb.read_file("v") == "visible"
        with pytest.raises(FileNotFoundError):
            sb.read_file("s")
        for command in (f"cat {secret}/f.txt", "cat s", "ls /root", "ls /home", "cat /etc/shadow",
                        f"ls {ROOT}", "touch /tmp/x", f"touch {shared}/x"):
            result = sb.run(command)
            assert result.exit_code != 0 and "hunter2" not in result.output, command
        assert sb.run("python3 -c 'import ssl, sqlite3' && git --version && awk 'BEGIN{}'"
                      ).exit_code == 0
        assert sb.run("whoami").output.strip() == "sandbox"
    for bad in (["relative/dir"], ["/"], "/opt"):
        with pytest.raises(ValueError, match="read_only"):
            LocalSandbox(Source(repo_files=FILES), LocalOptions(read_only=bad))


def test_local_total_memory_bound_ends_a_command_not_the_sandbox(memory_cgroups):
    """Three processes of 120 MiB each fit their own address-space limit but not the
    sandbox's 300 MiB together: the kernel ends one; the sandbox goes on, and one
    alone runs. Without the cgroup all three would run (sum 360 MiB)."""
    hold = "python3 -c 'b = bytearray(120 << 20); import time; time.sleep(2); print(\"held\")'"
    limits = LocalLimits(memory_bytes=1 << 30, total_memory_bytes=300 << 20)
    with LocalSandbox(Source(repo_files=FILES), LocalOptions(limits=limits)) as sb:
        group = sb._memory.path
        result = sb.run(f"for i in 1 2 3; do {hold} & done; wait")
        held = result.output.splitlines().count("held")
        assert held < 3 and "Killed" in result.output, result.output
        assert sb.oom_kills() >= 1
        assert sb.run(hold).output.strip() == "held"
    assert not os.path.exists(group)


NO_CGROUP_SCRIPT = """
import logging
from env.sandbox import SandboxFactory
logging.basicConfig(format="%(levelname)s %(message)s")
factory = SandboxFactory("local")
for _ in range(2):
    with factory.create(repo_files={"a.py": "x = 1\\n"}) as sb:
        assert sb.run("echo ok").output == "ok\\n"
print(factory.metrics())
print(factory.metrics())
"""


def test_local_without_a_memory_cgroup_warns_once_and_counts_it(isolated, memory_cgroups):
    """An empty tmpfs over /sys/fs/cgroup (a mount namespace of the child's own): no memory
    cgroup can be made, so both sandboxes run without a total bound; one warning says so
    and the factory's metrics count them. Here, with cgroups, the count is 0."""
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs none {cgroup.CGROUP_ROOT} && exec {sys.executable} -c "
         f"'{NO_CGROUP_SCRIPT}'"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["{'env/no_memory_cgroup': 2.0}",
                                        "{'env/no_memory_cgroup': 0.0}"], done.stdout
    warnings = [line for line in done.stderr.splitlines() if "no total memory bound" in line]
    assert len(warnings) == 1 and "no memory cgroup can be made here" in warnings[0], \
        done.stderr
    factory = SandboxFactory("local")
    with factory.create(repo_files=FILES) as sb:
        assert sb._memory is not None
    assert factory.metrics() == {"env/no_memory_cgroup": 0.0}


def test_local_from_repo_dir_at_base_commit(tmp_path):
    src = tmp_path / "src"
    with SandboxFactory("local").create(repo_files=FILES) as first:
        first.write_file("calc.py", "changed\n")
        first.run("git add -A && git commit -qm second")
        subprocess.run(["cp", "-r", first.repo, str(src)], check=True)
        base = first.base_commit
    with SandboxFactory("local").create(repo_dir=str(src), base_commit=base) as sb:
        assert sb.read_file("calc.py") == FILES["calc.py"]
        assert sb.base_commit == base and sb.patch() == ""
    with pytest.raises(ValueError, match="cannot check out"):
        SandboxFactory("local").create(repo_dir=str(src), base_commit="0" * 40)


@pytest.fixture
def open_tmp():
    """A directory other users can traverse (sandboxes under a dedicated uid need it)."""
    path = tempfile.mkdtemp(prefix="reap-test-")
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_local_reap_stale_removes_only_sandboxes_of_exited_owners(open_tmp):
    tmp_path = open_tmp
    # A process that made a sandbox with a command still running in it, and was killed.
    script = textwrap.dedent(f"""
        import os, signal, sys, threading
        sys.path.insert(0, {ROOT!r})
        from env.sandbox import SandboxFactory
        sb = SandboxFactory("local").create(repo_files={{"a.py": "x = 1\\n"}},
                                            root_dir={str(tmp_path)!r})
        threading.Thread(target=sb.run, args=("sleep 60",), daemon=True).start()
        print(sb.root, sb._uid, flush=True)
        threading.Event().wait(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    dead_root, uid = out.stdout.split()
    assert os.path.isdir(dead_root)
    foreign = tmp_path / "sandbox-foreign"  # no owner record: not ours to remove
    foreign.mkdir()
    with SandboxFactory("local").create(repo_files=FILES, root_dir=str(tmp_path)) as live:
        reused = tmp_path / "sandbox-reused"  # this pid, but a process started at tick 0
        reused.mkdir()
        (reused / ".owner").write_text(json.dumps({"owner": f"{os.getpid()}:0"}))
        assert sorted(reap_stale(str(tmp_path))) == sorted([dead_root, str(reused)])
        assert not os.path.exists(dead_root) and not reused.exists() and foreign.is_dir()
        assert live.run("cat calc.py").output == FILES["calc.py"]
        if os.geteuid() == 0 and uid != "None":  # its orphaned `sleep 60` was killed
            assert uid_processes(int(uid)) == []
        if cgroup.available():  # and its memory cgroup removed
            assert not os.path.exists(os.path.join(cgroup.parent()[0], os.path.basename(dead_root)))
        assert reap_stale(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == ["sandbox-foreign"]


def test_exit_codes_and_output_forms(make):
    sb = make(repo_files=FILES, max_output_bytes=1 << 16)
    for cmd, code in [("exit 3", 3), ("exit 255", 255), ("kill -9 $$", 137),
                      ("kill -TERM $$", 143), ("no-such-command-here", 127), ("true", 0)]:
        res = sb.run(cmd)
        assert (res.exit_code, res.timed_out) == (code, False), (cmd, res)
    assert sb.run("printf abc").output == "abc"  # no trailing newline
    assert sb.run("printf '\\x00\\x01\\xff\\xfe'").output == "\x00\x01\ufffd\ufffd"
    start = time.monotonic()
    res = sb.run("printf head; head -c 50M /dev/urandom; printf tail")
    assert res.truncated and res.exit_code == 0 and time.monotonic() - start < 60
    assert res.output.startswith("head") and res.output.endswith("tail")
    assert "bytes of output truncated" in res.output


def test_a_command_that_ignores_signals_still_times_out(make):
    sb = make(repo_files=FILES)
    sleep = marker_sleep()
    res = sb.run(f"trap '' TERM INT HUP; ({sleep} &); while :; do :; done", timeout=1)
    assert res.timed_out and res.exit_code == -1
    assert host_processes(sleep) == []
    assert sb.run("echo ok").output == "ok\n"


# -- local only -----------------------------------------------------------------------


def server_pid(sb) -> int:
    """Host pid of the sandbox's command server: the supervisor itself unisolated, its
    child (the PID namespace's init) isolated."""
    outer = sb._supervisor.proc.pid
    if not sb.isolated:
        return outer
    with open(f"/proc/{outer}/task/{outer}/children") as f:
        return int(f.read().split()[0])


def test_local_limits_hold_for_every_command():
    limits = LocalLimits(cpu_seconds=1, memory_bytes=1 << 30, max_processes=64)
    with SandboxFactory("local").create(repo_files=FILES, limits=limits) as sb:
        for _ in range(2):  # the same limits for a later command of the same supervisor
            assert sb.run("ulimit -t; ulimit -v; ulimit -u").output.split() == [
                "1", str((1 << 30) // 1024), "64"]
            res = sb.run("python3 -c 'while True: pass'", timeout=120)
            # Soft and hard limit are one: the kernel's SIGKILL at the hard limit.
            assert (res.exit_code, res.timed_out) == (128 + signal.SIGKILL, False), res


def test_local_command_text_reaches_bash_whole():
    """Short scripts go to bash through argv, long ones (or with a NUL) through a memfd:
    both run the same text."""
    with SandboxFactory("local").create(repo_files=FILES) as sb:
        for filler in ("", "☃" * 40_000):  # 120 KB of UTF-8: over the argv path's size
            res = sb.run(f": '{filler}'\nprintf '%s|' \"$0\" done\nfoo_missing\nexit 7")
            assert res.exit_code == 7 and res.output.startswith("bash|done|"), res.output[:200]
            assert "line 3: foo_missing: command not found" in res.output
        res = sb.run("echo a\0b")  # bash drops the NUL, as it does reading any script
        assert res.exit_code == 0 and res.output.endswith("ab\n"), res.output


def test_local_commands_cannot_kill_the_supervisor():
    with SandboxFactory("local").create(repo_files=FILES) as sb:
        assert sb.isolated and sb._uid is not None
        res = sb.run("kill -9 1; echo rc=$?; kill -9 $PPID; echo rc=$?; kill -9 -1; echo rc=$?")
        assert res.output.count("Operation not permitted") == 2, res.output
        assert res.output.count("rc=1\n") == 3  # kill -1: none it may signal but itself
        assert sb.run("echo ok").output == "ok\n"


def test_local_background_children_are_killed_after_each_command():
    with SandboxFactory("local").create(repo_files=FILES) as sb:
        sleep = marker_sleep()
        res = sb.run(f"setsid nohup {sleep} >/dev/null 2>&1 & disown; "
                     f"(trap '' HUP TERM; {sleep} &) & echo started")
        assert (res.exit_code, res.output) == (0, "started\n")
        assert host_processes(sleep) == [] and uid_processes(sb._uid) == []
        # The next command shares no process with the last: /proc lists the server and
        # this command's own processes (bash, ls, grep).
        assert int(sb.run("ls /proc | grep -c '^[0-9]'").output) <= 4


@pytest.mark.parametrize("victim", ["group", "server"])
def test_local_supervisor_killed_mid_command_is_an_infrastructure_error(victim):
    with SandboxFactory("local").create(repo_files=FILES) as sb:
        sleep = marker_sleep()
        thread, result = run_in_background(sb, f"{sleep} & {sleep}", sleep, 2)
        if victim == "group":  # as `kill -9 -PGID` of the supervisor would
            os.killpg(sb._supervisor.proc.pid, signal.SIGKILL)
        else:
            os.kill(server_pid(sb), signal.SIGKILL)
        thread.join(20)
        assert not thread.is_alive() and "supervisor" in str(result["err"])
        assert host_processes(sleep) == [] and uid_processes(sb._uid) == []
        with pytest.raises(SandboxError, match="supervisor"):
            sb.run("echo hi")
        with pytest.raises(SandboxError, match="supervisor"):
            sb.read_file("calc.py")
        sb.close()
        assert not os.path.exists(sb.root) and not running(sb._supervisor.proc.pid)


def test_local_supervisor_dying_between_commands_ends_the_episode_as_env_error():
    from env.episode import Episode
    from env.tasks import Task

    task = Task("dies", "test repo", repo_files=FILES)
    with Episode(SandboxFactory("local"), task) as ep:
        ep.reset()
        assert ep.step({"name": "execute_bash", "arguments": {"command": "echo hi"}}) == (
            "hi", False)
        os.kill(server_pid(ep.sandbox), signal.SIGKILL)
        observation, done = ep.step({"name": "execute_bash", "arguments": {"command": "true"}})
        assert done and ep.status == "env_error" and ep.error.startswith("SandboxError")
        assert "supervisor" in ep.error and ep.reward() is None
        uid, supervisor = ep.sandbox._uid, ep.sandbox._supervisor.proc.pid
        assert uid_processes(uid) == []
    assert not running(supervisor) and uid_processes(uid) == []


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_local_supervisors_are_forked_by_one_fork_server_and_reaped():
    """Every sandbox's supervisor is a child of this process's one fork server (no
    interpreter started per sandbox); a closed one is reaped (no zombie left); a dead
    fork server is replaced at the next sandbox, and the sandboxes it forked run on."""
    from env.sandbox import supervisor

    boxes = [SandboxFactory("local").create(repo_files=FILES) for _ in range(3)]
    try:
        server = supervisor._fork_server().proc
        pids = [sb._supervisor.proc.pid for sb in boxes]
        assert {parent_pid(pid) for pid in pids} == {server.pid} and len(set(pids)) == 3
        boxes.pop().close()
        assert not os.path.exists(f"/proc/{pids[2]}")  # reaped, not a zombie
        server.kill()
        server.wait(10)
        assert boxes[0].run("echo still").output == "still\n"
        boxes.append(SandboxFactory("local").create(repo_files=FILES))
        replacement = supervisor._fork_server().proc
        assert replacement.pid != server.pid and replacement.poll() is None
        assert parent_pid(boxes[-1]._supervisor.proc.pid) == replacement.pid
        assert boxes[-1].run("echo new").output == "new\n"
    finally:
        for sb in boxes:
            sb.close()
    assert all(not running(pid) for pid in pids)


def test_local_supervisor_stop_says_clean_only_after_its_own_clean_up(tmp_path):
    """stop() is True only for a supervisor that exited by itself with code 0 (close()
    then skips its scan of /proc for the uid's processes), not for a killed one."""
    from env.sandbox.local import SAFE_PATH
    from env.sandbox.supervisor import Confinement, Supervisor

    for victim in (None, "group", "server"):
        root = tmp_path / str(victim)
        root.mkdir()
        sup = Supervisor(str(root), {"PATH": SAFE_PATH}, Confinement(isolate=str(root)))
        assert sup.run(["true"], 30).exit_code == 0
        if victim == "group":
            os.killpg(sup.proc.pid, signal.SIGKILL)
        elif victim == "server":
            with open(f"/proc/{sup.proc.pid}/task/{sup.proc.pid}/children") as f:
                os.kill(int(f.read().split()[0]), signal.SIGKILL)
        if victim:
            assert sup.proc.wait(10)
        assert sup.stop() is (victim is None), victim


def test_local_supervisor_ends_with_its_owner(open_tmp):
    """A trainer killed while a command runs: the supervisor sees its control socket
    close, kills the command and exits; no process of the sandbox is left."""
    sleep = marker_sleep()
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path.insert(0, {ROOT!r})
        from env.sandbox import SandboxFactory
        sb = SandboxFactory("local").create(repo_files={{"a.py": "x = 1\\n"}},
                                            root_dir={str(open_tmp)!r})
        threading.Thread(target=sb.run, args=({sleep!r},), daemon=True).start()
        print(sb._supervisor.proc.pid, sb._uid, flush=True)
        while not os.popen("pgrep -f '^{sleep}$'").read():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    supervisor, uid = (int(x) for x in out.stdout.split())
    deadline = time.monotonic() + 10
    while (host_processes(sleep) or uid_processes(uid) or running(supervisor)) and (
            time.monotonic() < deadline):
        time.sleep(0.05)
    assert host_processes(sleep) == [] and uid_processes(uid) == []
    assert not running(supervisor)


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie has no command line)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return bool(f.read())
    except OSError:
        return False


def test_local_concurrent_sandboxes_and_commands_stay_apart():
    sandboxes = [SandboxFactory("local").create(repo_files={"id.txt": f"{i}\n"}) for i in range(6)]
    try:
        def work(i):
            sb = sandboxes[i]
            outs = []
            for _ in range(5):
                res = sb.run(f"cat id.txt; echo {i} >> log; ls /proc | grep -c '^[0-9]'")
                outs.append(res.output.split())
            return outs

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(work, range(6)))
        for i, outs in enumerate(results):
            assert all(out[0] == str(i) and int(out[1]) <= 4 for out in outs), outs
            assert sandboxes[i].read_file("log") == f"{i}\n" * 5
        # Commands sent to one sandbox from several threads run one at a time, each whole.
        sb = sandboxes[0]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda k: sb.run(f"echo {k}; sleep 0.1; echo {k}").output,
                                 range(8)))
        assert outs == [f"{k}\n{k}\n" for k in range(8)]
    finally:
        for sb in sandboxes:
            sb.close()
    assert not any(os.path.exists(sb.root) for sb in sandboxes)


# -- docker only ----------------------------------------------------------------------


@pytest.fixture
def docker_sb(docker_image):
    client, image = docker_image
    sb = SandboxFactory("docker").create(image=image, client=client, repo_files=FILES)
    yield client, sb
    sb.close()


def test_docker_has_no_network(docker_sb):
    _, sb = docker_sb
    res = sb.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), "
                 "timeout=3)\"", timeout=20)
    assert res.exit_code != 0 and "unreachable" in res.output


def test_docker_killed_container_is_an_infrastructure_error(docker_sb):
    client, sb = docker_sb
    container_id = sb.container_id
    client.api.kill(container_id)
    with pytest.raises(SandboxError, match="not running|no longer exists"):
        sb.run("echo hi")
    sb.close()
    assert client.containers.list(all=True, filters={"id": container_id}) == []


def test_docker_container_killed_mid_command_is_an_infrastructure_error(docker_image):
    client, image = docker_image
    for how in ("kill", "remove"):
        sb = SandboxFactory("docker").create(image=image, client=client, repo_files=FILES)
        assert sb.run("kill -9 $$").exit_code == 137  # a command's own signal: a result
        sleep = marker_sleep()

        def kill_when_running(sb=sb, sleep=sleep, how=how):
            deadline = time.monotonic() + 10
            while not host_processes(sleep, exact=True) and time.monotonic() < deadline:
                time.sleep(0.02)
            if how == "kill":
                client.api.kill(sb.container_id)
            else:
                client.api.remove_container(sb.container_id, force=True)

        killer = threading.Thread(target=kill_when_running)
        killer.start()
        try:
            # The engine may report the exec's exit (137) before the container's.
            with pytest.raises(SandboxError, match="stopped while|no longer exists"):
                sb.run(sleep, timeout=60)
        finally:
            killer.join()
            sb.close()


def test_docker_repository_from_the_image(docker_image):
    client, image = docker_image
    with SandboxFactory("docker").create(image=image, client=client, repo_files=FILES) as first:
        first.write_file("calc.py", "changed\n")
        first.run("git add -A && git -c user.name=a -c user.email=a@b commit -qm second")
        base = first.base_commit
        container = client.containers.get(first.container_id)
        tagged = container.commit(repository="swe-sandbox-test-repo", tag=secrets.token_hex(4))
    try:
        with SandboxFactory("docker").create(image=tagged.id, client=client,
                                             base_commit=base) as sb:
            assert sb.read_file("calc.py") == FILES["calc.py"] and sb.patch() == ""
        with pytest.raises(ValueError, match="workdir|does not exist"):
            SandboxFactory("docker").create(image=tagged.id, client=client, workdir="/nowhere")
    finally:
        client.images.remove(tagged.id, force=True)


@pytest.mark.parametrize("host", ["unix:///nonexistent.sock", "tcp://127.0.0.1:1"])
def test_unreachable_daemon_is_a_clear_sandbox_error(monkeypatch, host):
    monkeypatch.setenv("DOCKER_HOST", host)
    with pytest.raises(SandboxError, match=host.replace(".", r"\.")):
        SandboxFactory("docker").create(image=IMAGE)


# -- pool -----------------------------------------------------------------------------


def pool_for(backend, request, max_concurrent):
    if backend == "docker":
        client, image = request.getfixturevalue("docker_image")
        return SandboxPool(SandboxFactory("docker", image=image, client=client),
                           max_concurrent), client
    return SandboxPool(SandboxFactory("local"), max_concurrent), None


def leftovers(pool, client, sandboxes, marker):
    containers = []
    if client is not None:
        containers = client.containers.list(all=True,
                                            filters={"label": f"{FACTORY_LABEL}={pool.factory.id}"})
    dirs = [sb.root for sb in sandboxes if hasattr(sb, "root") and os.path.exists(sb.root)]
    return containers, host_processes(marker), dirs


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_pool_bounds_concurrency(backend, request):
    pool, client = pool_for(backend, request, max_concurrent=2)
    active, peak = 0, 0
    two_alive = asyncio.Event()

    async def episode(i):
        nonlocal active, peak
        async with pool.acquire({"repo_files": {"i.txt": f"{i}\n"}}) as sb:
            active += 1
            peak = max(peak, active)
            if active == 2:
                two_alive.set()
            await asyncio.wait_for(two_alive.wait(), 120)  # the first two overlap
            res = await pool.call(sb.run, "sleep 0.3; cat i.txt")
            active -= 1
            return res.output

    async def main():
        async with pool:
            return await asyncio.gather(*(episode(i) for i in range(5)))

    assert asyncio.run(main()) == [f"{i}\n" for i in range(5)]
    assert peak == 2 and pool.peak == 2 and pool.live == 0


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_pool_cleans_up_after_exceptions_and_cancellation(backend, request):
    pool, client = pool_for(backend, request, max_concurrent=3)
    sleep = marker_sleep()
    seen = []
    all_acquired = asyncio.Event()

    async def failing(i):
        async with pool.acquire({"repo_files": FILES}) as sb:
            seen.append(sb)
            if len(seen) == 3:
                all_acquired.set()
            await asyncio.wait_for(all_acquired.wait(), 120)
            if i == 0:
                await pool.call(sb.run, sleep, 60)  # cancelled by the failures below
            deadline = time.monotonic() + 30
            while not host_processes(sleep, exact=True) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            raise RuntimeError(f"episode {i} crashed")

    async def main():
        async with pool:
            await asyncio.gather(*(failing(i) for i in range(3)))

    with pytest.raises(RuntimeError, match="crashed"):
        asyncio.run(main())
    assert len(seen) == 3
    assert leftovers(pool, client, seen, sleep) == ([], [], [])


def test_pool_slot_stays_taken_until_a_cancelled_creation_is_closed():
    gate = threading.Event()
    events = []

    class Recorded(SandboxFactory):
        def __call__(self, spec):
            return factory(spec)

    def factory(spec):
        events.append(f"create {spec}")
        if spec == "a":
            gate.wait(30)
        sandbox = SandboxFactory("local").create(repo_files=FILES)
        close = sandbox.close

        def recorded_close():
            close()
            events.append(f"closed {spec}")

        sandbox.close = recorded_close
        return sandbox

    pool = SandboxPool(Recorded("local"), max_concurrent=1)

    async def use(spec):
        async with pool.acquire(spec):
            events.append(f"used {spec}")

    async def main():
        async with pool:
            first = asyncio.create_task(use("a"))
            while "create a" not in events:
                await asyncio.sleep(0.01)
            first.cancel()
            second = asyncio.create_task(use("b"))
            await asyncio.sleep(0.3)
            assert "create b" not in events  # a's sandbox is still being made
            gate.set()
            await second
            with pytest.raises(asyncio.CancelledError):
                await first

    asyncio.run(main())
    assert events == ["create a", "closed a", "create b", "used b", "closed b"]
    assert pool.peak == 1 and pool.live == 0


def test_pool_retries_transient_creation_errors():
    failures = []

    class Flaky(SandboxFactory):
        def __call__(self, spec):
            if len(failures) < 2:
                failures.append(1)
                raise SandboxError("engine busy")
            return self.create(repo_files=spec)

    flaky = Flaky("local")
    pool = SandboxPool(flaky, max_concurrent=1, backoff_s=0.01)

    async def main():
        async with pool, pool.acquire(FILES) as sb:
            return await pool.call(sb.read_file, "calc.py")

    assert asyncio.run(main()) == FILES["calc.py"] and len(failures) == 2
    with pytest.raises(ValueError):
        SandboxPool(flaky, max_concurrent=0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("backend", ["local", "docker"])
def test_pool_closes_everything_on_signals(backend, signum, request, tmp_path):
    args = {"local": "", "docker": f"image={IMAGE!r}"}[backend]
    if backend == "docker":
        _, _ = request.getfixturevalue("docker_image")
    sleep = marker_sleep()
    script = tmp_path / "episode.py"
    # The child resets SIGINT and SIGTERM as a foreground process has them: a signal ignored
    # at exec stays ignored (Python then installs no KeyboardInterrupt handler), and a
    # non-interactive shell starts background jobs (`nohup pytest &`) with SIGINT ignored.
    script.write_text(textwrap.dedent(f"""\
        import asyncio, signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from env.sandbox import SandboxFactory
        from env.sandbox.pool import SandboxPool
        pool = SandboxPool(SandboxFactory({backend!r}, {args}), 2)

        async def episode():
            async with pool.acquire({{"repo_files": {{"a": "b"}}}}) as sb:
                print(pool.factory.id, getattr(sb, "root", ""), flush=True)
                await pool.call(sb.run, {sleep!r}, 60)

        async def main():
            await asyncio.gather(episode(), episode())

        asyncio.run(main())
        """))
    # Start it with both ignored, as under `nohup pytest &`, whatever runs this test.
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": ROOT})
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    lines = [proc.stdout.readline().split() for _ in range(2)]
    deadline = time.monotonic() + 15
    while len(host_processes(sleep, exact=True)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(host_processes(sleep, exact=True)) == 2
    proc.send_signal(signum)
    # SIGTERM: SystemExit(128 + 15) from the pool's handler; SIGINT: KeyboardInterrupt.
    assert proc.wait(30) == (128 + signum if signum == signal.SIGTERM else -signum)
    pool_id = lines[0][0]
    assert host_processes(sleep) == []
    if backend == "docker":
        client = request.getfixturevalue("docker_client")
        assert client.containers.list(
            all=True, filters={"label": f"{FACTORY_LABEL}={pool_id}"}) == []
    else:
        assert not any(os.path.exists(line[1]) for line in lines)


def test_docker_frames_already_buffered_with_the_headers_are_kept():
    """docker-py hands out the raw socket of an exec; output that arrived with the HTTP
    headers sits in the client's buffer. _read_frames must parse those bytes first (they
    were lost before: empty `cat` output under load)."""
    import socket
    import struct

    from env.sandbox.docker import _read_frames

    def frame(stream, data):
        return struct.pack(">BxxxL", stream, len(data)) + data

    a, b = socket.socketpair()
    try:
        b.sendall(frame(1, b"world\n"))
        b.close()  # EOF after the one frame still on the socket
        out, err = bytearray(), bytearray()
        initial = frame(1, b"hello ") + frame(2, b"warn\n")
        assert _read_frames(a, out, err, time.monotonic() + 5, initial)
        assert bytes(out) == b"hello world\n" and bytes(err) == b"warn\n"
    finally:
        a.close()


def test_sigterm_while_the_main_thread_holds_the_pools_executor_lock(tmp_path):
    """SIGTERM arriving while the main thread is inside the pool's executor (submit holds
    its shutdown lock while a worker thread starts, which is when it came in train.py)
    still ends the process with 128 + 15 and closes the pool's sandboxes."""
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent("""\
        import asyncio, os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from env.sandbox import SandboxFactory
        from env.sandbox.pool import SandboxPool
        pool = SandboxPool(SandboxFactory("local"), 2)

        async def main():
            async with pool.acquire({"repo_files": {"a": "b"}}) as sb:
                print(sb.root, flush=True)
                with pool._executor._shutdown_lock:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(60)

        asyncio.run(main())
        """))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    (root,) = proc.stdout.split()
    assert not os.path.exists(root)
