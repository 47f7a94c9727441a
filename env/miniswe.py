"""mini-SWE: generated tiny Python repositories with planted bugs, and a scripted expert.

Each task is a repo of two modules (a helper module and a caller module importing
it) with one unittest file per module, about 1 KB in all. Bugs are single-token
mutations of a marked site (`«correct|wrong|...»` in the function bank). Graded
difficulty:

  0  one operator bug, in the file the problem statement names;
  1  the statement names a caller function, the bug is in the helper it calls;
  2  the statement only says tests fail: run them to find the bug;
  3  two coupled bugs, in a caller function and in the helper it calls.
  4  one operator bug in a module of functions whose names say nothing of what they
     compute (`beta(a, b)`, operators drawn per task, so lines repeat): which operator
     is right must be read from the expected value, and the line by its number.

Tests are generated so that every planted bug, alone, fails at least one test and
the fixed repo passes all (checked by executing both versions of the code at
generation time). Everything is a pure function of `(seed, index)`.
"""

from __future__ import annotations

import dataclasses
import difflib
import random
import re
from typing import Any

from env.tasks import Task

TEST_RUN = "python3 -m unittest -q"
# Grading names every test's result (env.logparsers.parse_unittest): verbose.
GRADE_RUN = "python3 -m unittest -v"
GITIGNORE = "__pycache__/\n*.pyc\n"
_SITE = re.compile(r"«([^»]*)»")
_WORDS = ("cat", "apple", "river", "stone", "blue", "moon", "tiger", "lamp", "sun", "tree")


@dataclasses.dataclass(frozen=True)
class Fn:
    """A bank function: `args` as (name, kind) with kind i=int, l=list of ints, w=word."""

    name: str
    args: tuple[tuple[str, str], ...]
    lines: tuple[str, ...]  # body lines; exactly one contains a «correct|wrong...» site
    uses: tuple[str, ...] = ()


def _fn(name: str, args: str, *lines: str, uses: str = "") -> Fn:
    parsed = tuple(tuple(a.strip().split(":")) for a in args.split(","))
    return Fn(name, parsed, lines, tuple(uses.split()))


HELPERS: dict[str, list[Fn]] = {
    "mathx": [
        _fn("double", "x:i", "return x «*|+|**» 2"),
        _fn("square", "x:i", "return x «*|+» x"),
        _fn("half", "x:i", "return x «//|%|*» 2"),
        _fn("diff", "a:i, b:i", "return a «-|+» b"),
        _fn("larger", "a:i, b:i", "return «max|min»(a, b)"),
    ],
    "listx": [
        _fn("total", "xs:l", "result = 0", "for x in xs:", "    result «+=|-=|*=» x",
            "return result"),
        _fn("count_big", "xs:l, limit:i", "return len([x for x in xs if x «>|<|<=» limit])"),
        _fn("last", "xs:l", "return xs[«-1|0|1»]"),
        _fn("span", "xs:l", "return max(xs) «-|+» min(xs)"),
    ],
    "textx": [
        _fn("shout", "word:w", "return word.«upper|lower|title»() + '!'"),
        _fn("repeat", "word:w, n:i", "return word «*|+» n"),
        _fn("initial", "word:w", "return word[«0|1|-1»]"),
        _fn("is_long", "word:w, n:i", "return len(word) «>|<|==» n"),
    ],
}

