"""120 episodes with random kills leave zero containers and zero stray processes.

Generated mini-SWE tasks (difficulty 0) run as env.episode.Episode through a
`SandboxPool`, CONCURRENCY at a time. A seeded plan gives every episode a kind:

  normal    fix the bug (str_replace), finish: status finished, the fix in the patch;
            GRADED of them also run the tests: reward 1.0
  kill      another thread kills the sandbox from outside at a random moment of a
            command that cannot end by itself (a step, or the grading run) or, on
            docker, between two steps. Docker: `docker kill` or forced removal of the
            container; local: SIGKILL to the running command's process group. Expected:
            status env_error and reward None, never a scored 0
  cancel    the episode's asyncio task is cancelled at a random moment inside its
            acquire block (during a step or a command)
  creating  the task is cancelled at a random moment soon after it asked for a sandbox
            (one of the first episodes, so most likely while the sandbox is made)
  crash     an exception raised inside the acquire block

Then: never more than CONCURRENCY sandboxes were alive; every acquire block released
its sandbox (the pool holds none and the engine lists no container of the pool, checked
before the pool's own close, whose label sweep would hide a leak, and again after it);
no process anywhere on the host runs the victims' marker command or names one of the
containers (shims), this process has no new child, the local sandboxes' uids run
nothing and their directories are gone. References: the Docker engine's own listing and
the host's /proc. Kept short (a few execs per episode, 7 waves of CONCURRENCY episodes)
to stay within about 45 s on 2 cores for docker.
"""

import asyncio
import concurrent.futures
import dataclasses
import os
import random
import secrets
import shutil
import signal
import tempfile
import time

import pytest
from sandbox_backends import BACKENDS, docker_defaults

from env.episode import Episode, EpisodeOptions
from env.miniswe import generate_tasks
from env.sandbox import FACTORY_LABEL, SandboxFactory, sandbox_spec
from env.sandbox.base import Source
from env.sandbox.local import LocalLimits, LocalSandbox
from env.sandbox.pool import SandboxPool

N_EPISODES = 120
CONCURRENCY = 16
SEED = 7
COUNTS = {"kill": 30, "cancel": 6, "creating": 4, "crash": 6}  # the rest are normal
GRADED = 0.3  # share of the normal episodes that are graded too
STEP_TIMEOUT_S = 20.0  # a kill that did not happen shows up as a timeout after this
FINISH = {"name": "finish", "arguments": {}}


