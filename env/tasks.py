"""One task schema for SWE-bench rows, R2E-Gym rows and generated mini-SWE repos.

Row conventions matched (field names as the datasets spell them):
- SWE-bench / SWE-bench-Verified: `instance_id, repo, version, base_commit, patch,
  test_patch, problem_statement, FAIL_TO_PASS, PASS_TO_PASS`, the two test lists as
  JSON strings. A raw row loads as it is: its image comes from the image template
  (`env.swebench.SWEBENCH_IMAGE_TEMPLATE` unless given), its test command, parser and
  environment activation from `env.swebench.REPO_SPECS`, its test files from test_patch.
- R2E-Gym: `repo_name, docker_image, commit_hash, problem_statement,
  expected_output_json` (a JSON string mapping test name -> PASSED/FAILED/ERROR).
  The image holds the repository at /testbed and `/root/run_tests.sh`, which runs
  the held-out tests of `/root/r2e_tests` (linked into the repo while it runs);
  the reward compares its pytest `-rA` summary with `expected_output_json`.

Fields a row may add to any of them: `image`, `test_command` (wins over the table;
`{tests}` = the listed test ids, `{test_files}` = the test files, `{test_labels}` =
them as Django labels, all shell-quoted), `log_parser` (a name in
env.logparsers.PARSER_NAMES), `env_setup` (shell run before every command), `test_files`,
`protect_tests` (false for datasets whose tasks edit tests). env/grading.py says how
they are used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
from typing import Any

from env import swebench
from env.logparsers import PARSER_NAMES
from env.paths import repo_relative

R2E_TEST_COMMAND = (
    "rm -rf r2e_tests && ln -s /root/r2e_tests r2e_tests && bash /root/run_tests.sh; "
    "status=$?; rm -f r2e_tests; exit $status")
PYTEST_TEST_COMMAND = "python -m pytest -rA {test_files}"
# Host directories a row's repo_dir may not name (or lie inside): the sandbox copies
# repo_dir, so one of these would put the host's configuration or secrets in it.
SYSTEM_DIRS = ("/etc", "/root", "/proc", "/sys", "/dev", "/boot", "/run", "/usr", "/bin",
               "/sbin", "/lib", "/lib32", "/lib64", "/var/lib", "/var/log", "/var/run",
               "/var/spool", "/var/mail", "/var/cache", "/var/backups")


@dataclasses.dataclass
class Task:
    """A repository in a broken state, a problem statement, and the tests that judge it.

    Exactly one source: `image` (a Docker image with the repo at `workdir`), or
    `repo_files` (path -> text) / `repo_dir` (a host directory) copied into a fresh
    sandbox. Grading (env.grading) restores test files and test infrastructure to
    the base commit, applies `test_patch`, runs `test_command` after `env_setup` and
    reads the log with `log_parser` ("" = "pytest" for the default command,
    "r2e" with `expected_output`, else "exit_code": the command judges itself).
    `test_infra`: globs of the test runner's own files, also restored.
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
    version: str = ""
    log_parser: str = ""
    env_setup: str = ""
    test_infra: list[str] = dataclasses.field(default_factory=list)
    protect_tests: bool = True
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.log_parser:
            self.log_parser = ("r2e" if self.expected_output is not None else
                               "pytest" if self.test_command == PYTEST_TEST_COMMAND else
                               "exit_code")

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


def _harness_defaults(row: dict, where: str, image_template: str) -> dict[str, Any]:
    """What the official harness supplies beside the row: for SWE-bench rows (`repo` and
    `version`) the image from `image_template`, the test command, parser, activation,
    runner files and test files of the repository (env.swebench); for R2E-Gym rows
    (`expected_output_json`) run_tests.sh and its activation; else the pytest default."""
    if "expected_output_json" in row:
        return {"test_command": R2E_TEST_COMMAND, "log_parser": "r2e",
                "env_setup": swebench.R2E_ACTIVATE}
    if not ("repo" in row and "version" in row):
        return {"test_command": PYTEST_TEST_COMMAND}
    repo, version = _field(row, where, "repo"), _field(row, where, "version", default="")
    spec = swebench.repo_spec(repo, version) or swebench.RepoSpec()
    command = spec.test_command + (" {test_labels}" if spec.django_labels else " {test_files}")
    instance_id = _field(row, where, "instance_id", default="")
    return {
        "image": swebench.image_name(image_template, instance_id)
        if image_template and instance_id else "",
        "test_command": f"{spec.install}; {command}" if spec.install else command,
        "log_parser": spec.parser,
        "env_setup": "\n".join(filter(None, (swebench.CONDA_ACTIVATE, spec.setup))),
        "test_infra": list(spec.infra),
        "test_files": swebench.test_directives(_field(row, where, "test_patch", default="")),
    }


