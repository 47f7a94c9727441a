"""Task schema and JSONL loader: SWE-bench and R2E-Gym rows, and errors naming line and field."""

import json
import re

import pytest

from env import swebench
from env.grading import grading_command
from env.tasks import (
    R2E_TEST_COMMAND,
    TaskRowError,
    load_tasks,
    task_from_row,
    task_to_row,
)

# Field names and value shapes as in princeton-nlp/SWE-bench rows (the lists are JSON strings).
SWE_BENCH_ROW = {
    "instance_id": "astropy__astropy-12907",
    "repo": "astropy/astropy",
    "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
    "patch": "diff --git a/astropy/modeling/separable.py b/astropy/modeling/separable.py\n",
    "test_patch": "diff --git a/astropy/modeling/tests/test_separable.py "
                  "b/astropy/modeling/tests/test_separable.py\n",
    "problem_statement": "Modeling's `separability_matrix` does not compute separability...",
    "hints_text": "",
    "created_at": "2022-03-03T15:14:54Z",
    "version": "4.3",
    "FAIL_TO_PASS": '["astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"]',
    "PASS_TO_PASS": '["astropy/modeling/tests/test_separable.py::test_coord_matrix", '
                    '"astropy/modeling/tests/test_separable.py::test_cdot"]',
    "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
    "image_name": "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest",
}

# Field names as in R2E-Gym/R2E-Gym-Lite rows.
R2E_ROW = {
    "repo_name": "orange3",
    "docker_image": "namanjain12/orange3_final:9d1ec8bd2b1a1e8b5a2e3e3ad8b5d2a3f0e7f1c4",
    "commit_hash": "9d1ec8bd2b1a1e8b5a2e3e3ad8b5d2a3f0e7f1c4",
    "problem_statement": "Title: Table.from_numpy fails on sparse input ...",
    "expected_output_json": json.dumps({"TestTable.test_from_numpy": "PASSED",
                                        "TestTable.test_sparse": "PASSED"}),
    "parsed_commit_content": "{}",
    "num_non_test_files": 1,
}


def _write(tmp_path, rows):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_swe_bench_row_parses_json_string_test_lists(tmp_path):
    (task,) = load_tasks(_write(tmp_path, [SWE_BENCH_ROW]))
    assert task.instance_id == "astropy__astropy-12907"
    assert task.FAIL_TO_PASS == [
        "astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"]
    assert task.PASS_TO_PASS == ["astropy/modeling/tests/test_separable.py::test_coord_matrix",
                                 "astropy/modeling/tests/test_separable.py::test_cdot"]
    assert task.gold_patch == SWE_BENCH_ROW["patch"]
    assert task.test_patch == SWE_BENCH_ROW["test_patch"]
    assert task.base_commit == SWE_BENCH_ROW["base_commit"]
    assert task.image == SWE_BENCH_ROW["image_name"]
    assert task.repo == "astropy/astropy"
    # the harness's facts for astropy 4.3: its command on the test patch's files, its parser
    assert task.version == "4.3" and task.log_parser == "pytest_v2"
    assert task.test_files == ["astropy/modeling/tests/test_separable.py"]
    assert grading_command(task) == "pytest -rA astropy/modeling/tests/test_separable.py"
    assert "conda activate testbed" in task.env_setup
    assert task.expected_output is None and task.protect_tests


