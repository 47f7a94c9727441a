"""Episodes on real local and Docker sandboxes: steps, patches, reward, env_error, replay.

References: file hashes by `sha256sum` inside the sandboxes (restore), the sandbox's
own `patch()` (recorded patches), a hand-written pytest log (R2E-Gym grading), the
Docker engine killing a container (env_error).
"""

import random

import pytest
from sandbox_backends import BACKENDS, backend_factory, docker_defaults, tree_hashes

from env.episode import Episode, EpisodeOptions, restore, same_observation
from env.grading import GradeCache, grade, r2e_outcome_matches
from env.logparsers import parse_r2e
from env.miniswe import expert_demo, generate_tasks
from env.sandbox import SandboxFactory
from env.tasks import Task
from models.tokenizer import render_tool_call


@pytest.fixture(params=BACKENDS)
def factory(request):
    return backend_factory(request, request.param)


def _bash(command):
    return {"name": "execute_bash", "arguments": {"command": command}}


def _trajectories():
    """Expert demos of every difficulty, and a scripted mix of edits by every route
    (bash, create, insert, undo) with a malformed action in between."""
    tasks = generate_tasks(4, seed=99)
    trajectories = [(t, expert_demo(t).calls) for t in tasks]
    t = tasks[0]
    path = t.metadata["bugs"][0]["path"]
    mixed = [
        {"name": "file_editor", "arguments": {"command": "view", "path": path}},
        "I think the bug is <tool_call>{not json}</tool_call>",
        _bash(f"sed -i 's/def /def  /' {path} && echo edited"),
        {"name": "file_editor", "arguments": {"command": "create", "path": "docs/new.md",
                                              "file_text": "notes\n"}},
        {"name": "file_editor", "arguments": {"command": "insert", "path": "docs/new.md",
                                              "insert_line": 1, "new_str": "more"}},
        {"name": "file_editor", "arguments": {"command": "undo_edit", "path": "docs/new.md"}},
        _bash("rm -f test_*.py && ls"),
        {"name": "finish", "arguments": {}},
    ]
    return trajectories + [(t, mixed)]


def _record(factory, task, actions):
    """Runs actions; returns (episode steps, file hashes after each step)."""
    hashes = []
    with Episode(factory, task) as episode:
        episode.reset()
        for action in actions:
            episode.step(action)
            hashes.append(tree_hashes(episode.sandbox))
            assert episode.steps[-1].patch == episode.sandbox.patch()
        return episode.steps, hashes


def test_restore_reproduces_files_at_step_k(factory):
    rng = random.Random(0)
    for task, actions in _trajectories():
        steps, hashes = _record(factory, task, actions)
        for k in sorted(rng.sample(range(1, len(steps)), min(2, len(steps) - 1))):
            episode, mismatches = restore(task, steps, k, factory)
            with episode:
                assert tree_hashes(episode.sandbox) == hashes[k - 1], (task.instance_id, k)
                assert mismatches == [] and episode.steps == steps[:k]
                assert episode.status == "running"
        k = len(steps) - 1
        episode, mismatches = restore(task, steps, k, factory, reexec=True)
        with episode:
            assert mismatches == [], (task.instance_id, mismatches)
            assert tree_hashes(episode.sandbox) == hashes[k - 1]
            assert [s.patch for s in episode.steps] == [s.patch for s in steps[:k]]


def test_reexec_reports_differing_observations(factory):
    task = generate_tasks(1, seed=1)[0]
    steps, _ = _record(factory, task, [_bash("echo $RANDOM$RANDOM$RANDOM"), _bash("echo same")])
    episode, mismatches = restore(task, steps, 2, factory, reexec=True)
    episode.close()
    assert [m.step for m in mismatches] == [1]
    assert mismatches[0].recorded == steps[0].observation
    assert same_observation("Ran 4 tests in 0.002s\n\nOK", "Ran 4 tests in 0.013s\n\nOK")
    assert not same_observation("Ran 4 tests", "Ran 5 tests")