CALLERS: dict[str, tuple[str, list[Fn]]] = {
    "mathx": ("shapes", [
        _fn("grow", "x:i", "return double(x) «+|-» 1", uses="double"),
        _fn("box", "w:i, h:i", "return square(w) «+|*|-» half(h)", uses="square half"),
        _fn("gap", "a:i, b:i", "return diff(larger(a, b), «1|2»)", uses="diff larger"),
        _fn("area", "w:i, h:i", "return w «*|+» h"),
    ]),
    "listx": ("report", [
        _fn("average", "xs:l", "return total(xs) «//|%» len(xs)", uses="total"),
        _fn("score", "xs:l", "return span(xs) «+|*» last(xs)", uses="span last"),
        _fn("head_total", "xs:l", "return total(xs[:«2|1|3»])", uses="total"),
        _fn("busy", "xs:l", "return count_big(xs, 4) «>|<» 1", uses="count_big"),
    ]),
    "textx": ("greet", [
        _fn("hello", "name:w", "return 'hi ' «+|*» shout(name)", uses="shout"),
        _fn("badge", "name:w", "return initial(name).«upper|lower»() + '.'", uses="initial"),
        _fn("echo", "word:w", "return repeat(word, «2|3»)", uses="repeat"),
        _fn("long_name", "name:w", "return is_long(name, «4|3»)", uses="is_long"),
    ]),
}


@dataclasses.dataclass(frozen=True)
class Bug:
    """One planted bug: the line as shipped (`buggy`) and as it should be (`fixed`),
    both stripped of indentation; `wrong_fixes` are other edits of the line that
    still fail the tests (for imperfect demonstrations)."""

    path: str
    function: str
    buggy: str
    fixed: str
    wrong_fixes: tuple[str, ...]
    line: int = 0  # 1-based line of the bug in `path` (difficulty 4; 0: unrecorded)


@dataclasses.dataclass(frozen=True)
class Demo:
    """A scripted demonstration: tool calls in order, and whether they solve the task."""

    calls: list[dict[str, Any]]
    correct: bool
    mistake: str = ""  # "", "wrong_edit", "finish_early" or "half_fix"


# ---- rendering ---------------------------------------------------------------------------------


def _choose_site(line: str, choice: int) -> str:
    return _SITE.sub(lambda m: m.group(1).split("|")[choice], line)


def _site_options(fn: Fn) -> tuple[int, int]:
    """(line index of the site, number of options)."""
    for i, line in enumerate(fn.lines):
        m = _SITE.search(line)
        if m:
            return i, len(m.group(1).split("|"))
    raise ValueError(f"bank function {fn.name} has no «...» site")


def _render_fn(fn: Fn, choice: int) -> str:
    args = ", ".join(name for name, _ in fn.args)
    body = "\n".join("    " + _choose_site(line, choice) for line in fn.lines)
    return f"def {fn.name}({args}):\n{body}\n"


def _render_module(fns: list[Fn], choices: dict[str, int], imports: str = "") -> str:
    head = f"{imports}\n\n\n" if imports else ""
    return head + "\n\n".join(_render_fn(f, choices.get(f.name, 0)) for f in fns)


def _render_test(module: str, fns: list[Fn], cases: dict[str, list[tuple]],
                 expected: dict[str, list[Any]]) -> str:
    names = ", ".join(f.name for f in fns)
    out = [f"import unittest\n\nfrom {module} import {names}\n\n",
           f"class Test{module.capitalize()}(unittest.TestCase):"]
    for f in fns:
        out.append(f"    def test_{f.name}(self):")
        for args, want in zip(cases[f.name], expected[f.name], strict=True):
            call = f"{f.name}({', '.join(repr(a) for a in args)})"
            out.append(f"        self.assertEqual({call}, {want!r})")
        out.append("")
    return "\n".join(out[:2]) + "\n" + "\n".join(out[2:]).rstrip("\n") + "\n"


def unified_diff(path: str, before: str, after: str) -> str:
    """A git-style unified diff of one text file."""
    body = difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                f"a/{path}", f"b/{path}", n=3)
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


# ---- reference execution -------------------------------------------------------------------


def _namespace(fns: list[Fn], choices: dict[str, int]) -> dict[str, Any]:
    """Executes the rendered functions (helpers first) in one namespace."""
    ns: dict[str, Any] = {}
    exec("\n".join(_render_fn(f, choices.get(f.name, 0)) for f in fns), ns)  # noqa: S102
    return ns


def _call(ns: dict[str, Any], name: str, args: tuple) -> Any:
    try:
        return ns[name](*args)
    except Exception as e:  # noqa: BLE001 - a raising bug is an outcome to compare
        return ("raises", type(e).__name__)


