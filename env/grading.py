"""Grading a task's tests in its sandbox, per test, as the official harnesses grade them.

One path for every task (SWE-bench, R2E-Gym, mini-SWE, native rows):

1. Protect the tests (unless `task.protect_tests` is off): every file the agent changed
   that is a test or test infrastructure goes back to the base commit (`restore_plan`),
   then `test_patch` is applied. Test infrastructure: every `conftest.py`, `pytest.ini`,
   `tox.ini`, the pytest sections of `setup.cfg` / `pyproject.toml`, the test files of
   the row and the test directories holding them, the runner's own files
   (`task.test_infra`), and modules named like a standard-library module outside any
   package (a `unittest.py` in the repository root shadows the real one).
2. Run `task.test_command` (the sandbox runs `task.env_setup` before it, as before the
   agent's commands: env.sandbox.sandbox_spec), and read the log with the task's
   parser (env.logparsers): test name -> PASSED / FAILED / ERROR / SKIPPED / XFAIL.
3. Grade: R2E-Gym rows (`expected_output`) must reproduce `expected_output_json`
   exactly; others pass when no FAIL_TO_PASS or PASS_TO_PASS test is FAILED, ERROR or
   missing from the log (SWE-bench `get_eval_tests_report`: a skipped test is neither
   a success nor a failure). The `exit_code` parser grades by the command's status.

Where the tests run (`GRADINGS`): "fresh" (the default, `grade_patch`) grades an
episode's final patch as SWE-bench's harness does, in a new sandbox of the task at its
base commit with the patch applied (a patch that does not apply scores 0): nothing the
agent left outside its patch (site-packages, its home directory, /usr/local/bin, files
its ignore rules leave out of the diff, a process) reaches the grade. "in_place"
(`grade` on the agent's own sandbox) saves a sandbox per episode, and trusts that
state: an agent can reach reward 1 through it without fixing anything.

Graded once per patch (`GradeCache`): with fresh grading the reward is a function of
the task and the patch, so an episode whose final patch was graded before, for the
same task, takes that grade without running the tests again.

A run in which none of the listed tests ran (the interpreter or the test runner is
missing, collection failed, nothing was collected, pytest stopped on an internal error,
the parser found none of them, the run timed out) is no task outcome (the log parsers
and this classification are checked against pytest 7, 8 and 9). The tests are then run
once more from a reference state (base + gold patch + test_patch, or base + test_patch
without a gold patch): if they run there, the agent's change stopped them and the
reward is 0; if they do not, the result is an env_error carrying the reason
(`Grade.error`). Grading leaves the tree in the state it graded.
"""

from __future__ import annotations

import collections
import fnmatch
import hashlib
import posixpath
import re
import shlex
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple

from env.logparsers import ANSI, PARSERS, RUNNER_PASSED, clean, passed_count
from env.sandbox.base import Sandbox, SandboxError
from env.swebench import NON_TEST_EXTS, patch_paths, test_directives
from env.tasks import Task

GIT = "git -c safe.directory=* -c core.quotepath=off"
FAILING = ("FAILED", "ERROR")
TEST_DIR_NAMES = {"tests", "test", "testing"}
# pytest's configuration files (7-9 read these names; pytest.toml and .pytest.toml from 9).
INFRA_NAMES = {"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml",
               "tox.ini"}
SECTION_FILES = {"setup.cfg": lambda s: s in ("tool:pytest", "pytest"),
                 "pyproject.toml": lambda s: s.startswith("tool.pytest")}
# Names a module in a directory on sys.path would shadow. `test` (CPython's own suite)
# is left out: repositories have their own `test` directories.
# `sitecustomize` / `usercustomize` run at every interpreter start from sys.path.
STDLIB = frozenset(sys.stdlib_module_names) - {"test"} | {"sitecustomize", "usercustomize"}
# Names a module at the repository root would shadow for `python -m pytest` (the root is
# first on sys.path): the runner and what it imports.
RUNNERS = frozenset({"pytest", "_pytest", "pluggy", "py"})


class Grade(NamedTuple):
    """reward: 1.0 / 0.0, None when the tests never ran; error: why they never ran
    ("tests never ran [kind]: detail"), "" otherwise."""

    reward: float | None
    output: str
    error: str = ""




