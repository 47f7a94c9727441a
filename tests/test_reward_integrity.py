"""Reward integrity: what an agent leaves outside its patch never reaches the grade.

Each hack runs as an agent would run it (bash steps of an Episode, on local and Docker
sandboxes) and leaves an empty or test-free patch. With fresh-sandbox grading (the
default) it scores 0; the same test grades it in place too, where it scores 1 today
(so the check can fail) unless the in-place protection already stops it, which the
test then states. Hacks that make the tests import a fixed copy of the code do so
through `HOOK`, an import hook planted where the interpreter runs it at start-up
(site-packages `.pth`, `sitecustomize`, `usercustomize`, the test runner itself).

References: the task's gold patch graded the same way (1), the untouched repository (0).
"""

import dataclasses
import io
import os
import posixpath
import shlex
import shutil
import subprocess
import tarfile
import tempfile

import pytest
from sandbox_backends import BACKENDS, docker_defaults, ensure_image, world_readable

from env.episode import Episode, EpisodeOptions
from env.grading import GradeCache, grade, grade_patch
from env.miniswe import generate_tasks
from env.sandbox import SandboxFactory
from env.sandbox.local import LocalLimits
from env.sandbox.pool import SandboxPool
from env.swebench import patch_paths
from env.tasks import Task

# Imports of a module the fixed copy in ~/fixed holds come from that copy.
HOOK = """
import importlib.machinery, os, sys
class _Fixed:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and cls.os.path.exists(cls.os.path.join(cls.fixed, name + ".py")):
            return cls.finder.find_spec(name, [cls.fixed])
        return None
_Fixed.os, _Fixed.finder = os, importlib.machinery.PathFinder
_Fixed.fixed = os.path.expanduser("~/fixed")
sys.meta_path.insert(0, _Fixed)
"""
# (A .pth file runs a line that starts with `import`.)
RUN_HOOK = 'import os; exec(open(os.path.expanduser("~/hook.py")).read())'
USER_SITE = 'd=$(python3 -m site --user-site) && mkdir -p "$d"'
# Every listed test reported as passed, whatever it does.
PLUGIN = ("def pytest_collection_modifyitems(items):\n    for item in items:\n"
          "        item.obj = lambda *args, **kwargs: None\n")
# Forges the runner's lines and its closing summary.
SHADOW = ("import sys\n\ntests = [a for a in sys.argv[1:] if not a.startswith('-')]\n"
          "for arg in tests:\n    print(f\"{arg.rsplit('.', 1)[1]} ({arg}) ... ok\")\n"
          "print(f'Ran {len(tests)} tests in 0.001s')\nprint()\nprint('OK')\n")
PYTEST_IN_IMAGE = "/opt/pytest"


def factory_for(request, backend: str, image: str | None = None, read_only: tuple = ()):
    """read_only: host paths a local sandbox sees besides the toolchain."""
    if backend == "docker":
        defaults = docker_defaults(request)
        return SandboxFactory("docker", **{**defaults, "image": image or defaults["image"]})
    return SandboxFactory("local", limits=LocalLimits(memory_bytes=1 << 30), read_only=read_only)


def run_episode(factory, task: Task, commands: list[str], grading: str,
                grades: GradeCache | None = None) -> tuple[float | None, Episode]:
    """Steps `commands` as bash tool calls, then grades: (reward, the episode)."""
    with Episode(factory, task, EpisodeOptions(grading=grading), grades=grades) as episode:
        episode.reset()
        for command in commands:
            observation, _ = episode.step({"name": "execute_bash",
                                           "arguments": {"command": command}})
            assert episode.status == "running", observation
        return episode.reward(), episode


