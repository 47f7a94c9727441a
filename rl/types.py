"""Trajectory types shared by rollout, Prefix Sampling, SPO and the learner.

Token-in, token-out: the ids stored here are exactly the ids the engine consumed
and produced. A trajectory's token stream is `concat(turn.obs_ids + turn.action_ids
for turn in turns)`; only `action_ids` of non-replayed turns are ever trained.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

Status = Literal["finished", "max_steps", "truncated", "timeout", "env_error"]
STATUSES: tuple[str, ...] = ("finished", "max_steps", "truncated", "timeout", "env_error")


@dataclasses.dataclass
class Turn:
    """One agent step: the tokens fed before it, the action, and its effect.

    obs_ids: ids fed before this action (system/user prompt for the first turn,
      the tool response and the assistant header afterwards); never trained.
    action_ids / action_logprobs: generated ids and the sampler's log-probs of
      `log_softmax(logits / temperature)`, same length.
    tool_call: the parsed call ({"name": ..., "arguments": {...}}) or None when the
      action did not contain a valid call.
    observation: the text the environment answered with.
    patch: `git diff` of the repository against the base commit after this step.
    unpatched: the paths no patch carries after this step (ignored files, empty
      directories; env.sandbox Sandbox.unpatched), which a replay by patch cannot restore.
    replayed: copied from a prefix source; prefilled, never trained.
    policy_version: the oldest policy version that sampled the action (the engine's
      weight version where it reports one, else the agent's; None when scripted).
    """

    obs_ids: list[int]
    action_ids: list[int]
    action_logprobs: list[float]
    tool_call: dict[str, Any] | None = None
    observation: str = ""
    patch: str = ""
    unpatched: list[str] = dataclasses.field(default_factory=list)
    replayed: bool = False
    policy_version: int | None = None

    def __post_init__(self):
        if len(self.action_ids) != len(self.action_logprobs):
            raise ValueError(
                f"action_ids ({len(self.action_ids)}) and action_logprobs "
                f"({len(self.action_logprobs)}) differ in length")


@dataclasses.dataclass(frozen=True)
class PrefixInfo:
    """Where a prefix-task trajectory started: source trajectory uid, step k, kind."""

    source_uid: str
    k: int
    kind: Literal["too_hard", "too_easy"]


@dataclasses.dataclass
class Trajectory:
    task_id: str
    uid: str
    turns: list[Turn]
    reward: float | None = None  # 0/1; None when the episode could not be scored
    status: Status = "finished"
    prefix: PrefixInfo | None = None
    policy_version: int = 0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str = ""  # what went wrong, for env_error
    grade_cached: bool = False  # the reward is a kept grade of the same patch (GradeCache)
    seed: int = 0  # the rollout's seed (rl.rollout.RolloutJob.seed): which job it ran

    @property
    def num_steps(self) -> int:
        return len(self.turns)

    @property
    def is_env_error(self) -> bool:
        return self.status == "env_error"

    @property
    def is_scored(self) -> bool:
        """The episode ran and was graded: no env_error, and a reward. Only scored
        trajectories count in pass rates, advantages and value estimates."""
        return not self.is_env_error and self.reward is not None

    def token_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids[T], loss_mask[T], sampler_logprobs[T]) of the whole token stream.

        loss_mask is 1 exactly on generated ids of non-replayed turns; logprobs are
        0 where the mask is 0.
        """
        ids, mask, logp = [], [], []
        for turn in self.turns:
            ids += turn.obs_ids
            mask += [0] * len(turn.obs_ids)
            logp += [0.0] * len(turn.obs_ids)
            ids += turn.action_ids
            trained = 0 if turn.replayed else 1
            mask += [trained] * len(turn.action_ids)
            logp += turn.action_logprobs if trained else [0.0] * len(turn.action_ids)
        return (np.asarray(ids, np.int32), np.asarray(mask, np.int32),
                np.asarray(logp, np.float32))

    @property
    def versions(self) -> tuple[int, int]:
        """(oldest, newest) policy version that sampled this trajectory's own turns (a
        rollout that ran across weight updates spans several); the version it started
        under when no turn reports one."""
        own = [t.policy_version for t in self.turns
               if not t.replayed and t.policy_version is not None]
        return (min(own), max(own)) if own else (self.policy_version, self.policy_version)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t.action_ids) for t in self.turns if not t.replayed)

    @property
    def num_replayed_tokens(self) -> int:
        return sum(len(t.obs_ids) + len(t.action_ids) for t in self.turns if t.replayed)
