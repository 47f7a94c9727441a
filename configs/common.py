"""Config conventions shared by every file in `configs/`.

Each config file defines `get_config(arg=None) -> ConfigDict` (big_vision style)
and `OPTIONS`, the defaults of its options. `arg` is the text after the colon in
`--config configs/default.py:smoke,seed=3`; `parse_arg` turns it into a ConfigDict
of typed options, each replacing only its own default. Config files import only
ml_collections and `configs` modules, so reading one imports no JAX. Configs are
returned locked: setting a key that does not exist raises an error naming the key,
so a typo in a sweep or on the command line never passes silently. A key derived
from another is a reference to it (`get_ref`), so an override moves both. Every
numeric key has an allowed range in `RANGES` and every key that names one of a few
choices its allowed values in `CHOICES`, both checked by `check_values`: the one home of
ranges and choices (a section's combinations are its owner's checks, combinations
across sections train.py's).
"""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Iterable, Iterator
from typing import Any

import ml_collections

ConfigDict = ml_collections.ConfigDict


def parse_arg(arg: str | None, **defaults: Any) -> ConfigDict:
    """Parses `"smoke,seed=3,name=x"` into a ConfigDict over `defaults`.

    A bare word sets a boolean default to True. Values are converted to the type
    of the default; an option that is not in `defaults` is an error naming it.
    """
    out = ConfigDict(dict(defaults))
    if not arg:
        return out
    for item in arg.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, raw = item.partition("=")
        if key not in defaults:
            raise KeyError(f"unknown config option {key!r}; known: {sorted(defaults)}")
        if not eq:
            if not isinstance(defaults[key], bool):
                raise ValueError(f"config option {key!r} needs a value ({key}=...)")
            out[key] = True
            continue
        out[key] = _convert(raw, defaults[key], key)
    return out


def _convert(raw: str, default: Any, key: str) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"config option {key!r} expects a boolean, got {raw!r}")
    if isinstance(default, str) or default is None:
        return raw
    try:
        return type(default)(ast.literal_eval(raw))
    except (ValueError, SyntaxError) as e:
        expected = type(default).__name__
        raise ValueError(f"config option {key!r} expects {expected}, got {raw!r}") from e


def lock(config: ConfigDict) -> ConfigDict:
    """Locks the config so unknown keys raise (ml_collections names the key)."""
    config.lock()
    return config


