"""Per-test grading on generated repositories, as SWE-bench and R2E-Gym grade.

Every repository is generated here (not copied) to reproduce one harness's log format
and id shape, and loaded from a raw SWE-bench-shaped row (JSON-string test lists,
`repo`, `version`), so the repository specs pick its command and parser:

- pytest (`pallets/flask`): parametrized ids with spaces, quotes, brackets and ` - `,
  listed whole and cut at their first space as SWE-bench's parser writes them;
- Django (`django/django`): `tests/runtests.py` runs unittest at verbosity 2 as
  Django's runner does; ids `name (module.Class.name)` and a docstring's first line;
- sympy (`sympy/sympy`): `bin/test` prints `name ok|F|E` lines and `___ path:name ___`
  failure headers as sympy's runner does.

The reference is the repository itself: untouched (bug) 0, gold patch 1, a wrong edit 0,
and each hack, which scores 1 with protection off (so the check can fail), scores 0.
Runs in local sandboxes; pytest comes from a world-readable copy of this interpreter's.
"""

import concurrent.futures
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from sandbox_backends import docker_defaults, world_readable

from env.episode import Episode
from env.grading import (
    Grade,
    GradeCache,
    error_kind,
    grade,
    merge_test_sections,
    restore_plan,
    runner_disagrees,
)
from env.logparsers import parse_django, parse_pytest, parse_sympy, parse_unittest
from env.miniswe import generate_tasks, unified_diff
from env.sandbox import SandboxFactory
from env.sandbox.local import LocalLimits
from env.tasks import Task, task_from_row

FLASK_CALC = "def add(a, b):\n    return a - b\n\n\ndef label(text):\n    return text.upper()\n"
FLASK_FILES = {
    "pytest.ini": "[pytest]\npythonpath = src\n",
    "src/calc.py": FLASK_CALC,
    "tests/conftest.py": "import pytest\n\n\n@pytest.fixture\ndef base():\n    return 10\n",
    "tests/helpers.py": "def expected_add(a, b):\n    return a + b\n",
    "tests/test_calc.py": (
        "import pytest\n\nfrom calc import add, label\n\n\n"
        "@pytest.mark.parametrize('text', ['foo bar', 'say \"hi\"', 'a[1]', 'x - y'])\n"
        "def test_label(text):\n    assert label(text) == text.upper()\n\n\n"
        "def test_add_zero():\n    assert add(0, 0) == 0\n"),
}
FLASK_NEW_TESTS = FLASK_FILES["tests/test_calc.py"] + (
    "\n\nfrom helpers import expected_add  # noqa: E402\n\n\n"
    "@pytest.mark.parametrize('pair', ['1 2', '3 4'])\n"
    "def test_add_pairs(pair):\n    a, b = map(int, pair.split())\n"
    "    assert add(a, b) == expected_add(a, b)\n\n\n"
    "def test_add_base(base):\n    assert add(base, 1) == 11\n")
FLASK_F2P = ["tests/test_calc.py::test_add_pairs[1",  # cut at the space, as SWE-bench has it
             "tests/test_calc.py::test_add_pairs[3 4]", "tests/test_calc.py::test_add_base"]
FLASK_P2P = ["tests/test_calc.py::test_add_zero", "tests/test_calc.py::test_label[foo bar]",
             'tests/test_calc.py::test_label[say "hi"]', "tests/test_calc.py::test_label[a[1]]",
             "tests/test_calc.py::test_label[x - y]", "tests/test_calc.py::test_label[say"]
FLASK_GOLD = FLASK_CALC.replace("a - b", "a + b")
FLASK_WRONG = FLASK_CALC.replace("a - b", "a * b")