KNOWN_FIELDS = {
    "instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS", "test_command", "repo",
    "repo_name", "base_commit", "image", "docker_image", "image_name", "repo_files", "repo_dir",
    "workdir", "patch", "test_patch", "test_files", "expected_output_json", "split",
    "difficulty", "version", "log_parser", "env_setup", "test_infra", "protect_tests"}


def task_from_row(row: Any, where: str = "row",
                  image_template: str = swebench.SWEBENCH_IMAGE_TEMPLATE) -> Task:
    """Builds a Task from a SWE-bench, R2E-Gym or native row; TaskRowError if invalid.

    A SWE-bench row without an image gets `image_template` filled with its instance id
    (env.swebench.image_name); "" turns that off.
    """
    if not isinstance(row, dict):
        raise TaskRowError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    harness = _harness_defaults(row, where, image_template)
    image = _field(row, where, "image", "docker_image", "image_name", default="")
    repo_files = _repo_files(row, where)
    repo_dir = _repo_dir(row, where)
    image = image or ("" if repo_files is not None or repo_dir else harness.get("image", ""))
    if not (image or repo_files or repo_dir):
        raise TaskRowError(
            f"{where}: missing field 'image' (or 'docker_image' / 'image_name'), "
            "'repo_files' or 'repo_dir': the task has no repository source (SWE-bench rows "
            "need 'repo', 'version' and 'instance_id' for the image template)")
    instance_id = _field(row, where, "instance_id", default=image)
    if not instance_id:
        raise TaskRowError(f"{where}: missing field 'instance_id'")
    log_parser = _field(row, where, "log_parser", default=harness.get("log_parser", ""))
    _check_parser(log_parser, where)
    return Task(
        instance_id=instance_id,
        problem_statement=_field(row, where, "problem_statement", required=True),
        FAIL_TO_PASS=_test_list(row, where, "FAIL_TO_PASS"),
        PASS_TO_PASS=_test_list(row, where, "PASS_TO_PASS"),
        test_command=_field(row, where, "test_command", default=harness["test_command"]),
        repo=_field(row, where, "repo", "repo_name", default=""),
        base_commit=_field(row, where, "base_commit", default=""),
        image=image, repo_files=repo_files, repo_dir=repo_dir,
        workdir=_workdir(row, where),
        gold_patch=_field(row, where, "patch", default=""),
        test_patch=_field(row, where, "test_patch", default=""),
        test_files=_test_list(row, where, "test_files") or harness.get("test_files", []),
        expected_output=_expected_output(row, where),
        split=_field(row, where, "split", default=""),
        difficulty=_difficulty(row, where),
        version=_field(row, where, "version", default=""),
        log_parser=log_parser,
        env_setup=_field(row, where, "env_setup", default=harness.get("env_setup", "")),
        test_infra=_test_list(row, where, "test_infra") or harness.get("test_infra", []),
        protect_tests=_field(row, where, "protect_tests", kind=bool, default=True),
        metadata={k: v for k, v in row.items()
                  if k not in KNOWN_FIELDS or (k == "difficulty" and isinstance(v, str))},
    )


def _repo_files(row: dict, where: str) -> dict[str, str] | None:
    """Repository-relative paths -> text; an absolute path or one that climbs out with
    '..' is refused here rather than at the first sandbox."""
    repo_files = _field(row, where, "repo_files", kind=dict)
    if repo_files is None:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in repo_files.items()):
        raise TaskRowError(f"{where}: field 'repo_files' must map paths to text")
    for path in repo_files:
        try:
            repo_relative(path)
        except ValueError as e:
            raise TaskRowError(f"{where}: field 'repo_files': {e}") from None
    return repo_files


