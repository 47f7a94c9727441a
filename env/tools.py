"""The agent's tools (R2E-Gym / SWE-agent style) and the Hermes tool-call parser.

The model writes one call per turn in Qwen3's Hermes format:

    <tool_call>
    {"name": "file_editor", "arguments": {"command": "view", "path": "calc/ops.py"}}
    </tool_call>

`parse_tool_call` turns that text into `{"name": ..., "arguments": {...}}` or raises
`ToolCallError` whose message is the observation the model sees next: a malformed
call is the model's mistake, reported back to it, never a crash. `ToolBox` executes
validated calls against a `Sandbox` through its interface only (`run`, `read_file`,
`write_file`), so the same tools work in every backend.

Paths are relative to the repository root, or absolute under `repo_root`
(`/testbed` by the R2E-Gym convention); anything resolving outside is refused.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import shlex
from typing import Any

from env.sandbox.base import Sandbox

__all__ = ["TOOL_SCHEMAS", "ToolBox", "ToolCallError", "ToolResult", "cap_text",
           "parse_tool_call", "scrub_timings", "validate_call"]

TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "execute_bash",
            "description": "Run a bash command in the repository root and return its output.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The bash command to run."},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "file_editor",
            "description": (
                "View, create and edit files. view: a file with line numbers (optionally "
                "view_range [start, end], end -1 for the last line) or a directory listing. "
                "create: a new file with file_text. str_replace: replace old_str, which must "
                "occur exactly once, by new_str. insert: insert new_str after line "
                "insert_line (0 for the top). replace_lines: replace lines line_range "
                "[start, end] (1-based, inclusive), or the one line [line], by new_str. "
                "undo_edit: revert the last edit of path."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {
                        "type": "string",
                        "enum": ["view", "create", "str_replace", "insert", "replace_lines",
                                 "undo_edit"],
                    },
                    "path": {"type": "string", "description": "File or directory path."},
                    "file_text": {"type": "string", "description": "Content for create."},
                    "old_str": {"type": "string", "description": "Exact text to replace."},
                    "new_str": {"type": "string", "description": "Replacement or inserted text."},
                    "insert_line": {"type": "integer", "description": "Insert after this line."},
                    "line_range": {
                        "type": "array",
                        "items": {"type": "integer"},
                        "description": "[start, end] lines to replace, 1-based, inclusive; "
                                       "[line] for one line.",
                    },
                    "view_range": {
                        "type": "array",
                        "items": {"type": "integer"},
                        "description": "[start, end] lines to view, 1-based, end -1 = last.",
                    },
                },
                "required": ["command", "path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Find lines containing search_term (plain text) under path.",
            "parameters": {
                "type": "object",
                "properties": {
                    "search_term": {"type": "string", "description": "Text to look for."},
                    "path": {"type": "string", "description": "Directory or file; default '.'."},
                },
                "required": ["search_term"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "End the episode when the task is solved.",
            "parameters": {
                "type": "object",
                "properties": {
                    "message": {"type": "string", "description": "Optional closing note."},
                },
                "required": [],
            },
        },
    },
]

_SCHEMA_BY_NAME = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SCHEMAS}
_EDITOR_REQUIRED = {
    "view": (),
    "create": ("file_text",),
    "str_replace": ("old_str",),
    "insert": ("insert_line", "new_str"),
    "replace_lines": ("line_range", "new_str"),
    "undo_edit": (),
}
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


class ToolCallError(ValueError):
    """A call the tools cannot run; `str(error)` is the observation for the model."""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """observation: what the model sees; done: finish was called; changed: the call
    may have modified the repository (bash commands and successful edits)."""

    observation: str
    done: bool = False
    changed: bool = False


def parse_tool_call(text: str) -> dict[str, Any]:
    """Extracts and validates the single Hermes tool call in an assistant message.

    Reasoning inside `<think>...</think>` is ignored. Raises ToolCallError naming
    exactly what was wrong: no call, several calls, unterminated tag, malformed JSON,
    missing name, unknown tool, missing / unexpected / wrong-typed arguments.
    """
    text = _THINK_RE.sub("", text)
    blocks = _TOOL_CALL_RE.findall(text)
    if not blocks:
        if "<tool_call>" in text:
            raise ToolCallError("ERROR: <tool_call> is not closed by </tool_call>.")
        raise ToolCallError(
            "ERROR: no tool call found. Reply with exactly one "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.')
    if len(blocks) > 1:
        raise ToolCallError(f"ERROR: found {len(blocks)} tool calls; make exactly one per turn.")
    payload = _load_json(blocks[0], "tool call")
    if not isinstance(payload, dict):
        raise ToolCallError("ERROR: a tool call must be a JSON object with 'name' and 'arguments'.")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        arguments = _load_json(arguments, "'arguments'")
    call = {"name": payload.get("name"), "arguments": arguments}
    validate_call(call)
    return call


def _load_json(text: str, what: str) -> Any:
    """json.loads, with every way it can fail as a ToolCallError: malformed text, and
    nesting deeper than the parser recurses (RecursionError, e.g. 5000 `[`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"ERROR: malformed JSON in {what}: {e.msg} at char {e.pos}.") from e
    except RecursionError:
        raise ToolCallError(f"ERROR: the JSON in {what} is nested too deeply.") from None
    except ValueError as e:  # e.g. an integer literal beyond int's digit limit
        raise ToolCallError(f"ERROR: invalid JSON in {what}: {_short(str(e))}.") from None