def _sample_args(fn: Fn, rng: random.Random) -> tuple:
    draw = {"i": lambda: rng.randint(1, 9), "w": lambda: rng.choice(_WORDS),
            "l": lambda: [rng.randint(1, 9) for _ in range(rng.randint(3, 5))]}
    return tuple(draw[kind]() for _, kind in fn.args)


def _sample_cases(fn: Fn, rng: random.Random, count: int = 2) -> list[tuple]:
    """`count` argument tuples, distinct when a few draws allow it."""
    cases: list[tuple] = []
    for _ in range(10 * count):
        args = _sample_args(fn, rng)
        if args not in cases:
            cases.append(args)
        if len(cases) == count:
            return cases
    return (cases * count)[:count]


def _describe(value: Any) -> str:
    if isinstance(value, tuple) and value[:1] == ("raises",):
        return f"raises {value[1]}"
    return f"returns {value!r}"


# ---- generation ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Repo:
    helper: str
    caller: str
    helper_fns: list[Fn]
    caller_fns: list[Fn]

    @property
    def fns(self) -> list[Fn]:
        return self.helper_fns + self.caller_fns

    def path_of(self, fn: Fn) -> str:
        return f"{self.helper if fn in self.helper_fns else self.caller}.py"


@dataclasses.dataclass
class _Draw:
    """What a task breaks: in `repo`, the functions `broken` at their `buggy` sites (name ->
    choice), the caller function the statement names (or None), at `difficulty`."""

    repo: _Repo
    broken: list[Fn]
    buggy: dict[str, int]
    named: Fn | None
    difficulty: int


def _pick_repo(rng: random.Random) -> _Repo:
    helper = rng.choice(sorted(HELPERS))
    caller, bank = CALLERS[helper]
    caller_fns = rng.sample(bank, 2)
    used = {u for f in caller_fns for u in f.uses}
    extra = [f for f in HELPERS[helper] if f.name not in used]
    keep = used | ({rng.choice(extra).name} if extra else set())
    helper_fns = [f for f in HELPERS[helper] if f.name in keep]
    return _Repo(helper, caller, helper_fns, [f for f in bank if f in caller_fns])


def _pick_bugs(repo: _Repo, difficulty: int, rng: random.Random) -> tuple[list[Fn], Fn | None]:
    """(functions to break, the caller function the statement names or None)."""
    callers_using = [f for f in repo.caller_fns if f.uses]
    if difficulty in (0, 2):
        return [rng.choice(repo.fns)], None
    if not callers_using:
        return [], None
    named = rng.choice(callers_using)
    used = rng.choice(named.uses)
    helper = next(f for f in repo.helper_fns if f.name == used)
    return ([helper] if difficulty == 1 else [named, helper]), named


def _generate_one(rng: random.Random, difficulty: int, instance_id: str) -> Task | None:
    repo = _pick_repo(rng)
    broken, named = _pick_bugs(repo, difficulty, rng)
    if not broken:
        return None
    buggy = {f.name: rng.randint(1, _site_options(f)[1] - 1) for f in broken}
    correct_ns = _namespace(repo.fns, {})
    single_ns = [_namespace(repo.fns, {f.name: buggy[f.name]}) for f in broken]
    buggy_ns = _namespace(repo.fns, buggy)
    for _ in range(40):
        cases = {f.name: _sample_cases(f, rng) for f in repo.fns}
        expected = {f.name: [_call(correct_ns, f.name, a) for a in cases[f.name]]
                    for f in repo.fns}
        if any(isinstance(v, tuple) for vs in expected.values() for v in vs):
            continue
        if all(_fails(ns, cases, expected) for ns in single_ns) and (
                named is None or _fails(buggy_ns, {named.name: cases[named.name]}, expected)):
            break
    else:
        return None
    return _assemble(_Draw(repo, broken, buggy, named, difficulty), cases, expected,
                     instance_id)


