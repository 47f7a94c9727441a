"""Tool-call parsing and the tools, on real local and Docker sandboxes.

References: `cat -n` and `grep` run in the sandbox for views and searches, file
contents read back through the sandbox, hand-written expected error messages.
"""

import json

import pytest
from sandbox_backends import BACKENDS, backend_factory

from env.tasks import Task
from env.tools import (
    TOOL_SCHEMAS,
    ToolBox,
    ToolCallError,
    cap_text,
    parse_tool_call,
    scrub_timings,
)
from models.tokenizer import render_tool_call

FILES = {
    "calc.py": "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n",
    "pkg/util.py": "X = 1\nY = 2\n",
    "notes.txt": "alpha\nbeta\ngamma\n",
}
TASK = Task("tools", "test repo", repo_files=FILES)


def call(name, **arguments):
    return render_tool_call({"name": name, "arguments": arguments})


# ---- parsing (no sandbox) ---------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("I will fix it now.", "no tool call found"),
    ('<tool_call>{"name": "finish", "arguments": {}}', "<tool_call> is not closed"),
    (call("finish") + call("finish"), "found 2 tool calls"),
    ('<tool_call>\n{"name": "finish", "arguments": {}\n</tool_call>', "malformed JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "has no 'name'"),
    (call("rm_rf", path="."), "unknown tool 'rm_rf'"),
    ('<tool_call>{"name": "finish", "arguments": [1]}</tool_call>',
     "'arguments' of finish must be a JSON object"),
    ('<tool_call>{"name": "search", "arguments": "{bad"}</tool_call>',
     "malformed JSON in 'arguments'"),
    (call("execute_bash"), "execute_bash is missing the required argument 'command'"),
    (call("execute_bash", command="ls", cwd="/"), "unexpected argument 'cwd' for execute_bash"),
    (call("execute_bash", command=["ls"]), "'command' of execute_bash must be of type string, "
                                           "got list"),
    (call("file_editor", command="insert", path="a", insert_line="3", new_str="x"),
     "'insert_line' of file_editor must be of type integer, got str"),
    (call("file_editor", command="insert", path="a", insert_line=True, new_str="x"),
     "'insert_line' of file_editor must be of type integer, got bool"),
    (call("file_editor", command="view", path="a", view_range=[1, "2"]),
     "'view_range' of file_editor must be of type array of integers"),
    (call("file_editor", command="delete", path="a"), "must be one of view, create"),
    (call("file_editor", command="create", path="a"), "file_editor create needs the argument "
                                                      "'file_text'"),
    (call("file_editor", command="str_replace", path="a"), "needs the argument 'old_str'"),
    (call("file_editor", command="insert", path="a", new_str="x"),
     "needs the argument 'insert_line'"),
    (call("file_editor", path="a"), "file_editor is missing the required argument 'command'"),
    # Deeper than json's recursion: RecursionError, as a clear observation.
    ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "nested too deeply"),
    ('<tool_call>{"name": "finish", "arguments": ' + "{" * 5000 + "</tool_call>",
     "malformed JSON"),
    ('<tool_call>{"name": "finish", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}</tool_call>',
     "'arguments' is nested too deeply"),
    ('<tool_call>{"name": "finish", "arguments": {"message": 1' + "0" * 5000 + "}}</tool_call>",
     "invalid JSON in tool call"),
])
def test_malformed_calls_name_the_problem(text, message):
    with pytest.raises(ToolCallError) as err:
        parse_tool_call(text)
    assert str(err.value).startswith("ERROR: ")
    assert message in str(err.value)
    assert len(str(err.value)) < 300  # never the model's text echoed in full