def _short(text: str, limit: int = 80) -> str:
    """`text` cut to `limit` characters, so an error echoing model output stays small."""
    return text if len(text) <= limit else text[:limit] + "..."


def validate_call(call: dict[str, Any]) -> None:
    """Checks a parsed call against TOOL_SCHEMAS; raises ToolCallError otherwise."""
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError("ERROR: the tool call has no 'name'.")
    if name not in _SCHEMA_BY_NAME:
        raise ToolCallError(f"ERROR: unknown tool '{_short(name)}'. "
                            f"Available tools: {', '.join(_SCHEMA_BY_NAME)}.")
    arguments = call.get("arguments")
    if not isinstance(arguments, dict):
        raise ToolCallError(f"ERROR: 'arguments' of {name} must be a JSON object.")
    schema = _SCHEMA_BY_NAME[name]
    for key in schema["required"]:
        if key not in arguments:
            raise ToolCallError(f"ERROR: {name} is missing the required argument '{key}'.")
    for key, value in arguments.items():
        spec = schema["properties"].get(key)
        if spec is None:
            allowed = ", ".join(schema["properties"])
            raise ToolCallError(
                f"ERROR: unexpected argument '{_short(key)}' for {name}; allowed: {allowed}.")
        _check_type(name, key, value, spec)
    if name == "file_editor":
        for key in _EDITOR_REQUIRED[arguments["command"]]:
            if key not in arguments:
                raise ToolCallError(
                    f"ERROR: file_editor {arguments['command']} needs the argument '{key}'.")


def _check_type(tool: str, key: str, value: Any, spec: dict[str, Any]) -> None:
    kind = spec["type"]
    if kind == "string":
        ok = isinstance(value, str)
    elif kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:  # array of integers (view_range)
        ok = isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ToolCallError(
            f"ERROR: argument '{key}' of {tool} must be of type {_type_name(spec)}, "
            f"got {type(value).__name__}.")
    if "enum" in spec and value not in spec["enum"]:
        raise ToolCallError(
            f"ERROR: argument '{key}' of {tool} must be one of {', '.join(spec['enum'])}; "
            f"got '{_short(value)}'.")


def _type_name(spec: dict[str, Any]) -> str:
    return "array of integers" if spec["type"] == "array" else spec["type"]