def test_replay_reports_what_it_could_not_restore(factory):
    """Replay by patch: an ignored *.pyc and an empty directory of the source are named as
    not restored. Replay by re-execution: a file of /dev/urandom bytes (same, empty
    observation) is a patch mismatch at its step and the next (whose patch holds it too)."""
    task = generate_tasks(1, seed=1)[0]
    path = task.metadata["bugs"][0]["path"]
    steps, _ = _record(factory, task, [
        _bash(f"python3 -c 'import py_compile; py_compile.compile(\"{path}\", cfile=\"x.pyc\")'"
              " && mkdir -p empty/dir"),
        _bash("head -c 16 /dev/urandom > key.bin"), _bash("echo same")])
    assert steps[0].unpatched == ["empty/dir/", "x.pyc"]
    episode, mismatches = restore(task, steps, 1, factory)
    episode.close()
    assert [(m.step, m.what, m.recorded, m.replayed) for m in mismatches] == [
        (1, "unpatched", "empty/dir/\nx.pyc", "")]
    episode, mismatches = restore(task, steps, 3, factory, reexec=True)
    episode.close()
    assert [(m.step, m.what) for m in mismatches] == [(2, "patch"), (3, "patch")]
    assert "key.bin" in mismatches[0].recorded and mismatches[0].recorded != mismatches[0].replayed


def test_steps_patches_and_statuses(factory):
    task = generate_tasks(1, seed=4)[0]
    bug = task.metadata["bugs"][0]
    with Episode(factory, task, EpisodeOptions(max_steps=3)) as episode:
        assert episode.reset() == task.problem_statement
        obs, done = episode.step("no call here")
        assert obs.startswith("ERROR: no tool call found") and not done
        assert episode.steps[0].tool_call is None and episode.steps[0].patch == ""
        edit = {"name": "file_editor", "arguments": {
            "command": "str_replace", "path": f"/testbed/{bug['path']}",
            "old_str": bug["buggy"], "new_str": bug["fixed"]}}
        obs, done = episode.step(render_tool_call(edit))
        assert obs.startswith(f"Edited {bug['path']}") and not done
        assert episode.steps[1].tool_call == edit
        assert f"+    {bug['fixed']}" in episode.steps[1].patch
        obs, done = episode.step(_bash("true"))
        assert done and episode.status == "max_steps"
        with pytest.raises(RuntimeError, match="already max_steps"):
            episode.step(_bash("true"))
        assert episode.reward() == (1.0 if task.difficulty != 3 else 0.0)


def test_edited_tests_do_not_count(factory):
    task = generate_tasks(1, seed=4)[0]
    with Episode(factory, task) as episode:
        episode.reset()
        for path in task.test_files:
            episode.step(_bash(f"printf 'import unittest\\n' > {path}"))
        episode.step({"name": "finish", "arguments": {}})
        assert episode.reward() == 0.0


def test_r2e_gym_and_test_patch_grading(factory):
    log = ("============ short test summary info ============\n"
           "PASSED r2e_tests/test_t.py::TestT::test_a\n"
           "FAILED r2e_tests/test_t.py::TestT::test_b - AssertionError: x\n"
           "============ 1 failed, 1 passed in 0.12s ============\n")
    assert parse_r2e("noise\n" + log) == {"TestT.test_a": "PASSED",
                                                     "TestT.test_b": "FAILED"}
    assert parse_r2e("no summary") == {}
    expected = {"TestT.test_a": "PASSED", "TestT.test_b": "FAILED"}
    assert r2e_outcome_matches(parse_r2e(log), expected)
    assert not r2e_outcome_matches(parse_r2e(log), {"TestT.test_a": "PASSED"})

    files = {"log.txt": log, "a.py": "A = 1\n"}
    r2e = Task("r2e", "x", repo_files=files, expected_output=expected,
               test_command="cat log.txt; exit 1")
    sandbox = factory(r2e)
    try:
        assert grade(r2e, sandbox)[0] == 1.0
        sandbox.write_file("log.txt", log.replace("FAILED", "PASSED"))
        assert grade(r2e, sandbox)[0] == 0.0
    finally:
        sandbox.close()

    test_patch = ("diff --git a/test_a.py b/test_a.py\nnew file mode 100644\n--- /dev/null\n"
                  "+++ b/test_a.py\n@@ -0,0 +1,2 @@\n+from a import A\n+assert A == 2\n")
    swe = Task("swe", "x", repo_files={"a.py": "A = 1\n"}, test_patch=test_patch,
               FAIL_TO_PASS=["test_a.py"], test_command="python3 {tests}")
    sandbox = factory(swe)
    try:
        assert grade(swe, sandbox)[0] == 0.0
        sandbox.write_file("a.py", "A = 2\n")
        sandbox.write_file("test_a.py", "pass\n")  # replaced by the test patch's version
        assert grade(swe, sandbox)[0] == 1.0
    finally:
        sandbox.close()