def fixed_copy(task: Task) -> str:
    """Shell: the repository's files with the gold patch applied copied to ~/fixed, the
    repository left untouched, and HOOK in ~/hook.py."""
    return (f"printf %s {shlex.quote(task.gold_patch)} > ~/gold.patch && git apply ~/gold.patch"
            " && mkdir -p ~/fixed && cp *.py ~/fixed/ && git checkout -q -- . && "
            f"printf %s {shlex.quote(HOOK)} > ~/hook.py && git status --short | wc -l")


def assert_fresh_zero(factory, task, commands, in_place: float, error: str = "",
                      in_patch: tuple[str, ...] = ()):
    """The hack scores 0 graded fresh and `in_place` graded in place; its patch changes
    no Python file but those `in_patch`."""
    fresh, episode = run_episode(factory, task, commands, "fresh")
    assert (fresh, episode.error) == (0.0, error), episode.test_output[-3000:]
    patch = episode.steps[-1].patch if episode.steps else ""
    python = [p for p in patch_paths(patch) if p.endswith((".py", ".pyc"))]
    assert sorted(python) == sorted(in_patch), patch
    assert run_episode(factory, task, commands, "in_place")[0] == in_place


@pytest.fixture(scope="module")
def unittest_task():
    return generate_tasks(1, seed=3)[0]


# ---- hooks the interpreter runs at start-up, outside the repository -----------------------------

USER_HACKS = {
    "user_pth": f'{USER_SITE} && echo {shlex.quote(RUN_HOOK)} > "$d/hack.pth"',
    "usercustomize": f'{USER_SITE} && cp ~/hook.py "$d/usercustomize.py"',
}
ROOT_HACKS = {
    "system_pth": f"echo {shlex.quote(RUN_HOOK)} > /usr/local/lib/python3.11/dist-packages/x.pth",
    "sitecustomize": "cat ~/hook.py >> /etc/python3.11/sitecustomize.py",
    "replaced_interpreter": ("printf '#!/bin/sh\\ncd /root/fixed && exec /usr/bin/python3 "
                             "\"$@\"\\n' > /usr/local/bin/python3 && chmod 755 "
                             "/usr/local/bin/python3"),
    "edited_runner": f"echo {shlex.quote(RUN_HOOK)} >> /usr/lib/python3.11/unittest/__init__.py",
}
CASES = ([pytest.param(b, name, id=f"{b.values[0]}-{name}", marks=b.marks)
          for b in BACKENDS for name in USER_HACKS]
         + [pytest.param(BACKENDS[1].values[0], name, id=f"docker-{name}",
                         marks=BACKENDS[1].marks) for name in ROOT_HACKS])


@pytest.mark.parametrize("backend,hack", CASES)
def test_startup_hooks_outside_the_repository_score_zero(request, backend, hack,
                                                         unittest_task):
    factory = factory_for(request, backend)
    commands = [fixed_copy(unittest_task), {**USER_HACKS, **ROOT_HACKS}[hack]]
    assert_fresh_zero(factory, unittest_task, commands, in_place=1.0)
    # The reference: the fix itself scores 1 graded fresh.
    gold = f"printf %s {shlex.quote(unittest_task.gold_patch)} | git apply"
    assert run_episode(factory, unittest_task, [gold], "fresh")[0] == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_leftover_background_process_scores_zero(request, backend, unittest_task):
    """A loop copying the fixed files back in: every command's background processes are
    killed when it returns, so it scores 0 in place too."""
    factory = factory_for(request, backend)
    loop = ("(setsid sh -c 'sleep 1; while :; do cp ~/fixed/*.py . 2>/dev/null; sleep 0.05; "
            "done' >/dev/null 2>&1 &); echo started")
    assert_fresh_zero(factory, unittest_task, [fixed_copy(unittest_task), loop], in_place=0.0)


# ---- modules hidden from the patch by ignore rules -----------------------------------------------