DJANGO_RUNNER = """#!/usr/bin/env python3
import argparse
import os
import sys
import unittest

parser = argparse.ArgumentParser()
parser.add_argument("labels", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings", default="test_sqlite")
parser.add_argument("--parallel", type=int, default=0)
args = parser.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(here)]
__import__(args.settings)
suite = unittest.defaultTestLoader.loadTestsFromNames(args.labels)
result = unittest.TextTestRunner(verbosity=args.verbosity).run(suite)
sys.exit(not result.wasSuccessful())
"""
DJANGO_PRICING = "def total(prices):\n    return sum(prices[1:])\n"
DJANGO_TESTS = (
    "import unittest\n\nfrom shop.pricing import total\n\n\n"
    "class TotalTests(unittest.TestCase):\n"
    "    def test_empty(self):\n        self.assertEqual(total([]), 0)\n")
DJANGO_FILES = {
    "tests/runtests.py": DJANGO_RUNNER, "tests/test_sqlite.py": "DATABASES = {}\n",
    "shop/__init__.py": "", "shop/pricing.py": DJANGO_PRICING,
    "tests/pricing/__init__.py": "", "tests/pricing/tests.py": DJANGO_TESTS,
}
DJANGO_NEW_TESTS = DJANGO_TESTS + (
    "\n    def test_sum(self):\n        \"\"\"Totals add every price.\"\"\"\n"
    "        self.assertEqual(total([1, 2]), 3)\n")
DJANGO_F2P = ["Totals add every price."]
DJANGO_P2P = ["test_empty (pricing.tests.TotalTests.test_empty)"]
DJANGO_GOLD = DJANGO_PRICING.replace("prices[1:]", "prices")
DJANGO_WRONG = DJANGO_PRICING.replace("prices[1:]", "prices[:-1]")

SYMPY_RUNNER = """#!/usr/bin/env python3
import importlib.util
import os
import sys
import traceback

sys.path.insert(0, os.getcwd())
failures = []
for path in [a for a in sys.argv[1:] if not a.startswith("-")]:
    spec = importlib.util.spec_from_file_location("tests_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = sorted(n for n in dir(module) if n.startswith("test_"))
    print(f"{path}[{len(names)}] ")
    for name in names:
        try:
            getattr(module, name)()
            print(f"{name} ok")
        except AssertionError:
            print(f"{name} F")
            failures.append((path, name, traceback.format_exc()))
        except Exception:
            print(f"{name} E")
            failures.append((path, name, traceback.format_exc()))
for path, name, trace in failures:
    print("_" * 78)
    print(f"{'_' * 20} {path}:{name} {'_' * 20}")
    print(trace)
sys.exit(bool(failures))
"""
SYMPY_CORE = "def double(x):\n    return x + 2\n"
SYMPY_TESTS = ("from mathlib.core import double\n\n\ndef test_zero():\n"
               "    assert double(0) * 0 == 0\n")
SYMPY_FILES = {"bin/test": SYMPY_RUNNER, "mathlib/__init__.py": "",
               "mathlib/core.py": SYMPY_CORE, "mathlib/tests/__init__.py": "",
               "mathlib/tests/test_core.py": SYMPY_TESTS}
SYMPY_NEW_TESTS = SYMPY_TESTS + "\n\ndef test_double():\n    assert double(3) == 6\n"
SYMPY_GOLD = SYMPY_CORE.replace("x + 2", "x * 2")
SYMPY_WRONG = SYMPY_CORE.replace("x + 2", "x ** 2")


EXECUTABLES = ("tests/runtests.py", "bin/test")


