"""Attacks through the project's own interfaces, on real local and Docker sandboxes.

Each one goes through an Episode (the path a rollout takes): it must end as a clear
observation to the model or, where the episode cannot go on, as env_error with the
reason; never as an exception out of the step. References: the sandbox's own shell
(`stat`, `wc`), the host's file system and /proc, a TCP server in this process.
"""

import os
import socket
import subprocess
import sys
import tracemalloc
import uuid

import pytest
from sandbox_backends import BACKENDS, docker_defaults

from env.episode import Episode, EpisodeOptions
from env.sandbox import SandboxFactory
from env.sandbox.base import Source
from env.sandbox.local import IsolationUnavailable, LocalLimits, LocalSandbox
from env.tasks import Task
from models.tokenizer import render_tool_call

FILES = {"calc.py": "def add(a, b):\n    return a + b\n"}
TASK = Task("attacks", "test repo", repo_files=FILES)
FILE_CAP = 32 << 20  # the largest file a command may write, in these tests
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def factory_for(request, backend, **overrides):
    if backend == "docker":
        return SandboxFactory("docker", **{**docker_defaults(request),
                                            "file_size_bytes": FILE_CAP, **overrides})
    return SandboxFactory("local", limits=LocalLimits(memory_bytes=1 << 30,
                                                       file_size_bytes=FILE_CAP), **overrides)


@pytest.fixture(params=BACKENDS)
def episode(request):
    with Episode(factory_for(request, request.param), TASK, EpisodeOptions(max_steps=50)) as ep:
        ep.reset()
        yield ep


def bash(command: str) -> str:
    return render_tool_call({"name": "execute_bash", "arguments": {"command": command}})


def test_deeply_nested_tool_calls_are_observations(episode):
    for text in ["<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",
                 '<tool_call>{"name": "execute_bash", "arguments": ' + "{" * 5000
                 + "}" * 5000 + "}</tool_call>",
                 '<tool_call>{"name": "finish", "arguments": "' + "[" * 5000 + '"}</tool_call>']:
        observation, done = episode.step(text)
        assert observation.startswith("ERROR: ") and not done, observation
    assert episode.status == "running" and len(episode.steps) == 3


def test_a_200kb_command_runs(episode):
    observation, done = episode.step(bash("echo " + "x" * 200_000 + " | wc -c"))
    assert observation == "200001" and not done and episode.status == "running"


def test_a_2gb_write_is_capped_with_a_clear_observation(episode):
    observation, _ = episode.step(bash("head -c 2G /dev/zero > huge.bin; echo rc=$?"))
    assert "File size limit exceeded" in observation and "rc=153" in observation
    assert episode.sandbox.run("stat -c %s huge.bin").output == f"{FILE_CAP}\n"


def test_a_64mb_file_ends_the_episode_without_reading_its_patch(episode):
    tracemalloc.start()
    episode.step(bash("head -c 30M /dev/urandom > a.bin && head -c 30M /dev/urandom > b.bin "
                      "&& head -c 4M /dev/urandom > c.bin"))  # 64 MiB, each file under the cap
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert episode.status == "env_error" and "PatchTooLarge" in episode.error
    assert "over the cap of 1048576 bytes" in episode.error
    assert peak < 8 << 20  # the patch's 64 MiB never reached this process
    assert episode.reward() is None


def test_local_disk_quota_bounds_the_sandbox():
    """The command sees ENOSPC; the patch that follows cannot be written either, so
    the episode ends as env_error naming it."""
    with Episode(SandboxFactory("local", limits=LocalLimits(file_size_bytes=FILE_CAP),
                                 disk_bytes=48 << 20), TASK) as ep:
        ep.reset()
        out = ep.sandbox.run("head -c 30M /dev/zero > a; head -c 30M /dev/zero > b; "
                             "echo rc=$?; cat a b | wc -c").output
        assert "No space left on device" in out and "rc=1" in out
        assert int(out.split()[-1]) < 48 << 20
        observation, done = ep.step(bash("true"))
        assert done and ep.status == "env_error" and "No space left on device" in ep.error