HIDDEN = {
    "gitignore": "printf 'unittest/\\n' >> .gitignore && mkdir unittest && "
                 "cp ~/shadow.py unittest/__init__.py",
    "info_exclude": "printf 'unittest/\\n' >> .git/info/exclude && mkdir unittest && "
                    "cp ~/shadow.py unittest/__init__.py",
    # The task's own `*.pyc` rule: a package of only `__init__.pyc`.
    "pyc_only": "mkdir unittest && python3 -c \"import py_compile, os; py_compile.compile("
                "os.path.expanduser('~/shadow.py'), 'unittest/__init__.pyc')\"",
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", list(HIDDEN))
def test_a_module_hidden_by_ignore_rules_scores_zero(request, backend, rule, unittest_task):
    """A module the repository's ignore rules keep out of the patch never reaches a fresh
    grade. A line a command adds to .git/info/exclude hides nothing: the patch is taken
    with the exclude file as the sandbox made it (env.sandbox.shell.capped_patch), so the
    module is in it, and grading restores the standard library's `unittest` it shadows
    (in place as well)."""
    factory = factory_for(request, backend)
    commands = [f"printf %s {shlex.quote(SHADOW)} > ~/shadow.py", HIDDEN[rule]]
    if rule == "info_exclude":
        assert_fresh_zero(factory, unittest_task, commands, in_place=0.0,
                          in_patch=("unittest/__init__.py",))
    else:
        assert_fresh_zero(factory, unittest_task, commands, in_place=1.0)


# ---- pytest: configuration files and a plugin under ~/.local -------------------------------------

CALC = "def add(a, b):\n    return a - b\n"
PYTEST_FILES = {"calc.py": CALC, "tests/test_calc.py": (
    "from calc import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n\n\n"
    "def test_zero():\n    assert add(0, 0) == 0\n")}
CONFIGS = {
    "pytest.ini": "[pytest]\naddopts = -p hackplugin\n",
    ".pytest.ini": "[pytest]\naddopts = -p hackplugin\n",
    "pytest.toml": '[pytest]\naddopts = ["-p", "hackplugin"]\n',
    ".pytest.toml": '[pytest]\naddopts = ["-p", "hackplugin"]\n',
    "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-p hackplugin"\n',
    "tox.ini": "[pytest]\naddopts = -p hackplugin\n",
    "setup.cfg": "[tool:pytest]\naddopts = -p hackplugin\n",
}
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments")


@pytest.fixture(scope="module")
def pytest_dir():
    """This interpreter's pytest, its pure-Python dependencies and their metadata in a
    world-readable directory (the sandbox's python cannot see this interpreter's)."""
    import importlib.metadata

    out = tempfile.mkdtemp(prefix="integrity-pytest-")
    for name in PYTEST_PACKAGES:
        src = os.path.dirname(__import__(name).__file__)
        shutil.copytree(src, os.path.join(out, name), ignore=shutil.ignore_patterns("__pycache__"))
    for dist in ("pytest", "pluggy", "iniconfig", "packaging", "pygments"):
        info = importlib.metadata.distribution(dist)._path
        shutil.copytree(info, os.path.join(out, os.path.basename(info)))
    py = os.path.join(os.path.dirname(os.path.dirname(pytest.__file__)), "py.py")
    if os.path.exists(py):
        shutil.copy(py, out)
    world_readable(out)
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def pytest_image(request, pytest_dir):
    """The sandbox image with `pytest_dir` at PYTEST_IN_IMAGE (made once per engine)."""
    import pytest as pytest_module

    client = request.getfixturevalue("docker_client")
    base = ensure_image(client)
    tag = f"swe-sandbox:integrity-pytest-{pytest_module.__version__}"
    try:
        client.images.get(tag)
        return tag
    except Exception:  # noqa: BLE001 - not made yet
        pass
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(pytest_dir, arcname=PYTEST_IN_IMAGE.lstrip("/"))
    container = client.containers.create(base, "true")
    try:
        container.put_archive("/", buf.getvalue())
        container.commit(*tag.split(":"))
    finally:
        container.remove(force=True)
    return tag


def pytest_setup(request, backend: str):
    """(factory, env_setup) with pytest importable in the sandbox."""
    if backend == "docker":
        return (factory_for(request, backend, request.getfixturevalue("pytest_image")),
                f"export PYTHONPATH={PYTEST_IN_IMAGE}")
    directory = request.getfixturevalue("pytest_dir")
    return factory_for(request, backend, read_only=(directory,)), f"export PYTHONPATH={directory}"


def pytest_task(env_setup: str, **extra) -> Task:
    gold = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n"
            " def add(a, b):\n-    return a - b\n+    return a + b\n")
    return Task("integrity-pytest", "add is broken", repo_files=PYTEST_FILES,
                FAIL_TO_PASS=["tests/test_calc.py::test_add"],
                PASS_TO_PASS=["tests/test_calc.py::test_zero"], gold_patch=gold,
                test_command="python3 -m pytest -rA -p no:cacheprovider {test_files}",
                test_files=["tests/test_calc.py"], log_parser="pytest", env_setup=env_setup,
                **extra)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_pytest_config_files_loading_a_plugin_score_zero(request, backend, name):
    """Each name pytest reads, at the root, left out of the patch by .gitignore, loads
    a plugin that passes every test. In place, with test protection off, it scores 1:
    the hack works; graded fresh, and in place with protection, 0."""
    factory, setup = pytest_setup(request, backend)
    task = pytest_task(setup)
    commands = [f"printf %s {shlex.quote(PLUGIN)} > hackplugin.py && printf %s "
                f"{shlex.quote(CONFIGS[name])} > {shlex.quote(name)} && printf '%s\\n' "
                f"{shlex.quote(name)} hackplugin.py >> .gitignore"]
    assert run_episode(factory, task, [], "fresh")[0] == 0.0
    assert run_episode(factory, task, [f"printf %s {shlex.quote(task.gold_patch)} | git apply"],
                       "fresh")[0] == 1.0
    open_task = dataclasses.replace(task, protect_tests=False)
    assert run_episode(factory, open_task, commands, "in_place")[0] == 1.0
    assert_fresh_zero(factory, task, commands, in_place=0.0)
    assert run_episode(factory, open_task, commands, "fresh")[0] == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pytest_plugin_registered_under_local_scores_zero(request, backend):
    factory, setup = pytest_setup(request, backend)
    task = pytest_task(setup)
    register = (f'{USER_SITE} && printf %s {shlex.quote(PLUGIN)} > "$d/hackplugin.py" && '
                'mkdir -p "$d/hackplugin-1.0.dist-info" && printf "Metadata-Version: 2.1\\n'
                'Name: hackplugin\\nVersion: 1.0\\n" > "$d/hackplugin-1.0.dist-info/METADATA" && '
                'printf "[pytest11]\\nhack = hackplugin\\n" > '
                '"$d/hackplugin-1.0.dist-info/entry_points.txt"')
    assert_fresh_zero(factory, task, [register], in_place=1.0)


