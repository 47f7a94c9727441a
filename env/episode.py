"""One agent episode on one task: tool steps, a patch after every step, the reward.

An episode's history is a list of `StepRecord(tool_call, observation, patch)`;
`restore` rebuilds the state after step k of such a history in a fresh sandbox
(Prefix Sampling replay, DESIGN section 4): by applying the recorded patch of step
k, or with `reexec=True` by re-running the k calls and reporting every observation
that came out differently.

The reward grades the episode's final patch in a new sandbox of the task by default
(`grading="fresh"`, env.grading.grade_patch), so that nothing the agent left outside
its patch reaches it; `grading="in_place"` grades the episode's own sandbox.

Infrastructure failures (`SandboxError`), and any other exception out of the sandbox
or the tools (a bad task row, a bug), end the episode with status `env_error` and no
reward, the exception in `error`; they are never a reward of 0. A malformed tool call
is the model's own mistake: an observation, not an error.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from env.grading import GRADINGS, GradeCache, SandboxOpener, grade, grade_patch
from env.sandbox import SandboxFactory
from env.sandbox.base import Sandbox, SandboxError
from env.tasks import Task
from env.tools import ToolBox, ToolCallError, parse_tool_call


@dataclasses.dataclass
class StepRecord:
    """One step: the parsed call (None when the action did not parse), the observation,
    the `git diff` after the step, the raw action text when one was given, and the paths
    of the tree after the step that no patch carries (Sandbox.unpatched)."""

    tool_call: dict[str, Any] | None
    observation: str
    patch: str
    action: str = ""
    unpatched: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """What a replay could not reproduce at one step. what: "observation" or "patch" (a
    re-executed step's differs from the recorded one), or "unpatched" (after step k, paths
    no patch carries, e.g. an ignored *.pyc or an empty directory: `recorded` lists those
    of the source the replay lacks, `replayed` those it has that the source had not, one
    a line)."""

    step: int  # 1-based
    recorded: str
    replayed: str
    what: str = "observation"


@dataclasses.dataclass(frozen=True)
class EpisodeOptions:
    """An episode's budget and grading (Episode).

    max_steps: tool calls before the episode ends as "max_steps". test_timeout: seconds
    the grading tests may take. prompt_template: the first observation, formatted with
    the task's `problem_statement`. grading: "fresh" or "in_place" (Episode). tools:
    keyword arguments of the episode's env.tools.ToolBox (e.g. bash_timeout).
    """

    max_steps: int = 30
    test_timeout: float = 300.0
    prompt_template: str = "{problem_statement}"
    grading: str = "fresh"
    tools: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Episode:
    """Steps tool calls through one sandbox of one task, within `options` (EpisodeOptions).

    status: "running", then one of "finished" (finish called), "max_steps",
    "env_error" (the sandbox failed; `error` says how; reward is None).
    grading: "fresh" (default): `reward()` closes the episode's sandbox and grades its
    final patch in a new one from `grader` (default: the sandbox factory), as the
    official harness does (env.grading.grade_patch); "in_place": in the episode's own
    sandbox, whose state outside the patch (site-packages, home directory, ignored
    files) then reaches the grade: faster, and open to reward hacking.
    grades: a GradeCache shared by the episodes of a run (None: every episode runs its
    tests), for fresh grading only; `grade_cached` says whether the reward came from it.
    call_delay: called with the step's index before the environment answers each action
      (e.g. env.latency.LatencyModel.sleep: a slow environment reproduced); None: none.
    """

    def __init__(self, sandbox_factory: SandboxFactory | Sandbox, task: Task | None = None,
                 options: EpisodeOptions = EpisodeOptions(), *,
                 grades: GradeCache | None = None,
                 call_delay: Callable[[int], None] | None = None,
                 grader: SandboxOpener | None = None):
        grading = options.grading
        if grading not in GRADINGS:
            raise ValueError(f"grading must be one of {GRADINGS}, got {grading!r}")
        if grader is None and not isinstance(sandbox_factory, Sandbox):
            grader = sandbox_factory
        if grading == "fresh" and grader is None:
            raise ValueError("fresh grading opens a new sandbox: give a sandbox factory, or "
                             "grader= with one sandbox (or grading='in_place')")
        self._factory = sandbox_factory
        self.call_delay = call_delay
        self._grader = grader
        self.grades = grades if grading == "fresh" else None
        self.grade_cached = False
        self.task = task
        self.options = options
        self.sandbox: Sandbox | None = None
        self.tools: ToolBox | None = None
        self.steps: list[StepRecord] = []
        self.status = "running"
        self.error = ""
        self.test_output = ""
        self._reward: float | None = None
        self._graded = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def reset(self, task: Task | None = None) -> str:
        """Opens a fresh sandbox for `task`; returns the first observation (the prompt)."""
        self.close()
        self.task = task or self.task
        if self.task is None:
            raise ValueError("Episode.reset needs a task")
        self.steps, self.status, self.error, self.test_output = [], "running", "", ""
        self._reward, self._graded, self.grade_cached = None, False, False
        if isinstance(self._factory, Sandbox):
            self.sandbox, self._factory = self._factory, None
        elif self._factory is None:
            raise ValueError("this Episode was given one sandbox, which is already used")
        else:
            try:
                self.sandbox = self._factory(self.task)
            except Exception as e:  # noqa: BLE001 - a bad task row or a failed engine alike
                self._fail(e)
        if self.sandbox is not None:
            self.tools = ToolBox(self.sandbox, repo_root=self.task.workdir, **self.options.tools)
        return self.options.prompt_template.format(problem_statement=self.task.problem_statement,
                                           workdir=self.task.workdir)

    def close(self) -> None:
        if self.sandbox is not None:
            try:
                self.sandbox.close()
            finally:
                self.sandbox = None

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def done(self) -> bool:
        return self.status != "running"

    def _fail(self, error: Exception) -> None:
        self.status, self.error = "env_error", f"{type(error).__name__}: {error}"

    # ---- steps -------------------------------------------------------------------------------

    def step(self, action: str | dict[str, Any]) -> tuple[str, bool]:
        """Executes one action (assistant text or a parsed call): (observation, done)."""
        if self.done:
            raise RuntimeError(f"step() on an episode that is already {self.status}")
        if self.tools is None:
            raise RuntimeError("step() before reset()")
        text = action if isinstance(action, str) else ""
        changed = False
        try:
            call = parse_tool_call(action) if isinstance(action, str) else action
        except ToolCallError as e:
            call, observation, finished = None, str(e), False
        try:
            if self.call_delay is not None:
                self.call_delay(len(self.steps))
            if call is not None:
                result = self.tools.execute(call)
                observation, finished, changed = result.observation, result.done, result.changed
            # Read-only calls (view, search, finish, rejected calls) keep the last patch.
            if changed or not self.steps:
                patch, unpatched = self.sandbox.snapshot()
            else:
                patch, unpatched = self.steps[-1].patch, self.steps[-1].unpatched
        except Exception as e:  # noqa: BLE001 - whatever broke, it is no task outcome
            self._fail(e)
            return f"ERROR: the environment failed: {self.error}", True
        self.steps.append(StepRecord(call, observation, patch, text, unpatched))
        self.status = "finished" if finished else self._budget_status()
        return observation, self.done

    def _budget_status(self) -> str:
        return "max_steps" if len(self.steps) >= self.options.max_steps else "running"

    def play(self, actions) -> None:
        """Steps through `actions` (a scripted episode: a demonstration's calls) until they
        run out or the episode is done."""
        for action in actions:
            if self.done:
                return
            self.step(action)

    # ---- reward ------------------------------------------------------------------------------

    def reward(self) -> float | None:
        """Grades the task's tests once (env.grading): 1.0 or 0.0; None on env_error,
        which a run in which the tests never ran also is. Fresh grading closes the
        episode's sandbox first."""
        if not self._graded and self.status != "env_error":
            if self.sandbox is None and self.options.grading == "in_place":
                raise RuntimeError("in-place grading needs an open sandbox (before close())")
            try:
                result = self._grade()
                self._reward, self.test_output = result.reward, result.output
                if result.error:  # the tests never ran: no task outcome
                    self.status, self.error = "env_error", result.error
            except Exception as e:  # noqa: BLE001 - an unscored episode, never reward 0
                self._fail(e)
            self._graded = True
        return None if self.status == "env_error" else self._reward

    def _grade(self):
        if self.options.grading == "in_place":
            return grade(self.task, self.sandbox, self.options.test_timeout)
        # The patch after the last step is the tree's (read-only steps keep the last one);
        # it is all the grader sees.
        patch = self.steps[-1].patch if self.steps else ""
        self.close()

        def run():
            return grade_patch(self.task, patch, self._grader, self.options.test_timeout)

        if self.grades is None:
            return run()
        result, self.grade_cached = self.grades.grade(self.task, patch, run)
        return result


# ---- replay ----------------------------------------------------------------------------------

_ELAPSED = re.compile(r"\b\d+(?:\.\d+)?s\b")


def same_observation(a: str, b: str) -> bool:
    """Equal up to elapsed-time figures ("Ran 5 tests in 0.001s"), which no replay repeats."""
    return a == b or _ELAPSED.sub("<t>s", a) == _ELAPSED.sub("<t>s", b)



def unpatched_mismatch(k: int, recorded: list[str], replayed: list[str]) -> list[Mismatch]:
    """[Mismatch "unpatched"] where the paths no patch carries differ after step k."""
    lacking, extra = sorted(set(recorded) - set(replayed)), sorted(set(replayed) - set(recorded))
    if not (lacking or extra):
        return []
    return [Mismatch(k, "\n".join(lacking), "\n".join(extra), "unpatched")]


def restore(task: Task, source_steps: list[StepRecord], k: int,
            sandbox_factory: SandboxFactory, *, reexec: bool = False,
            **episode_kwargs: Any) -> tuple[Episode, list[Mismatch]]:
    """An Episode in the state after step k (1 <= k <= len(source_steps)) of a source.

    Default: a fresh sandbox with step k's recorded patch applied; the episode's
    history is the source's first k records (the step counter and budget continue
    from k). reexec=True instead re-executes the k calls and returns the steps whose
    observation (`same_observation`) or patch differs from the recorded one; the history
    is then the re-executed one. Either way, what no patch carries (ignored files, empty
    directories) and differs from the source after step k is returned as a Mismatch
    "unpatched": replay by patch cannot restore it. Raises SandboxError on infrastructure
    failure and ValueError when the recorded patch does not apply.
    """
    if not 1 <= k <= len(source_steps):
        raise ValueError(f"k={k} is outside [1, {len(source_steps)}]")
    episode = Episode(sandbox_factory, task, **episode_kwargs)
    episode.reset()
    if episode.status == "env_error":
        raise SandboxError(episode.error)
    mismatches: list[Mismatch] = []
    try:
        if reexec:
            for i, record in enumerate(source_steps[:k], 1):
                action = record.tool_call if record.tool_call is not None else record.action
                observation, _ = episode.step(action)
                if episode.status == "env_error":
                    raise SandboxError(episode.error)
                if not same_observation(observation, record.observation):
                    mismatches.append(Mismatch(i, record.observation, observation))
                if episode.steps[-1].patch != record.patch:
                    mismatches.append(Mismatch(i, record.patch, episode.steps[-1].patch, "patch"))
        else:
            if source_steps[k - 1].patch:
                episode.sandbox.apply_patch(source_steps[k - 1].patch)
            episode.steps = [dataclasses.replace(r) for r in source_steps[:k]]
        replayed = episode.steps[-1].unpatched if reexec else episode.sandbox.unpatched()
        mismatches += unpatched_mismatch(k, source_steps[k - 1].unpatched, replayed)
        episode.status = episode._budget_status()
    except BaseException:
        episode.close()
        raise
    return episode, mismatches
