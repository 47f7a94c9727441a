"""bench.taxonomy: the first mistake of a failed rollout, checked on the scripted expert's
own demonstrations (correct, and each of its planted mistakes) of real mini-SWE tasks."""

import random

import pytest

from bench import taxonomy as tx
from env.miniswe import expert_demo, generate_tasks
from env.tools import ToolCallError, validate_call
from rl.types import Turn

TASKS = generate_tasks(12, seed=5, difficulties=(1, 3)) + generate_tasks(4, seed=5,
                                                                        difficulties=(4,))


def _turns(calls, errors=()):
    return [Turn([], [], [], tool_call=c, observation="ERROR: old_str was not found in x.py; "
                 "no change made." if i in errors else "ok") for i, c in enumerate(calls)]


def _demo(task, mistake):
    for s in range(200):  # the demo's mistake is drawn: find the seed that draws this one
        demo = expert_demo(task, imperfect=bool(mistake), rng=random.Random(s))
        if demo.mistake == mistake:
            return demo
    raise AssertionError(f"{task.instance_id} has no {mistake} demonstration")


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.instance_id)
def test_the_experts_demonstrations_are_classified_by_their_planted_mistake(task):
    bugs = task.metadata["bugs"]
    assert tx.classify(_turns(_demo(task, "").calls), "finished", bugs) == "other"
    assert tx.classify(_turns(_demo(task, "finish_early").calls), "finished",
                       bugs) == "premature_finish"
    assert tx.classify(_turns(_demo(task, "finish_early").calls[:-1]), "max_steps",
                       bugs) == "over_budget"
    if bugs[0]["wrong_fixes"]:
        assert tx.classify(_turns(_demo(task, "wrong_edit").calls), "finished",
                           bugs) == "wrong_fix"
    if len(bugs) > 1:
        assert tx.classify(_turns(_demo(task, "half_fix").calls), "finished",
                           bugs) == "premature_finish"


def test_a_missed_old_str_is_a_slip_near_the_bug_line_and_a_wrong_place_elsewhere():
    task = next(t for t in TASKS if t.difficulty == 3)
    calls = _demo(task, "").calls
    at = next(i for i, c in enumerate(calls) if c["arguments"].get("command") == "str_replace")
    old = calls[at]["arguments"]["old_str"]
    slipped = {**calls[at], "arguments": {**calls[at]["arguments"], "old_str": old[:-1] + "#"}}
    elsewhere = {**calls[at], "arguments": {**calls[at]["arguments"],
                                            "old_str": "import zzzzzz_qqqq"}}
    bugs = task.metadata["bugs"]
    assert tx.classify(_turns([*calls[:at], slipped], {at}), "max_steps", bugs) == "copy_slip"
    assert tx.classify(_turns([*calls[:at], elsewhere], {at}), "max_steps",
                       bugs) == "wrong_location"
    moved = {**calls[at], "arguments": {**calls[at]["arguments"], "old_str": "import unittest",
                                        "new_str": "import unittest  # ok"}}
    assert tx.classify(_turns([*calls[:at], moved]), "finished", bugs) == "wrong_location"
    with pytest.raises(ToolCallError) as refused:  # the tools' own words for a bad call
        validate_call({"name": "nope", "arguments": {}})
    bad = _turns([*calls[:at], {"name": "nope", "arguments": {}}])
    bad[-1].observation = str(refused.value)
    assert tx.classify(bad, "finished", bugs) == "malformed_call"
    no_call = _turns(calls)
    no_call[at].tool_call = None
    assert tx.classify(no_call, "finished", bugs) == "malformed_call"


def test_a_line_edit_is_placed_by_its_range_and_judged_by_its_operator():
    task = next(t for t in TASKS if t.difficulty == 4)
    (bug,) = bugs = task.metadata["bugs"]
    calls = _demo(task, "").calls
    edit = calls[1]

    def with_edit(**changes):
        return [calls[0], {**edit, "arguments": {**edit["arguments"], **changes}}, calls[-1]]

    assert edit["arguments"]["line_range"] == [bug["line"]]  # the one line, as [line]
    assert tx.classify(_turns(calls), "finished", bugs) == "other"
    assert tx.classify(_turns(with_edit(line_range=[bug["line"]] * 2)), "finished",
                       bugs) == "other"
    for span in ([bug["line"] - 1], [bug["line"] - 1] * 2):
        assert tx.classify(_turns(with_edit(line_range=span)), "finished",
                           bugs) == "wrong_location", span
    for span in ([bug["line"] + 4, bug["line"]], [bug["line"], bug["line"] + 1]):
        assert tx.classify(_turns(with_edit(line_range=span)), "finished",
                           bugs) == "range_slip", span
    wrong = bug["fixed"].replace(bug["fixed"].split()[2], bug["wrong_fixes"][0].split()[2])
    assert tx.classify(_turns(with_edit(new_str="    " + wrong)), "finished",
                       bugs) == "wrong_fix"
    divided = "    " + " ".join(w if j != 2 else "/" for j, w in enumerate(bug["fixed"].split()))
    assert tx.classify(_turns(with_edit(new_str=divided)), "finished", bugs) == "wrong_fix"
    slipped = "    " + bug["fixed"].replace(" b", " bb")
    assert tx.classify(_turns(with_edit(new_str=slipped)), "finished", bugs) == "copy_slip"
    assert tx.classify(_turns(with_edit(new_str="    pass  # nothing to see")), "finished",
                       bugs) == "wrong_fix"


def test_the_table_counts_decisions_and_slips():
    out = tx.table(["copy_slip", "copy_slip", "wrong_fix", "premature_finish", "other"])
    assert out["failed"] == 5 and out["counts"]["copy_slip"] == 2
    assert out["decisions_share"] == 2 / 5 and out["slips_share"] == 2 / 5
