"""How the official harnesses run each repository: test command, activation, log parser, images.

Sources (read, not copied):
- SWE-bench v4.1.0 `swebench/harness/constants/python.py` (`MAP_REPO_VERSION_TO_SPECS_PY`:
  `test_cmd`, `install`, `eval_commands` per repository and version),
  `swebench/harness/log_parsers/python.py` (`MAP_REPO_TO_PARSER_PY`),
  `swebench/harness/test_spec/python.py` (`get_test_directives`: the files test_patch
  touches, minus data files; Django's as dotted module labels under `tests/`;
  `make_eval_script_list_py`: `source /opt/miniconda3/bin/activate; conda activate
  testbed`, then `eval_commands`, `install`, test files reset to base, test_patch
  applied, the test command on the directives),
  `swebench/harness/test_spec/test_spec.py` (`instance_image_key`:
  `{namespace}/sweb.eval.{arch}.{instance_id lowercased}:{tag}` with `__` -> `_1776_`;
  the published namespace is `swebench`, tag `latest`).
- R2E-Gym `src/r2egym/agenthub/runtime/docker.py`: commands run with
  `PATH=/root/.venv/bin:/root/.local/bin:/root/.cargo/bin:...`, the repository's
  `.venv` linked to `/root/.venv`.

The harness's `install` step (reinstalling the package before the tests) is kept only
where the image's install is not editable (Django before 3.0, old matplotlib): an
editable install already sees the patched sources, and the sandbox has no network for
pip to rebuild with.
"""

from __future__ import annotations

import dataclasses
import re

SWEBENCH_IMAGE_TEMPLATE = "swebench/sweb.eval.x86_64.{instance_id_1776}:latest"
# Only where the image has the conda install (a locally built image may not).
CONDA_ACTIVATE = ("if [ -f /opt/miniconda3/bin/activate ]; then "
                  "source /opt/miniconda3/bin/activate && conda activate testbed; fi")
R2E_ACTIVATE = ("export PATH=/testbed/.venv/bin:/root/.venv/bin:/root/.local/bin:"
                "/root/.cargo/bin:$PATH")
# Files of these kinds in a test patch are data, not test files to run (NON_TEST_EXTS).
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml",
                 ".yaml", ".toml")

_PYTEST = "pytest -rA"
_DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
_DJANGO_LOCALE = ("export LANG=en_US.UTF-8 LC_ALL=en_US.UTF-8 PYTHONIOENCODING=utf8 "
                  "LANGUAGE=en_US:en")


@dataclasses.dataclass(frozen=True)
class RepoSpec:
    """How one repository's tests run and are read.

    test_command: run in the repository root followed by the quoted test files
      (`{test_files}`); parser: a name in env.logparsers.PARSERS; setup: shell run before
      every command (agent's and grader's) after the conda activation; install: run
      before the tests; infra: globs of the test runner's own files, restored before
      grading; django_labels: test files are given as dotted labels under tests/.
    """

    test_command: str = _PYTEST
    parser: str = "pytest"
    setup: str = ""
    install: str = ""
    infra: tuple[str, ...] = ()
    django_labels: bool = False


_DJANGO_SPEC = RepoSpec(_DJANGO, "django", setup=_DJANGO_LOCALE, django_labels=True,
                        infra=("tests/runtests.py", "tests/test_sqlite.py"))
SYMPY_INFRA = ("bin/test", "sympy/testing/*", "sympy/utilities/runtests.py",
               "sympy/utilities/pytest.py")

REPO_SPECS: dict[str, RepoSpec] = {
    "astropy/astropy": RepoSpec(parser="pytest_v2"),
    "django/django": _DJANGO_SPEC,
    "marshmallow-code/marshmallow": RepoSpec(),
    "matplotlib/matplotlib": RepoSpec(),
    "mwaskom/seaborn": RepoSpec("pytest --no-header -rA"),
    "pallets/flask": RepoSpec(),
    "psf/requests": RepoSpec(parser="pytest_options"),
    "pvlib/pvlib-python": RepoSpec(),
    "pydata/xarray": RepoSpec(),
    "pydicom/pydicom": RepoSpec(parser="pytest_options"),
    "pylint-dev/astroid": RepoSpec(),
    "pylint-dev/pylint": RepoSpec(parser="pytest_options"),
    "pytest-dev/pytest": RepoSpec(),
    "pyvista/pyvista": RepoSpec(),
    "scikit-learn/scikit-learn": RepoSpec(parser="pytest_v2"),
    "sphinx-doc/sphinx": RepoSpec("tox --current-env -epy39 -v --", "pytest_v2"),
    "sqlfluff/sqlfluff": RepoSpec(),
    "sympy/sympy": RepoSpec(
        "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
        "sympy", infra=SYMPY_INFRA),
}

# (repo, version) entries that differ from the repository's row above.
VERSION_SPECS: dict[tuple[str, str], RepoSpec] = {
    **{("astropy/astropy", v): RepoSpec(
        "pytest -rA -vv -o console_output_style=classic --tb=no", "pytest_v2")
       for v in ("0.1", "0.2", "0.3", "0.4", "1.1", "1.2", "1.3")},
    **{("django/django", v): dataclasses.replace(_DJANGO_SPEC, install="python setup.py install")
       for v in ("1.4", "1.5", "1.6", "1.7", "1.8", "1.10", "1.11", "2.0", "2.1", "2.2")},
    ("django/django", "1.9"): dataclasses.replace(
        _DJANGO_SPEC, test_command="./tests/runtests.py --verbosity 2",
        install="python setup.py install"),
    **{("matplotlib/matplotlib", v): RepoSpec(
        install="python setup.py build; python setup.py install")
       for v in ("1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "2.0", "2.1", "2.2")},
}


def repo_spec(repo: str, version: str = "") -> RepoSpec | None:
    """The spec of a SWE-bench repository (and version), or None for an unknown one."""
    return VERSION_SPECS.get((repo, version)) or REPO_SPECS.get(repo)


def image_name(template: str, instance_id: str) -> str:
    """The image of an instance: `template` with `{instance_id}` (as given),
    `{instance_id_lower}` and `{instance_id_1776}` (lowercased, `__` -> `_1776_`, the
    form the published SWE-bench images use) filled in."""
    lower = instance_id.lower()
    return template.format(instance_id=instance_id, instance_id_lower=lower,
                           instance_id_1776=lower.replace("__", "_1776_"))


def patch_paths(patch: str) -> list[str]:
    """The files a unified diff touches (their `b/` names), in order."""
    return re.findall(r"^diff --git a/.* b/(.*)$", patch, flags=re.MULTILINE)


def test_directives(test_patch: str, django_labels: bool = False) -> list[str]:
    """What the harness runs: the files test_patch touches minus data files; Django's
    as module labels (`tests/a/b.py` -> `a.b`)."""
    files = [p for p in patch_paths(test_patch) if not p.endswith(NON_TEST_EXTS)]
    if not django_labels:
        return files
    return [p.removesuffix(".py").removeprefix("tests/").replace("/", ".") for p in files]