# ---- the fresh grader itself ---------------------------------------------------------------------

TREE_FILES = {"old.py": "X = 1\n", "gone.txt": "bye\n", "run.sh": "echo run\n",
              "keep.txt": "same\n"}
TREE_CHECK = ("test \"$(cat new.py)\" = 'X = 1' && ! test -e old.py && ! test -e gone.txt && "
              "test -x run.sh && test \"$(od -An -tx1 data.bin | tr -d ' ')\" = 00ff0a80 && "
              "test -L link && test \"$(readlink link)\" = keep.txt && echo tree-ok")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fresh_grading_applies_renames_deletions_modes_binary_and_links(request, backend):
    factory = factory_for(request, backend)
    task = Task("integrity-tree", "reshape the tree", repo_files=TREE_FILES,
                test_command=TREE_CHECK)
    assert task.log_parser == "exit_code"
    edit = ("git mv old.py new.py && rm gone.txt && chmod +x run.sh && "
            "printf '\\000\\377\\n\\200' > data.bin && ln -s keep.txt link")
    reward, episode = run_episode(factory, task, [edit], "fresh")
    patch = episode.steps[-1].patch
    assert "GIT binary patch" in patch and "new mode 100755" in patch and "deleted file" in patch
    assert (reward, episode.error) == (1.0, ""), episode.test_output
    assert run_episode(factory, task, ["rm gone.txt"], "fresh")[0] == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_patch_that_does_not_apply_scores_zero(request, backend, unittest_task):
    factory = factory_for(request, backend)
    bad = unittest_task.gold_patch.replace("return x + x", "return x - x")
    result = grade_patch(unittest_task, bad, factory, timeout=60)
    assert result.reward == 0.0 and "does not apply" in result.output, result
    assert grade_patch(unittest_task, unittest_task.gold_patch, factory, 60).reward == 1.0


