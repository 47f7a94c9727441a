"""The task part of the `env` config section: the run's training and held-out tasks.

`env.tasks` is "miniswe" (tasks generated from `task_seed` / `eval_seed`, the held-out
ones minus any statement the training tasks share) or "train.jsonl|eval.jsonl"
(env.tasks.load_tasks rows), cut to `train_tasks` / `eval_tasks` when those are set.
"""

from __future__ import annotations

import os
from typing import Any

from env import miniswe
from env.config import EnvConfig
from env.swebench import SWEBENCH_IMAGE_TEMPLATE
from env.tasks import Task, load_tasks


def splits(env_cfg: EnvConfig) -> tuple[list[Task], list[Task]]:
    """(train, held-out eval) tasks: generated mini-SWE, or JSONL files `train|eval`."""
    if env_cfg.tasks == "miniswe":
        diffs = tuple(env_cfg.difficulties)
        train = miniswe.generate_tasks(env_cfg.train_tasks, env_cfg.task_seed, diffs)
        held_out = miniswe.generate_tasks(env_cfg.eval_tasks, env_cfg.eval_seed, diffs)
        seen = {t.problem_statement for t in train}
        held_out = [t for t in held_out if t.problem_statement not in seen]
        return train, held_out
    train_path, _, eval_path = env_cfg.tasks.partition("|")
    template = image_template(env_cfg)
    train = load_tasks(train_path, template)
    held_out = load_tasks(eval_path, template) if eval_path else []
    if env_cfg.train_tasks:
        train = train[:env_cfg.train_tasks]
    if env_cfg.eval_tasks:
        held_out = held_out[:env_cfg.eval_tasks]
    if env_cfg.image:
        for t in (*train, *held_out):
            t.image = t.image or env_cfg.image
    return train, held_out


def image_template(env_cfg: EnvConfig) -> str:
    """`env.image_template` ("": the SWE-bench convention)."""
    return env_cfg.image_template or SWEBENCH_IMAGE_TEMPLATE


def task_images(env_cfg: EnvConfig) -> dict[str, Any]:
    """For the dry run: per task file, instance id -> the image its sandbox will use."""
    if env_cfg.tasks == "miniswe":
        return {}
    return {path: {t.instance_id: t.image or env_cfg.image
                   for t in load_tasks(path, image_template(env_cfg))}
            if os.path.exists(path) else "file not found"
            for path in filter(None, env_cfg.tasks.split("|"))}
