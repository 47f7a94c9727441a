"""The default's rollout phase on the embedded engine of an earlier commit and of this tree.

    python -m bench.engine_rollout [--old 630a893 | --old DIR] [--old-sandbox COMMIT|new]
        [--rounds 3] [--warmup 1] [--seed 0] [--ckpt WORKDIR] [--compilation_cache DIR]
        [--grade-cache 1|0]

Both engines serve the same model (the default config's tiny Qwen3, randomly
initialised from --seed, so turns run to their token budget rather than a learned
tool call; or, with --ckpt, the parameters and tokenizer of a run of the default, e.g.
its SFT warm start, whose turns are the policy's short tool calls) with the default's
engine options, to the same `Agent` and jobs: one RL step's rollout phase,
`batch_tasks` train tasks x `group_size` rollouts, as `train.py` collects it. The old
engine's code is read from git (`git show <old>:inference/embedded.py`, its
`sampling.py` and its `models/qwen3.py`, whose decode path and cache layout the engine
uses) and imported beside this tree's. The old engine's rollouts run in the local
sandboxes of --old-sandbox (default: the --old commit, so the old arm is the old
code's whole rollout phase; its env/sandbox/local.py, supervisor program and supervisor.py
imported as bench.env imports them), or in this tree's with `--old-sandbox new` (the
engines alone compared). Both arms run this tree's Agent, tools and grading, the old
arm without the grade cache (rollout.grade_cache=False), which the old commit lacks.
Each round runs the phase once per engine, the order alternating so machine load
affects both alike; the first --warmup rounds compile and are left out of the steady
figures (with train.py's compilation cache, a rerun compiles little for either engine).
tokens/s is generated tokens over the phase's wall time, as the per-step console line
counts it.

Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

import train
from bench.env import old_local_factory
from configs.common import load_config
from env import sandbox, splits
from env.config import EnvConfig
from env.sandbox.pool import SandboxPool
from inference.embedded import EmbeddedEngine, EmbeddedOptions
from models import loading, sharding
from rl import learner, sft
from rl.checkpoint import Checkpointer
from rl.metrics import rollout_metrics
from rl.rollout import Agent, RolloutConfig, RolloutJob, collect_groups


def _log(*args):
    print(*args, file=sys.stderr, flush=True)


# The old engine's modules, and its imports of them rewritten to the copies.
_OLD_MODULES = ("inference/embedded.py", "inference/sampling.py", "models/qwen3.py")
_OLD_IMPORTS = (("from inference.sampling import", "from .sampling import"),
                ("from models import qwen3", "from . import qwen3"))


def _old_source(old: str, path: str) -> str:
    if os.path.isdir(old):
        with open(os.path.join(old, os.path.basename(path))) as f:
            return f.read()
    return subprocess.run(["git", "show", f"{old}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def old_engine_class(old: str, root: str):
    """EmbeddedEngine of `old` (a commit, or a folder with copies of its embedded.py,
    sampling.py and qwen3.py: the model's cache layout belongs to the engine), imported
    as package `engine_old` under `root`."""
    package = os.path.join(root, "engine_old")
    os.makedirs(package, exist_ok=True)
    open(os.path.join(package, "__init__.py"), "w").close()
    for path in _OLD_MODULES:
        src = _old_source(old, path)
        for old_import, new_import in _OLD_IMPORTS:
            src = src.replace(old_import, new_import)
        with open(os.path.join(package, os.path.basename(path)), "w") as f:
            f.write(src)
    sys.path.insert(0, root)
    return (importlib.import_module("engine_old.embedded").EmbeddedEngine,
            importlib.import_module("engine_old.qwen3"))


def old_engine(cls, weights, options: EmbeddedOptions, seed: int):
    """`cls`, an older EmbeddedEngine, with the options it knows: its module's
    EmbeddedOptions, or keywords from before there was one (min_chunk_steps None then
    meant chunk_steps // 4, what 0 means now)."""
    module = sys.modules[cls.__module__]
    given = dataclasses.asdict(options)
    if hasattr(module, "EmbeddedOptions"):
        known = {f.name for f in dataclasses.fields(module.EmbeddedOptions)}
        return cls(weights, module.EmbeddedOptions(**{k: v for k, v in given.items()
                                                      if k in known}), seed=seed)
    kwargs = {k: v for k, v in given.items() if k in cls.__init__.__code__.co_varnames}
    if kwargs.get("min_chunk_steps") == 0:
        kwargs["min_chunk_steps"] = None
    return cls(weights, seed=seed, **kwargs)


def old_model_weights(model, old_qwen3):
    """(graphdef, params) of `old_qwen3`'s Qwen3 holding `model`'s parameters: the
    config's fields it knows, and stacked [num_layers, ...] layer leaves given to its
    per-layer modules when its layers are a list."""
    cfg = model.cfg
    fields = {f.name for f in dataclasses.fields(old_qwen3.Qwen3Config)}
    old = old_qwen3.Qwen3(old_qwen3.Qwen3Config(**{
        k: v for k, v in dataclasses.asdict(cfg).items() if k in fields}), rngs=nnx.Rngs(0))
    new_params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    graphdef, params = nnx.split(old, nnx.Param)
    flat = []
    for path, var in nnx.to_flat_state(params):
        if path in new_params:
            value = new_params[path][...]
        else:  # ("layers", i, ...) of a list <- ("layers", ...)[i] of stacked leaves
            value = new_params[(path[0], *path[2:])][...][path[1]]
        flat.append((path, var.replace(value)))
    return graphdef, nnx.from_flat_state(flat)


async def rollout_phase(agent: Agent, jobs, group_size: int) -> dict:
    t0 = time.perf_counter()
    groups = await collect_groups(agent, jobs, group_size)
    wall = time.perf_counter() - t0
    trajs = [t for g in groups for t in g]
    tokens = sum(t.num_generated_tokens for t in trajs)
    m = rollout_metrics(trajs, groups)
    return {"rollout_s": round(wall, 2), "generated_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1),
            "env_errors": int(m["rollout/env_errors"]),
            "grades_cached": int(m["rollout/grades_cached"]),
            "first_env_error": next((t.error for t in trajs if t.is_env_error), None),
            "env_share": round(m["time/env_s_sum"] / max(
                m["time/env_s_sum"] + m["time/generate_s_sum"], 1e-9), 3)}


def restore_params(model, config, mesh, run_dir: str) -> int:
    """Loads the parameters of the latest checkpoint of the run in `run_dir` into
    `model`; returns its step."""
    _, abstract = learner.abstract_train_state(
        model, learner.LearnerConfig.from_section(config.learner), mesh)
    step, state, _ = Checkpointer(run_dir).restore_latest(abstract, set_aside=False)
    nnx.update(model, state.params)
    return step


async def run(args) -> dict:
    config = load_config("configs/default.py:planted")
    batch_tasks = args.tasks or config.batch_tasks
    group_size = args.group_size or config.group_size
    env_cfg = EnvConfig.from_section(config.env)
    train_tasks, _ = splits.splits(env_cfg)
    workdir = tempfile.mkdtemp(prefix="engine_rollout_")
    tokenizer = sft.build_tokenizer(sft.TokenizerConfig(**config.tokenizer), args.ckpt or workdir,
                                    train_tasks)
    model_cfg = loading.model_config(config.model, tokenizer.vocab_size)
    mesh = sharding.make_mesh(**config.mesh)
    model = loading.build_model(config.model, model_cfg, mesh, args.seed)
    if args.ckpt:
        restore_params(model, config, mesh, args.ckpt)
    weights = nnx.split(model, nnx.Param)
    options = dataclasses.replace(EmbeddedOptions.from_section(config.engine),
                                  **{k: int(v) for k, v in (o.split("=") for o in args.option)})
    old_cls, old_qwen3 = old_engine_class(args.old, workdir)
    engines = {"old": old_engine(old_cls, old_model_weights(model, old_qwen3), options,
                                 args.seed),
               "new": EmbeddedEngine(weights, options, seed=args.seed)}
    factory = sandbox.from_config(env_cfg)
    old_sandbox = args.old_sandbox or ("new" if os.path.isdir(args.old) else args.old)
    factories = {"old": factory if old_sandbox == "new" else old_local_factory(
        old_sandbox, workdir), "new": factory}
    # The old commit graded every episode; this tree grades a patch once (GradeCache).
    rollout_cfgs = {name: RolloutConfig(**{**config.rollout, "grade_cache": cached})
                    for name, cached in (("old", False), ("new", bool(args.grade_cache)))}
    agents = {name: Agent(engine, tokenizer,
                          SandboxPool(factories[name], config.env.max_concurrent),
                          rollout_cfgs[name], tools_in_prompt=config.env.tools_in_prompt)
              for name, engine in engines.items()}
    rng = np.random.default_rng(args.seed)
    rounds = []
    for r in range(args.rounds):
        picks = rng.choice(len(train_tasks), batch_tasks, replace=False)
        jobs = [RolloutJob(train_tasks[i], seed=int(rng.integers(2**31))) for i in picks]
        order = list(agents) if r % 2 == 0 else list(agents)[::-1]
        row = {}
        for name in order:
            row[name] = await rollout_phase(agents[name], jobs, group_size)
            _log(f"round {r} {name}: {row[name]}")
        rounds.append(row)
    for engine in engines.values():
        await engine.aclose()
    steady = rounds[args.warmup:] or rounds
    tps = {name: float(np.mean([row[name]["tokens_per_s"] for row in steady]))
           for name in engines}
    old, new = tps["old"], tps["new"]
    errors = sum(row[name]["env_errors"] for row in rounds for name in row)
    if errors:  # a phase whose episodes failed generated other tokens: no comparison
        _log(f"{errors} rollouts ended in env_error; the speedup is not reported")
    return {"old_commit": args.old, "old_sandbox": old_sandbox,
            "new_grade_cache": bool(args.grade_cache), "checkpoint": args.ckpt or None,
            "engine_options": options,
            "model_params": sum(x.size for x in jax.tree.leaves(weights[1])),
            "phase": f"{batch_tasks} tasks x {group_size} rollouts",
            "rounds": rounds, "steady_tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "env_errors": errors, "speedup": None if errors else round(new / old, 2),
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", default="630a893",
                   help="the old engine: a commit, or a folder with its embedded.py, "
                        "sampling.py and qwen3.py")
    p.add_argument("--old-sandbox", default="",
                   help="the old arm's local sandboxes: a commit, or 'new' for this tree's "
                        "(default: the --old commit; this tree's when --old is a folder)")
    p.add_argument("--rounds", type=int, default=3, help="phases per engine")
    p.add_argument("--warmup", type=int, default=1,
                   help="first rounds left out of the steady figures (they compile)")
    p.add_argument("--compilation_cache", default=train.COMPILATION_CACHE,
                   help="persistent XLA cache, as train.py keeps it ('' off): a rerun "
                        "compiles nothing either engine compiled before")
    p.add_argument("--grade-cache", type=int, default=1,
                   help="this tree's arm grades a patch once (1, the default's) or every "
                        "episode (0: the grade cache's share of the speed-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default="",
                   help="a run directory of the default (its latest checkpoint and tokenizer)")
    p.add_argument("--option", action="append", default=[],
                   help="KEY=VALUE engine option over the config's (both engines, where known)")
    p.add_argument("--tasks", type=int, default=0, help="tasks per phase (0: the default's)")
    p.add_argument("--group-size", type=int, default=0, help="rollouts per task (0: the default's)")
    args = p.parse_args(argv)
    train.compilation_cache(args.compilation_cache)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
