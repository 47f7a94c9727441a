"""The sandbox interface every backend implements.

A sandbox holds one checkout of a task's repository for one episode. All paths
given to `read_file` / `write_file` are relative to the repository root. Errors
of the infrastructure (container died, daemon unreachable) raise `SandboxError`:
callers turn them into the `env_error` status, never into reward 0.
"""

from __future__ import annotations

import abc
import dataclasses

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