def test_parse_round_trip_and_hermes_text():
    c = {"name": "file_editor", "arguments": {"command": "str_replace", "path": "calc.py",
                                              "old_str": "a - b", "new_str": "a + b"}}
    text = render_tool_call(c)
    assert text == ('<tool_call>\n{"name": "file_editor", "arguments": {"command": '
                    '"str_replace", "path": "calc.py", "old_str": "a - b", "new_str": '
                    '"a + b"}}\n</tool_call>')
    assert parse_tool_call("Let me fix it.\n" + text + "\n") == c
    # Reasoning is ignored, even when it contains a call; string arguments are accepted.
    assert parse_tool_call("<think>" + call("finish") + "</think>" + text) == c
    as_string = '<tool_call>{"name": "finish", "arguments": "{\\"message\\": \\"ok\\"}"}'
    assert parse_tool_call(as_string + "</tool_call>") == {"name": "finish",
                                                           "arguments": {"message": "ok"}}
    assert parse_tool_call('<tool_call>{"name": "finish"}</tool_call>') == {
        "name": "finish", "arguments": {}}


def test_schemas_are_openai_tool_descriptions():
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == [
        "execute_bash", "file_editor", "search", "finish"]
    for s in TOOL_SCHEMAS:
        assert s["type"] == "function"
        params = s["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
        json.dumps(s)


def test_cap_text_keeps_head_and_tail():
    text = "".join(f"line {i}\n" for i in range(1000))
    capped = cap_text(text, 200)
    assert len(capped) <= 200 and capped.startswith("line 0\n") and capped.endswith("line 999\n")
    assert "characters omitted" in capped
    assert cap_text("short", 200) == "short"


def test_scrub_timings_drops_only_test_runner_durations():
    assert scrub_timings("....\n---\nRan 4 tests in 0.072s\n\nOK") == "....\n---\nRan 4 tests\n\nOK"
    assert scrub_timings("Ran 1 test in 12s") == "Ran 1 test"
    assert scrub_timings("=== 3 passed, 1 failed in 0.12s ===\nx") == (
        "=== 3 passed, 1 failed ===\nx")
    assert scrub_timings("===== 2 passed in 62.01s (0:01:02) =====") == "===== 2 passed ====="
    for kept in ["I ran 4 tests in 0.1s today", "Ran 4 tests in 0.1 s", "took 0.072s",
                 "== 2 passed in 0.1s"]:
        assert scrub_timings(kept) == kept


# ---- tools on real sandboxes ---------------------------------------------------------------

@pytest.fixture(params=BACKENDS)
def tools(request):
    sandbox = backend_factory(request, request.param)(TASK)
    yield ToolBox(sandbox, bash_timeout=2, max_search_results=3, max_observation_chars=600)
    sandbox.close()


def run(tools, name, **arguments):
    return tools.execute({"name": name, "arguments": arguments})


SLOW_TEST = ("import time, unittest\n\n\nclass T(unittest.TestCase):\n"
             "    def test_slow(self):\n        time.sleep(0.02)\n")


def test_bash_observations_carry_no_test_durations(tools):
    run(tools, "file_editor", command="create", path="test_slow.py", file_text=SLOW_TEST)
    raw = tools.sandbox.run("python3 -m unittest -q test_slow").output.rstrip("\n")
    timing = [ln for ln in raw.splitlines() if ln.startswith("Ran 1 test in ")]
    assert len(timing) == 1 and timing[0] != "Ran 1 test in 0.000s", raw  # it slept 20 ms
    seen = {run(tools, "execute_bash", command="python3 -m unittest -q test_slow").observation
            for _ in range(2)}
    assert seen == {raw.replace(timing[0], "Ran 1 test")}
    tools.scrub_timings = False
    assert "Ran 1 test in 0.0" in run(tools, "execute_bash",
                                      command="python3 -m unittest -q test_slow").observation


def test_view_matches_cat_n_and_lists_directories(tools):
    reference = tools.sandbox.run("cat -n calc.py").output.rstrip("\n")
    assert run(tools, "file_editor", command="view", path="calc.py").observation == (
        "calc.py:\n" + reference)
    ranged = run(tools, "file_editor", command="view", path="/testbed/calc.py",
                 view_range=[2, 3]).observation
    assert ranged == "calc.py:\n" + "\n".join(reference.split("\n")[1:3])
    tail = run(tools, "file_editor", command="view", path="calc.py", view_range=[5, -1])
    assert tail.observation == "calc.py:\n" + "\n".join(reference.split("\n")[4:])
    listing = run(tools, "file_editor", command="view", path=".").observation
    assert listing.splitlines()[1:] == ["calc.py", "notes.txt", "pkg", "pkg/util.py"]
    assert run(tools, "file_editor", command="view", path="/testbed/pkg").observation == (
        "Files in pkg (depth 2):\npkg\npkg/util.py")
    assert run(tools, "file_editor", command="view", path="nope.py").observation == (
        "ERROR: nope.py does not exist.")
    assert "invalid view_range [7, 9]; calc.py has 6 lines" in run(
        tools, "file_editor", command="view", path="calc.py", view_range=[7, 9]).observation
    assert "cannot be used on a directory" in run(
        tools, "file_editor", command="view", path="pkg", view_range=[1, 2]).observation


@pytest.mark.parametrize("path", ["../outside.py", "pkg/../../outside.py", "/etc/passwd",
                                  "/testbed/../outside.py", "/testbedx/a.py", "/tmp/a.py"])
def test_paths_outside_the_repo_are_refused(tools, path):
    probe = "ls ../outside.py /tmp/a.py /testbedx/a.py 2>&1 | grep -vc 'No such file'"
    assert tools.sandbox.run(probe).output.strip() == "0"
    for command, extra in [("view", {}), ("create", {"file_text": "x"}),
                           ("str_replace", {"old_str": "a", "new_str": "b"}),
                           ("insert", {"insert_line": 0, "new_str": "x"})]:
        obs = run(tools, "file_editor", command=command, path=path, **extra).observation
        assert obs.startswith("ERROR: path ") and ("outside the repository" in obs
                                                   or "escapes the repository" in obs), obs
    assert run(tools, "search", search_term="root", path=path).observation.startswith(
        "ERROR: path ")
    assert tools.sandbox.run(probe).output.strip() == "0"


def test_str_replace_requires_a_unique_match(tools):
    obs = run(tools, "file_editor", command="str_replace", path="calc.py", old_str="return a - b",
              new_str="return a + b").observation
    assert obs == ("ERROR: old_str occurs 2 times in calc.py (lines [2, 6]); it must be unique. "
                   "No change made.")
    obs = run(tools, "file_editor", command="str_replace", path="calc.py", old_str="a * b",
              new_str="a + b").observation
    assert obs == "ERROR: old_str was not found in calc.py; no change made."
    assert tools.sandbox.read_file("calc.py") == FILES["calc.py"]
    result = run(tools, "file_editor", command="str_replace", path="calc.py",
                 old_str="def add(a, b):\n    return a - b", new_str="def add(a, b):\n"
                 "    return a + b")
    assert result.changed and "     2\t    return a + b" in result.observation
    assert tools.sandbox.read_file("calc.py") == FILES["calc.py"].replace("a - b", "a + b", 1)


def test_replace_lines_names_its_place_by_number(tools):
    """SWE-agent's `edit START:END`: the lines are replaced whatever they hold (the two
    `return a - b` lines that str_replace cannot tell apart), checked against list
    slicing of the file's lines."""
    edit = lambda **kw: run(tools, "file_editor", command="replace_lines", path="calc.py", **kw)
    result = edit(line_range=[6, 6], new_str="    return a + b")
    lines = FILES["calc.py"].split("\n")
    lines[5:6] = ["    return a + b"]
    assert result.changed and tools.sandbox.read_file("calc.py") == "\n".join(lines)
    assert "     6\t    return a + b" in result.observation
    edit(line_range=[1, 2], new_str="def add(a, b):\n    c = a + b\n    return c\n")
    lines[0:2] = ["def add(a, b):", "    c = a + b", "    return c"]
    assert tools.sandbox.read_file("calc.py") == "\n".join(lines)
    edit(line_range=[3], new_str="    c = a * b")  # one line: [line]
    lines[2:3] = ["    c = a * b"]
    assert tools.sandbox.read_file("calc.py") == "\n".join(lines)
    edit(line_range=[3], new_str=lines[2] + "\n    c = c")  # ... by one or more
    lines[2:3] = [lines[2], "    c = c"]
    assert tools.sandbox.read_file("calc.py") == "\n".join(lines)
    for bad in ([0, 1], [3, 2], [9, 9], [0], [9], [], [1, 2, 3]):
        assert edit(line_range=bad, new_str="x").observation.startswith(
            f"ERROR: invalid line_range {bad}; calc.py has 8 lines"), bad
    assert tools.sandbox.read_file("calc.py") == "\n".join(lines)
    assert "only allowed with the replace_lines" in run(
        tools, "file_editor", command="view", path="calc.py", line_range=[1, 1]).observation
    assert "needs the argument 'line_range'" in run(
        tools, "file_editor", command="replace_lines", path="calc.py", new_str="x").observation
    for _ in range(4):
        run(tools, "file_editor", command="undo_edit", path="calc.py")
    assert tools.sandbox.read_file("calc.py") == FILES["calc.py"]


def test_insert_create_and_undo(tools):
    edit = lambda **kw: run(tools, "file_editor", **kw).observation
    edit(command="insert", path="notes.txt", insert_line=0, new_str="top")
    edit(command="insert", path="notes.txt", insert_line=2, new_str="mid1\nmid2\n")
    edit(command="insert", path="notes.txt", insert_line=6, new_str="end")
    assert tools.sandbox.read_file("notes.txt") == "top\nalpha\nmid1\nmid2\nbeta\ngamma\nend\n"
    assert edit(command="insert", path="notes.txt", insert_line=9, new_str="x") == (
        "ERROR: insert_line 9 is out of range [0, 7] for notes.txt.")
    assert edit(command="create", path="notes.txt", file_text="x").startswith(
        "ERROR: notes.txt already exists")
    assert edit(command="create", path="new/deep.py", file_text="Z = 3\n") == "Created new/deep.py."
    assert tools.sandbox.read_file("new/deep.py") == "Z = 3\n"

    assert edit(command="undo_edit", path="notes.txt") == "Undid the last edit of notes.txt."
    assert tools.sandbox.read_file("notes.txt") == "top\nalpha\nmid1\nmid2\nbeta\ngamma\n"
    edit(command="undo_edit", path="notes.txt")
    edit(command="undo_edit", path="notes.txt")
    assert tools.sandbox.read_file("notes.txt") == FILES["notes.txt"]
    assert edit(command="undo_edit", path="notes.txt") == "ERROR: no edit of notes.txt to undo."
    assert "is removed" in edit(command="undo_edit", path="new/deep.py")
    assert edit(command="view", path="new/deep.py") == "ERROR: new/deep.py does not exist."


def test_execute_bash_search_and_finish(tools):
    assert run(tools, "execute_bash", command="echo hi; echo err >&2").observation == "hi\nerr"
    assert run(tools, "execute_bash", command="exit 3").observation == "[exit code 3]"
    assert run(tools, "execute_bash", command="echo x; exit 3").observation == (
        "x\n[exit code 3]")
    assert run(tools, "execute_bash", command="true").observation == "(no output)"
    assert run(tools, "execute_bash", command="sleep 20").observation.endswith(
        "[command timed out after 2s]")
    assert run(tools, "execute_bash", command="  ").observation == "ERROR: command is empty."
    big = run(tools, "execute_bash", command="seq 1 5000").observation
    assert len(big) <= 600 and big.startswith("1\n2\n") and big.endswith("4999\n5000")

    grep = tools.sandbox.run("grep -rnIF -- 'a - b' .").output.splitlines()
    found = run(tools, "search", search_term="a - b").observation
    assert found.splitlines() == ['2 matches for "a - b" in .:'] + [
        ln.removeprefix("./") for ln in grep]
    assert run(tools, "search", search_term="zzz").observation == 'No matches for "zzz" in .'
    assert run(tools, "search", search_term="X", path="nowhere").observation == (
        "ERROR: nowhere does not exist.")
    many = run(tools, "search", search_term="a").observation
    assert "(showing the first 3; narrow the search)" in many and len(many.splitlines()) == 4
    done = run(tools, "finish", message="fixed")
    assert done.done and done.observation == "Episode finished. fixed"


def test_toolbox_never_raises_on_garbage(tools):
    for text in ["", "<tool_call></tool_call>", "<tool_call>null</tool_call>",
                 '<tool_call>{"name": 3}</tool_call>', "\x00<tool_call>{]</tool_call>",
                 call("file_editor", command="view", path=""),
                 call("file_editor", command="view", path="a\x00b"),
                 call("file_editor", command="create", path="calc.py/x", file_text="1"),
                 "<tool_call>" + "[" * 5000 + "</tool_call>",
                 "<tool_call>" + "{\"a\":" * 5000 + "1" + "}" * 5000 + "</tool_call>",
                 call("x" * 10_000), call("file_editor", command="v" * 10_000, path="a")]:
        result = tools(text)
        assert result.observation.startswith("ERROR: ") and not result.done


def test_a_path_never_acts_as_an_option(tools):
    tools.sandbox.run("mkdir -- -delete && echo 'needle = 1' > -delete/a.py")
    listing = run(tools, "file_editor", command="view", path="-delete").observation
    assert listing == "Files in -delete (depth 2):\n-delete\n-delete/a.py"
    found = run(tools, "search", search_term="needle", path="-delete").observation
    assert found == '1 matches for "needle" in -delete:\n-delete/a.py:1:needle = 1'
    assert tools.sandbox.run("test -d .git && ls -- calc.py -delete/a.py").exit_code == 0


def test_edits_follow_links_inside_the_repo_and_refuse_links_out(tools):
    sb = tools.sandbox
    sb.run("ln -s calc.py link.py && mkdir -p ../outside && echo 'out = 1' > ../outside/x.py"
           " && ln -s ../outside/x.py out.py && chmod 755 calc.py")
    edited = run(tools, "file_editor", command="str_replace", path="link.py",
                 old_str="return a - b\n\n\ndef sub", new_str="return a + b\n\n\ndef sub")
    assert edited.observation.startswith("Edited link.py.")
    assert sb.read_file("calc.py").startswith("def add(a, b):\n    return a + b\n")
    assert sb.run("test -L link.py && stat -c %a calc.py").output.strip() == "755"
    refused = run(tools, "file_editor", command="str_replace", path="out.py",
                  old_str="out = 1", new_str="out = 2").observation
    assert refused.startswith("ERROR: out.py is a symbolic link to ") and "outside the " \
        "repository; not edited" in refused
    assert run(tools, "file_editor", command="insert", path="out.py", insert_line=0,
               new_str="x").observation == refused
    assert sb.run("cat ../outside/x.py; test -L out.py").output == "out = 1\n"


def test_edits_of_non_utf8_files_are_refused_and_leave_every_byte(tools):
    sb = tools.sandbox
    sb.run(r"printf 'a = 1\n# caf\xe9\n' > latin1.py")
    before = sb.run("sha256sum latin1.py").output
    for call in [dict(command="str_replace", path="latin1.py", old_str="a = 1", new_str="a = 2"),
                 dict(command="insert", path="latin1.py", insert_line=0, new_str="b = 0")]:
        observation = run(tools, "file_editor", **call).observation
        assert observation == ("ERROR: latin1.py is not UTF-8 text (byte 0xe9 at offset 11); "
                               "file_editor edits only UTF-8 files. No change made.")
    assert sb.run("sha256sum latin1.py").output == before
    assert "caf\ufffd" in run(tools, "file_editor", command="view", path="latin1.py").observation