def _fails(ns: dict[str, Any], cases: dict[str, list[tuple]], expected: dict) -> list[str]:
    """Names of the functions whose test has a failing assertion in namespace `ns`."""
    return [name for name, args in cases.items()
            if any(_call(ns, name, a) != want
                   for a, want in zip(args, expected[name], strict=True))]


def _assemble(draw: _Draw, cases: dict, expected: dict, instance_id: str) -> Task | None:
    repo, buggy, named = draw.repo, draw.buggy, draw.named
    imports = f"from {repo.helper} import {', '.join(f.name for f in repo.helper_fns)}"
    caller_imports = imports if any(f.uses for f in repo.caller_fns) else ""
    files, fixed_files = {".gitignore": GITIGNORE}, {}
    for module, fns, imp in ((repo.helper, repo.helper_fns, ""),
                             (repo.caller, repo.caller_fns, caller_imports)):
        files[f"{module}.py"] = _render_module(fns, buggy, imp)
        fixed_files[f"{module}.py"] = _render_module(fns, {}, imp)
        files[f"test_{module}.py"] = _render_test(module, fns, cases, expected)
    bugs = [b for f in draw.broken
            if (b := _bug(repo, f, buggy[f.name], files, cases, expected))]
    if len(bugs) != len(draw.broken):
        return None
    failing = set(_fails(_namespace(repo.fns, buggy), cases, expected))
    test_ids = [f"test_{m}.Test{m.capitalize()}.test_{f.name}"
                for m, fns in ((repo.helper, repo.helper_fns), (repo.caller, repo.caller_fns))
                for f in fns]
    gold = "".join(unified_diff(p, files[p], fixed_files[p])
                   for p in sorted(files) if p in fixed_files and files[p] != fixed_files[p])
    statement = _statement(draw, bugs, cases, expected)
    if statement is None:
        return None
    return Task(
        instance_id=instance_id,
        problem_statement=statement,
        FAIL_TO_PASS=[t for t in test_ids if t.rsplit(".test_", 1)[1] in failing],
        PASS_TO_PASS=[t for t in test_ids if t.rsplit(".test_", 1)[1] not in failing],
        test_command=GRADE_RUN + " {tests}",
        log_parser="unittest",
        repo=f"miniswe/{repo.caller}",
        repo_files=files,
        gold_patch=gold,
        test_files=[f"test_{repo.helper}.py", f"test_{repo.caller}.py"],
        split="miniswe",
        difficulty=draw.difficulty,
        metadata={"bugs": [dataclasses.asdict(b) for b in bugs],
                  "named": named.name if named else "",
                  "named_path": repo.path_of(named) if named else ""},
    )


def _bug(repo: _Repo, fn: Fn, choice: int, files: dict[str, str], cases: dict,
         expected: dict) -> Bug | None:
    """The Bug record, or None when its buggy line is not unique in its file."""
    path = repo.path_of(fn)
    site, options = _site_options(fn)
    line = fn.lines[site].strip()
    buggy, fixed = _choose_site(line, choice), _choose_site(line, 0)
    if files[path].count(buggy) != 1:
        return None
    wrong = []
    for other in range(1, options):
        if other != choice and _fails(_namespace(repo.fns, {fn.name: other}),
                                      {fn.name: cases[fn.name]}, expected):
            wrong.append(_choose_site(line, other))
    return Bug(path, fn.name, buggy, fixed, tuple(wrong))