def git_repo(files: dict[str, str]) -> str:
    """A committed host repository of `files` (world-readable; runners executable)."""
    root = tempfile.mkdtemp(prefix="grading-repo-")
    os.chmod(root, 0o755)
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
        os.chmod(full, 0o755 if path in EXECUTABLES else 0o644)
    git = ["git", "-C", root, "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(git + args, check=True)
    return root


def swebench_row(name: str, repo: str, version: str, files: dict[str, str], test_path: str,
                 new_tests: str, source: str, gold: str, f2p: list[str], p2p: list[str],
                 **extra) -> dict:
    return {
        "instance_id": f"{repo.replace('/', '__')}-{name}", "repo": repo, "version": version,
        "problem_statement": f"{name} is broken.", "repo_dir": git_repo(files),
        "patch": unified_diff(source, files[source], gold),
        "test_patch": unified_diff(test_path, files[test_path], new_tests),
        "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p), **extra,
    }


def flask_row(pytest_dir: str, **extra) -> dict:
    setup = f'export PYTHONPATH={pytest_dir}; pytest() {{ python3 -m pytest "$@"; }}'
    return swebench_row("calc", "pallets/flask", "2.3", FLASK_FILES, "tests/test_calc.py",
                        FLASK_NEW_TESTS, "src/calc.py", FLASK_GOLD, FLASK_F2P, FLASK_P2P,
                        env_setup=setup, **extra)


def django_row() -> dict:
    return swebench_row("pricing", "django/django", "4.0", DJANGO_FILES,
                        "tests/pricing/tests.py", DJANGO_NEW_TESTS, "shop/pricing.py",
                        DJANGO_GOLD, DJANGO_F2P, DJANGO_P2P)


def sympy_row() -> dict:
    return swebench_row("double", "sympy/sympy", "1.11", SYMPY_FILES,
                        "mathlib/tests/test_core.py", SYMPY_NEW_TESTS, "mathlib/core.py",
                        SYMPY_GOLD, ["test_double"], ["test_zero"])


# pytest majors the grading is checked against: SWE-bench's images pin old releases,
# R2E-Gym, SWE-smith and new repositories run current ones. Each is installed once per
# run, exactly pinned with its dependencies, from the package index.
# Where the pytest_dir fixture installs; local sandboxes see it (LocalSandbox read_only).
PYTEST_HOME = os.path.join(tempfile.gettempdir(), "grading-pytest")
PYTEST_RELEASES = {
    "7": ("pytest==7.4.4", "pluggy==1.7.0", "iniconfig==2.3.1", "packaging==26.4"),
    "8": ("pytest==8.4.2", "pluggy==1.7.0", "iniconfig==2.3.1", "packaging==26.4",
          "pygments==2.21.0"),
    "9": ("pytest==9.2.0", "pluggy==1.7.0", "iniconfig==2.3.1", "packaging==26.4",
          "pygments==2.21.0"),
}


@pytest.fixture(scope="module", params=sorted(PYTEST_RELEASES), ids=lambda v: f"pytest{v}")
def pytest_dir(request):
    """A pytest release (with its package metadata) installed in a world-readable
    directory that the task's env_setup puts on PYTHONPATH: the sandbox's python (and
    uid) cannot see this interpreter's packages."""
    os.makedirs(PYTEST_HOME, exist_ok=True)
    out = tempfile.mkdtemp(prefix=f"pytest{request.param}-", dir=PYTEST_HOME)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--disable-pip-version-check", "--target", out,
                           *PYTEST_RELEASES[request.param]],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"cannot install pytest {request.param}: {proc.stderr}"
    world_readable(out)
    yield out
    shutil.rmtree(out, ignore_errors=True)


FACTORY = SandboxFactory("local", limits=LocalLimits(memory_bytes=1 << 30),
                         read_only=(PYTEST_HOME,))


def _grade(task, *edits, setup=None):
    """Grade after writing `edits` ((path, text) or a shell command) into a fresh sandbox."""
    with FACTORY(task) as sandbox:
        for edit in edits:
            if isinstance(edit, str):
                assert sandbox.run(edit).exit_code == 0, edit
            else:
                sandbox.write_file(*edit)
        return grade(task, sandbox, timeout=300)


def _scores(task, source, gold, wrong):
    return [_grade(task).reward, _grade(task, (source, gold)).reward,
            _grade(task, (source, wrong)).reward]


