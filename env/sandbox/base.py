"""The sandbox interface every backend implements.

A sandbox holds one checkout of a task's repository for one episode. All paths
given to `read_file` / `write_file` are relative to the repository root. Errors
of the infrastructure (container died, daemon unreachable) raise `SandboxError`:
callers turn them into the `env_error` status, never into reward 0.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any

from env.sandbox import shell

# Default cap on a patch: each step's patch is kept in the history, the Prefix Sampling
# queue and checkpoints; real fixes are kilobytes.
MAX_PATCH_BYTES = 1 << 20
# Cap on the paths `unpatched` lists (a wholly ignored directory is one line).
MAX_UNPATCHED = 200


class SandboxError(RuntimeError):
    """The sandbox infrastructure failed; the episode result is not a task outcome."""


class PatchTooLarge(SandboxError):
    """The working tree's patch exceeds the sandbox's cap: the step cannot be recorded
    (nor replayed), so the episode cannot go on; only cap + 1 bytes were read."""


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int  # -1 when the command was killed (timeout) before exiting
    output: str  # stdout and stderr interleaved, decoded with errors="replace"
    timed_out: bool = False
    truncated: bool = False  # output exceeded the cap and was cut


@dataclasses.dataclass(frozen=True)
class Source:
    """The repository a sandbox holds: a task's part of a sandbox's arguments
    (factory.sandbox_spec makes it from a task; each backend takes the fields it names
    in `SOURCE_KEYS`).

    repo_files: path -> text content, committed as the base commit of a new history.
    repo_dir: local: a directory to copy instead (of a git repository, only `base_commit`,
      default HEAD, and its history, checked out; any other directory is committed as it is).
    base_commit: the commit `patch()` diffs against and the tree starts at (not with
      repo_files: a new history).
    env_setup: shell run before every `run` command (an environment's activation).
    image: docker: the image; its `workdir` holds the repository unless repo_files is given.
    workdir: docker: the repository root inside the container (R2E-Gym, SWE-bench: /testbed).
    """

    repo_files: Mapping[str, str] | None = None
    repo_dir: str | None = None
    base_commit: str | None = None
    env_setup: str = ""
    image: str | None = None
    workdir: str = "/testbed"


def from_keywords(sandbox: type, keywords: Mapping[str, Any]) -> tuple[Source, Any]:
    """A backend's arguments given as keywords (a factory's defaults and a task's spec)
    -> (its Source, its options: `sandbox.Options`); TypeError naming any keyword the
    backend does not take."""
    accepted = sorted([*sandbox.SOURCE_KEYS,
                       *(f.name for f in dataclasses.fields(sandbox.Options))])
    unknown = sorted(set(keywords) - set(accepted))
    if unknown:
        raise TypeError(f"unknown keyword(s) {unknown}; {sandbox.__name__} accepts {accepted}")
    source = {k: v for k, v in keywords.items() if k in sandbox.SOURCE_KEYS}
    options = {k: v for k, v in keywords.items() if k not in sandbox.SOURCE_KEYS}
    return Source(**source), sandbox.Options(**options)


class Sandbox(abc.ABC):
    """One isolated working copy of a repository, for one episode."""

    @abc.abstractmethod
    def run(self, cmd: str, timeout: float = 60.0) -> ExecResult:
        """Runs `bash -c cmd` in the repository root; stderr is merged into stdout.

        Past `timeout` seconds every process of the command is killed and the result has
        `timed_out=True, exit_code=-1`; the sandbox stays usable. Processes the command
        leaves in the background are killed when it returns, so calls are independent.
        Output beyond the backend's cap keeps its head and tail (`truncated=True`).
        """

    @abc.abstractmethod
    def read_file(self, path: str, errors: str = "replace") -> str:
        """Reads a text file (relative to the repository root), decoded from UTF-8 with
        `errors` ("strict": UnicodeDecodeError for bytes that are not UTF-8).

        Raises FileNotFoundError if it is missing and ValueError for a path that is absolute
        or leaves the repository.
        """

    @abc.abstractmethod
    def write_file(self, path: str, content: str) -> None:
        """Writes a text file, creating parent directories. A symbolic link on the way is
        followed when it leads to a path inside the repository (the link stays a link);
        one leading out raises ValueError and nothing is written."""

    @abc.abstractmethod
    def patch(self) -> str:
        """The `git diff` of the working tree against the task's base commit
        (binary-safe, including untracked files). PatchTooLarge past the backend's cap."""

    def unpatched(self) -> list[str]:
        """The paths of the tree no patch carries (ignored files and directories, empty
        directories; shell.unpatched_paths), sorted, at most MAX_UNPATCHED: what a replay
        by patch cannot restore."""
        result = self.run(shell.unpatched_paths(MAX_UNPATCHED), timeout=60)
        if result.exit_code != 0:
            raise SandboxError(f"listing the paths a patch leaves out failed: {result.output}")
        return result.output.splitlines()

    def snapshot(self) -> tuple[str, list[str]]:
        """(patch(), unpatched()): what a step records of the tree, in one call where the
        sandbox is remote."""
        return self.patch(), self.unpatched()

    @abc.abstractmethod
    def apply_patch(self, patch: str) -> None:
        """Applies a patch produced by `patch()`; raises ValueError if it does not apply."""

    def real_root(self) -> str:
        """The repository root's path with every link resolved, as its commands see it."""
        return self.run("pwd -P", timeout=10).output.strip()

    @abc.abstractmethod
    def close(self) -> None:
        """Releases every resource (processes, containers, files). Idempotent."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