def test_raw_swe_bench_rows_load_with_the_image_template(tmp_path):
    raw = {k: v for k, v in SWE_BENCH_ROW.items() if k != "image_name"}
    django = {**raw, "instance_id": "django__django-11099", "repo": "django/django",
              "version": "3.0", "test_patch": "diff --git a/tests/auth_tests/test_validators.py "
              "b/tests/auth_tests/test_validators.py\n"}
    sympy = {**raw, "instance_id": "sympy__sympy-20590", "repo": "sympy/sympy", "version": "1.7",
             "test_patch": "diff --git a/sympy/core/tests/test_basic.py "
             "b/sympy/core/tests/test_basic.py\ndiff --git a/doc/x.txt b/doc/x.txt\n"}
    astropy, django, sympy = load_tasks(_write(tmp_path, [raw, django, sympy]))
    assert astropy.image == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert django.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert grading_command(django) == ("./tests/runtests.py --verbosity 2 --settings=test_sqlite "
                                    "--parallel 1 auth_tests.test_validators")
    assert django.log_parser == "django" and "LC_ALL=en_US.UTF-8" in django.env_setup
    assert grading_command(sympy).endswith("bin/test -C --verbose sympy/core/tests/test_basic.py")
    assert sympy.log_parser == "sympy" and "bin/test" in sympy.test_infra
    verified = task_from_row({**raw, "difficulty": "15 min - 1 hour"})  # Verified's annotation
    assert verified.difficulty is None and verified.metadata["difficulty"] == "15 min - 1 hour"
    (own,) = load_tasks(_write(tmp_path, [raw]), image_template="reg.local/{instance_id}:v1")
    assert own.image == "reg.local/astropy__astropy-12907:v1"
    # a row's explicit fields win over the table
    row = {**raw, "test_command": "tox -e py -- {test_files}", "log_parser": "pytest",
           "env_setup": "", "protect_tests": False}
    task = task_from_row(row)
    assert (task.test_command, task.log_parser, task.env_setup, task.protect_tests) == (
        row["test_command"], "pytest", "", False)
    assert task_from_row(task_to_row(task)) == task
    assert swebench.repo_spec("django/django", "1.9").test_command == (
        "./tests/runtests.py --verbosity 2")


def test_r2e_gym_row(tmp_path):
    (task,) = load_tasks(_write(tmp_path, [R2E_ROW]))
    assert task.image == R2E_ROW["docker_image"]
    assert task.instance_id == R2E_ROW["docker_image"]
    assert task.repo == "orange3"
    assert task.workdir == "/testbed"
    assert task.expected_output == {"TestTable.test_from_numpy": "PASSED",
                                    "TestTable.test_sparse": "PASSED"}
    assert task.test_command == R2E_TEST_COMMAND
    assert "/root/run_tests.sh" in task.test_command
    assert task.log_parser == "r2e" and "/root/.venv/bin" in task.env_setup
    assert task.metadata["commit_hash"] == R2E_ROW["commit_hash"]


def test_native_row_round_trip(tmp_path):
    row = {"instance_id": "t1", "problem_statement": "fix it", "repo_files": {"a.py": "x = 1\n"},
           "FAIL_TO_PASS": ["test_a.T.test_x"], "PASS_TO_PASS": [], "difficulty": 2,
           "test_command": "python3 -m unittest -q {tests}", "split": "train"}
    (task,) = load_tasks(_write(tmp_path, [row, ""]))
    assert task.repo_files == {"a.py": "x = 1\n"} and task.difficulty == 2
    assert task_from_row(task_to_row(task)) == task


