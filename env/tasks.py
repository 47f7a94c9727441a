"""One task schema for SWE-bench rows, R2E-Gym rows and generated mini-SWE repos.

Row conventions matched (field names as the datasets spell them):
- SWE-bench: `instance_id, repo, base_commit, patch, test_patch, problem_statement,
  FAIL_TO_PASS, PASS_TO_PASS`, the two test lists as JSON strings. The harness keeps
  the test command per repo/version outside the row; give it as `test_command` or
  the pytest default below is used.
- R2E-Gym: `repo_name, docker_image, commit_hash, problem_statement,
  expected_output_json` (a JSON string mapping test name -> PASSED/FAILED/ERROR).
  The image holds the repository at /testbed and `/root/run_tests.sh`, which runs
  the held-out tests of `/root/r2e_tests` (linked into the repo while it runs);
  the reward compares its pytest `-rA` summary with `expected_output_json`.

`test_command` may contain `{tests}`, replaced by the shell-quoted FAIL_TO_PASS +
PASS_TO_PASS ids; exit status 0 then means every listed test passed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

R2E_TEST_COMMAND = (
    "rm -rf r2e_tests && ln -s /root/r2e_tests r2e_tests && bash /root/run_tests.sh; "
    "status=$?; rm -f r2e_tests; exit $status")
PYTEST_TEST_COMMAND = "python -m pytest -rA {tests}"


@dataclasses.dataclass
class Task:
    """A repository in a broken state, a problem statement, and the tests that judge it.

    Exactly one source: `image` (a Docker image with the repo at `workdir`), or
    `repo_files` (path -> text) / `repo_dir` (a host directory) copied into a fresh
    sandbox. `test_files` are restored to their `repo_files` content before grading
    so an edited test cannot pass itself; `test_patch` is applied before grading
    (SWE-bench).
    """

    instance_id: str
    problem_statement: str
    FAIL_TO_PASS: list[str] = dataclasses.field(default_factory=list)
    PASS_TO_PASS: list[str] = dataclasses.field(default_factory=list)
    test_command: str = PYTEST_TEST_COMMAND
    repo: str = ""
    base_commit: str = ""
    image: str = ""
    repo_files: dict[str, str] | None = None
    repo_dir: str | None = None
    workdir: str = "/testbed"
    gold_patch: str = ""
    test_patch: str = ""
    test_files: list[str] = dataclasses.field(default_factory=list)
    expected_output: dict[str, str] | None = None
    split: str = ""
    difficulty: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def tests(self) -> list[str]:
        return list(self.FAIL_TO_PASS) + list(self.PASS_TO_PASS)


class TaskRowError(ValueError):
    """A JSONL row that is not a valid task; the message names the line and field."""


def _field(row: dict, where: str, *names: str, kind: type | tuple = str, required: bool = False,
           default: Any = None) -> Any:
    for name in names:
        if name in row and row[name] is not None:
            value = row[name]
            if not isinstance(value, kind):
                raise TaskRowError(
                    f"{where}: field '{name}' must be {_kind_name(kind)}, "
                    f"got {type(value).__name__}")
            return value
    if required:
        raise TaskRowError(f"{where}: missing field '{' or '.join(names)}'")
    return default


def _kind_name(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _test_list(row: dict, where: str, name: str) -> list[str]:
    """A list of test ids, given as a list or (SWE-bench) a JSON string of a list."""
    value = _field(row, where, name, kind=(list, str), default=[])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise TaskRowError(f"{where}: field '{name}' is not a JSON list: {e.msg}") from e
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TaskRowError(f"{where}: field '{name}' must be a list of strings")
    return value


def _expected_output(row: dict, where: str) -> dict[str, str] | None:
    value = _field(row, where, "expected_output_json", kind=(dict, str))
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise TaskRowError(f"{where}: field 'expected_output_json' is not JSON: {e.msg}") from e
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TaskRowError(f"{where}: field 'expected_output_json' must map test names to status")
    return value


def task_from_row(row: Any, where: str = "row") -> Task:
    """Builds a Task from a SWE-bench, R2E-Gym or native row; TaskRowError if invalid."""
    if not isinstance(row, dict):
        raise TaskRowError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    image = _field(row, where, "image", "docker_image", "image_name", default="")
    repo_files = _field(row, where, "repo_files", kind=dict)
    if repo_files is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in repo_files.items()):
        raise TaskRowError(f"{where}: field 'repo_files' must map paths to text")
    repo_dir = _field(row, where, "repo_dir")
    if not (image or repo_files or repo_dir):
        raise TaskRowError(
            f"{where}: missing field 'image' (or 'docker_image' / 'image_name'), "
            "'repo_files' or 'repo_dir': the task has no repository source")
    expected = _expected_output(row, where)
    default_command = R2E_TEST_COMMAND if expected is not None else PYTEST_TEST_COMMAND
    instance_id = _field(row, where, "instance_id", default=image)
    if not instance_id:
        raise TaskRowError(f"{where}: missing field 'instance_id'")
    difficulty = _field(row, where, "difficulty", kind=int)
    known = {"instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS", "test_command",
             "repo", "repo_name", "base_commit", "image", "docker_image", "image_name",
             "repo_files", "repo_dir", "workdir", "patch", "test_patch", "test_files",
             "expected_output_json", "split", "difficulty"}
    return Task(
        instance_id=instance_id,
        problem_statement=_field(row, where, "problem_statement", required=True),
        FAIL_TO_PASS=_test_list(row, where, "FAIL_TO_PASS"),
        PASS_TO_PASS=_test_list(row, where, "PASS_TO_PASS"),
        test_command=_field(row, where, "test_command", default=default_command),
        repo=_field(row, where, "repo", "repo_name", default=""),
        base_commit=_field(row, where, "base_commit", default=""),
        image=image,
        repo_files=repo_files,
        repo_dir=repo_dir,
        workdir=_field(row, where, "workdir", default="/testbed"),
        gold_patch=_field(row, where, "patch", default=""),
        test_patch=_field(row, where, "test_patch", default=""),
        test_files=_test_list(row, where, "test_files"),
        expected_output=expected,
        split=_field(row, where, "split", default=""),
        difficulty=difficulty,
        metadata={k: v for k, v in row.items() if k not in known},
    )


def task_to_row(task: Task) -> dict[str, Any]:
    """The native JSONL row of a task (inverse of task_from_row)."""
    row = {
        "instance_id": task.instance_id, "problem_statement": task.problem_statement,
        "FAIL_TO_PASS": task.FAIL_TO_PASS, "PASS_TO_PASS": task.PASS_TO_PASS,
        "test_command": task.test_command, "repo": task.repo, "base_commit": task.base_commit,
        "image": task.image, "repo_files": task.repo_files, "repo_dir": task.repo_dir,
        "workdir": task.workdir, "patch": task.gold_patch, "test_patch": task.test_patch,
        "test_files": task.test_files, "expected_output_json": task.expected_output,
        "split": task.split, "difficulty": task.difficulty,
    }
    return {**task.metadata, **{k: v for k, v in row.items() if v is not None}}


def load_tasks(path: str) -> list[Task]:
    """Reads a JSONL file of task rows; blank lines are skipped."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskRowError(f"{where}: invalid JSON: {e.msg}") from e
            tasks.append(task_from_row(row, where))
    return tasks