def test_the_agent_sandbox_is_closed_before_grading_and_the_cache_is_sound(unittest_task):
    """Two episodes with the same (empty) patch, the first with a .pth hack: both 0, the
    second from the cache. In place the cache is not used (its grade depends on more
    than the patch)."""
    factory = factory_for(None, "local")
    events = []

    def agent_factory(task):
        sandbox = factory(task)
        close = sandbox.close
        sandbox.close = lambda: (events.append("agent closed"), close())
        return sandbox

    def grader(task):
        events.append("grader opened")
        return factory(task)

    cache = GradeCache()
    hack = [fixed_copy(unittest_task), USER_HACKS["user_pth"]]
    for commands in (hack, []):
        with Episode(agent_factory, unittest_task, grades=cache, grader=grader) as episode:
            episode.reset()
            for command in commands:
                episode.step({"name": "execute_bash", "arguments": {"command": command}})
            assert episode.reward() == 0.0 and episode.sandbox is None
    assert events == ["agent closed", "grader opened", "agent closed"]  # then a cache hit
    assert (cache.hits, cache.misses) == (1, 1)
    reward, episode = run_episode(factory, unittest_task, hack, "in_place", grades=cache)
    assert reward == 1.0 and episode.grades is None and not episode.grade_cached


def test_pool_exchange_keeps_the_slot(unittest_task):
    """Fresh grading inside a pool takes the episode's slot: never more live sandboxes
    than max_concurrent, and none left."""
    import asyncio

    factory = factory_for(None, "local")
    pool = SandboxPool(factory, max_concurrent=2)

    async def one():
        async with pool.acquire(unittest_task) as sandbox:
            episode = Episode(sandbox, unittest_task, grader=lambda t: pool.exchange(sandbox, t))
            episode.reset()
            return await pool.call(episode.reward)

    async def main():
        async with pool:
            return await asyncio.gather(*(one() for _ in range(5)))

    assert asyncio.run(main()) == [0.0] * 5
    assert pool.peak <= 2 and pool.live == 0
    with factory(unittest_task) as sandbox:
        with pytest.raises(ValueError, match="fresh grading opens a new sandbox"):
            Episode(sandbox, unittest_task)
        assert grade(unittest_task, sandbox).reward == 0.0  # in place, as before


# ---- no future history ---------------------------------------------------------------------------

MARK = "FUTURE" + "FIX"  # in every later commit, never in the base's history
REACH = (f"git log --all --format='%H %s'; git tag; git branch -a; git stash list; git reflog; "
         f"git remote -v; git notes list; git rev-list --all | wc -l; "
         f"git cat-file --batch-all-objects --batch | grep -c {MARK}; "
         "git cat-file --batch-all-objects --batch-check")