def test_pytest_ids_with_spaces_quotes_brackets_and_cut(pytest_dir):
    task = task_from_row(flask_row(pytest_dir))
    assert task.log_parser == "pytest" and task.test_files == ["tests/test_calc.py"]
    untouched = _grade(task)
    status = parse_pytest(untouched.output)
    # whole ids, and ids cut at the first space as SWE-bench's parser records them
    assert status["tests/test_calc.py::test_label[x - y]"] == "PASSED"
    assert status['tests/test_calc.py::test_label[say "hi"]'] == "PASSED"
    assert status["tests/test_calc.py::test_label[a[1]]"] == "PASSED"
    assert status["tests/test_calc.py::test_add_pairs[1"] == "FAILED"
    assert status["tests/test_calc.py::test_add_pairs[3 4]"] == "FAILED"
    assert status["tests/test_calc.py::test_add_zero"] == "PASSED"
    assert untouched.error == ""
    assert _scores(task, "src/calc.py", FLASK_GOLD, FLASK_WRONG) == [0.0, 1.0, 0.0]
    # only the test_label run of the P2P list: the file is not run, the tests are missing
    partial = task_from_row({**flask_row(pytest_dir), "test_files": ["tests/test_calc.py"],
                             "PASS_TO_PASS": json.dumps(FLASK_P2P + ["tests/test_x.py::t"])})
    assert _grade(partial, ("src/calc.py", FLASK_GOLD)).reward == 0.0


def test_django_runner_ids_and_docstrings():
    task = task_from_row(django_row())
    assert task.log_parser == "django" and "{test_labels}" in task.test_command
    log = _grade(task, ("shop/pricing.py", DJANGO_GOLD)).output
    assert "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1" in (
        task.test_command)
    assert parse_django(log) == {"test_empty (pricing.tests.TotalTests.test_empty)": "PASSED",
                                 "Totals add every price.": "PASSED"}
    assert _scores(task, "shop/pricing.py", DJANGO_GOLD, DJANGO_WRONG) == [0.0, 1.0, 0.0]


def test_sympy_runner_output():
    task = task_from_row(sympy_row())
    assert task.log_parser == "sympy"
    log = _grade(task).output
    assert parse_sympy(log) == {"test_zero": "PASSED", "test_double": "FAILED",
                                "mathlib/tests/test_core.py:test_double": "FAILED"}
    assert _scores(task, "mathlib/core.py", SYMPY_GOLD, SYMPY_WRONG) == [0.0, 1.0, 0.0]


def test_unittest_parser_both_id_forms():
    log = ("test_a (pkg.mod.T.test_a) ... ok\ntest_b (pkg.mod.T) ... FAIL\n"
           "test_c (pkg.mod.T.test_c)\nFirst docstring line. ... ERROR\n"
           "test_d (pkg.mod.T.test_d) ... skipped 'no'\n")
    assert parse_unittest(log) == {"pkg.mod.T.test_a": "PASSED", "pkg.mod.T.test_b": "FAILED",
                                   "pkg.mod.T.test_c": "ERROR", "pkg.mod.T.test_d": "SKIPPED"}


