"""Test-log parsers, one per harness: a test run's log -> {test name: status}.

Statuses are those of SWE-bench's harness (`STATUSES`); `PARSERS` names each parser as
a task row's `log_parser` does (env.tasks), and "exit_code" lets the test command judge
itself (env.grading).
"""

from __future__ import annotations

import re
from collections.abc import Callable

STATUSES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def clean(log: str) -> list[str]:
    return ANSI.sub("", log.replace("\r", "")).split("\n")


def _pytest_lines(log: str):
    """(status, rest) of each `-rA` summary line; skips `SKIPPED [N] file:line` counts."""
    for line in clean(log):
        status, _, rest = line.partition(" ")
        if status in STATUSES and rest.strip() and not re.match(r"\[\d+\]", rest):
            yield status, rest.strip()


def _pytest_full_id(status: str, rest: str) -> str:
    """The whole node id: up to the `]` that closes a parametrization, else up to the
    ` - message` pytest appends to FAILED / ERROR / XFAIL lines."""
    bracketed = re.match(r"\S*?\[.*?\](?= - |$)", rest)
    if bracketed:
        return bracketed.group(0)
    return rest if status == "PASSED" else rest.split(" - ", 1)[0]


def parse_pytest(log: str) -> dict[str, str]:
    """pytest `-rA` summaries. Each test is entered under its whole node id and under
    the id cut at its first space, the form SWE-bench's `parse_log_pytest` records
    (`test_x[a b]` -> `test_x[a`); among cut ids that collide the last line wins, as
    there."""
    out = {}
    for status, rest in _pytest_lines(log):
        out[rest.split()[0]] = status
        out[_pytest_full_id(status, rest)] = status
    return out


def _short_option(test_id: str) -> str:
    """`test[/abs/path/x]` -> `test[/x]`: the id form of SWE-bench's pytest-with-options
    parser (requests, pylint, pydicom), whose ids must not depend on the checkout path."""
    m = re.fullmatch(r"(.*?)\[(.*)\]", test_id)
    if not m or not m.group(2).startswith("/") or m.group(2).startswith("//") or "*" in m.group(2):
        return test_id
    return f"{m.group(1)}[/{m.group(2).rsplit('/', 1)[-1]}]"


def parse_pytest_options(log: str) -> dict[str, str]:
    return {_short_option(k): v for k, v in parse_pytest(log).items()}


def parse_pytest_v2(log: str) -> dict[str, str]:
    """Later pytest logs (astropy, scikit-learn, sphinx): whole ids, spaces kept as single
    spaces, and verbose `id STATUS` lines of older pytest versions."""
    out = {}
    for line in clean(log):
        line = "".join(c for c in line if c >= " " or c == "\t")
        words = line.split()
        if len(words) < 2:
            continue
        if words[0] in STATUSES:
            if not re.fullmatch(r"\[\d+\]", words[1]):
                head = line.split(" - ", 1)[0] if words[0] == "FAILED" else line
                out[" ".join(head.split()[1:])] = words[0]
        elif words[-1] in STATUSES:
            out[" ".join(words[:-1])] = words[-1]
    return out


def parse_django(log: str) -> dict[str, str]:
    """Django's runner at verbosity 2: `name (module.Class) ... ok|FAIL|ERROR|skipped`.
    The name is what precedes ` ... ` on the line with the result (a docstring's first
    line when the test has one), and a bare `ok` line completes the last `...` line
    whose result was pushed down by the test's own output, as SWE-bench records them."""
    out, pending = {}, None
    for line in (raw.strip() for raw in clean(log)):
        if " ... " in line:
            pending = line.split(" ... ", 1)[0]
        for suffix, status in ((" ... ok", "PASSED"), (" ... OK", "PASSED"),
                               (" ...  OK", "PASSED"), (" ... FAIL", "FAILED"),
                               (" ... ERROR", "ERROR")):
            if line.endswith(suffix):
                out[line[: -len(suffix)]] = status
        if " ... skipped" in line:
            out[line.split(" ... skipped", 1)[0]] = "SKIPPED"
        if line.startswith(("FAIL:", "ERROR:")) and len(line.split()) > 1:
            out[line.split()[1]] = "FAILED" if line.startswith("FAIL:") else "ERROR"
        if line.startswith("ok") and pending is not None:
            out[pending] = "PASSED"
    return out