def _difficulty(row: dict, where: str) -> int | None:
    """A graded level (mini-SWE); SWE-bench-Verified's annotation ("15 min - 1 hour")
    is text and stays in the metadata."""
    value = _field(row, where, "difficulty", kind=(int, str))
    if isinstance(value, bool):
        raise TaskRowError(f"{where}: field 'difficulty' must be an integer level or text, "
                           f"got {value!r}")
    return value if isinstance(value, int) else None


def _workdir(row: dict, where: str) -> str:
    """The repository's absolute path inside the sandbox."""
    value = _field(row, where, "workdir", default="/testbed")
    if not posixpath.isabs(value) or ".." in value.split("/") or value.strip("/") == "":
        raise TaskRowError(f"{where}: field 'workdir' must be an absolute path below / "
                           f"inside the sandbox (without '..'), got {value!r}")
    return value


def _repo_dir(row: dict, where: str) -> str | None:
    """A host directory to copy into the sandbox: never /, the home directory itself
    or a system directory (SYSTEM_DIRS), links resolved."""
    value = _field(row, where, "repo_dir")
    if value is None:
        return None
    real = os.path.realpath(value)
    home = os.path.realpath(os.path.expanduser("~"))
    if real in ("/", home) or any(real == d or real.startswith(d + "/")
                                  for d in map(os.path.realpath, SYSTEM_DIRS)):
        raise TaskRowError(f"{where}: field 'repo_dir' is {value!r} (the host's {real}): a "
                           f"task repository may not be /, the home directory or a system "
                           f"directory, whose contents would be copied into the sandbox")
    return value


def _check_parser(name: str, where: str) -> None:
    if name and name not in PARSER_NAMES:
        raise TaskRowError(f"{where}: field 'log_parser' is {name!r}; known: "
                           f"{', '.join(PARSER_NAMES)}")


def task_to_row(task: Task) -> dict[str, Any]:
    """The native JSONL row of a task (inverse of task_from_row)."""
    row = {
        "instance_id": task.instance_id, "problem_statement": task.problem_statement,
        "FAIL_TO_PASS": task.FAIL_TO_PASS, "PASS_TO_PASS": task.PASS_TO_PASS,
        "test_command": task.test_command, "repo": task.repo, "base_commit": task.base_commit,
        "image": task.image, "repo_files": task.repo_files, "repo_dir": task.repo_dir,
        "workdir": task.workdir, "patch": task.gold_patch, "test_patch": task.test_patch,
        "test_files": task.test_files, "expected_output_json": task.expected_output,
        "split": task.split, "difficulty": task.difficulty, "version": task.version,
        "log_parser": task.log_parser, "env_setup": task.env_setup,
        "test_infra": task.test_infra, "protect_tests": task.protect_tests,
    }
    return {**task.metadata, **{k: v for k, v in row.items() if v is not None}}


def load_tasks(path: str, image_template: str = swebench.SWEBENCH_IMAGE_TEMPLATE
               ) -> list[Task]:
    """Reads a JSONL file of task rows (see task_from_row); blank lines are skipped. Each
    instance_id appears once."""
    tasks, lines = [], {}
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            line = decode_line(raw, where, TaskRowError)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskRowError(f"{where}: invalid JSON: {e.msg}") from e
            except RecursionError:
                raise TaskRowError(f"{where}: invalid JSON: nested too deeply") from None
            task = task_from_row(row, where, image_template)
            if task.instance_id in lines:
                raise TaskRowError(f"{where}: field 'instance_id' {task.instance_id!r} "
                                   f"repeats line {lines[task.instance_id]}")
            lines[task.instance_id] = line_no
            tasks.append(task)
    return tasks


def decode_line(raw: bytes, where: str, error: type[Exception]) -> str:
    """A JSONL line's bytes as text; `error` naming the line and byte if not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start + 1} of the line is "
                    f"{raw[e.start:e.start + 1]!r})") from None