class Crash(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: str  # normal | kill | cancel | creating | crash
    fix_first: bool  # fix the bug before the rest of the script
    kill_at: str = ""  # kill: step | grade | idle (between steps; docker only)
    how: str = ""  # kill: kill | remove (docker), killpg (local)
    delay: float = 0.0  # seconds from the victim command (kill) / the signal (cancel)
    graded: bool = False  # normal: also run the tests (most only finish, to save time)


def make_plans(backend: str, rng: random.Random) -> list[Plan]:
    kinds = ["normal"] * N_EPISODES
    # "creating" episodes are among the first ones, which get a slot at once.
    first = rng.sample(range(CONCURRENCY), COUNTS["creating"])
    rest = rng.sample([i for i in range(N_EPISODES) if i not in first],
                      COUNTS["kill"] + COUNTS["cancel"] + COUNTS["crash"])
    for i in first:
        kinds[i] = "creating"
    for i, kind in zip(rest, ["kill"] * COUNTS["kill"] + ["cancel"] * COUNTS["cancel"]
                       + ["crash"] * COUNTS["crash"], strict=True):
        kinds[i] = kind
    plans = []
    for kind in kinds:
        fix_first = rng.random() < 0.5
        if kind == "kill":
            points = ["step", "step", "grade"] + (["idle"] if backend == "docker" else [])
            kill_at = rng.choice(points)
            how = rng.choice(["kill", "remove"]) if backend == "docker" else "killpg"
            delay = 0.0 if kill_at == "idle" else rng.uniform(0, 0.25 if backend == "docker"
                                                              else 0.05)
            plans.append(Plan(kind, fix_first or kill_at == "grade", kill_at, how, delay))
        elif kind in ("cancel", "creating"):
            plans.append(Plan(kind, fix_first, delay=rng.uniform(0.0, 0.3 if kind == "cancel"
                                                                 else 1.0)))
        else:
            plans.append(Plan(kind, fix_first or kind == "normal",
                              graded=kind == "normal" and rng.random() < GRADED))
    return plans


def bash(command: str) -> dict:
    return {"name": "execute_bash", "arguments": {"command": command}}


def fix(task) -> dict:
    bug = task.metadata["bugs"][0]
    return {"name": "file_editor", "arguments": {
        "command": "str_replace", "path": bug["path"], "old_str": bug["buggy"],
        "new_str": bug["fixed"]}}


# -- leftovers -------------------------------------------------------------------------


def proc_table() -> dict[int, tuple[int, int, bytes]]:
    """pid -> (ppid, real uid, cmdline) of every process on the host (zombies included)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        table[int(name)] = (int(fields["PPid"]), int(fields["Uid"].split()[0]), cmdline)
    return table


def descendants(table: dict[int, tuple[int, int, bytes]]) -> set[int]:
    found, stack = set(), [os.getpid()]
    while stack:
        parent = stack.pop()
        kids = [pid for pid, (ppid, _, _) in table.items() if ppid == parent]
        found.update(kids)
        stack += kids
    return found


def strays(before: set[int], marker: str, uids: set[int],
           container_ids: set[str]) -> dict[str, list[int]]:
    """Processes this run left: new descendants of this process, any process on the host
    running `marker` (docker exec'd ones are host processes too), processes of the local
    sandboxes' uids, and processes naming one of the containers (their shims)."""
    table = proc_table()
    ids = [cid.encode() for cid in container_ids]
    found = {
        "children": sorted(descendants(table) - before),
        "marker": [pid for pid, (_, _, cmd) in table.items()
                   if marker.encode() in cmd.replace(b"\0", b" ")],
        "uids": [pid for pid, (_, uid, _) in table.items() if uid in uids],
        "containers": [pid for pid, (_, _, cmd) in table.items()
                       if any(cid in cmd for cid in ids)],
    }
    return {what: pids for what, pids in found.items() if pids}


def pool_containers(client, pool, *labels: str) -> list:
    """Containers (running or not) carrying the pool factory's label (and `labels`); none on
    local."""
    if client is None:
        return []
    return client.containers.list(
        all=True, filters={"label": [f"{FACTORY_LABEL}={pool.factory.id}", *labels]})


async def eventually(check, timeout: float = 15.0):
    """check()'s first falsy value, or its last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (value := check()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return value


# -- the run ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_stress_random_kills_leave_nothing_behind(backend, request):
    rng = random.Random(SEED)
    plans = make_plans(backend, rng)
    tasks = generate_tasks(N_EPISODES, seed=SEED, difficulties=(0,))
    victim = f"sleep {secrets.randbelow(10**6) + 10**6}.5"  # no other process runs this
    if backend == "local":  # this process's fork server, which lives as long as it, first
        LocalSandbox(Source(repo_files={"a.py": ""})).close()
    children_before = descendants(proc_table())
    client, root_dir = None, None
    if backend == "docker":
        import docker

        defaults = docker_defaults(request)  # skips, or fails under REQUIRE_ALL, without one
        # A client of its own: enough pooled connections for every pool and killer thread.
        client = docker.from_env(timeout=60, max_pool_size=4 * CONCURRENCY)
        pool = SandboxPool(SandboxFactory("docker", **{**defaults, "client": client}),
                           CONCURRENCY)
    else:
        # Searchable by the sandboxes' own uids (LocalSandbox checks), unlike tmp_path.
        root_dir = tempfile.mkdtemp(prefix="stress-sandboxes-")
        os.chmod(root_dir, 0o755)
        pool = SandboxPool(SandboxFactory("local", limits=LocalLimits(memory_bytes=1 << 30),
                                          root_dir=root_dir), CONCURRENCY)
    killers = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="killer")
    container_ids: set[str] = set()
    uids: set[int] = set()

    def kill(sb, container_id: str | None, plan: Plan) -> None:
        """In a killer thread: kills the sandbox `plan.delay` s after its command started."""
        if backend == "docker":
            import docker.errors

            time.sleep(plan.delay)
            try:
                if plan.how == "kill":
                    client.api.kill(container_id)
                else:
                    client.api.remove_container(container_id, force=True)
            except docker.errors.APIError:
                # Gone, not running, removal in progress: the episode saw the kill and
                # removed the container first. Had the kill failed, the episode would not
                # end in env_error: its outcome is what the test checks.
                pass
            return
        # local: SIGKILL to the command's process group (its supervisor leads one).
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            with sb._lock:
                running = [proc.pid for proc in sb._running]
            if running or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        assert running, "the victim command never started"
        time.sleep(plan.delay)
        os.killpg(running[0], signal.SIGKILL)

    async def killed(sb, plan: Plan, action):
        """Runs action() in the pool while a killer thread kills the sandbox."""
        loop = asyncio.get_running_loop()
        killing = loop.run_in_executor(killers, kill, sb, getattr(sb, "container_id", None),
                                       plan)
        try:
            return await pool.call(action)
        finally:
            await killing

    async def episode(i: int, plan: Plan, ready: asyncio.Event):
        task = tasks[i]
        if plan.kill_at == "grade":  # the grading run cannot end before the kill
            task = dataclasses.replace(task, test_command=f"{victim} && {task.test_command}")
        if plan.kind == "creating":
            ready.set()
        async with pool.acquire(sandbox_spec(task, backend)) as sb:
            if backend == "docker":
                container_ids.add(sb.container_id)
            elif sb._uid is not None:
                uids.add(sb._uid)
            if plan.kind == "cancel":
                ready.set()
            # In place: the kills of the grading run hit this sandbox.
            ep = Episode(sb, task, EpisodeOptions(max_steps=8, test_timeout=STEP_TIMEOUT_S,
                                                  grading="in_place",
                                                  tools={"bash_timeout": STEP_TIMEOUT_S}))
            ep.reset()
            if plan.fix_first:
                await pool.call(ep.step, fix(task))
            if plan.kind == "crash":
                raise Crash(i)
            if plan.kind in ("cancel", "creating"):
                await pool.call(ep.step, bash(victim))
                raise AssertionError(f"episode {i} ({plan}) was not cancelled")
            if plan.kill_at == "idle":  # the container is dead before the next command
                await killed(sb, plan, lambda: None)
                await pool.call(ep.step, bash("true"))
            elif plan.kill_at == "step":
                await killed(sb, plan, lambda: ep.step(bash(victim)))
            else:
                await pool.call(ep.step, FINISH)
            if plan.kill_at == "grade":
                reward = await killed(sb, plan, ep.reward)
            elif plan.kind == "kill" or plan.graded:
                reward = await pool.call(ep.reward)
            else:
                reward = None
            return ep.status, reward, ep.error, ep.steps[-1].patch if ep.steps else ""

    async def cancel_when(task: asyncio.Task, ready: asyncio.Event, delay: float):
        await ready.wait()
        await asyncio.sleep(delay)
        task.cancel()

    async def main():
        async with pool:
            readies = [asyncio.Event() for _ in range(N_EPISODES)]
            running = [asyncio.create_task(episode(i, plan, readies[i]))
                       for i, plan in enumerate(plans)]
            cancels = [asyncio.create_task(cancel_when(running[i], readies[i], plan.delay))
                       for i, plan in enumerate(plans) if plan.kind in ("cancel", "creating")]
            results = await asyncio.wait_for(
                asyncio.gather(*running, return_exceptions=True), timeout=300)
            await asyncio.gather(*cancels)
            # Every acquire block has ended, so nothing is left for close() to sweep up (a
            # sandbox whose creation was cancelled is closed in the background once made).
            before_close = (await eventually(lambda: pool.live),
                            await eventually(lambda: pool_containers(client, pool)))
        return results, before_close

    start = time.monotonic()
    try:
        results, before_close = asyncio.run(main())
        elapsed = time.monotonic() - start
        print(f"{backend}: {N_EPISODES} episodes in {elapsed:.1f}s, peak {pool.peak} sandboxes")

        outcomes: dict[str, int] = {}
        for i, (plan, result) in enumerate(zip(plans, results, strict=True)):
            if plan.kind in ("cancel", "creating"):
                assert isinstance(result, asyncio.CancelledError), (i, plan, result)
            elif plan.kind == "crash":
                assert isinstance(result, Crash) and result.args == (i,), (i, plan, result)
            elif isinstance(result, BaseException):
                raise AssertionError(f"episode {i} ({plan}) raised") from result
            else:
                status, reward, error, patch = result
                if plan.kind == "kill":  # never a scored reward
                    assert (status, reward) == ("env_error", None), (i, plan, result)
                    assert error.startswith("SandboxError"), (i, plan, error)
                else:
                    assert (status, reward) == ("finished", 1.0 if plan.graded else None), (
                        i, plan, result)
                    fixed = tasks[i].metadata["bugs"][0]["fixed"]
                    assert any(line.startswith("+") and line[1:].strip() == fixed
                               for line in patch.splitlines()), (i, patch)
            key = "graded" if plan.graded else plan.kind + (f":{plan.kill_at}" * bool(
                plan.kill_at))
            outcomes[key] = outcomes.get(key, 0) + 1
        assert all(outcomes.get(k) for k in ("normal", "graded", "kill:step", "kill:grade",
                                              "cancel", "creating", "crash")), outcomes

        assert before_close == (0, [])
        assert pool.live == 0 and 1 < pool.peak <= CONCURRENCY
        if backend == "docker":
            from env.sandbox.docker import LABEL

            assert len(container_ids) >= N_EPISODES - COUNTS["creating"]
            assert pool_containers(client, pool, LABEL) == []
            assert [c.id for c in client.containers.list(all=True, filters={"label": LABEL})
                    if c.id in container_ids] == []
        else:
            assert os.listdir(root_dir) == []
        left = asyncio.run(eventually(
            lambda: strays(children_before, victim, uids, container_ids), timeout=10))
        assert left == {}
    finally:
        killers.shutdown(wait=True)
        if client is not None:
            client.close()
        if root_dir is not None:
            shutil.rmtree(root_dir, ignore_errors=True)