def r2e_outcome_matches(parsed: dict[str, str], expected: dict[str, str]) -> bool:
    """Same tests, same statuses (names compared before any ' - ' suffix)."""
    strip = lambda d: {ANSI.sub("", k).split(" - ")[0]: v for k, v in d.items()}
    parsed, expected = strip(parsed), strip(expected)
    return len(parsed) == len(expected) and all(
        not k or expected.get(k) == v for k, v in parsed.items())


# ---- per-test grading and "never ran" -----------------------------------------------------------


def failing_tests(status: dict[str, str], tests: list[str]) -> list[str]:
    """The listed tests that failed, errored or are missing from the log."""
    return [t for t in tests if status.get(t, "FAILED") in FAILING]


def never_ran(task: Task, output: str, exit_code: int, timed_out: bool, timeout: float,
              status: dict[str, str]) -> str:
    """Why none of the task's tests ran ("kind: detail"), or "" when they ran."""
    if timed_out:
        return f"timeout: the test run did not finish in {timeout:g}s"
    if exit_code in (126, 127):
        last = (output.strip().splitlines() or [""])[-1]
        return f"interpreter_missing: the test command could not start (exit {exit_code}): {last}"
    if task.log_parser == "exit_code":
        return ""
    runner = re.search(r"^.*No module named '?(pytest|nose|django)'?.*$", "\n".join(
        clean(output)), re.MULTILINE)
    if runner and not any(t in status for t in task.tests):
        return f"runner_missing: the test runner is not installed: {runner.group(0).strip()}"
    if task.expected_output is not None:
        return "" if status else "tests_not_found: the log has no pytest summary"
    if any(t in status for t in task.tests) or not task.tests:
        return ""
    text = "\n".join(clean(output))
    if "\nINTERNALERROR> " in "\n" + text:
        raised = re.findall(r"^INTERNALERROR> +(\w[\w.]*(?:Error|Exception|Exit)\b.*)$", text,
                            re.MULTILINE)
        return f"internal_error: {raised[-1].strip() if raised else 'see the log'}"
    collect = re.search(r"^(?:ERROR collecting .*|E +\w*Error.*|\w*Error: .*)$", text, re.MULTILINE)
    if re.search(r"error(s)? during collection|^ERROR collecting|Interrupted: \d+ error", text,
                 re.MULTILINE) or (exit_code in (2, 3, 4) and collect):
        return f"collection_failed: {collect.group(0).strip() if collect else 'see the log'}"
    if re.search(r"collected 0 items|no tests ran|^Ran 0 tests", text, re.MULTILINE) or (
            exit_code == 5):
        return "no_tests_collected: the test command collected no tests"
    return f"tests_not_found: none of the {len(task.tests)} listed tests is in the log"


def error_kind(error: str) -> str:
    """A short counter name for an env_error message: the never-ran kind, else the
    exception class that ended the episode ("SandboxError")."""
    m = re.match(r"tests never ran \[(\w+)\]", error)
    return m.group(1) if m else (error.split(":", 1)[0].strip() or "unknown")


# ---- protecting the tests ----------------------------------------------------------------------


def listed_test_files(task: Task) -> list[str]:
    """The row's test files: those test_patch touches, `test_files`, and the files of
    pytest-style ids (`path::name`)."""
    paths = patch_paths(task.test_patch) + list(task.test_files)
    paths += [t.split("::", 1)[0] for t in task.tests if "::" in t]
    return list(dict.fromkeys(p for p in paths if p))


def _test_dirs(paths: list[str]) -> set[str]:
    """Directories of test files that are test directories (a `tests`/`test`/`testing`
    component): every file under them is protected. Test files elsewhere (the repository
    root, a package) are protected one by one."""
    dirs = set()
    for path in paths:
        parts = posixpath.dirname(path).split("/")
        if TEST_DIR_NAMES & set(parts):
            dirs.add(posixpath.dirname(path))
    return dirs


def _shadow_name(path: str) -> str | None:
    """The standard-library module (or, at the root, test runner) `path` would shadow
    from a directory on sys.path (`X.py`, `X.pyc`, `X.<tag>.so`, `X/__init__.py`), or
    None."""
    parts = path.split("/")
    name = parts[-1]
    if name == "__init__.py" and len(parts) > 1:
        name = parts[-2]
    elif re.search(r"\.(py|pyc|so|pyd)$", name):
        name = name.split(".", 1)[0]
    else:
        return None
    at_root = _package_init(path) == "__init__.py"
    return name if name in STDLIB or (at_root and name in RUNNERS) else None