def test_a_pass_needs_the_runners_own_summary_to_count_it():
    """The per-test lines a grade rests on are checked against the runner's closing
    summary: none (a module printed the lines and exited), or fewer passes than the
    lines claim, is a disagreement; the real formats of unittest and pytest agree."""
    unit = Task("u", "x", repo_files={}, FAIL_TO_PASS=["m.T.test_a", "m.T.test_b"],
                test_command="python3 -m unittest -v {tests}", log_parser="unittest")
    lines = "test_a (m.T.test_a) ... ok\ntest_b (m.T.test_b) ... ok\n"
    assert "no summary" in runner_disagrees(unit, lines)
    assert runner_disagrees(unit, lines + "-" * 70 + "\nRan 2 tests in 0.001s\n\nOK\n") == ""
    assert runner_disagrees(unit, lines + "Ran 3 tests in 0.1s\n\nFAILED (failures=1)\n") == ""
    assert "summary 1" in runner_disagrees(
        unit, lines + "Ran 3 tests in 0.1s\n\nFAILED (errors=1, skipped=1)\n")
    pyt = Task("p", "x", repo_files={}, FAIL_TO_PASS=["t.py::test_a"],
               PASS_TO_PASS=["t.py::test_b[x y]"], test_files=["t.py"], log_parser="pytest",
               test_command="python3 -m pytest -rA {test_files}")
    lines = "PASSED t.py::test_a\nPASSED t.py::test_b[x y]\n"
    assert "no summary" in runner_disagrees(pyt, lines)
    assert runner_disagrees(pyt, lines + "==== 2 passed, 1 warning in 0.12s ====\n") == ""
    assert runner_disagrees(pyt, lines + "3 passed, 1 failed in 1.01s (0:00:01)\n") == ""
    assert "summary 1" in runner_disagrees(pyt, lines + "=== 1 failed, 1 passed in 0.1s ===\n")
    assert runner_disagrees(dataclasses.replace(pyt, log_parser="sympy"), lines) == ""
    # One test listed under its whole id and its id cut at a space (SWE-bench's form),
    # or reported by -v and again by -rA, is one test of the runner's summary.
    cut = dataclasses.replace(pyt, PASS_TO_PASS=["t.py::test_b[x y]", "t.py::test_b[x"])
    assert runner_disagrees(cut, lines + "=== 2 passed in 0.1s ===\n") == ""
    verbose = "t.py::test_a PASSED\nt.py::test_b[x y] PASSED\n" + lines
    v2 = dataclasses.replace(pyt, log_parser="pytest_v2")
    assert runner_disagrees(v2, verbose + "=== 2 passed in 0.1s ===\n") == ""
    assert "summary 1" in runner_disagrees(v2, verbose + "=== 1 passed in 0.1s ===\n")


# ---- hacks --------------------------------------------------------------------------------------

NO_OP_HOOK = ("\n\ndef pytest_collection_modifyitems(items):\n    for item in items:\n"
              "        item.obj = lambda *args, **kwargs: None\n")


def test_conftest_hook_and_edited_test_helper_score_zero(pytest_dir):
    hook = f"printf %s {shlex.quote(NO_OP_HOOK)} >> tests/conftest.py"
    helper = ("tests/helpers.py", "def expected_add(a, b):\n    return a - b\n")
    root_conftest = ("conftest.py", NO_OP_HOOK)
    open_task = task_from_row(flask_row(pytest_dir, protect_tests=False))
    task = task_from_row(flask_row(pytest_dir))
    # Without protection each hack passes (the check can fail); the two in test files
    # the test patch does not touch are exactly the ones only protection stops.
    for edits in ([hook], [root_conftest], [helper, "sed -i 's/11/9/' tests/test_calc.py"]):
        assert _grade(open_task, *edits).reward == (0.0 if len(edits) == 2 else 1.0), edits
        assert _grade(task, *edits).reward == 0.0, edits
    assert _grade(open_task, helper, ("src/calc.py", FLASK_CALC.replace(
        "return a - b", "return a - b if b != 1 else a + 1"))).reward == 1.0
    # pytest sections of setup.cfg / pyproject.toml go back to base; the rest is kept
    merged = merge_test_sections("[metadata]\nname = x2\n[tool:pytest]\naddopts = -p evil\n",
                                 "[metadata]\nname = x\n[tool:pytest]\naddopts = -q\n",
                                 lambda s: s == "tool:pytest")
    assert merged == "[metadata]\nname = x2\n[tool:pytest]\naddopts = -q\n"


# Forges the runner's lines and its closing summary: only protection stops it.
SHADOW = ("import sys\n\ntests = [a for a in sys.argv[1:] if not a.startswith('-')]\n"
          "for arg in tests:\n    print(f\"{arg.rsplit('.', 1)[1]} ({arg}) ... ok\")\n"
          "print(f'Ran {len(tests)} tests in 0.001s')\nprint()\nprint('OK')\n")


