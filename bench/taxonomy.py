"""Why a warm start's rollouts fail: each failed mini-SWE rollout classified by its first
mistake, read from its tool calls against the task's planted bugs.

    python -m bench.taxonomy --workdir runs/mechanism/seed0/sft [--config SPEC] [--set K=V ...]
        [--tasks 64] [--rollouts 4] [--out results/taxonomy_sft256_t04.json]

The rollouts are the run's own (its checkpoint at step 0, its tokenizer, its sampling
temperature), on training tasks of every difficulty the config mixes. A failed rollout
is one that was scored 0; the checks run over its turns in order, and the first that
fires names it:

  malformed_call    an action with no valid tool call, or a call the tools refused as
                    malformed (JSON, schema)
  copy_slip         a str_replace whose old_str is not in the file (or not unique) but
                    is close to a planted bug's line (difflib ratio >= 0.6): the right
                    place, copied wrong
  wrong_location    a str_replace of text that is no bug's line, or whose old_str is
                    not in the file and resembles no bug line
  wrong_fix         a str_replace of a bug's line whose replacement is not the fix
  (replace_lines, difficulty 4: a single line that is not the bug's is wrong_location;
  on it, another operator is wrong_fix, any other text near the fix a copy_slip)
  range_slip        a replace_lines whose range is not one line of the file (start > end,
                    past the end, or several lines where the expert always names one)
  premature_finish  (after the turns) the episode finished with a bug left unfixed
  over_budget       (after the turns) it ran out of steps, tokens or time with a bug
                    left unfixed
  other             every bug fixed and still failing (an edit broke something else)

The decisions are wrong_location, wrong_fix, premature_finish and over_budget; the slips
are copy_slip, range_slip and malformed_call. Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
from collections import Counter
from collections.abc import Sequence

import numpy as np

from bench import seed_claims as sc

CLASSES = ("malformed_call", "copy_slip", "range_slip", "wrong_location", "wrong_fix",
           "premature_finish", "over_budget", "other")
DECISIONS = ("wrong_location", "wrong_fix", "premature_finish", "over_budget")
SLIPS = ("malformed_call", "copy_slip", "range_slip")
NEAR = 0.6  # difflib ratio of a missed old_str to a bug line that counts as a copy slip
MALFORMED = ("tool call", "JSON", "argument", "unknown tool")


def _edit(call: dict | None) -> dict | None:
    args = (call or {}).get("arguments")
    if (call or {}).get("name") == "file_editor" and isinstance(args, dict) \
            and args.get("command") in ("str_replace", "replace_lines"):
        return args
    return None


def _lines(text: object) -> list[str]:
    return [line.strip() for line in str(text).splitlines() if line.strip()]


def _edit_class(args: dict, observation: str, bugs: Sequence[dict], fixed: set[int]
                ) -> str | None:
    """The class of one edit, or None when it fixed a bug (added to `fixed`)."""
    if args.get("command") == "replace_lines":
        return _lines_class(args, observation, bugs, fixed)
    old, new = _lines(args.get("old_str", "")), _lines(args.get("new_str", ""))
    if observation.startswith("ERROR"):
        near = max((difflib.SequenceMatcher(None, line, b["buggy"]).ratio()
                    for line in old or [""] for b in bugs), default=0.0)
        return "copy_slip" if near >= NEAR else "wrong_location"
    hit = [i for i, b in enumerate(bugs) if b["buggy"] in old and i not in fixed]
    if not hit:
        return "wrong_location"
    i = hit[0]
    if [bugs[i]["fixed"] if line == bugs[i]["buggy"] else line for line in old] != new:
        return "wrong_fix"
    fixed.add(i)
    return None


def _differing(a: str, b: str) -> list[int] | None:
    """Positions of the words in which two lines differ (None: different word counts)."""
    x, y = a.split(), b.split()
    return [j for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v] \
        if len(x) == len(y) else None


def _lines_class(args: dict, observation: str, bugs: Sequence[dict], fixed: set[int]
                 ) -> str | None:
    """The class of one replace_lines (a bug's place is its recorded line)."""
    span = args.get("line_range") or [0]
    if observation.startswith("ERROR") or len(span) not in (1, 2) or span[0] != span[-1]:
        return "range_slip"
    hit = [i for i, b in enumerate(bugs) if i not in fixed and b.get("line") == span[0]]
    if not hit:
        return "wrong_location"
    bug, new = bugs[hit[0]], _lines(args.get("new_str", ""))
    if bug["fixed"] in new:
        fixed.add(hit[0])
        return None
    site = _differing(bug["buggy"], bug["fixed"])
    other_operator = any(_differing(line, bug["fixed"]) == site for line in new)
    if other_operator:
        return "wrong_fix"
    near = max((difflib.SequenceMatcher(None, line, bug["fixed"]).ratio() for line in new),
               default=0.0)
    return "copy_slip" if near >= NEAR else "wrong_fix"


def classify(turns: Sequence, status: str, bugs: Sequence[dict]) -> str:
    """The first mistake of a failed rollout (its turns, status and the task's bugs:
    dicts with `buggy` and `fixed` lines, stripped)."""
    return first_mistake(turns, status, bugs)[0]


def first_mistake(turns: Sequence, status: str, bugs: Sequence[dict]) -> tuple[str, str]:
    """(class, evidence): the class as `classify` names it, and the call that made the
    mistake (its arguments, or the observation of a malformed one; empty after the
    turns), for auditing the classes by eye."""
    fixed: set[int] = set()
    for turn in turns:
        obs = turn.observation or ""
        if turn.tool_call is None or (obs.startswith("ERROR") and _edit(turn.tool_call) is None
                                      and any(m in obs for m in MALFORMED)):
            return "malformed_call", obs[:160]
        args = _edit(turn.tool_call)
        if args is not None:
            kind = _edit_class(args, obs, bugs, fixed)
            if kind is not None:
                return kind, json.dumps({k: args.get(k) for k in
                                         ("old_str", "line_range", "new_str")})[:240]
    if len(fixed) == len(bugs):
        return "other", ""
    return ("premature_finish" if status == "finished" else "over_budget"), ""


def table(labels: Sequence[str]) -> dict:
    """Counts and shares of the classes, and the decisions' and slips' shares."""
    counts = Counter(labels)
    n = max(1, len(labels))
    return {"failed": len(labels), "counts": {c: counts[c] for c in CLASSES},
            "shares": {c: counts[c] / n for c in CLASSES},
            "decisions_share": sum(counts[c] for c in DECISIONS) / n,
            "slips_share": sum(counts[c] for c in SLIPS) / n}


async def rollouts(agent, tasks, n: int):
    from rl.rollout import RolloutJob, collect_groups

    return await collect_groups(agent, [RolloutJob(t, seed=i) for i, t in enumerate(tasks)], n)


def measure(workdir: str, spec: str, sets: Sequence[str], tasks: int, n: int) -> dict:
    from configs import common

    config = common.apply_overrides(common.load_config(spec), common.parse_overrides(sets))
    agent, train_tasks = sc.load_agent(config, workdir)
    try:
        groups = asyncio.run(rollouts(agent, list(train_tasks)[:tasks], n))
    finally:
        agent.close()
        agent.engine.close()
    by_id = {t.instance_id: t for t in train_tasks}
    scored = [t for g in groups for t in g if t.is_scored]
    failed = [t for t in scored if t.reward == 0]
    labels = {t.uid: classify(t.turns, t.status, by_id[t.task_id].metadata["bugs"])
              for t in failed}
    out = {"workdir": workdir, "config": spec, "sets": list(sets), "tasks": tasks,
           "rollouts_per_task": n, "scored": len(scored),
           "pass_rate": float(np.mean([t.reward for t in scored])) if scored else None,
           "all": table(list(labels.values())), "load": sc.load_note()}
    for d in sorted({by_id[t.task_id].difficulty for t in failed}):
        out[f"difficulty_{d}"] = table([labels[t.uid] for t in failed
                                        if by_id[t.task_id].difficulty == d])
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a run whose step-0 checkpoint is scored")
    p.add_argument("--config", default=sc.WARM.format(seed=0))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    result = measure(args.workdir, args.config, args.set, args.tasks, args.rollouts)
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
