"""mini-SWE generation and the scripted expert.

References: the generated tests run by the host's Python in a plain directory
(independent of the sandboxes) for the FAIL_TO_PASS / PASS_TO_PASS lists; a stratified
sample of the 200-task acceptance set runs through real sandboxes of each backend (the
whole set: `python -m bench.miniswe`).
"""

import json
import os
import random
import re
import subprocess
import sys

import pytest
from sandbox_backends import BACKENDS, backend_factory

from bench.miniswe import sweep
from env.episode import Episode, EpisodeOptions
from env.grading import grade
from env.logparsers import parse_unittest
from env.miniswe import TEST_RUN, expert_demo, generate_tasks
from env.sandbox import SandboxFactory
from env.tools import parse_tool_call
from rl.sft import expert_actions_text

RUN_EACH = """
import json, sys, unittest
out = {}
for test_id in json.loads(sys.argv[1]):
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromName(test_id).run(result)
    out[test_id] = result.wasSuccessful()
print(json.dumps(out))
"""


def host_outcomes(files: dict[str, str], patch: str, tmp_path) -> dict[str, bool]:
    """test id -> passed, running each test separately with the host's python3."""
    repo = tmp_path / f"repo{len(list(tmp_path.iterdir()))}"
    repo.mkdir()
    for path, text in files.items():
        (repo / path).write_text(text)
    if patch:
        subprocess.run(["git", "apply", "-"], input=patch.encode(), cwd=repo, check=True)
    test_ids = json.loads(subprocess.run(
        [sys.executable, "-c", "import json,sys,unittest;"
         "s=unittest.defaultTestLoader.discover('.');"
         "print(json.dumps([t.id() for g in s for c in g for t in c]))"],
        cwd=repo, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout)
    res = subprocess.run([sys.executable, "-c", RUN_EACH, json.dumps(test_ids)], cwd=repo,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return json.loads(res.stdout)


def test_generation_is_deterministic_and_tiny():
    a, b = generate_tasks(40, seed=7), generate_tasks(40, seed=7)
    assert a == b
    assert [t.repo_files for t in generate_tasks(5, seed=8)] != [t.repo_files for t in a[:5]]
    assert [t.difficulty for t in a[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert {t.difficulty for t in generate_tasks(6, 1, difficulties=(2,))} == {2}
    assert len({t.instance_id for t in a}) == 40
    for t in a:
        size = sum(len(v) for v in t.repo_files.values())
        assert 300 <= size <= 2048, (t.instance_id, size)
        assert t.gold_patch.startswith("diff --git ")
        assert t.FAIL_TO_PASS and set(t.FAIL_TO_PASS).isdisjoint(t.PASS_TO_PASS)
    with pytest.raises(ValueError, match="difficulties"):
        generate_tasks(1, 0, difficulties=(5,))


def test_grading_reads_each_test_as_the_host_runs_it(tmp_path):
    """mini-SWE goes through env.grading: the unittest log's per-test statuses equal the
    host's own run of each test, untouched and with the gold patch."""
    factory = SandboxFactory("local")
    for task in generate_tasks(4, seed=11):
        assert task.log_parser == "unittest"
        for patch, reward in (("", 0.0), (task.gold_patch, 1.0)):
            with factory(task) as sandbox:
                sandbox.apply_patch(patch)
                result = grade(task, sandbox)
            host = host_outcomes(task.repo_files, patch, tmp_path)
            assert result.reward == reward and result.error == ""
            assert {t: s == "PASSED" for t, s in parse_unittest(result.output).items()} == host


def test_statements_follow_the_difficulty():
    for t in generate_tasks(40, seed=3):
        bugs = t.metadata["bugs"]
        if t.difficulty == 0:
            assert len(bugs) == 1 and f"Fix the bug in {bugs[0]['path']}" in t.problem_statement
        elif t.difficulty == 1:
            assert len(bugs) == 1 and bugs[0]["path"] not in t.problem_statement
            assert t.metadata["named_path"] in t.problem_statement
        elif t.difficulty == 2:
            assert ".py" not in t.problem_statement and TEST_RUN in t.problem_statement
        else:
            assert len(bugs) == 2 and bugs[0]["path"] != bugs[1]["path"]
            assert "two mistakes" in t.problem_statement


def test_test_lists_match_the_host_python(tmp_path):
    for t in generate_tasks(12, seed=11):
        before = host_outcomes(t.repo_files, "", tmp_path)
        assert sorted(k for k, ok in before.items() if not ok) == sorted(t.FAIL_TO_PASS)
        assert sorted(k for k, ok in before.items() if ok) == sorted(t.PASS_TO_PASS)
        after = host_outcomes(t.repo_files, t.gold_patch, tmp_path)
        assert all(after.values()) and set(after) == set(t.tests)


def test_difficulty_4_the_operator_is_read_from_the_expected_value(tmp_path):
    """Operators drawn per task under names that say nothing: the statement's case is
    met by exactly one operator (computed here by the host), the bug's recorded line is
    the file's, the lists match the host's run, and the expert edits that line by
    number (lines repeat, so str_replace could not name it)."""
    tasks = generate_tasks(24, seed=3, difficulties=(4,))
    assert [t.repo_files for t in tasks] == [
        t.repo_files for t in generate_tasks(24, seed=3, difficulties=(4,))]
    repeated = 0
    for t in tasks:
        (bug,) = t.metadata["bugs"]
        lines = t.repo_files["ops.py"].split("\n")
        assert lines[bug["line"] - 1].strip() == bug["buggy"] != bug["fixed"]
        repeated += lines.count("    " + bug["buggy"]) > 1
        call, want = re.fullmatch(r"In ops\.py, (\w+\(\d, \d\)) returns -?\d+ but it "
                                  r"should return (-?\d+)\. Fix the bug in ops\.py\.",
                                  t.problem_statement).groups()
        a, b = map(int, re.findall(r"\d", call))
        assert [op for op in "+-*" if eval(f"{a} {op} {b}") == int(want)] == [
            bug["fixed"].split()[2]]
        before = host_outcomes(t.repo_files, "", tmp_path)
        assert sorted(k for k, ok in before.items() if not ok) == sorted(t.FAIL_TO_PASS)
        assert all(host_outcomes(t.repo_files, t.gold_patch, tmp_path).values())
        edit = expert_demo(t).calls[1]["arguments"]
        assert edit == {"command": "replace_lines", "path": "ops.py",
                        "line_range": [bug["line"]], "new_str": "    " + bug["fixed"]}
    assert repeated >= 6  # a buggy line that is not unique in its file is common
    assert {t.metadata["bugs"][0]["fixed"] for t in tasks} == {
        f"return a {op} b" for op in "+-*"}


def test_expert_text_and_imperfect_demos():
    rng = random.Random(0)
    mistakes = set()
    for t in generate_tasks(40, seed=5):
        demo = expert_demo(t)
        assert demo.correct and demo.calls[-1] == {"name": "finish", "arguments": {}}
        texts = expert_actions_text(demo)
        assert all(x.startswith("<tool_call>\n{") and x.endswith("}\n</tool_call>")
                   for x in texts)
        assert [parse_tool_call(x) for x in texts] == demo.calls
        if t.difficulty != 3:  # one bug: exploring runs the tests and searches first
            assert [c["name"] for c in expert_demo(t, explore=True).calls[:3]] == [
                "execute_bash", "search", "file_editor"]
        bad = expert_demo(t, imperfect=True, rng=rng)
        assert not bad.correct and bad.mistake in {"wrong_edit", "finish_early", "half_fix"}
        assert bad.mistake != "half_fix" or t.difficulty == 3
        mistakes.add(bad.mistake)
    assert mistakes == {"wrong_edit", "finish_early", "half_fix"}
    with pytest.raises(ValueError, match="not a mini-SWE task"):
        expert_demo(generate_tasks(1)[0].__class__("x", "y", repo_files={}))


def _stratum(task) -> tuple[str, int]:
    return task.repo, task.difficulty


def _bug_sites(task) -> set[tuple[str, str]]:
    return {(b["path"], b["function"]) for b in task.metadata["bugs"]}


def acceptance_sample(tasks, per_template: int = 2) -> list[int]:
    """Indices of a stratified sample of `tasks`: the first `per_template` of each repo
    template (helper and caller module) at each difficulty, and every task that plants
    a bug in a function no earlier pick does."""
    picked, per, functions = [], {}, set()
    for i, task in enumerate(tasks):
        stratum, bugs = _stratum(task), _bug_sites(task)
        if per.get(stratum, 0) < per_template or not bugs <= functions:
            picked.append(i)
            per[stratum] = per.get(stratum, 0) + 1
            functions |= bugs
    return picked


def imperfect_picks(tasks, indices, per_mistake: int = 2) -> set[int]:
    """The first `per_mistake` of `indices` whose imperfect demo (rng seed = index) makes
    each kind of mistake."""
    picks, seen = set(), {}
    for i in indices:
        mistake = expert_demo(tasks[i], True, random.Random(i)).mistake
        if seen.get(mistake, 0) < per_mistake:
            picks.add(i)
            seen[mistake] = seen.get(mistake, 0) + 1
    return picks


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_tasks_gold_untouched_and_expert(request, backend):
    """Per task: untouched repo -> 0, expert demo -> 1, gold patch -> 1, and imperfect
    demos -> 0, in real sandboxes of each backend (bench.miniswe.check_task), on a
    stratified sample of the 200-task acceptance set (seed 2024): every repo template
    at every difficulty, every function a bug is planted in, every kind of imperfect
    demo. The full sweep of all 200 tasks is `python -m bench.miniswe --tasks 200`."""
    factory = backend_factory(request, backend)
    tasks = generate_tasks(200, seed=2024)
    sample = acceptance_sample(tasks)
    imperfect = imperfect_picks(tasks, sample)
    assert {_stratum(tasks[i]) for i in sample} == {_stratum(t) for t in tasks}
    assert len({_stratum(t) for t in tasks}) == 12 and len(sample) <= 40
    assert set().union(*(_bug_sites(tasks[i]) for i in sample)) == set().union(
        *map(_bug_sites, tasks))
    assert {expert_demo(tasks[i], True, random.Random(i)).mistake for i in imperfect} == {
        "wrong_edit", "finish_early", "half_fix"}
    problems = sweep(factory, tasks, sample, imperfect.__contains__)
    assert not problems, problems[:5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_difficulty_4_gold_untouched_and_expert(request, backend):
    """Difficulty 4 through real sandboxes: untouched -> 0, expert (replace_lines) -> 1,
    gold -> 1, an imperfect demo -> 0."""
    tasks = generate_tasks(6, seed=2024, difficulties=(4,))
    problems = sweep(backend_factory(request, backend), tasks, range(6), {0, 3}.__contains__)
    assert not problems, problems


@pytest.mark.parametrize("backend", BACKENDS)
def test_exploring_demo_solves_and_a_3_step_budget_ends_it_before_its_edit(request, backend):
    """The `budget` option's two ways of working, through real sandboxes: exploring
    (tests, search, view, edit) solves the task given the steps; at max_steps=3 it ends
    unedited and grades 0, while the direct way (view, edit, tests) grades 1."""
    factory = backend_factory(request, backend)
    for task in generate_tasks(2, seed=2025, difficulties=(4,)):
        explore = expert_demo(task, explore=True)
        assert [c["name"] for c in explore.calls] == [
            "execute_bash", "search", "file_editor", "file_editor", "execute_bash", "finish"]
        for demo, budget, want in ((explore, 30, ("finished", 1.0)),
                                   (explore, 3, ("max_steps", 0.0)),
                                   (expert_demo(task), 3, ("max_steps", 1.0))):
            with Episode(factory, task, EpisodeOptions(max_steps=budget)) as episode:
                episode.reset()
                episode.play(demo.calls)
                assert (episode.status, episode.reward()) == want, (task.instance_id, budget)
