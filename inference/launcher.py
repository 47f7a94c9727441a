"""Starting SGLang servers and connecting a client to them.

`SGLangLauncher` starts `python -m sglang.launch_server ...` (or any command
template, e.g. `inference.server` in tests) in its own process group on its own
GPUs, logs to a file, waits for `/health`, and kills the group on close.
`placement` says which of the host's GPUs the launched servers and the learner use;
`connect` launches the servers an `engine.sglang` section asks for (or takes its urls),
refuses a server that does not fit the run (`check_server`) and returns an
`inference.sglang.SGLangClient` that stops what it launched on close.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from inference.engine import EngineError
from inference.sglang import SGLangClient, SGLangConfig, error_text

log = logging.getLogger(__name__)

MIN_VERSION = (0, 5, 0)
SEED_VERSION = (0, 5, 3)  # first release with sampling_seed (--enable-deterministic-inference)
SGLANG_COMMAND = ("{python} -m sglang.launch_server --model-path {model_path} --port {port} "
                  "--tp-size {tp_size} --mem-fraction-static {mem_fraction_static} "
                  "--context-length {context_length} --skip-tokenizer-init --host {host}")
DETERMINISTIC_FLAG = "--enable-deterministic-inference"


@dataclasses.dataclass
class LauncherConfig:
    """How to start one server: the `engine.sglang` section's launch keys
    (`from_section`) for one port, its GPUs and context length. The fields that come from
    the section have no defaults of their own (the config is their one source).

    model_path: HF directory (or hub id) of the served model.
    port: TCP port; 0 picks a free one.
    host: interface to bind (and to reach the server on).
    tp_size: tensor-parallel GPUs (SGLang --tp-size).
    mem_fraction_static: GPU memory for weights + KV cache (SGLang --mem-fraction-static).
    context_length: longest prompt + output (SGLang --context-length).
    gpus: GPU ids the server may use (CUDA_VISIBLE_DEVICES); empty leaves it unset.
    deterministic: add --enable-deterministic-inference (seeded sampling).
    extra_args: appended verbatim, e.g. ["--dtype", "bfloat16"].
    command: format template; fields python, model_path, port, host, tp_size,
      mem_fraction_static, context_length.
    python: the interpreter of `{python}` (SGLang's environment); default this one.
    log_path: file receiving stdout+stderr; default a temporary file.
    startup_timeout: seconds to wait for /health.
    env: extra environment variables for the process.
    cwd: its working directory; default a new temporary directory. A relative model_path
      that exists here is made absolute first.

    The process never has this repository on its sys.path unless `env` puts it there:
    SGLang imports the `kernels` library, which the project's top-level `kernels`
    package would shadow. So it runs outside the repository, with PYTHONSAFEPATH=1
    (`python -m` does not put the working directory first; Python 3.11+) and without
    the repository in an inherited PYTHONPATH. The project's own server
    (`inference.server`) needs the repository: its configs pass
    `env={"PYTHONPATH": <repository root>}`.
    """

    model_path: str
    port: int
    host: str
    tp_size: int
    mem_fraction_static: float
    context_length: int
    gpus: Sequence[int]
    deterministic: bool
    extra_args: Sequence[str]
    command: str
    python: str
    startup_timeout: float
    env: Mapping[str, str]
    log_path: str | None = None
    cwd: str = ""

    @classmethod
    def from_section(cls, sg: SGLangConfig, model_path: str, port: int, context_length: int,
                     gpus: Sequence[int] = ()) -> LauncherConfig:
        """One server of `sg` on `port`; SGLang's --context-length is `sg.context_length`
        or `context_length` (the run's rollout.max_context)."""
        return cls(model_path=model_path, port=int(port), host=sg.host, tp_size=int(sg.tp_size),
                   mem_fraction_static=float(sg.mem_fraction_static),
                   context_length=int(sg.context_length or context_length), gpus=tuple(gpus),
                   deterministic=bool(sg.deterministic), extra_args=tuple(sg.extra_args),
                   command=sg.command or SGLANG_COMMAND, python=sg.python,
                   startup_timeout=float(sg.health_timeout_s), env=_env_entries(sg.env))


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangLauncher:
    """Runs one server process; a context manager.

    cfg: a LauncherConfig, or a mapping with its fields (all but log_path and cwd).
    """

    def __init__(self, cfg):
        if not isinstance(cfg, LauncherConfig):
            items = dict(cfg)
            known = {f.name for f in dataclasses.fields(LauncherConfig)}
            unknown = set(items) - known
            if unknown:
                raise KeyError(f"unknown launcher option(s) {sorted(unknown)}; "
                               f"known: {sorted(known)}")
            cfg = LauncherConfig(**items)
        self.config = cfg
        self.port = cfg.port or free_port(cfg.host)
        self.url = f"http://{cfg.host}:{self.port}"
        self.log_path = cfg.log_path or tempfile.mkstemp(prefix="server_", suffix=".log")[1]
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """The argv this launcher runs."""
        c = self.config
        model_path = os.path.abspath(c.model_path) if c.model_path and os.path.exists(
            c.model_path) else c.model_path
        fields = {"python": c.python or sys.executable, "model_path": model_path,
                  "port": self.port, "host": c.host, "tp_size": c.tp_size,
                  "mem_fraction_static": c.mem_fraction_static,
                  "context_length": c.context_length}
        argv = [part.format(**fields) for part in shlex.split(c.command)]
        flags = [DETERMINISTIC_FLAG] if c.deterministic else []
        return argv + flags + [str(a) for a in c.extra_args]

    def environment(self) -> dict[str, str]:
        """Variables set for the process on top of this one's (see LauncherConfig: the
        repository stays off the server's sys.path unless `env` puts it there)."""
        gpus = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.config.gpus))} \
            if self.config.gpus else {}
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        kept = [p for p in inherited if os.path.realpath(p) != REPOSITORY]
        path = {"PYTHONPATH": os.pathsep.join(kept)} if kept != inherited else {}
        return {"PYTHONSAFEPATH": "1", **path, **gpus, **self.config.env}

    def start(self) -> SGLangLauncher:
        """Starts the process and blocks until /health answers 200."""
        self.spawn()
        self.wait_healthy()
        return self

    def spawn(self) -> None:
        """Starts the process without waiting (start several, then `wait_healthy` each)."""
        if self.process is not None:
            raise RuntimeError(f"server {self.url} already started")
        cwd = self.config.cwd or tempfile.mkdtemp(prefix="server_")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env={**os.environ, **self.environment()}, cwd=cwd)

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Blocks until /health answers 200; on exit or deadline kills the group and raises
        EngineError with the log tail."""
        try:
            self._wait(self.config.startup_timeout if timeout is None else timeout)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise EngineError(f"server {shlex.join(self.command())} exited with code "
                                  f"{code} before becoming healthy; log {self.log_path}:\n"
                                  f"{self.log_tail()}")
            if _http_ok(self.url + "/health"):
                return
            if time.monotonic() > deadline:
                raise EngineError(f"server at {self.url} not healthy after {timeout:.0f} s; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError as e:
            return f"(log unreadable: {e})"

    def close(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`."""
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        # Children that outlived the leader (SGLang's scheduler/detokenizer) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def __enter__(self) -> SGLangLauncher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