def test_module_shadows(task: Task) -> list[str]:
    """Shell words (globs) naming what the interpreter would import instead of a listed
    test module `d/x.py`: a package or directory `d/x/`, an extension module `d/x.so` /
    `d/x.<tag>.so` (extensions come first), and cached code `d/__pycache__/x.*` (an
    "unchecked" .pyc runs without a look at its source). None of them belongs to a
    repository's base."""
    words = []
    for path in run_files(task):
        if not path.endswith(".py"):
            continue
        stem = shlex.quote(path[:-3])
        cached = shlex.quote(posixpath.join(posixpath.dirname(path), "__pycache__",
                                            posixpath.basename(path)[:-3]))
        words += [stem, f"{stem}.so", f"{stem}.*.so", f"{stem}.pyd", f"{stem}.*.pyd",
                  f"{cached}.*"]
    return words


def restore_plan(task: Task, changed: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(paths to restore, stdlib shadows to restore unless their directory is a package,
    setup.cfg / pyproject.toml files whose pytest sections go back to base)."""
    tests = listed_test_files(task)
    dirs, tests = _test_dirs(tests), set(tests)
    restore, shadows, sections = [], [], []
    for path in changed:
        name = posixpath.basename(path)
        if (name in INFRA_NAMES or path in tests
                or any(path.startswith(d + "/") for d in dirs)
                or any(fnmatch.fnmatch(path, g) for g in task.test_infra)):
            restore.append(path)
        elif name in SECTION_FILES:
            sections.append(path)
        elif _shadow_name(path):
            shadows.append(path)
    return restore, shadows, sections


def _changed_paths(sandbox: Sandbox, base: str) -> list[str]:
    """Every path that differs from `base`, and every ignored untracked file."""
    res = sandbox.run(f"{GIT} add -A . >/dev/null 2>&1; {GIT} diff --cached --name-only "
                      f"--no-renames -z {base} -- && {GIT} ls-files -z -o -i --exclude-standard "
                      "--directory --no-empty-directory", timeout=120)
    if res.exit_code != 0:
        raise SandboxError(f"listing the changed files failed: {res.output.strip()[-500:]}")
    return [p for p in res.output.split("\0") if p.strip() and not p.endswith("/")]


def _package_init(path: str) -> str:
    """The `__init__.py` whose presence makes the module at `path` part of a package."""
    directory = posixpath.dirname(path)
    if posixpath.basename(path) == "__init__.py":
        directory = posixpath.dirname(directory)
    return posixpath.join(directory, "__init__.py")


def _restore_command(base: str, restore: list[str], shadows: list[str]) -> str:
    """Shadows go back unless their directory is a package below the root: the root is
    on sys.path whether or not it holds an `__init__.py`."""
    def back(path: str) -> str:
        q = shlex.quote(path)
        return f"{{ {GIT} checkout {base} -- {q} 2>/dev/null || rm -f -- {q}; }}"

    cmds = [back(p) for p in restore]
    cmds += [back(p) if _package_init(p) == "__init__.py" else
             f"[ -e {shlex.quote(_package_init(p))} ] || {back(p)}" for p in shadows]
    return "; ".join(cmds)


def _sections(text: str) -> list[tuple[str, str]]:
    """(section name, text) blocks of an INI / TOML file; the head block is named ''."""
    blocks, name, lines = [], "", []
    for line in text.splitlines(keepends=True):
        m = re.match(r"\s*\[+([^\]]+)\]+\s*(#.*)?$", line)
        if m:
            blocks.append((name, "".join(lines)))
            name, lines = m.group(1).strip(), []
        lines.append(line)
    return blocks + [(name, "".join(lines))]


def merge_test_sections(current: str, base: str, is_test: Callable[[str], bool]) -> str:
    """`current` with its test sections replaced by those of `base`."""
    kept = "".join(b for n, b in _sections(current) if not is_test(n))
    if kept and not kept.endswith("\n"):
        kept += "\n"
    return kept + "".join(b for n, b in _sections(base) if is_test(n))


def _restore_sections(sandbox: Sandbox, base: str, paths: list[str]) -> None:
    for path in paths:
        shown = sandbox.run(f"{GIT} show {base}:{shlex.quote(path)}", timeout=60)
        if shown.exit_code != 0:  # new file: its sections cannot have been in the base
            sandbox.run(f"rm -f -- {shlex.quote(path)}", timeout=60)
            continue
        current = sandbox.read_file(path)
        merged = merge_test_sections(current, shown.output, SECTION_FILES[posixpath.basename(path)])
        if merged != current:
            sandbox.write_file(path, merged)


def protect_tests(task: Task, sandbox: Sandbox, base: str) -> str:
    """Restores test files and test infrastructure to `base` (only test_patch's files
    when `task.protect_tests` is off), then applies test_patch; returns '' or why the
    test patch does not apply."""
    restore, shadows, sections = [], [], []
    if task.protect_tests:
        restore, shadows, sections = restore_plan(task, _changed_paths(sandbox, base))
    restore = list(dict.fromkeys(restore + patch_paths(task.test_patch)))
    commands = [_restore_command(base, restore, shadows)]
    if task.protect_tests and run_files(task):
        commands.append(f"rm -rf -- {' '.join(test_module_shadows(task))}")
    command = "; ".join(c for c in commands if c)
    if command:
        sandbox.run(command + "; true", timeout=120)
    _restore_sections(sandbox, base, sections)
    try:
        sandbox.apply_patch(task.test_patch)
    except ValueError as e:
        return f"test_patch does not apply: {e}"
    return ""


# ---- running and grading -----------------------------------------------------------------------


def run_files(task: Task) -> list[str]:
    """The test files the command runs: the row's `test_files`, else those test_patch
    touches (data files left out), else the files of pytest-style ids."""
    return list(task.test_files) or test_directives(task.test_patch) or [
        p for p in listed_test_files(task) if not p.endswith(NON_TEST_EXTS)]


def grading_command(task: Task) -> str:
    """The task's command with `{tests}` (the listed ids), `{test_files}` (run_files)
    and `{test_labels}` (run_files as Django labels) replaced, shell-quoted."""
    files = run_files(task)
    labels = test_directives("".join(f"diff --git a/{p} b/{p}\n" for p in files), True)
    quote = lambda items: " ".join(shlex.quote(i) for i in items)
    return (task.test_command.replace("{tests}", quote(task.tests))
            .replace("{test_files}", quote(files)).replace("{test_labels}", quote(labels)))


def _score(task: Task, output: str, exit_code: int, timed_out: bool, timeout: float
           ) -> tuple[float | None, str]:
    """(reward, "") when the tests ran, (None, "kind: detail") when they never ran."""
    status = {} if task.log_parser == "exit_code" else PARSERS[task.log_parser](output)
    reason = never_ran(task, output, exit_code, timed_out, timeout, status)
    if reason:
        return None, reason
    if task.expected_output is not None:
        return float(r2e_outcome_matches(status, task.expected_output)), ""
    if task.log_parser == "exit_code":
        return float(exit_code == 0), ""
    return float(not failing_tests(status, task.tests)), ""


def runner_disagrees(task: Task, output: str) -> str:
    """Why the per-test lines of a passing log are not the runner's own account, or '':
    the runner's closing summary must be there and count at least as many passed tests
    as the lines the grade rests on (a module that prints the runner's lines and exits
    leaves no summary, or one that disagrees)."""
    count = RUNNER_PASSED.get(task.log_parser)
    if count is None:
        return ""
    claimed = passed_count(task.log_parser, output,
                           None if task.expected_output is not None else task.tests)
    passed = count(output)
    if passed is None:
        return f"the log shows {claimed} passed tests, but no summary of the test runner"
    if passed < claimed:
        return f"the log shows {claimed} passed tests, the test runner's summary {passed}"
    return ""


def _run(task: Task, sandbox: Sandbox, base: str, timeout: float) -> tuple[float | None, str, str]:
    """Protects the tests, runs them once: (reward or None, reason it never ran, log). A
    pass the runner's summary does not bear out (`runner_disagrees`) scores 0."""
    problem = protect_tests(task, sandbox, base)
    if problem:
        return None, f"test_patch: {problem}", problem
    res = sandbox.run(grading_command(task), timeout=timeout)
    reward, reason = _score(task, res.output, res.exit_code, res.timed_out, timeout)
    disagreement = runner_disagrees(task, res.output) if reward == 1.0 else ""
    if disagreement:
        return 0.0, "", f"{res.output}\n[grader] {disagreement}"
    return reward, reason, res.output


def _reset_to_reference(task: Task, sandbox: Sandbox, base: str) -> bool:
    """The tree at base + gold patch (when the task has one); False if that fails."""
    res = sandbox.run(f"{GIT} reset -q --hard {base} && {GIT} clean -fdq", timeout=120)
    if res.exit_code != 0:
        return False
    try:
        sandbox.apply_patch(task.gold_patch)
    except ValueError:
        return False
    return True


def grade(task: Task, sandbox: Sandbox, timeout: float = 300.0) -> Grade:
    """Grades the sandbox's tree (see the module docstring). Raises SandboxError on
    infrastructure failure."""
    base = shlex.quote(getattr(sandbox, "base_commit", "") or task.base_commit or "HEAD")
    reward, reason, output = _run(task, sandbox, base, timeout)
    if reward is not None:
        return Grade(reward, output)
    kind, _, detail = reason.partition(": ")
    if _reset_to_reference(task, sandbox, base):
        ref_reward, _, _ = _run(task, sandbox, base, timeout)
        if ref_reward is not None:  # the tests run without the agent's change: its fault
            return Grade(0.0, f"{output}\n[grader] {reason}; they run at the reference state")
    return Grade(None, output, f"tests never ran [{kind}]: {detail}")


GRADINGS = ("fresh", "in_place")
# task -> a new sandbox of the task at its base commit, closed when its block ends (a
# sandbox factory: every Sandbox is its own context manager).
SandboxOpener = Callable[[Task], AbstractContextManager[Sandbox]]


def grade_patch(task: Task, patch: str, open_sandbox: SandboxOpener,
                timeout: float = 300.0) -> Grade:
    """Grades `patch` in a new sandbox of `task` (`open_sandbox(task)`, at the base
    commit): the patch applied, then `grade`. A patch that does not apply is the
    patch's own failure, reward 0, as the official harness scores it. Raises
    SandboxError on infrastructure failure. An opener whose sandboxes live elsewhere
    and that grades where they are (it has `grade_patch`, as
    env.sandbox.cluster.RayFactory) grades in one call to it."""
    near = getattr(open_sandbox, "grade_patch", None)
    if near is not None:
        return near(task, patch, timeout)
    with open_sandbox(task) as sandbox:
        try:
            sandbox.apply_patch(patch)
        except ValueError as e:
            return Grade(0.0, f"[grader] the episode's patch does not apply at the base "
                              f"commit: {e}")
        return grade(task, sandbox, timeout)


class GradeCache:
    """Grades by (task, patch), for the episodes of one run (module docstring).

    A grade whose tests never ran (reward None) is not kept: the next episode with that
    patch grades again. Gradings of one key at once run once, the others wait for its
    grade. Up to `max_bytes` of test output is kept, least recently used out.

    Sound for fresh grading (`grade_patch`), whose grade depends on nothing but the
    task and the patch; env.episode.Episode uses it for that only.
    """

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.hits = self.misses = 0
        self._grades: collections.OrderedDict[str, Grade] = collections.OrderedDict()
        self._running: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(task: Task, patch: str) -> str:
        digest = hashlib.sha256(repr(task).encode("utf-8", "surrogateescape"))
        digest.update(b"\0" + patch.encode("utf-8", "surrogateescape"))
        return digest.hexdigest()

    def grade(self, task: Task, patch: str, run: Callable[[], Grade]) -> tuple[Grade, bool]:
        """(grade, whether it was kept from before) of `task` at `patch`; `run()` grades
        the tree when no grade is kept."""
        key = self.key(task, patch)
        while True:
            with self._lock:
                if key in self._grades:
                    self._grades.move_to_end(key)
                    self.hits += 1
                    return self._grades[key], True
                running = self._running.get(key)
                if running is None:
                    done = self._running[key] = threading.Event()
                    self.misses += 1
                    break
            running.wait()  # then kept, or never ran: one of the waiters runs it
        try:
            result = run()
            if result.reward is not None and not result.error:
                self._keep(key, result)
            return result, False
        finally:
            with self._lock:
                del self._running[key]
            done.set()

    def _keep(self, key: str, result: Grade) -> None:
        size = len(result.output) + len(key)
        with self._lock:
            if size > self.max_bytes:
                return
            self._grades[key] = result
            self.bytes += size
            while self.bytes > self.max_bytes:
                old_key, old = self._grades.popitem(last=False)
                self.bytes -= len(old.output) + len(old_key)