def test_closed_sandbox_is_env_error_not_reward_zero(factory):
    task = generate_tasks(1, seed=6)[0]
    with Episode(factory, task) as episode:
        episode.reset()
        episode.step(_bash("ls"))
        episode.sandbox.close()
        obs, done = episode.step(_bash("ls"))
        assert done and episode.status == "env_error" and "SandboxError" in episode.error
        assert obs.startswith("ERROR: the environment failed")
        assert episode.reward() is None


@pytest.mark.docker
def test_killed_container_is_env_error(request):
    defaults = docker_defaults(request)
    client = defaults["client"]
    factory = SandboxFactory("docker", **defaults)
    task = generate_tasks(1, seed=6)[0]

    with Episode(factory, task) as episode:  # killed mid-episode
        episode.reset()
        episode.step(_bash("ls"))
        client.api.kill(episode.sandbox.container_id)
        obs, done = episode.step(_bash("ls"))
        assert done and episode.status == "env_error" and episode.reward() is None

    # Killed after finish, before grading: in place, no grade; fresh grading grades the
    # recorded patch in a new container.
    for grading, reward in (("in_place", None), ("fresh", 1.0)):
        with Episode(factory, task, EpisodeOptions(grading=grading)) as episode:
            episode.reset()
            for tool_call in expert_demo(task).calls:
                episode.step(tool_call)
            assert episode.status == "finished"
            client.api.kill(episode.sandbox.container_id)
            assert episode.reward() == reward, episode.error
            assert episode.status == ("env_error" if reward is None else "finished")

    broken = SandboxFactory("docker", **{**defaults, "image": "swe-rl-no-such-image:0"})
    with Episode(broken, task) as episode:
        episode.reset()
        assert episode.status == "env_error" and "image" in episode.error
        assert episode.reward() is None


def _fix_calls(task):
    return [{"name": "file_editor", "arguments": {
        "command": "str_replace", "path": f"/testbed/{bug['path']}",
        "old_str": bug["buggy"], "new_str": bug["fixed"]}} for bug in task.metadata["bugs"]]


def test_an_equal_patch_takes_the_kept_grade(request):
    """The second episode with the fix takes the first one's grade; the grade it gets
    is the one its own tree grades to; another patch, or another task, runs its tests."""
    factory = backend_factory(request, "local")
    task, other = generate_tasks(2, seed=4)
    cache = GradeCache()
    rewards = []
    for actions in (_fix_calls(task), _fix_calls(task), [_bash("echo > notes.txt")]):
        with Episode(factory, task, grades=cache) as episode:
            episode.reset()
            for action in actions:
                episode.step(action)
            rewards.append((episode.reward(), episode.grade_cached))
            assert episode.sandbox is None  # closed before grading
            with factory(task) as sandbox:  # its own patch, graded where it ran
                sandbox.apply_patch(episode.steps[-1].patch)
                assert grade(task, sandbox).reward == rewards[-1][0]
    assert rewards == [(1.0, False), (1.0, True), (0.0, False)]
    with Episode(factory, other, grades=cache) as episode:
        episode.reset()
        assert episode.reward() == 0.0 and not episode.grade_cached
    assert (cache.hits, cache.misses) == (1, 3)
