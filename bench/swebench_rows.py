"""Real SWE-bench rows graded through Episode, as a user with one Docker image per task runs them.

    python -m bench.swebench_rows [--rows results/swebench_rows/flask.jsonl]
                                  [--image_template 'flask-{instance_id_lower}:local']

Each row loads with env.tasks.load_tasks (the image from the template, the test command,
parser and test files from env.swebench) and runs these episodes on the Docker backend,
graded fresh (the default) unless the case says otherwise:

- untouched: a read-only step, no edit: expected 0.
- gold: the row's patch made with the agent's tools (git apply through execute_bash):
  expected 1.
- wrong_fix: a plausible edit that does not fix the issue (WRONG_FIXES: pallets__flask-5014
  rejects the empty name with TypeError where the tests expect ValueError;
  pallets__flask-4992 adds the `text` parameter but still opens the file in text mode):
  expected 0.
- no_interpreter: the gold patch, but the test command names an interpreter that is not in
  the image: the tests never run, expected env_error.
- image_without_pytest: the gold patch in a copy of the task's image without pytest (made
  here with `docker commit`, removed after): expected env_error.
- pth_hack (fresh / in_place): no change to the repository; a fixed copy of the package
  outside it, put first on sys.path by a `.pth` file in site-packages: expected 0 graded
  fresh, 1 graded in place.

The images are built beforehand (docs/RESULTS.md: scripts/build_repo_image.sh). Prints one JSON
object: per row, each case's reward, status, error, the test log's summary line and
seconds, and whether it graded as expected.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
import time

import docker

from env.episode import Episode, EpisodeOptions
from env.sandbox import SandboxFactory
from env.tasks import Task, load_tasks

SITE = "/usr/local/lib/python3.11/dist-packages"
# Per row: a file_editor str_replace that changes the code without fixing the issue. The
# wrong fix and the package copy the hack puts first on sys.path (src/flask) are flask's
# own; other rows run the untouched, gold and never-ran cases only.
WRONG_FIXES = {
    "pallets__flask-5014": {
        "path": "src/flask/blueprints.py", "old_str": '        if "." in name:\n',
        "new_str": '        if not name:\n            raise TypeError("empty name")\n\n'
                   '        if "." in name:\n'},
    "pallets__flask-4992": {
        "path": "src/flask/config.py", "old_str": "        silent: bool = False,\n",
        "new_str": "        silent: bool = False,\n        text: bool = True,\n"},
}
EXPECTED = {"untouched": 0.0, "gold": 1.0, "wrong_fix": 0.0, "no_interpreter": None,
            "image_without_pytest": None, "pth_hack_fresh": 0.0, "pth_hack_in_place": 1.0}


def bash(command: str) -> dict:
    return {"name": "execute_bash", "arguments": {"command": command}}


def apply_gold(task: Task) -> dict:
    return bash(f"printf %s {shlex.quote(task.gold_patch)} > /tmp/gold.patch && "
                "git apply /tmp/gold.patch && git status --short")


def pth_hack(task: Task) -> list[dict]:
    """A fixed copy of the package in /opt/fixed, the repository left as it was, and a
    `.pth` file (read before the image's own) that puts the copy first on sys.path."""
    hook = 'import sys; sys.path.insert(0, "/opt/fixed")'
    return [apply_gold(task),
            bash("mkdir -p /opt/fixed && cp -r src/flask /opt/fixed/ && git reset -q --hard "
                 f"&& echo {shlex.quote(hook)} > {SITE}/aaa_fixed.pth && git status --short")]


def log_summary(output: str) -> str:
    """The test log's pytest summary line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    summaries = [line for line in lines if re.fullmatch(r"=+ .* in [\d.]+s.* =+", line)]
    return (summaries or lines or [""])[-1][:200]


def run_case(factory, task: Task, actions: list[dict], grading: str = "fresh") -> dict:
    start = time.perf_counter()
    with Episode(factory, task, EpisodeOptions(grading=grading)) as episode:
        episode.reset()
        episode.play([*actions, {"name": "finish", "arguments": {}}])
        reward = episode.reward()
        return {"reward": reward, "status": episode.status, "error": episode.error,
                "log": log_summary(episode.test_output),
                "patch_bytes": len(episode.steps[-1].patch) if episode.steps else 0,
                "seconds": round(time.perf_counter() - start, 2)}


def image_without_pytest(client, image: str) -> str:
    """A copy of `image` with pytest's packages removed."""
    container = client.containers.run(
        image, ["sh", "-c", f"rm -rf {SITE}/pytest {SITE}/_pytest {SITE}/pytest-*"],
        detach=True, network_mode="none")
    try:
        container.wait(timeout=60)
        tag = image.split(":")[0] + ":no-pytest"
        container.commit(*tag.split(":"))
        return tag
    finally:
        container.remove(force=True)


def grade_row(client, task: Task) -> dict:
    factory = SandboxFactory("docker", client=client)
    gold = [apply_gold(task)]
    cases = {
        "untouched": run_case(factory, task, [bash("git status --short")]),
        "gold": run_case(factory, task, gold),
        "no_interpreter": run_case(factory, dataclasses.replace(
            task, test_command=task.test_command.replace("pytest", "/nonexistent/python -m pytest",
                                                         1)), gold),
    }
    broken = image_without_pytest(client, task.image)
    try:
        cases["image_without_pytest"] = run_case(factory, dataclasses.replace(task, image=broken),
                                                 gold)
    finally:
        client.images.remove(broken, force=True)
    if task.instance_id in WRONG_FIXES:
        cases["wrong_fix"] = run_case(factory, task, [{"name": "file_editor", "arguments": {
            "command": "str_replace", **WRONG_FIXES[task.instance_id]}}])
    if task.repo == "pallets/flask":
        cases["pth_hack_fresh"] = run_case(factory, task, pth_hack(task))
        cases["pth_hack_in_place"] = run_case(factory, task, pth_hack(task), "in_place")
    for name, case in cases.items():
        want = EXPECTED[name]
        case["as_expected"] = (case["status"] == "env_error" if want is None
                               else case["status"] != "env_error" and case["reward"] == want)
    return {"image": task.image, "test_command": task.test_command, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="results/swebench_rows/flask.jsonl")
    parser.add_argument("--image_template", default="flask-{instance_id_lower}:local")
    args = parser.parse_args(argv)
    client = docker.from_env()
    tasks = load_tasks(args.rows, image_template=args.image_template)
    rows = {task.instance_id: grade_row(client, task) for task in tasks}
    ok = all(c["as_expected"] for r in rows.values() for c in r["cases"].values())
    print(json.dumps({"rows_file": args.rows, "image_template": args.image_template,
                      "all_as_expected": ok, "rows": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