def _statement(draw: _Draw, bugs: list[Bug], cases: dict, expected: dict) -> str | None:
    """The task text; None when the described function shows no failing case (the
    failure only surfaces elsewhere), so the caller draws another task."""
    difficulty, named, repo = draw.difficulty, draw.named, draw.repo
    if difficulty == 2:
        return f"Some unit tests fail. Run them with `{TEST_RUN}`, find the bug and fix it."
    subject = named if named is not None else next(
        f for f in repo.fns if f.name == bugs[0].function)
    ns = _namespace(repo.fns, draw.buggy)
    failing = [(a, w) for a, w in zip(cases[subject.name], expected[subject.name], strict=True)
               if _call(ns, subject.name, a) != w]
    if not failing:
        return None
    args, want = failing[0]
    got = _call(ns, subject.name, args)
    call = f"{subject.name}({', '.join(repr(a) for a in args)})"
    where = repo.path_of(subject)
    text = f"In {where}, {call} {_describe(got)} but it should return {want!r}."
    if difficulty == 0:
        return text + f" Fix the bug in {where}."
    if difficulty == 1:
        return text + " Find the cause and fix it."
    return text + " There are two mistakes, in different files. Fix both."


# ---- difficulty 4: the operator is a decision ----------------------------------------------

NEUTRAL = ("alpha", "beta", "gamma", "delta", "kappa", "sigma")
OPS = ("+", "-", "*")


def _neutral_fns(rng: random.Random) -> list[Fn]:
    """Four functions `name(a, b): return a OP b`, each with its own correct operator
    (first) and the others as the bug's options."""
    fns = []
    for name in sorted(rng.sample(NEUTRAL, 4)):
        ops = rng.sample(OPS, len(OPS))
        fns.append(_fn(name, "a:i, b:i", f"return a «{'|'.join(ops)}» b"))
    return fns


def _one_operator(args: tuple, want: Any) -> bool:
    """Whether exactly one operator of OPS gives `want` for `args`."""
    return sum(eval(f"{args[0]} {op} {args[1]}") == want for op in OPS) == 1  # noqa: S307


def _generate_decide(rng: random.Random, instance_id: str) -> Task | None:
    fns = _neutral_fns(rng)
    target = rng.choice(fns)
    buggy = {target.name: rng.randint(1, len(OPS) - 1)}
    correct_ns, buggy_ns = _namespace(fns, {}), _namespace(fns, buggy)
    cases = {f.name: _sample_cases(f, rng) for f in fns}
    expected = {f.name: [_call(correct_ns, f.name, a) for a in cases[f.name]] for f in fns}
    shown = [(a, w) for a, w in zip(cases[target.name], expected[target.name], strict=True)
             if _call(buggy_ns, target.name, a) != w and _one_operator(a, w)]
    if not shown:
        return None
    files = {".gitignore": GITIGNORE, "ops.py": _render_module(fns, buggy),
             "test_ops.py": _render_test("ops", fns, cases, expected)}
    line = files["ops.py"].split("\n").index(f"def {target.name}(a, b):") + 2
    text = target.lines[0]
    fixed, wrong = _choose_site(text, 0), _choose_site(text, buggy[target.name])
    bug = Bug("ops.py", target.name, wrong, fixed, tuple(
        _choose_site(text, i) for i in range(1, len(OPS)) if i != buggy[target.name]), line)
    args, want = shown[0]
    call = f"{target.name}({', '.join(repr(a) for a in args)})"
    test_ids = [f"test_ops.TestOps.test_{f.name}" for f in fns]
    return Task(
        instance_id=instance_id,
        problem_statement=(f"In ops.py, {call} {_describe(_call(buggy_ns, target.name, args))}"
                           f" but it should return {want!r}. Fix the bug in ops.py."),
        FAIL_TO_PASS=[t for t in test_ids if t.endswith(f".test_{target.name}")],
        PASS_TO_PASS=[t for t in test_ids if not t.endswith(f".test_{target.name}")],
        test_command=GRADE_RUN + " {tests}", log_parser="unittest", repo="miniswe/ops",
        repo_files=files, gold_patch=unified_diff("ops.py", files["ops.py"],
                                                  _render_module(fns, {})),
        test_files=["test_ops.py"], split="miniswe", difficulty=4,
        metadata={"bugs": [dataclasses.asdict(bug)], "named": "", "named_path": ""})