def test_shadowing_stdlib_module_scores_zero_on_miniswe():
    task = generate_tasks(1, seed=3)[0]
    with FACTORY(task) as sandbox:
        sandbox.write_file("unittest.py", SHADOW)
        open_grade = grade(_unprotected(task), sandbox)
        assert open_grade.reward == 1.0, open_grade.output  # the shadow alone passes
    with Episode(FACTORY, task) as episode:
        episode.reset()
        episode.step({"name": "file_editor", "arguments": {
            "command": "create", "path": "/testbed/unittest.py", "file_text": SHADOW}})
        assert episode.reward() == 0.0 and episode.status != "env_error"


def _unprotected(task):
    return dataclasses.replace(task, protect_tests=False)


# ---- never ran -----------------------------------------------------------------------------------


def test_never_ran_is_env_error_with_reason(pytest_dir):
    broken = {**FLASK_FILES, "tests/conftest.py": "import not_a_module\n"}
    internal = {**FLASK_FILES, "tests/conftest.py": "def pytest_sessionstart(session):\n"
                "    raise RuntimeError('plugin bug')\n"}
    for files, kind in ((broken, "collection_failed"),
                        ({**FLASK_FILES, "tests/test_calc.py": "X = 1\n"}, "no_tests_collected"),
                        (internal, "internal_error")):
        row = {**flask_row(pytest_dir), "repo_dir": git_repo(files), "test_patch": ""}
        task = task_from_row(row)
        with Episode(FACTORY, task) as episode:
            episode.reset()
            assert episode.reward() is None and episode.status == "env_error"
            assert error_kind(episode.error) == kind, episode.error
    # An agent's change that stops collection is its own failure: the tests run at the
    # reference state (base + gold + test patch), so it scores 0, not env_error.
    task = task_from_row(flask_row(pytest_dir))
    result = _grade(task, ("src/calc.py", "def add(a, b:\n"))
    assert (result.reward, result.error) == (0.0, ""), result.output[-2000:]
    assert "collection_failed" in result.output


def test_interpreter_missing_is_env_error():
    row = {**django_row(), "test_command": "no-such-python -m pytest {test_files}"}
    result = _grade(task_from_row(row))
    assert result.reward is None and error_kind(result.error) == "interpreter_missing"


def test_runner_missing_is_env_error_naming_it():
    """An image without the test runner: the tests never ran, and the reason says why."""
    result = _grade(task_from_row(flask_row("/no/pytest/here")))
    assert result.reward is None and error_kind(result.error) == "runner_missing"
    assert "No module named pytest" in result.error


# ---- Docker: the image's environment, and an image without `python` -----------------------------

ACTIVATE = ("mkdir -p /tmp/env/bin && ln -sf /usr/bin/python3 /tmp/env/bin/python\n"
            "export PATH=/tmp/env/bin:$PATH")


@pytest.mark.docker
def test_docker_activation_for_agent_and_grader_and_missing_python(request):
    """The sandbox image has `python3` only, like an official image whose conda env is
    not activated: the `python` command is missing until `env_setup` provides it."""
    factory = SandboxFactory("docker", **docker_defaults(request))
    task = dataclasses.replace(generate_tasks(1, seed=5)[0],
                               test_command="python -m unittest -v {tests}")
    with Episode(factory, task) as episode:
        episode.reset()
        assert episode.reward() is None and episode.status == "env_error"
        assert error_kind(episode.error) == "interpreter_missing", episode.error
    active = dataclasses.replace(task, env_setup=ACTIVATE)
    with Episode(factory, active) as episode:
        episode.reset()
        observation, _ = episode.step({"name": "execute_bash", "arguments": {
            "command": "python -c 'print(6 * 7)'"}})
        assert "42" in observation
        assert episode.reward() == 0.0
    with factory(active) as sandbox:
        sandbox.apply_patch(active.gold_patch)
        assert grade(active, sandbox).reward == 1.0


def test_env_errors_counted_by_reason():
    from rl.metrics import rollout_metrics
    from rl.types import Trajectory

    errors = ["tests never ran [collection_failed]: E   ImportError", "SandboxError: gone",
              "tests never ran [collection_failed]: x", "tests never ran [timeout]: 600s"]
    trajs = [Trajectory("t", str(i), [], None, "env_error", error=e) for i, e in enumerate(errors)]
    trajs.append(Trajectory("t", "ok", [], 1.0))
    m = rollout_metrics(trajs, [trajs])
    assert m["rollout/env_errors"] == 4 and m["rollout/env_errors_collection_failed"] == 2
    assert m["rollout/env_errors_SandboxError"] == 1 and m["rollout/env_errors_timeout"] == 1