def cap_text(text: str, limit: int) -> str:
    """Keeps the head and tail of `text` within `limit` characters, marking the cut."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} characters omitted ...]\n"
    head = max(limit - len(marker), 0) * 2 // 3
    tail = max(limit - len(marker) - head, 0)
    return text[:head] + marker + (text[-tail:] if tail else "")


# Test runners' wall-clock durations: unittest's "Ran 4 tests in 0.072s" and pytest's
# "===== 3 passed, 1 failed in 0.12s =====" (optionally "(0:01:02)" after it).
_UNITTEST_TIME = re.compile(r"^(Ran \d+ tests?) in \d+(?:\.\d+)?s$", re.MULTILINE)
_PYTEST_TIME = re.compile(r"^(=+ .*?) in \d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))?( =+)$",
                          re.MULTILINE)


def scrub_timings(text: str) -> str:
    """`text` without test runners' durations, which vary from run to run; the rest of
    the summary line stays. Makes an observation a function of the sandbox's state and
    the command alone, so demonstrations, replays and evaluations are reproducible."""
    return _PYTEST_TIME.sub(r"\1\2", _UNITTEST_TIME.sub(r"\1", text))


def number_lines(lines: list[str], start: int = 1) -> str:
    """`cat -n` style: right-aligned 1-based line number, a tab, the line."""
    return "\n".join(f"{i:6d}\t{line}" for i, line in enumerate(lines, start))


def _not_an_option(rel: str) -> str:
    """`rel` spelled so that no command reads it as an option (`find` takes no `--`):
    a directory named `-delete` must be listed, not run."""
    return f"./{rel}" if rel.startswith("-") else rel


class ToolBox:
    """Executes tool calls for one episode; remembers edits so undo_edit can revert them."""

    def __init__(self, sandbox: Sandbox, *, repo_root: str = "/testbed",
                 max_observation_chars: int = 4000, bash_timeout: float = 30.0,
                 max_search_results: int = 50, scrub_timings: bool = True):
        self.sandbox = sandbox
        self.scrub_timings = scrub_timings
        self.repo_root = repo_root.rstrip("/") or "/"
        self.max_observation_chars = max_observation_chars
        self.bash_timeout = bash_timeout
        self.max_search_results = max_search_results
        self._history: dict[str, list[str | None]] = {}
        self._real_root: str | None = None

    def execute(self, call: dict[str, Any]) -> ToolResult:
        """Runs a call; bad calls become ERROR observations. SandboxError propagates."""
        try:
            validate_call(call)
            result = getattr(self, "_" + call["name"])(**call["arguments"])
        except ToolCallError as e:
            result = ToolResult(str(e))
        except (OSError, ValueError) as e:  # the sandbox refused a file operation
            result = ToolResult(f"ERROR: {e}")
        return dataclasses.replace(
            result, observation=cap_text(result.observation, self.max_observation_chars))

    def __call__(self, text: str) -> ToolResult:
        """Parses assistant text and executes its call."""
        try:
            call = parse_tool_call(text)
        except ToolCallError as e:
            return ToolResult(str(e))
        return self.execute(call)

    # ---- paths -------------------------------------------------------------------------------

    def resolve(self, path: str) -> str:
        """Repository-relative normalised path ('.' for the root); refuses escapes."""
        if not path.strip():
            raise ToolCallError("ERROR: path is empty.")
        if "\x00" in path:
            raise ToolCallError("ERROR: path contains a NUL character.")
        if path.startswith("/"):
            root = self.repo_root
            if path != root and not path.startswith(root.rstrip("/") + "/"):
                raise ToolCallError(
                    f"ERROR: path {path} is outside the repository {root}; use a path under "
                    f"{root} or relative to it.")
            path = path[len(root):].lstrip("/") or "."
        rel = posixpath.normpath(path)
        if rel == ".." or rel.startswith("../"):
            raise ToolCallError(f"ERROR: path {path} escapes the repository; '../' is not allowed.")
        return rel

    def _exists(self, rel: str) -> bool:
        res = self.sandbox.run(f"test -e {shlex.quote(rel)} || test -L {shlex.quote(rel)}",
                               timeout=10)
        return res.exit_code == 0

    def _read(self, rel: str, allow_dir: bool = False, for_edit: bool = False) -> str | None:
        """The text of a regular file (None for a directory when `allow_dir`);
        ToolCallError when missing or not readable, and, `for_edit`, when it is not
        UTF-8: rewriting its text would change bytes the edit never named."""
        try:
            if rel == ".":
                raise IsADirectoryError(rel)
            return self.sandbox.read_file(rel, errors="strict" if for_edit else "replace")
        except UnicodeDecodeError as e:
            raise ToolCallError(
                f"ERROR: {rel} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                f"{e.start}); file_editor edits only UTF-8 files. No change made.") from None
        except FileNotFoundError:
            raise ToolCallError(f"ERROR: {rel} does not exist.") from None
        except IsADirectoryError:
            if allow_dir:
                return None
            raise ToolCallError(f"ERROR: {rel} is a directory, not a file.") from None
        except OSError as e:
            raise ToolCallError(f"ERROR: cannot read {rel}: {e}") from None

    def _as_repo_root(self, text: str) -> str:
        """Writes the sandbox's real repository path as `repo_root`, so that outputs
        (tracebacks) read the same in every backend and every replay."""
        if self._real_root is None:
            self._real_root = self.sandbox.real_root()
        if self._real_root and self._real_root != self.repo_root:
            text = text.replace(self._real_root, self.repo_root)
        return text

    # ---- tools -------------------------------------------------------------------------------

    def _execute_bash(self, command: str) -> ToolResult:
        if not command.strip():
            raise ToolCallError("ERROR: command is empty.")
        res = self.sandbox.run(command, timeout=self.bash_timeout)
        out = self._as_repo_root(res.output).rstrip("\n")
        if self.scrub_timings:
            out = scrub_timings(out)
        if res.timed_out:
            out += f"\n[command timed out after {self.bash_timeout:g}s]"
        elif res.exit_code != 0:
            out += f"\n[exit code {res.exit_code}]"
        return ToolResult(out.lstrip("\n") or "(no output)", changed=True)

    def _search(self, search_term: str, path: str = ".") -> ToolResult:
        if not search_term:
            raise ToolCallError("ERROR: search_term is empty.")
        rel = self.resolve(path)
        res = self.sandbox.run(
            "grep -rnIF --exclude-dir=.git --exclude-dir=__pycache__ -- "
            f"{shlex.quote(search_term)} {shlex.quote(_not_an_option(rel))}", timeout=30)
        if res.exit_code == 2 and "No such file" in res.output:
            raise ToolCallError(f"ERROR: {rel} does not exist.")
        lines = [ln[2:] if ln.startswith("./") else ln for ln in res.output.splitlines()]
        if not lines:
            return ToolResult(f'No matches for "{search_term}" in {rel}')
        shown = lines[: self.max_search_results]
        head = f'{len(lines)} matches for "{search_term}" in {rel}'
        if len(lines) > len(shown) or res.truncated:
            head += f" (showing the first {len(shown)}; narrow the search)"
        return ToolResult(head + ":\n" + "\n".join(shown))

    def _finish(self, message: str = "") -> ToolResult:
        return ToolResult("Episode finished." + (f" {message}" if message else ""), done=True)

    def _file_editor(self, command: str, path: str, **edit) -> ToolResult:
        """edit: the call's other arguments (file_text, old_str, new_str, insert_line,
        view_range, line_range), names and types checked against the schema by
        validate_call."""
        rel = self.resolve(path)
        view_range, line_range = edit.get("view_range"), edit.get("line_range")
        if line_range is not None and command != "replace_lines":
            raise ToolCallError(
                "ERROR: line_range is only allowed with the replace_lines command.")
        if command == "view":
            return self._view(rel, view_range)
        if view_range is not None:
            raise ToolCallError("ERROR: view_range is only allowed with the view command.")
        if command == "replace_lines":
            return self._replace_lines(rel, line_range, edit.get("new_str"))
        if command == "create":
            return self._create(rel, edit.get("file_text"))
        if command == "str_replace":
            return self._str_replace(rel, edit.get("old_str"), edit.get("new_str") or "")
        if command == "insert":
            return self._insert(rel, edit.get("insert_line"), edit.get("new_str"))
        return self._undo(rel)

    def _view(self, rel: str, view_range: list[int] | None) -> ToolResult:
        text = self._read(rel, allow_dir=True)
        if text is None:
            return self._listing(rel, view_range)
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        start, end = 1, len(lines)
        if view_range is not None:
            if len(view_range) != 2:
                raise ToolCallError("ERROR: view_range must be [start, end].")
            start, end = view_range
            end = len(lines) if end == -1 else end
            if not 1 <= start <= max(len(lines), 1) or end < start:
                raise ToolCallError(
                    f"ERROR: invalid view_range {view_range}; {rel} has {len(lines)} lines.")
            end = min(end, len(lines))
        return ToolResult(f"{rel}:\n" + number_lines(lines[start - 1:end], start))

    def _listing(self, rel: str, view_range: list[int] | None) -> ToolResult:
        if view_range is not None:
            raise ToolCallError("ERROR: view_range cannot be used on a directory.")
        res = self.sandbox.run(
            f"find {shlex.quote(_not_an_option(rel))} -maxdepth 2 -not -path '*/.*' "
            "-not -path '*__pycache__*' | sort", timeout=10)
        entries = [ln[2:] if ln.startswith("./") else ln for ln in res.output.splitlines()]
        listing = "\n".join(e for e in entries if e and e != ".")
        return ToolResult(f"Files in {rel} (depth 2):\n{listing}")

    def _create(self, rel: str, file_text: str) -> ToolResult:
        if rel == "." or self._exists(rel):
            raise ToolCallError(
                f"ERROR: {rel} already exists; create cannot overwrite, use str_replace.")
        self.sandbox.write_file(rel, file_text)
        self._history.setdefault(rel, []).append(None)
        return ToolResult(f"Created {rel}.", changed=True)

    def _str_replace(self, rel: str, old_str: str, new_str: str) -> ToolResult:
        text = self._read(rel, for_edit=True)
        if not old_str:
            raise ToolCallError("ERROR: old_str is empty.")
        count = text.count(old_str)
        if count == 0:
            raise ToolCallError(f"ERROR: old_str was not found in {rel}; no change made.")
        if count > 1:
            at = [text[:m.start()].count("\n") + 1 for m in re.finditer(re.escape(old_str), text)]
            raise ToolCallError(
                f"ERROR: old_str occurs {count} times in {rel} (lines {at}); it must be unique. "
                "No change made.")
        first = text[:text.index(old_str)].count("\n") + 1
        self._write(rel, text, text.replace(old_str, new_str, 1))
        return self._edited(rel, text.replace(old_str, new_str, 1), first,
                            first + new_str.count("\n"))

    def _insert(self, rel: str, insert_line: int, new_str: str) -> ToolResult:
        text = self._read(rel, for_edit=True)
        lines = text.split("\n")
        trailing = lines[-1] == ""
        if trailing:
            lines.pop()
        if not 0 <= insert_line <= len(lines):
            raise ToolCallError(
                f"ERROR: insert_line {insert_line} is out of range [0, {len(lines)}] for {rel}.")
        added = new_str.split("\n")
        if added[-1] == "":
            added.pop()
        lines[insert_line:insert_line] = added
        new_text = "\n".join(lines) + ("\n" if trailing or not lines else "")
        self._write(rel, text, new_text)
        return self._edited(rel, new_text, insert_line + 1, insert_line + max(len(added), 1))

    def _replace_lines(self, rel: str, line_range: list[int], new_str: str) -> ToolResult:
        """SWE-agent's `edit START:END`: the lines replaced by new_str, whatever they held
        (no text to copy, so the edit names its place by number)."""
        text = self._read(rel, for_edit=True)
        lines = text.split("\n")
        trailing = lines[-1] == ""
        if trailing:
            lines.pop()
        if (len(line_range) not in (1, 2)
                or not 1 <= line_range[0] <= line_range[-1] <= len(lines)):
            raise ToolCallError(f"ERROR: invalid line_range {line_range}; {rel} has "
                                f"{len(lines)} lines (1-based [start, end] or [line]). "
                                "No change made.")
        start, end = line_range[0], line_range[-1]
        added = new_str.split("\n")
        if added[-1] == "" and len(added) > 1:
            added.pop()
        lines[start - 1:end] = added
        new_text = "\n".join(lines) + ("\n" if trailing else "")
        self._write(rel, text, new_text)
        return self._edited(rel, new_text, start, start + len(added) - 1)

    def _undo(self, rel: str) -> ToolResult:
        stack = self._history.get(rel)
        if not stack:
            raise ToolCallError(f"ERROR: no edit of {rel} to undo.")
        previous = stack.pop()
        if previous is None:
            self.sandbox.run(f"rm -f -- {shlex.quote(rel)}", timeout=10)
            return ToolResult(f"Undid the creation of {rel}; the file is removed.", changed=True)
        self.sandbox.write_file(rel, previous)
        return ToolResult(f"Undid the last edit of {rel}.", changed=True)

    def _write(self, rel: str, old: str, new: str) -> None:
        self.sandbox.write_file(rel, new)
        self._history.setdefault(rel, []).append(old)

    def _edited(self, rel: str, text: str, first: int, last: int, context: int = 2) -> ToolResult:
        lines = text.split("\n")
        lo, hi = max(first - context, 1), min(last + context, len(lines))
        snippet = number_lines(lines[lo - 1:hi], lo)
        return ToolResult(f"Edited {rel}. Lines {lo}-{hi} now read:\n{snippet}", changed=True)