def apply_overrides(config: ConfigDict, overrides: dict[str, Any]) -> ConfigDict:
    """Sets dotted keys (`"rl.lr": 1e-6`); an unknown key raises naming it."""
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for p in parents:
            if p not in node:
                raise KeyError(f"unknown config key {dotted!r} (no {p!r})")
            node = node[p]
        if leaf not in node:
            raise KeyError(f"unknown config key {dotted!r}")
        node[leaf] = value
    return config


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`["learner.optim.lr=1e-4", "env.backend=docker"]` -> {dotted key: value}; a value
    is a Python literal where it parses as one, else the string."""
    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"override {item!r} is not KEY=VALUE")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def load_config(spec: str) -> ConfigDict:
    """Loads `path/to/file.py[:arg]` by calling its `get_config(arg)`."""
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    if not os.path.isfile(path) or not path.endswith(".py"):
        raise ValueError(f"config {path!r} is not a Python file: give a file of configs/ "
                         f"that defines get_config, e.g. configs/default.py")
    name = "config_" + os.path.splitext(os.path.basename(path))[0]
    spec_ = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"config file {path!r} defines no get_config(arg) function")
    return module.get_config(arg or None)


# ------------------------------------------------------------------ shared sections

# rollout.grading: "fresh" grades each episode's final patch in a new sandbox of the task
# at its base commit, as the official harness does; "in_place" grades the episode's own
# sandbox (one sandbox less per episode, but what the agent left outside its patch, e.g.
# a .pth file in site-packages, reaches the reward). env.episode.Episode.
GRADING = "fresh"
# The system message of every conversation (rollout.system_prompt).
SYSTEM_PROMPT = (
    "You are a programming agent. Fix the issue in the repository by calling tools. "
    "Call exactly one tool per turn. Call finish when the tests pass.")


def sandbox_defaults() -> dict[str, Any]:
    """The sandbox keys of the `env` section.

    placement: "local": sandboxes on this machine (its $DOCKER_HOST engine, or local
      namespaces); "ray": each on a node of a Ray cluster with a free `sandbox_slot`,
      run against that node's own engine (env.sandbox.cluster).
    ray_address: the Ray cluster for placement "ray" ("auto": the one `ray start`
      joined this host to; "": a single-node Ray here with env.max_concurrent slots).
    local_allow_unisolated: let the local backend run commands unisolated (with the
      trainer's rights) where it cannot isolate them (no root, no namespaces); by
      default it refuses to start there.
    local_read_only: host paths an isolated local sandbox sees, read-only, besides the
      toolchain (/usr and the links into it): e.g. an environment its tasks' env_setup
      activates. Nothing else of the host is there to read.
    """
    return dict(placement="local", ray_address="auto", local_allow_unisolated=False,
                local_read_only=())


def staleness_defaults() -> dict[str, Any]:
    """The `rollout` keys of rollouts that run ahead of the learner (rl.rollout.StreamCollector).

    max_staleness: policy versions a trajectory may lag the learner's; 0 is the
      synchronous loop (a step collects its batch, then learns). k > 0: k + 1 batches of
      rollouts are in flight, and a step trains on the first groups to finish while the
      rest run on under the new weights (partial rollouts). For algo='spo', 0 keeps the
      stream unbounded (spo.in_flight rollouts in flight, whatever their age).
    stale: a group older than the bound is "drop"ped (and its job run again) or
      "finish"ed (trained on all the same); both counted (async/*_stale).
    """
    return dict(max_staleness=0, stale="drop")


def latency_defaults() -> dict[str, Any]:
    """The `env.latency` section: a sleep before each tool call (env.latency), to reproduce
    a slow environment's long tail on a laptop; median_s 0 (the default) is off.

    median_s, sigma: the log-normal delay of a call (median, spread of its log).
    slow_share, slow_factor: a share of tasks whose every call is slow_factor times
      slower (drawn per task from the run's seed).
    """
    return dict(median_s=0.0, sigma=1.0, slow_share=0.0, slow_factor=6.0)


def engine_defaults() -> ConfigDict:
    """The `engine` section: which sampler serves rollouts, and the embedded one's shape
    (inference.embedded.EmbeddedOptions; the `sglang` subsection is the other kind's).

    kind: "embedded" (the JAX sampler in this process, on the learner's weights) or
      "sglang" (a client of SGLang-protocol servers: engine.sglang).
    max_batch: most requests generating at once (more wait for a free slot); 0 with
      "sglang": no cap of the client's own.
    max_len: longest prompt + max_new_tokens; the length of a slot.
    min_batch, min_len: smallest row-count / prompt-length buckets (fewer shapes to
      compile).
    min_cache_len: smallest attention window (fewer shapes to compile, more positions
      read per decode step).
    prefix_cache_tokens: positions of keys/values kept parked for prompt reuse (0: no
      cache); the pool has room for them in whole slots beside the max_batch working ones.
    chunk_steps: most decode steps per device call; requests that arrive meanwhile wait
      at most this many steps (a finished row ends the call sooner).
    min_chunk_steps: fewest decode steps per call unless every row finished (0:
      chunk_steps // 4): when turns are short, rows finish nearly every step, and a call
      per finished row would spend more on reading the rows' caches than on the steps.
    """
    return ConfigDict(dict(kind="embedded", max_batch=64, max_len=1024, min_batch=8,
                           min_len=64, min_cache_len=256, prefix_cache_tokens=262_144,
                           chunk_steps=32, min_chunk_steps=0, sglang=sglang_defaults()))


def sglang_defaults() -> dict[str, Any]:
    """The `engine.sglang` section: client of running servers, or servers to launch.

    urls: servers already running (on other hosts; the learner keeps every local GPU).
      When empty and `launch` is true, one server per entry of `ports` is started
      (see inference.launcher.SGLangLauncher) on the last len(ports) * tp_size of the
      host's `host_gpus` GPUs, and the learner's JAX devices are the rest
      (inference.launcher.placement); they are torn down at exit.
    command / python / env / extra_args: the launch command template (default
      `{python} -m sglang.launch_server ...`), its interpreter (default this one),
      "KEY=VALUE" environment entries and extra flags.
    timeout_s / max_retries / backoff_s / down_s: seconds for one HTTP call (a whole
      generation), extra attempts after the first, seconds before the first retry
      (doubling each retry), and how long a failing server is skipped.
    context_length: SGLang --context-length; 0 takes rollout.max_context.
    deterministic: launch with --enable-deterministic-inference and send request seeds
      (servers must be SGLang >= 0.5.3 with that flag); False samples unseeded.
    sync_mode: how a weight update quiesces a server: "pause" (pause_generation,
      reload, continue), "abort" (abort in-flight requests, continue them after the
      reload) or "drain" (wait for in-flight requests to finish).
    on_restart: a server that answers with an older weight version than was loaded
      into it (it restarted on its launch weights) is reloaded before it serves again;
      the request it answered is sent again ("reload") or fails its episode as an
      env_error ("drop").
    export_dir / export_dtype / export_keep: where weights are written as HF
      safetensors for /update_weights_from_disk, in which dtype (the servers'), and how
      many of the newest exports stay on disk.
    router: "": the client sends each episode's turns to one server itself (least
      loaded for a new episode); "start": the run starts SGLang's gateway `smg` over
      the servers (inference.gateway); an http:// URL: a gateway already running over
      them. Generation goes through the gateway, routed by episode id (every turn on
      one server); pauses and reloads go to each server directly.
    """
    return dict(urls=(), launch=False, ports=(30000,), host="127.0.0.1", tp_size=1,
                mem_fraction_static=0.85, extra_args=(), timeout_s=600.0, max_retries=5,
                backoff_s=0.5, down_s=30.0,
                export_dir="", health_timeout_s=900.0, host_gpus=8, command="", python="",
                env=(), context_length=0, deterministic=True, sync_mode="pause",
                on_restart="reload", export_dtype="bfloat16", export_keep=1, router="")


def prefix_defaults(enabled: bool = True, adaptive: bool = False) -> ConfigDict:
    """The `ps` section (seed 000 values), rl.prefix.PrefixConfig; see rl.prefix.

    enabled: Prefix Sampling on (algo='grpo'); off, GRPO with rejection sampling alone.
    low, high: pass-rate thresholds of the five classes.
    remaining_ratio: too_hard share of the successful source's steps left to the model.
    prefix_ratio: too_easy share of the failing source's steps replayed.
    remaining_cap, prefix_cap: step caps of the two modes; 0 = uncapped (the seed names
      the caps but gives no values).
    max_share: at most floor(max_share * batch_size) queued prefix tasks per batch.
    max_age: a queued task created at step s may run up to step s + max_age, then expires.
    reprefix: prefix tasks that are still skewed may become prefix sources themselves.
    adaptive: the EMA controller moves the two ratios (seed: on in the 32B recipe).
    ema_alpha, ema_init, target, band, step_size, cooldown, ratio_min, ratio_max: the
      controller, rl.prefix.AdaptiveController (ema_init 0.5 starts the EMA at the set
      point; None takes the first observation).
    replay: how a prefix task's code state is restored: "patch" (apply the source's diff
      after step k; fast) or "reexec" (re-run its k tool calls, logging observations that
      differ from the recorded ones); a prefix that cannot be restored is an env_error.
    revisit: a control: skewed tasks re-run from the start (k = 0, no prefix).
    """
    return ConfigDict(dict(
        enabled=enabled, low=0.3, high=0.7, remaining_ratio=0.25, prefix_ratio=0.25,
        remaining_cap=0, prefix_cap=0, max_share=0.5, max_age=2, reprefix=False,
        adaptive=adaptive, ema_alpha=0.05, ema_init=0.5, target=0.5, band=0.03,
        step_size=0.05, cooldown=5, ratio_min=0.05, ratio_max=0.95, replay="patch",
        revisit=False))


def spo_defaults() -> ConfigDict:
    """The `spo` section (seed 002 values), rl.tracker.SPOConfig. See rl.tracker for the
    maths.

    rho_type: "kl" (rho = clip(2 ** (-D / d_half), rho_min, rho_max), D the policy's
      drift since the prompt's last visit) or "constant" (rho = rho_min, whose
      stationary evidence 1 / (1 - rho) equals the offline N0).
    prior: Beta(alpha, beta) of a prompt with no offline value.
    sampler_eps: added to every prompt's weight sqrt(v (1 - v)) (Eq. 11).
    in_flight: rollouts kept running at once by the single-stream collector (more
      than batch_tasks; the surplus carries over to the next step); over several
      processes, each keeps its share of them.
    pool_size: candidate prompts, the first pool_size training tasks (0 = all).
    init_samples: n0 offline rollouts per pool prompt with the initial policy before RL
      (0 = none); init_values: or a JSONL file of {"task_id", "successes", "n"}.
    init_form: "reference" (alpha0 = N0 (s+0.5)/(n0+1), the official code's and the
      default) or "paper" (Eq. 6).
    adv_std_ddof: 1, torch's unbiased std (the official code's), or 0.
    Choices where the official code differs (rl.tracker has both): duplicates
      ("sequential"; official "last"), prior and unseen ((1, 1) and "draw"; official
      (0.5, 0.5) and "skip": prompts without an offline value are never drawn),
      drift_tokens ("generated": D averages over the tokens the policy generated;
      official "response": over every token after the prompt, tool outputs included,
      as verl's compute_response_mask).
    """
    return ConfigDict(dict(
        rho_type="kl", d_half=0.06, rho_min=0.875, rho_max=0.96, prior=(1.0, 1.0),
        sampler_eps=0.05, pool_size=0, in_flight=96, init_samples=0, init_values="",
        init_form="reference", duplicates="sequential", adv_std_ddof=1, unseen="draw",
        drift_tokens="generated"))


def learner_defaults() -> ConfigDict:
    """The `learner` section (rl.learner reads it): optimizer, loss and batching.

    `temperature` and `seed` are derived keys: config files make them references to
    `rollout.temperature` and the top-level `seed` (`ConfigDict.get_ref`), so an
    override of either side is seen by both, and `check_values` refuses a config
    where they differ.
    """
    c = ConfigDict()
    c.num_minibatches = 1     # optimizer updates per train_step (rows split evenly)
    c.num_microbatches = 1    # gradient-accumulation chunks per mini-batch
    c.rows_multiple = 1       # a packed batch's rows are padded to a multiple of this: each
                              # new row count compiles the train step anew
    c.temperature = 1.0       # log-probs of log_softmax(logits / T): the sampler's T
    c.logprob_impl = None     # kernels.logprob implementation; None picks per backend
    c.seed = 0
    c.optim = ConfigDict(dict(
        lr=1e-6,
        warmup_steps=0,       # linear warmup from 0 over this many optimizer updates
        schedule="constant",  # after warmup: "constant" or "cosine"
        decay_steps=0,        # cosine: updates from the end of warmup to the final lr
        end_lr_frac=0.0,      # cosine: final lr as a fraction of lr
        b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01,
        max_grad_norm=1.0,    # global-norm clipping; 0 = off
    ))
    c.loss = ConfigDict(dict(
        name="ppo",           # rl.loss.TOKEN_LOSSES: "ppo" or "sft"
        agg="token-mean",     # rl.loss.AGGREGATIONS
        eps_low=0.2, eps_high=0.28,
        dual_clip=0.0,        # c > 1 bounds the loss of negative-advantage tokens; 0 = off
        kl="none",            # "none", "k1", "k2", "k3", "k3plus" or "exact"
        kl_coef=0.0,
        old_logprobs="sampler",  # PPO ratio vs "sampler" log-probs or the "learner"'s own
        # Off-policy correction, sampler -> learner-old (rl.loss.offpolicy_weights; needs
        # old_logprobs="learner"): rollouts of older policies (rollout.max_staleness)
        # and the sampler's numerics.
        tis_cap=0.0,          # truncated importance weight cap; 0 = off
        tis_level="token",    # "token": per-token ratio; "sequence": the trajectory's product
        seq_mask_low=0.0,     # a trajectory whose geometric-mean ratio lies outside
        seq_mask_high=0.0,    # [low, high] is left out of the loss; high 0 = off
    ))
    return c


def distributed_defaults() -> dict[str, Any]:
    """The `distributed` section: one JAX process per host (see rl.distributed).

    coordinator: "host:port" of process 0's coordination service; with num_processes
      and process_id (each may come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
      JAX_PROCESS_ID instead). All empty: one process.
    auto: let JAX detect the cluster (TPU pod slices, SLURM, Open MPI, Kubernetes).
    """
    return dict(coordinator="", num_processes=0, process_id=-1, auto=False)


# ------------------------------------------------------------------ value checks

# Allowed values of every numeric key, in interval notation; " | " joins alternatives
# and a bare number allows exactly that value. A tuple's elements are checked one by
# one. A numeric key added to a section gets a line here: tests/test_configs.py fails
# on a numeric key without one.
RANGES: dict[str, str] = {
    "seed": "[0, inf)", "total_steps": "[1, inf)", "batch_tasks": "[1, inf)",
    "group_size": "[1, inf)", "eval_every": "[1, inf)", "eval_temperature": "[0, inf)",
    "ckpt_every": "[1, inf)", "ckpt_every_s": "[0, inf)", "ckpt_keep": "[1, inf)",
    "log_texts_every": "[1, inf)", "max_env_error_steps": "[0, inf)",
    # model (a preset's fields overridden by the config)
    "model.hidden_size": "[1, inf)", "model.intermediate_size": "[1, inf)",
    "model.num_layers": "[1, inf)", "model.num_heads": "[1, inf)",
    "model.num_kv_heads": "[1, inf)", "model.head_dim": "[1, inf)",
    "model.max_position_embeddings": "[1, inf)",
    "tokenizer.bpe_vocab_size": "[0, inf)",
    # -1: the devices the other axes leave
    "mesh.data": "[1, inf) | -1", "mesh.fsdp": "[1, inf) | -1", "mesh.tensor": "[1, inf) | -1",
    "distributed.num_processes": "[0, inf)", "distributed.process_id": "[0, inf) | -1",
    "engine.max_batch": "[0, inf)", "engine.max_len": "[1, inf)",
    "engine.prefix_cache_tokens": "[0, inf)", "engine.min_batch": "[1, inf)",
    "engine.min_len": "[1, inf)", "engine.min_cache_len": "[1, inf)",
    "engine.chunk_steps": "[1, inf)", "engine.min_chunk_steps": "[0, inf)",
    "engine.sglang.backoff_s": "[0, inf)", "engine.sglang.down_s": "[0, inf)",
    "engine.sglang.ports": "[1, 65535]", "engine.sglang.tp_size": "[1, inf)",
    "engine.sglang.mem_fraction_static": "(0, 1]", "engine.sglang.timeout_s": "(0, inf)",
    "engine.sglang.max_retries": "[0, inf)", "engine.sglang.health_timeout_s": "(0, inf)",
    "engine.sglang.host_gpus": "[0, inf)", "engine.sglang.context_length": "[0, inf)",
    "engine.sglang.export_keep": "[1, inf)",
    "env.train_tasks": "[0, inf)", "env.eval_tasks": "[0, inf)", "env.difficulties": "[0, 4]",
    "env.task_seed": "[0, inf)", "env.eval_seed": "[0, inf)", "env.max_concurrent": "[1, inf)",
    "env.latency.median_s": "[0, inf)",
    "env.latency.sigma": "[0, inf)", "env.latency.slow_share": "[0, 1]",
    "env.latency.slow_factor": "(0, inf)",
    # The RL sampler's temperature divides the learner's logits: 0 (greedy) is refused.
    "rollout.temperature": "(0, inf)", "rollout.top_p": "(0, 1]", "rollout.top_k": "[1, inf) | -1",
    "rollout.max_steps": "[1, inf)", "rollout.max_turn_tokens": "[1, inf)",
    "rollout.max_response_tokens": "[1, inf)", "rollout.max_context": "[1, inf)",
    "rollout.wall_timeout_s": "(0, inf)", "rollout.test_timeout_s": "(0, inf)",
    "rollout.env_retries": "[0, inf)", "rollout.max_staleness": "[0, inf)",
    "ps.low": "[0, 1]", "ps.high": "[0, 1]", "ps.remaining_ratio": "(0, 1]",
    "ps.prefix_ratio": "(0, 1]", "ps.remaining_cap": "[0, inf)", "ps.prefix_cap": "[0, inf)",
    "ps.max_share": "[0, 1]",
    "ps.max_age": "[1, inf)",  # a queued task runs at the earliest the step after its own
    "ps.ema_alpha": "(0, 1]",
    "ps.ema_init": "[0, 1]", "ps.target": "[0, 1]", "ps.band": "[0, 1]",
    "ps.step_size": "(0, 1]",
    "ps.cooldown": "[0, inf)", "ps.ratio_min": "(0, 1]", "ps.ratio_max": "(0, 1]",
    "spo.d_half": "(0, inf)", "spo.rho_min": "(0, 1]", "spo.rho_max": "(0, 1]",
    "spo.prior": "(0, inf)", "spo.adv_std_ddof": "[0, 1]", "spo.sampler_eps": "[0, inf)",
    "spo.pool_size": "[0, inf)", "spo.in_flight": "[1, inf)", "spo.init_samples": "[0, inf)",
    "learner.num_minibatches": "[1, inf)", "learner.num_microbatches": "[1, inf)",
    "learner.rows_multiple": "[1, inf)",
    "learner.temperature": "(0, inf)", "learner.seed": "[0, inf)",
    "learner.row_buckets": "[1, inf)",
    # lr 0 freezes the policy: arms that differ only in how they collect.
    "learner.optim.lr": "[0, inf)", "learner.optim.warmup_steps": "[0, inf)",
    "learner.optim.decay_steps": "[0, inf)", "learner.optim.end_lr_frac": "[0, 1]",
    "learner.optim.b1": "[0, 1)", "learner.optim.b2": "[0, 1)", "learner.optim.eps": "(0, inf)",
    "learner.optim.weight_decay": "[0, inf)", "learner.optim.max_grad_norm": "[0, inf)",
    "learner.loss.eps_low": "[0, 1]", "learner.loss.eps_high": "[0, inf)",
    "learner.loss.dual_clip": "0 | (1, inf)", "learner.loss.kl_coef": "[0, inf)",
    "learner.loss.tis_cap": "[0, inf)", "learner.loss.seq_mask_low": "[0, 1]",
    "learner.loss.seq_mask_high": "0 | [1, inf)",
    "sft.steps": "[0, inf)", "sft.batch_size": "[0, inf)", "sft.lr": "[0, inf)",
    "sft.warmup_steps": "[0, inf)", "sft.end_lr_frac": "[0, 1]", "sft.num_demos": "[0, inf)",
    "sft.imperfect_share": "[0, 1]", "sft.explore_share": "[0, 1]",
    "sft.max_steps": "[0, inf)",
}


# Allowed values of every key that names one of a few choices. The code that reads a
# key owns the same tuple (tests/test_configs.py checks that they agree), so a typo is
# refused by --dry_run, before anything is built.
CHOICES: dict[str, tuple[Any, ...]] = {
    "algo": ("grpo", "spo"),
    "model.preset": ("tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b",
                     "qwen3-32b"),
    "model.dtype": ("float32", "bfloat16"), "model.param_dtype": ("float32", "bfloat16"),
    "model.remat": ("none", "full", "nested", "save-dots"),
    "model.attention": ("auto", "xla", "pallas", "reference"),
    "engine.kind": ("embedded", "sglang"),
    "engine.sglang.sync_mode": ("pause", "abort", "drain"),
    "engine.sglang.on_restart": ("reload", "drop"),
    "engine.sglang.export_dtype": ("bfloat16", "float16", "float32"),
    "env.backend": ("local", "docker"),
    "env.placement": ("local", "ray"),
    "rollout.grading": ("fresh", "in_place"), "rollout.stale": ("drop", "finish"),
    "ps.replay": ("patch", "reexec"), "spo.drift_tokens": ("generated", "response"),
    "spo.rho_type": ("kl", "constant"), "spo.init_form": ("reference", "paper"),
    "spo.duplicates": ("sequential", "last"), "spo.unseen": ("draw", "skip"),
    "learner.logprob_impl": (None, "reference", "xla", "pallas"),
    "learner.optim.schedule": ("constant", "cosine"),
    "learner.loss.name": ("ppo", "sft"),
    "learner.loss.agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "learner.loss.kl": ("none", "k1", "k2", "k3", "k3plus", "exact"),
    "learner.loss.old_logprobs": ("sampler", "learner"),
    "learner.loss.tis_level": ("token", "sequence"),
}


def check_choices(config: ConfigDict) -> None:
    """Every `CHOICES` key a config has holds one of its values; the error names each
    key that does not, its value and the allowed ones."""
    bad = []
    for key, allowed in CHOICES.items():
        node, *parts = config, *key.split(".")
        for part in parts:
            if not isinstance(node, ConfigDict) or part not in node:
                break
            node = node[part]
        else:
            if node not in allowed:
                bad.append(f"{key}={node!r} (allowed: {', '.join(map(repr, allowed))})")
    if bad:
        raise ValueError("config values not among the choices: " + "; ".join(bad))


def in_range(value: float, spec: str) -> bool:
    """Whether `value` lies in `spec` ("[0, 1)", "(0, inf)", "[1, inf) | -1", ...)."""
    for part in spec.split("|"):
        part = part.strip()
        if part[0] not in "[(":
            if value == float(part):
                return True
            continue
        lo, hi = (float(x) for x in part[1:-1].split(","))
        above = value >= lo if part[0] == "[" else value > lo
        below = value <= hi if part[-1] == "]" else value < hi
        if above and below:
            return True
    return False


def numeric_items(config: ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every number, or tuple of numbers, in `config`."""
    for key, value in config.items():
        if isinstance(value, ConfigDict):
            yield from numeric_items(value, f"{prefix}{key}.")
        elif _is_number(value) or (isinstance(value, tuple | list) and value
                                   and all(_is_number(v) for v in value)):
            yield prefix + key, value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_values(config: ConfigDict) -> None:
    """Every numeric key within its `RANGES` entry and every enumerated key among its
    `CHOICES`; the error names every key out of range, its value and what is allowed.
    (A section's combinations are its owner's checks; combinations across sections are
    train.py's.)"""
    bad = [f"{key}={value!r} (allowed: {RANGES[key]})" for key, value in numeric_items(config)
           if key in RANGES and not all(in_range(v, RANGES[key]) for v in
                                        (value if isinstance(value, tuple | list) else (value,)))]
    if bad:
        raise ValueError("config values out of range: " + "; ".join(bad))
    check_choices(config)
    relative = [p for p in config.env.local_read_only if not os.path.isabs(p)]
    if relative:
        raise ValueError(f"env.local_read_only holds relative paths {relative}: a sandbox "
                         "mounts host paths, give each as an absolute path")