@pytest.mark.parametrize("row, line_field", [
    ({k: v for k, v in SWE_BENCH_ROW.items() if k != "problem_statement"}, "problem_statement"),
    ({**SWE_BENCH_ROW, "FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS"),
    ({**SWE_BENCH_ROW, "PASS_TO_PASS": 7}, "PASS_TO_PASS"),
    ({**SWE_BENCH_ROW, "FAIL_TO_PASS": "[1, 2]"}, "FAIL_TO_PASS"),
    ({k: v for k, v in SWE_BENCH_ROW.items() if k not in ("image_name", "version")}, "image"),
    ({**SWE_BENCH_ROW, "log_parser": "nose"}, "log_parser"),
    ({**R2E_ROW, "expected_output_json": "{oops"}, "expected_output_json"),
    ({**SWE_BENCH_ROW, "difficulty": [1]}, "difficulty"),
    ({"problem_statement": "x", "repo_files": {"a.py": "1"}}, "instance_id"),
    ({"instance_id": "t", "problem_statement": "x", "repo_files": {"a.py": 1}}, "repo_files"),
])
def test_bad_row_names_line_and_field(tmp_path, row, line_field):
    path = _write(tmp_path, [SWE_BENCH_ROW, row])
    with pytest.raises(TaskRowError) as err:
        load_tasks(path)
    assert f"{path}:2:" in str(err.value)
    assert f"'{line_field}" in str(err.value)


def test_invalid_json_line_is_named(tmp_path):
    path = _write(tmp_path, [R2E_ROW, SWE_BENCH_ROW, "{broken"])
    with pytest.raises(TaskRowError, match=r"tasks\.jsonl:3: invalid JSON"):
        load_tasks(path)


def test_non_object_row(tmp_path):
    with pytest.raises(TaskRowError, match=r":1: a row must be a JSON object"):
        load_tasks(_write(tmp_path, ["[1, 2]"]))


NATIVE = {"instance_id": "t", "problem_statement": "x", "repo_files": {"a.py": "1"}}


@pytest.mark.parametrize("row, message", [
    ({**NATIVE, "difficulty": True}, "field 'difficulty' must be an integer level or text, "
                                     "got True"),
    ({**NATIVE, "workdir": "testbed"}, "field 'workdir' must be an absolute path"),
    ({**NATIVE, "workdir": "/testbed/../etc"}, "field 'workdir' must be an absolute path"),
    ({**NATIVE, "workdir": "/"}, "field 'workdir' must be an absolute path below /"),
    ({k: v for k, v in NATIVE.items() if k != "repo_files"} | {"repo_dir": "/etc"},
     "field 'repo_dir' is '/etc' (the host's /etc): a task repository may not be"),
    ({k: v for k, v in NATIVE.items() if k != "repo_files"} | {"repo_dir": "/usr/lib/.."},
     "field 'repo_dir' is '/usr/lib/..' (the host's /usr)"),
    ({k: v for k, v in NATIVE.items() if k != "repo_files"} | {"repo_dir": "/"},
     "field 'repo_dir' is '/' (the host's /)"),
    ({**NATIVE, "repo_files": {"a.py": "1", "/etc/cron.d/x": "2"}},
     "field 'repo_files': file path must be relative to the repository root, got "
     "'/etc/cron.d/x'"),
    ({**NATIVE, "repo_files": {"pkg/../../outside.py": "1"}},
     "field 'repo_files': file path 'pkg/../../outside.py' leaves the repository root"),
    ({**NATIVE, "repo_files": {"pkg/..": "1"}},
     "field 'repo_files': file path 'pkg/..' names the repository root, not a file"),
])
def test_unsafe_or_coerced_fields_are_refused_with_line_and_field(tmp_path, row, message):
    path = _write(tmp_path, [SWE_BENCH_ROW, row])
    with pytest.raises(TaskRowError, match=re.escape(f"{path}:2: {message}")):
        load_tasks(path)


def test_a_link_to_a_system_directory_is_refused(tmp_path):
    (tmp_path / "repo").symlink_to("/etc")
    row = {"instance_id": "t", "problem_statement": "x", "repo_dir": str(tmp_path / "repo")}
    with pytest.raises(TaskRowError, match=r":1: field 'repo_dir' .* \(the host's /etc\)"):
        load_tasks(_write(tmp_path, [row]))
    (tmp_path / "ok").mkdir()
    (task,) = load_tasks(_write(tmp_path, [{**row, "repo_dir": str(tmp_path / "ok")}]))
    assert task.repo_dir == str(tmp_path / "ok")


def test_a_repeated_instance_id_names_both_lines(tmp_path):
    path = _write(tmp_path, [NATIVE, {**NATIVE, "instance_id": "u"}, "", NATIVE])
    with pytest.raises(TaskRowError, match=re.escape(
            f"{path}:4: field 'instance_id' 't' repeats line 1")):
        load_tasks(path)


def test_invalid_utf8_names_the_line_and_byte(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(json.dumps(NATIVE).encode() + b"\n" + b'{"instance_id": "\xff"}\n')
    with pytest.raises(TaskRowError, match=re.escape(
            f"{path}:2: not UTF-8 text (byte 18 of the line is b'\\xff')")):
        load_tasks(str(path))