def parse_sympy(log: str) -> dict[str, str]:
    """sympy's `bin/test --verbose`: `test_name ok|F|E` lines, and the `___ path.py:name
    ___` header of each failure's report (entered as `path.py:name`, FAILED)."""
    out = {f"{path}.py:{name}": "FAILED"
           for path, name in re.findall(r"_+ (\S+)\.py:(\S+) _+", log)}
    for line in (raw.strip() for raw in clean(log)):
        words = line.split()
        if line.startswith("test_") and len(words) > 1:
            status = {"ok": "PASSED", "F": "FAILED", "E": "ERROR"}.get(words[-1])
            if status:
                out[words[0]] = status
    return out


_UNITTEST = re.compile(r"^(\w+) \(([\w.]+)\)(?:\n[^\n]*?)? \.\.\. (ok|FAIL|ERROR|skipped|"
                       r"expected failure|unexpected success)", re.MULTILINE)
_UNITTEST_STATUS = {"ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "skipped": "SKIPPED",
                    "expected failure": "XFAIL", "unexpected success": "FAILED"}


def parse_unittest(log: str) -> dict[str, str]:
    """`python -m unittest -v`: `test_m (pkg.mod.Class.test_m) ... ok` (Python 3.11+) or
    `test_m (pkg.mod.Class) ... ok`, entered under the dotted id `pkg.mod.Class.test_m`."""
    out = {}
    for name, where, status in _UNITTEST.findall("\n".join(clean(log))):
        test_id = where if where.endswith("." + name) else f"{where}.{name}"
        out[test_id] = _UNITTEST_STATUS[status]
    return out


def parse_r2e(log: str) -> dict[str, str]:
    """R2E-Gym's reading of a pytest `-rA` summary (`_calculate_reward_r2e`): the node id
    after the file, `::` -> `.`, cut before ` - `."""
    log = "\n".join(clean(log))
    if "short test summary info" not in log:
        return {}
    out = {}
    for line in log.split("short test summary info", 1)[1].strip().splitlines():
        for status in ("PASSED", "FAILED", "ERROR"):
            if status in line:
                out[".".join(line.split("::")[1:]).split(" - ")[0]] = status
                break
    return out


def pytest_passed(log: str) -> int | None:
    """The passed count of pytest's closing line (`=== 2 passed, 1 failed in 0.12s ===`,
    or `2 passed in 0.12s` under -q), None without one."""
    lines = [line for line in clean(log) if re.search(
        r"^=* ?(no tests ran|\d+ \w+(, \d+ \w+)*) in [\d.]+ ?s", line.strip())]
    if not lines:
        return None
    passed = re.search(r"(\d+) passed", lines[-1])
    return int(passed.group(1)) if passed else 0


def unittest_passed(log: str) -> int | None:
    """`Ran N tests` less the failures, errors, skips, expected failures and unexpected
    successes of the verdict below it (`OK`, `FAILED (failures=1)`), None without one."""
    text = "\n".join(clean(log))
    ran = re.findall(r"^Ran (\d+) tests? in [\d.]+s\n+(OK|FAILED)\b(.*)$", text, re.MULTILINE)
    if not ran:
        return None
    count, _, details = ran[-1]
    return int(count) - sum(int(n) for n in re.findall(r"=(\d+)", details))


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "pytest": parse_pytest, "pytest_options": parse_pytest_options,
    "pytest_v2": parse_pytest_v2, "django": parse_django, "sympy": parse_sympy,
    "unittest": parse_unittest, "r2e": parse_r2e,
}
# Parsers that read one test's result from one line: a test entered under two ids (whole
# and cut at a space) or reported twice (`-v` and `-rA`) is one test.
LINE_PARSERS = frozenset({"pytest", "pytest_options", "pytest_v2"})


def passed_count(parser: str, log: str, tests: list[str] | None = None) -> int:
    """How many tests the log's result lines report passed (of `tests`, when given)."""
    parse, listed = PARSERS[parser], None if tests is None else set(tests)
    if parser not in LINE_PARSERS:
        return sum(v == "PASSED" and (listed is None or k in listed)
                   for k, v in parse(log).items())
    seen = set()
    for line in clean(log):
        ids = [k for k, v in parse(line).items() if v == "PASSED"]
        if ids and (listed is None or listed.intersection(ids)):
            seen.add(max(ids, key=len))
    return len(seen)


# The runner's own count of passed tests, read from its closing summary, per parser.
RUNNER_PASSED: dict[str, Callable[[str], int | None]] = {
    "pytest": pytest_passed, "pytest_options": pytest_passed, "pytest_v2": pytest_passed,
    "r2e": pytest_passed, "unittest": unittest_passed,
}
# "exit_code": the command judges itself (exit 0 = every listed test passed).
PARSER_NAMES = (*PARSERS, "exit_code")