# ----------------------------------------------------------------------------- startup checks


def parse_version(text: str) -> tuple[int, ...]:
    """"0.5.3rc1" -> (0, 5, 3)."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not match:
        raise EngineError(f"cannot read a server version from {text!r}")
    return tuple(int(g or 0) for g in match.groups())


def server_context_length(info: Mapping[str, Any]) -> tuple[int, str] | None:
    """The longest request (prompt + output) a server takes, from /get_server_info, and
    the field it comes from; None when it reports neither.

    SGLang reports its server arguments there, so `context_length` is null unless it was
    launched with --context-length; its scheduler's `max_req_input_len` is always there:
    min(context length, KV pool tokens) - 6 (scheduler.py: max_req_len = min(
    context_len - 1, max_total_num_tokens - 1), max_req_input_len = max_req_len - 5), the
    model's own limit (or a smaller KV pool) when no --context-length was given. The
    smaller of the two.
    """
    limits = []
    if info.get("context_length"):
        limits.append((int(info["context_length"]), "context_length"))
    if info.get("max_req_input_len"):
        limits.append((int(info["max_req_input_len"]) + 6, "max_req_input_len + 6"))
    return min(limits) if limits else None


def check_server(url: str, info: Mapping[str, Any], max_context: int, seeded: bool) -> None:
    """Refuses a server (EngineError naming it and the numbers) whose version, context
    limit or determinism does not fit the run."""
    version = parse_version(info.get("version", ""))
    shown = ".".join(map(str, version))
    if version < MIN_VERSION:
        raise EngineError(f"{url} runs SGLang {shown}; this client needs >= "
                          f"{'.'.join(map(str, MIN_VERSION))}")
    limit = server_context_length(info)
    if limit is None:
        log.warning("%s reports no context limit (context_length, max_req_input_len): "
                    "rollout.max_context=%d is not checked against it", url, max_context)
    elif limit[0] < max_context:
        raise EngineError(f"{url} takes at most {limit[0]} tokens ({limit[1]}) but "
                          f"rollout.max_context is {max_context}; launch it with "
                          f"--context-length {max_context} (and KV cache room for it) or "
                          f"lower rollout.max_context")
    if seeded and (version < SEED_VERSION or not info.get("enable_deterministic_inference")):
        raise EngineError(
            f"{url} (SGLang {shown}, enable_deterministic_inference="
            f"{bool(info.get('enable_deterministic_inference'))}) cannot sample with seeds: "
            f"that needs SGLang >= {'.'.join(map(str, SEED_VERSION))} run with "
            f"{DETERMINISTIC_FLAG}; set engine.sglang.deterministic=False to sample unseeded")


def server_info(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """GET /get_server_info as a dict (EngineError with the server's text otherwise)."""
    try:
        with urllib.request.urlopen(url + "/get_server_info", timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise EngineError(f"{url}/get_server_info answered HTTP {e.code}: "
                          f"{error_text(e.code, e.read())}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise EngineError(f"{url}/get_server_info failed: {e}") from e


def check_context(max_context: int, model_config) -> None:
    """Refuses a recipe whose rollout.max_context exceeds the model's limit."""
    limit = int(model_config.max_position_embeddings)
    if max_context > limit:
        raise ValueError(f"rollout.max_context ({max_context}) exceeds the model's context "
                         f"limit ({limit} = max_position_embeddings); lower "
                         f"rollout.max_context to at most {limit}")


# ----------------------------------------------------------------------------- placement


def placement(sg: SGLangConfig) -> dict[str, Any]:
    """Which GPUs of the host the launched servers and the learner use.

    Launched servers take the last `len(ports) * tp_size` of `host_gpus` GPUs, server
    i the i-th group of `tp_size`; the learner's JAX devices are the rest. Servers at
    `urls` run elsewhere and the learner keeps every GPU; `host_gpus` 0 places nothing
    (servers and learner on CPUs).
    """
    total = int(sg.host_gpus)
    if not sg.servers_launched:
        return {"host_gpus": total, "learner_gpus": list(range(total)), "servers": []}
    if total == 0:  # servers on CPUs (inference.server): nothing to place
        return {"host_gpus": 0, "learner_gpus": [],
                "servers": [{"port": int(port), "gpus": []} for port in sg.ports]}
    tp, n = int(sg.tp_size), len(sg.ports)
    first = total - n * tp
    if first < 1:
        raise ValueError(f"engine.sglang: {n} server(s) x tp_size {tp} = {n * tp} GPUs leave "
                         f"none of host_gpus={total} for the learner; launch fewer servers or "
                         f"give urls of servers on other hosts")
    servers = [{"port": int(port), "gpus": list(range(first + i * tp, first + (i + 1) * tp))}
               for i, port in enumerate(sg.ports)]
    return {"host_gpus": total, "learner_gpus": list(range(first)), "servers": servers}


def restrict_learner_devices(sg: SGLangConfig) -> list[int]:
    """Limits this process's JAX GPUs to the learner's share of `placement` (before JAX
    starts its backend); returns the GPU ids."""
    import jax  # (as in SGLangClient._export: a client may run without JAX)

    gpus = placement(sg)["learner_gpus"]
    if sg.servers_launched and sg.host_gpus:
        jax.config.update("jax_cuda_visible_devices", ",".join(map(str, gpus)))
    return gpus


# ----------------------------------------------------------------------------- from a config


def launchers(sg: SGLangConfig, model_path: str, max_context: int) -> list[SGLangLauncher]:
    """One launcher per `sg.ports` serving `model_path` (not started), on its GPUs
    (`placement`); SGLang's --context-length is `sg.context_length` or `max_context`."""
    gpus = {s["port"]: s["gpus"] for s in placement(sg)["servers"]}
    return [SGLangLauncher(LauncherConfig.from_section(sg, model_path, port, max_context,
                                                       gpus.get(int(port), ())))
            for port in sg.ports]


def _env_entries(entries: Sequence[str]) -> dict[str, str]:
    out = {}
    for entry in entries:
        key, eq, value = str(entry).partition("=")
        if not eq or not key:
            raise ValueError(f"engine.sglang.env entry {entry!r} is not KEY=VALUE")
        out[key] = value
    return out


def launch_commands(sg: SGLangConfig, model_path: str, max_context: int) -> list[list[str]]:
    """The server command lines `connect` would run (one per `sg.ports`), each prefixed
    with its environment (e.g. CUDA_VISIBLE_DEVICES=2,3)."""
    return [[f"{k}={v}" for k, v in sorted(x.environment().items())] + x.command()
            for x in launchers(sg, model_path, max_context)]


@dataclasses.dataclass(frozen=True)
class Served:
    """What the servers serve: the HF directory (`model.hf_path`; "" for a model trained
    from scratch, exported from `model_config` initialised with `seed`), its Qwen3Config
    (read from hf_path when None) and the run's longest context."""

    hf_path: str
    model_config: Any
    max_context: int
    seed: int


def connect(sg: SGLangConfig, served: Served, workdir: str) -> SGLangClient:
    """An SGLangClient of `sg.urls`, or of servers it launches (`sg.launch`) and stops on
    close. Weights are exported under `sg.export_dir` (default workdir/sglang_weights).
    Every server is checked (`check_server`) first."""
    from models import hf_io  # (as in SGLangClient._export)

    model_config = served.model_config
    if model_config is None and served.hf_path:
        model_config = hf_io.load_config(served.hf_path)
    if model_config is not None:
        check_context(served.max_context, model_config)
    sg = dataclasses.replace(sg, export_dir=sg.export_dir or
                             os.path.join(workdir, "sglang_weights"))
    started = []
    if not sg.urls:
        if not sg.launch:
            raise ValueError("engine.sglang has no urls and launch=False: nothing to connect to")
        model_path = served.hf_path or _export_init(model_config, sg.export_dir, served.seed,
                                                    sg.export_dtype)
        started = launchers(sg, model_path, served.max_context)
    try:  # servers this call started are stopped if any fails to start or to pass
        for launcher in started:
            launcher.spawn()
        for launcher in started:
            launcher.wait_healthy()
        urls = list(sg.urls) or [launcher.url for launcher in started]
        for url in urls:
            check_server(url, server_info(url), served.max_context, bool(sg.deterministic))
        if sg.router == "start":
            from inference.gateway import Gateway  # (smg is needed only when asked for)

            started.append(Gateway(urls).start())
            sg = dataclasses.replace(sg, router=started[-1].url)
    except BaseException:
        for launcher in started:
            launcher.close()
        raise
    if not sg.deterministic:
        log.warning("engine.sglang.deterministic=False: sampling is not seeded")
    return SGLangClient(urls, sg, model_config=model_config, launchers=started)


def _export_init(model_config, export_dir: str, seed: int, dtype: str) -> str:
    # (As in SGLangClient._export: the model code only where weights are exported.)
    from flax import nnx

    from models import hf_io, qwen3

    if model_config is None:
        raise ValueError("launching SGLang for a model without model.hf_path needs "
                         "model_config to export initial weights")
    path = os.path.join(export_dir, "init")
    hf_io.save_hf(qwen3.Qwen3(model_config, rngs=nnx.Rngs(seed)), model_config, path,
                  dtype=dtype)
    return path