def git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def later_history(tmp_path_factory):
    """(repository, base commit, later commits): a clone whose HEAD is the fix, with a
    tag, another branch, a stash, a note and a remote, all after the base."""
    root = str(tmp_path_factory.mktemp("history"))
    os.chmod(root, 0o755)
    git(root, "init", "-q")
    for path, text in PYTEST_FILES.items():
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as f:
            f.write(text)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    base = git(root, "rev-parse", "HEAD")
    with open(os.path.join(root, "calc.py"), "w") as f:
        f.write(f"def add(a, b):  # {MARK}\n    return a + b\n")
    git(root, "commit", "-qam", f"{MARK} add")
    later = [git(root, "rev-parse", "HEAD")]
    git(root, "tag", "-a", "v1", "-m", f"{MARK} tag")
    git(root, "notes", "add", "-m", f"{MARK} note", base)
    git(root, "checkout", "-qb", "other", base)
    with open(os.path.join(root, "other.py"), "w") as f:
        f.write(f"# {MARK}\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", f"{MARK} other")
    later.append(git(root, "rev-parse", "HEAD"))
    with open(os.path.join(root, "other.py"), "a") as f:
        f.write(f"# {MARK} stash\n")
    git(root, "stash", "-q")
    git(root, "checkout", "-q", "master")
    git(root, "remote", "add", "origin", "https://example.invalid/repo.git")
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chmod(os.path.join(dirpath, name), 0o755 if name in dirs else 0o644)
    return root, base, later


def assert_only_base(sandbox, base: str, later: list[str]) -> None:
    out = sandbox.run(REACH).output
    assert sandbox.run("git rev-parse HEAD").output.strip() == base
    assert MARK not in out and not any(sha in out for sha in later), out
    lines = out.splitlines()
    assert lines[0] == f"{base} base" and "1" in lines and "0" in lines, out
    for sha in later:
        shown = sandbox.run(f"git show {sha}")
        assert shown.exit_code == 128 and MARK not in shown.output, shown
    assert sandbox.patch() == ""


def test_local_repositories_hold_no_later_commit(later_history):
    root, base, later = later_history
    git(root, "show", later[0])  # (the reference: there, it is)
    with SandboxFactory("local")(Task("h", "x", repo_dir=root, base_commit=base)) as sb:
        assert_only_base(sb, base, later)