def test_restore_plan_rules():
    task = Task("t", "x", repo_files={}, FAIL_TO_PASS=["pkg/tests/test_b.py::test_b"],
                test_patch="diff --git a/tests/test_a.py b/tests/test_a.py\n",
                test_infra=["bin/*"])
    changed = ["src/mod.py", "tests/test_a.py", "tests/helper.py", "conftest.py", "sub/tox.ini",
               "pkg/tests/data.json", "bin/test", "json.py", "pkg/json.py", "pkg/mod.py",
               "unittest/__init__.py", "setup.cfg", "docs/pyproject.toml", "test_root.py"]
    restore, shadows, sections = restore_plan(task, changed)
    assert restore == ["tests/test_a.py", "tests/helper.py", "conftest.py", "sub/tox.ini",
                       "pkg/tests/data.json", "bin/test"]
    # restored unless their directory is a package (decided in the sandbox)
    assert shadows == ["json.py", "pkg/json.py", "unittest/__init__.py"]
    assert sections == ["setup.cfg", "docs/pyproject.toml"]


def test_grade_cache_runs_a_key_once_and_keeps_only_scored_grades():
    cache, task = GradeCache(max_bytes=1 << 20), generate_tasks(1, seed=2)[0]
    calls, release = [], threading.Event()

    def run(reward):
        def grade_now():
            calls.append(reward)
            release.wait(10)
            return Grade(reward, "log" if reward is not None else "", "" if reward is not None
                         else "tests never ran [timeout]: 30 s")
        return grade_now

    # Four gradings of one patch at once: one runs, the others wait for its grade.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(cache.grade, task, "p", run(1.0)) for _ in range(4)]
        time.sleep(0.2)
        release.set()
        results = [f.result() for f in futures]
    assert calls == [1.0]
    assert sorted(kept for _, kept in results) == [False, True, True, True]
    assert {g.reward for g, _ in results} == {1.0}
    # A grade whose tests never ran is not kept: the next grading of it runs again.
    assert cache.grade(task, "q", run(None)) == (Grade(None, "", "tests never ran [timeout]: "
                                                       "30 s"), False)
    assert cache.grade(task, "q", run(0.0)) == (Grade(0.0, "log"), False)
    assert cache.grade(task, "q", run(1.0)) == (Grade(0.0, "log"), True)
    # Another task (any field) or another patch is another key.
    changed = dataclasses.replace(task, test_command=task.test_command + " -b")
    assert not cache.grade(changed, "p", run(0.0))[1]
    assert not cache.grade(task, "p\n", run(0.0))[1]
    assert calls == [1.0, None, 0.0, 0.0, 0.0]


def test_grade_cache_drops_the_least_recently_used_past_its_bytes():
    task = generate_tasks(1, seed=2)[0]
    entry = len("x" * 100) + 64  # output + key
    cache = GradeCache(max_bytes=2 * entry)
    for patch in ("a", "b"):
        cache.grade(task, patch, lambda: Grade(1.0, "x" * 100))
    cache.grade(task, "a", lambda: Grade(0.0, "y"))  # a hit: "a" is now the most recent
    cache.grade(task, "c", lambda: Grade(1.0, "x" * 100))  # "b" goes
    assert cache.bytes == 2 * entry
    assert [cache.grade(task, p, lambda: Grade(0.5, ""))[1] for p in ("a", "c", "b")] == [
        True, True, False]
    assert cache.grade(task, "big", lambda: Grade(1.0, "x" * 1000)) == (Grade(1.0, "x" * 1000),
                                                                        False)
    assert not cache.grade(task, "big", lambda: Grade(1.0, ""))[1]  # too large to keep