def generate_tasks(n: int, seed: int = 0, difficulties: tuple[int, ...] = (0, 1, 2, 3)
                   ) -> list[Task]:
    """`n` tasks, difficulty cycling through `difficulties`; deterministic in `seed`."""
    bad = [d for d in difficulties if d not in (0, 1, 2, 3, 4)]
    if bad or not difficulties:
        raise ValueError(f"difficulties must be a non-empty subset of 0..4, got {difficulties}")
    tasks = []
    for i in range(n):
        difficulty = difficulties[i % len(difficulties)]
        rng = random.Random(f"miniswe/{seed}/{i}")
        task = None
        while task is None:
            name = f"miniswe-{seed}-{i:05d}-d{difficulty}"
            task = (_generate_decide(rng, name) if difficulty == 4
                    else _generate_one(rng, difficulty, name))
        tasks.append(task)
    return tasks


# ---- scripted expert -------------------------------------------------------------------------


def _view(path: str) -> dict[str, Any]:
    return {"name": "file_editor", "arguments": {"command": "view", "path": path}}


def _replace(path: str, old: str, new: str) -> dict[str, Any]:
    return {"name": "file_editor",
            "arguments": {"command": "str_replace", "path": path, "old_str": old,
                          "new_str": new}}


def _bash(command: str) -> dict[str, Any]:
    return {"name": "execute_bash", "arguments": {"command": command}}


def _replace_lines(path: str, line: int, new: str) -> dict[str, Any]:
    return {"name": "file_editor",
            "arguments": {"command": "replace_lines", "path": path, "line_range": [line],
                          "new_str": new}}


def _search(term: str) -> dict[str, Any]:
    return {"name": "search", "arguments": {"search_term": term}}


FINISH = {"name": "finish", "arguments": {}}


def expert_demo(task: Task, imperfect: bool = False, rng: random.Random | None = None,
                explore: bool = False) -> Demo:
    """A tool-call script that solves a mini-SWE task with the agent's own tools.

    imperfect=True makes one plausible mistake (a wrong edit of the bug line,
    finishing before editing, or fixing only one of two bugs); such demos have
    correct=False and do not solve the task. explore=True looks before it edits as
    difficulty 2 does (runs the tests and searches for the function before viewing its
    file): still correct, two calls longer where the direct way views the file first.
    """
    if "bugs" not in task.metadata:
        raise ValueError(f"{task.instance_id} is not a mini-SWE task (no bug metadata)")
    rng = rng or random.Random(0)
    bugs = [Bug(**{**b, "wrong_fixes": tuple(b["wrong_fixes"])}) for b in task.metadata["bugs"]]
    calls = _locate(task, bugs, explore)
    mistake = ""
    if imperfect:
        options = ["finish_early"] + (["wrong_edit"] if bugs[0].wrong_fixes else [])
        options += ["half_fix"] if len(bugs) > 1 else []
        mistake = rng.choice(options)
    if mistake == "finish_early":
        return Demo(calls + [FINISH], correct=False, mistake=mistake)
    for j, bug in enumerate(bugs):
        if j and mistake == "half_fix":
            break
        new = rng.choice(bug.wrong_fixes) if (mistake == "wrong_edit" and j == 0) else bug.fixed
        if j:
            calls.append(_view(bug.path))
        calls.append(_replace_lines(bug.path, bug.line, "    " + new) if bug.line
                     else _replace(bug.path, bug.buggy, new))
    return Demo(calls + [_bash(TEST_RUN), FINISH], correct=not mistake, mistake=mistake)


def _locate(task: Task, bugs: list[Bug], explore: bool = False) -> list[dict[str, Any]]:
    """The exploration steps before the first edit, by difficulty; explore: difficulty 2's
    on every one-bug task."""
    first = bugs[0]
    if task.difficulty == 3:
        return [_bash(TEST_RUN), _view(first.path)]
    if explore or task.difficulty == 2:
        return [_bash(TEST_RUN), _search(f"def {first.function}"), _view(first.path)]
    if task.difficulty == 1:
        return [_view(task.metadata["named_path"]), _search(f"def {first.function}"),
                _view(first.path)]
    return [_view(first.path)]