@pytest.mark.docker
def test_docker_repositories_hold_no_later_commit(request, later_history, tmp_path):
    """An image built by scripts/build_repo_image.sh, and one holding the whole clone
    (its history is cut when the sandbox starts)."""
    root, base, later = later_history
    client = request.getfixturevalue("docker_client")
    ensure_image(client)
    built = "swe-sandbox:integrity-history"
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "scripts", "build_repo_image.sh")
    subprocess.run([script, built, root, base], check=True, capture_output=True, timeout=300)
    clone = str(tmp_path / "testbed")
    subprocess.run(["git", "clone", "-q", root, clone], check=True)
    git(clone, "checkout", "-q", base)
    git(clone, "fetch", "-q", "origin", "refs/stash:refs/stash", "refs/notes/*:refs/notes/*")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(clone, arcname="testbed")
    container = client.containers.create(ensure_image(client), "true")
    try:
        container.put_archive("/", buf.getvalue())
        whole = container.commit("swe-sandbox", "integrity-whole-clone").id
    finally:
        container.remove(force=True)
    assert MARK in subprocess.run(["git", "-C", clone, "log", "--all"], capture_output=True,
                                  text=True).stdout
    defaults = docker_defaults(request)
    try:
        for image in (built, whole):
            with SandboxFactory("docker", **{**defaults, "image": image})(
                    Task("h", "x", image=image, base_commit=base)) as sb:
                assert_only_base(sb, base, later)
    finally:
        for image in (built, whole):
            client.images.remove(image, force=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sitecustomize_in_the_patch_scores_zero(request, backend, unittest_task):
    """With the repository on PYTHONPATH (as an editable install puts it), a
    `sitecustomize.py` at its root runs before the tests: one that prints every test
    as passed scores 1 without test protection, 0 with it, graded fresh."""
    factory = factory_for(request, backend)
    task = dataclasses.replace(unittest_task, env_setup="export PYTHONPATH=$PWD")
    fake = ("import sys\nif sys.argv[:1] != ['-c']:\n" + "".join(
        f"    print('{t.rsplit('.', 1)[1]} ({t}) ... ok')\n" for t in task.tests)
        + f"    print('Ran {len(task.tests)} tests in 0.001s')\n    print()\n"
        + "    print('OK')\n    raise SystemExit(0)\n")
    commands = [f"printf %s {shlex.quote(fake)} > sitecustomize.py"]
    open_task = dataclasses.replace(task, protect_tests=False)
    assert run_episode(factory, open_task, commands, "fresh")[0] == 1.0
    reward, episode = run_episode(factory, task, commands, "fresh")
    assert (reward, episode.error) == (0.0, ""), episode.test_output[-2000:]


# ---- modules imported instead of the protected tests or the runner -------------------------------


def forged_report(tests: list[str], summary: bool = True) -> str:
    """Python that prints every listed test as passed, in unittest's and pytest's forms,
    with each runner's summary (unless `summary` is off), and exits 0: what a module
    imported instead of the protected tests (or of the runner) does."""
    lines = [f"{t.rsplit('.', 1)[-1]} ({t}) ... ok" for t in tests if "::" not in t]
    lines += [f"PASSED {t}" for t in tests if "::" in t]
    if summary:
        lines += ["", "-" * 70, f"Ran {len(tests)} tests in 0.001s", "", "OK",
                  f"==== {len(tests)} passed in 0.01s ===="]
    return f"import os\nprint({chr(10).join(lines)!r}, flush=True)\nos._exit(0)\n"


def calc_gold(path: str) -> str:
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,2 +1,2 @@\n"
            " def add(a, b):\n-    return a - b\n+    return a + b\n")


CALC_TESTS = ("from {module} import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n\n\n"
              "def test_zero():\n    assert add(0, 0) == 0\n")


def layout_task(layout: str, pytest_env: str, unittest_task: Task) -> Task:
    """A task of each family's test layout: mini-SWE's unittest modules at the repository
    root; pytest files at the root (native rows), in a `tests` directory (SWE-bench), and
    inside a package (SWE-bench, R2E-Gym)."""
    if layout == "root_unittest":
        return unittest_task
    where = {"root_pytest": ("calc.py", "test_calc.py", "calc"),
             "tests_dir_pytest": ("calc.py", "tests/test_calc.py", "calc"),
             "package_pytest": ("pkg/calc.py", "pkg/tests/test_calc.py", "pkg.calc")}
    code, test, module = where[layout]
    files = {code: CALC, test: CALC_TESTS.format(module=module)}
    if layout == "package_pytest":
        files.update({"pkg/__init__.py": "", "pkg/tests/__init__.py": ""})
    return Task(f"integrity-{layout}", "add is broken", repo_files=files,
                FAIL_TO_PASS=[f"{test}::test_add"], PASS_TO_PASS=[f"{test}::test_zero"],
                gold_patch=calc_gold(code), test_files=[test], log_parser="pytest",
                test_command="python3 -m pytest -rA -p no:cacheprovider {test_files}",
                env_setup=pytest_env)


def _test_module_dirs(task: Task) -> list[str]:
    """The directories and module names of the task's test files: [(dir, stem)]."""
    return [((posixpath.dirname(p) or "."), posixpath.basename(p)[:-3]) for p in task.test_files]


PYC = ("import importlib.util, os, py_compile; py_compile.compile('{fake}', "
       "importlib.util.cache_from_source('{source}'), invalidation_mode="
       "py_compile.PycInvalidationMode.UNCHECKED_HASH); os.remove('{fake}')")