def test_local_commands_cannot_see_the_trainer_or_write_the_host(tmp_path, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("TRAINER_SECRET", secret)
    host_file = f"/tmp/sandbox-attack-{uuid.uuid4().hex}"
    with socket.socket() as server, LocalSandbox(Source(repo_files=FILES)) as sb:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        out = sb.run(f"cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c {secret}; "
                     f"ls /proc | grep -c '^[0-9]'; kill -0 {os.getpid()}; echo kill=$?; "
                     f"echo x > {host_file}; ln -s {host_file} link && echo x > link; "
                     f"echo x > {tmp_path}/f; echo x > /var/tmp/f-{secret}; "
                     f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", "
                     f"{port}), 2)' 2>&1 | tail -1").output
        lines = out.splitlines()
        assert lines[0] == "0"  # no environment holds the trainer's secret
        assert int(lines[1]) <= 4  # its own processes only: bash, cat, tr, grep, ls...
        assert "kill=1" in lines
        # /tmp and through the link: read-only; the test's tmp_path and /var/tmp are not
        # in the sandbox's root at all
        assert out.count("Read-only file system") == 2, out
        assert out.count("No such file or directory") == 2, out
        assert "ConnectionRefusedError" in lines[-1]  # its own loopback, nothing listens
        assert not os.path.exists(host_file) and not os.listdir(tmp_path)
        assert not os.path.exists(f"/var/tmp/f-{secret}")
        assert sb.run("echo ok > inside && cat inside").output == "ok\n"


# Runs each setuid program named on the command line (`--help`, with its stdout a full pipe,
# so it blocks in its first write, after exec) and prints its Uid line and NoNewPrivs.
SETUID_PROBE = r"""
import os, subprocess, sys, time
for prog in sys.argv[1:]:
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    p = subprocess.Popen([prog, "--help"], stdout=w, stderr=subprocess.DEVNULL)
    for _ in range(200):
        time.sleep(0.05)
        with open(f"/proc/{p.pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        if fields["State"].split()[0] == "S":
            break
    p.kill()
    p.wait()
    print(prog, *fields["Uid"].split(), fields["NoNewPrivs"].strip())
"""
SETUID_PROGRAMS = [p for p in ("su", "passwd", "chsh", "chfn") if os.path.exists(f"/usr/bin/{p}")
                   and os.stat(f"/usr/bin/{p}").st_mode & 0o4000]


def test_local_setuid_programs_run_without_privilege():
    """su, passwd, chsh, chfn are setuid root on the host: in the sandbox they run with
    the command's own uid (real, effective, saved, filesystem), under no_new_privs."""
    assert SETUID_PROGRAMS, "no setuid-root program among su, passwd, chsh, chfn"
    with LocalSandbox(Source(repo_files={"probe.py": SETUID_PROBE})) as sb:
        out = sb.run(f"python3 probe.py {' '.join(SETUID_PROGRAMS)}")
        uid = sb.run("id -u").output.strip()
    rows = [line.split() for line in out.output.splitlines()]
    assert [r[0] for r in rows] == SETUID_PROGRAMS, out.output
    for prog, *uids, no_new_privs in rows:
        assert uids == [uid] * 4 and no_new_privs == "1", (prog, uids, no_new_privs)


def test_local_refuses_to_run_unisolated_unless_allowed():
    """Without CAP_SYS_ADMIN (an unprivileged container; setpriv drops it) no namespaces
    can be had: the backend refuses to start unless running untrusted code unisolated
    is explicitly accepted."""
    marker = f"sleep {uuid.uuid4().int % 10**6 + 10**6}.5"  # left in the background
    script = ("import subprocess\n"
              "from env.sandbox.base import Source\n"
              "from env.sandbox.local import IsolationUnavailable, LocalOptions, LocalSandbox\n"
              "try:\n    LocalSandbox(Source(repo_files={'a': 'b'}))\n"
              "except IsolationUnavailable as e:\n"
              "    print('refused:', e)\n"
              "with LocalSandbox(Source(repo_files={'a': 'b'}),\n"
              "                  LocalOptions(allow_unisolated=True)) as sb:\n"
              f"    sb.run('(setsid {marker} &); {marker} & echo bg')\n"
              f"    left = subprocess.run(['pgrep', '-f', '^{marker}$']).returncode != 1\n"
              "    print(sb.isolated, left, sb.run('cat a').output)\n")
    done = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin",
                           sys.executable, "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: the local sandbox cannot isolate commands here")
    assert done.stdout.endswith("False False b\n")  # nothing left after the command
    assert issubclass(IsolationUnavailable, RuntimeError)