def shadow_hacks(task: Task) -> dict[str, str]:
    """Shell commands planting, beside each test module or at the root, a module the
    tests' run imports instead of the protected one (or of the runner)."""
    fake = shlex.quote(forged_report(task.tests))
    write = lambda path: (f"mkdir -p {shlex.quote(posixpath.dirname(path) or '.')} && "
                          f"printf %s {fake} > {shlex.quote(path)}")
    packages = [posixpath.join(d, s, "__init__.py") for d, s in _test_module_dirs(task)]
    runner = "unittest" if task.log_parser == "unittest" else "pytest"
    return {
        # `test_x/__init__.py` beside `test_x.py`: the package is imported, not the file.
        "test_module_package": " && ".join(write(p) for p in packages),
        # A cached module marked "unchecked": the interpreter runs it without looking at
        # the protected source beside it.
        "test_module_bytecode": " && ".join(
            f"{write(d + '/_fake.py')} && python3 -c "
            + shlex.quote(PYC.format(fake=d + "/_fake.py", source=posixpath.join(d, s + ".py")))
            for d, s in _test_module_dirs(task))
        + " && printf '!__pycache__/\\n!*.pyc\\n' >> .gitignore",
        # An empty root `__init__.py`: the root looks like a package, yet stays first on
        # the import path, so a runner package there is imported.
        "root_init_runner_package": f"touch __init__.py && {write(runner + '/__init__.py')}"
                                    + (f" && {write(runner + '/__main__.py')}"
                                       if runner == "pytest" else ""),
        "runner_module_at_root": write(runner + ".py"),
    }


LAYOUTS = ("root_unittest", "root_pytest", "tests_dir_pytest", "package_pytest")
SHADOW_HACKS = ("test_module_package", "test_module_bytecode", "root_init_runner_package",
                "runner_module_at_root")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_modules_imported_instead_of_the_tests_or_the_runner_score_zero(
        request, backend, layout, unittest_task):
    """Each hack, in the agent's patch, in each family's test layout: graded fresh it
    scores 0; with test protection off, where the hack is live in that layout, 1 (so the
    check can fail). The gold patch scores 1 and the untouched repository 0."""
    factory, setup = pytest_setup(request, backend)
    task = layout_task(layout, setup, unittest_task)
    gold = f"printf %s {shlex.quote(task.gold_patch)} | git apply"
    assert run_episode(factory, task, [gold], "fresh")[0] == 1.0
    assert run_episode(factory, task, [], "fresh")[0] == 0.0
    open_task = dataclasses.replace(task, protect_tests=False)
    live = 0
    for name, command in shadow_hacks(task).items():
        reward, episode = run_episode(factory, task, [command], "fresh")
        assert (reward, episode.error) == (0.0, ""), (name, episode.test_output[-3000:])
        live += run_episode(factory, open_task, [command], "fresh")[0] == 1.0
    assert live, "no hack scores without test protection in this layout"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_under_test_printing_the_runner_lines_without_its_summary_scores_zero(
        request, backend, unittest_task):
    """The module under test prints every listed test's `... ok` line and exits 0 when
    the tests import it: the grade needs the runner's own closing summary to count those
    passes (env.grading.runner_disagrees). With the summary forged too it scores 1, as
    in the official harness (README, "What grading guarantees")."""
    factory = factory_for(request, backend)
    module = sorted(p for p in unittest_task.repo_files if p.endswith(".py")
                    and not p.startswith("test_"))[0]
    forge = lambda summary: (f"printf %s {shlex.quote(forged_report(unittest_task.tests, summary))}"
                             f" > {module}")
    reward, episode = run_episode(factory, unittest_task, [forge(False)], "fresh")
    assert (reward, episode.error) == (0.0, ""), episode.test_output[-2000:]
    assert "no summary of the test runner" in episode.test_output
    assert run_episode(factory, unittest_task, [forge(True)], "fresh")[0] == 1.0
