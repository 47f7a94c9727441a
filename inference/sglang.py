"""SGLang over HTTP: a client implementing `Engine`, and a launcher of server processes.

`SGLangClient` sends one native `/generate` call per request (SGLang batches
concurrent calls itself) to the server with the fewest outstanding requests.
Connection errors, timeouts and 5xx answers are retried with exponential backoff
on another server; a failing server is marked down for `down_s` seconds. Weight
sync exports HF safetensors (`models.hf_io.save_hf`) to a directory every server
can read and posts `/update_weights_from_disk` to each; a server that misses an
update is resynchronised before it gets traffic again.

`SGLangLauncher` starts `python -m sglang.launch_server ...` (or any command
template, e.g. `inference.server` in tests) in its own process group, logs to a
file, waits for `/health`, and kills the group on close.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from inference.engine import Engine, EngineError, GenerateRequest, GenerateResult


class ServerError(Exception):
    """A server failed in a way worth retrying elsewhere (connection, timeout, 5xx)."""


def request_payload(req: GenerateRequest) -> dict[str, Any]:
    """GenerateRequest -> SGLang /generate body (token ids in, log-probs of outputs)."""
    sampling = {"max_new_tokens": req.max_new_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "top_k": req.top_k,
                "stop_token_ids": list(req.stop_token_ids)}
    if req.seed is not None:
        sampling["sampling_seed"] = req.seed
    return {"input_ids": list(req.prompt_ids), "sampling_params": sampling,
            "return_logprob": True}


def parse_response(item: dict[str, Any], latency: float) -> GenerateResult:
    """SGLang /generate response item -> GenerateResult."""
    meta = item["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    ids = [int(p[1]) for p in pairs] if pairs else list(item.get("output_ids", []))
    reason = (meta.get("finish_reason") or {}).get("type", "abort")
    if reason not in ("stop", "length", "abort"):
        raise EngineError(f"unexpected finish_reason {meta.get('finish_reason')!r}")
    # SGLang reports only the end-to-end latency; it is booked as decode time.
    return GenerateResult(output_ids=ids, logprobs=[float(p[0]) for p in pairs],
                          finish_reason=reason,
                          timings={"prefill_s": 0.0, "decode_s": latency, "queue_s": 0.0},
                          cached_tokens=int(meta.get("cached_tokens") or 0))


@dataclasses.dataclass
class _Server:
    url: str
    outstanding: int = 0
    down_until: float = 0.0
    last_error: str = ""
    synced_path: str | None = None


class SGLangClient(Engine):
    """Engine over one or more SGLang (or `inference.server`) URLs.

    urls: base URLs, e.g. ["http://10.0.0.1:30000"].
    timeout: seconds for one HTTP call (a whole generation).
    max_retries: extra attempts after the first for one request.
    backoff: seconds before the first retry; doubles each retry.
    down_s: how long a failing server is skipped.
    model_config: Qwen3Config, needed to export a params pytree in `update_weights`.
    export_dir: where exported weights go (must be readable by every server);
      default a fresh temporary directory.
    launchers: server processes this client owns and stops on close.
    """

    def __init__(self, urls: Sequence[str], *, timeout: float = 600.0, max_retries: int = 3,
                 backoff: float = 0.5, down_s: float = 30.0, model_config=None,
                 export_dir: str | None = None,
                 launchers: Sequence[SGLangLauncher] = ()):
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.down_s = float(down_s)
        self.model_config = model_config
        self.export_dir = export_dir
        self.launchers = list(launchers)
        self.weights_path: str | None = None
        self._weights_version = 0
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ------------------------------------------------------------------ protocol

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if self._closed:
            raise EngineError("SGLangClient is closed")
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def update_weights(self, params_or_path) -> None:
        """Exports params (or takes an HF directory) and loads it on every server."""
        if isinstance(params_or_path, str | os.PathLike):
            path = os.path.abspath(os.fspath(params_or_path))
        else:
            path = await asyncio.get_running_loop().run_in_executor(
                None, self._export, params_or_path)
        previous, self.weights_path = self.weights_path, path
        outcomes = await asyncio.gather(*(self._sync(s) for s in self.servers),
                                        return_exceptions=True)
        failed = {s.url: o for s, o in zip(self.servers, outcomes, strict=True)
                  if isinstance(o, BaseException)}
        for server, error in zip(self.servers, outcomes, strict=True):
            if isinstance(error, BaseException):
                self._mark_down(server, error)
        if len(failed) == len(self.servers):
            self.weights_path = previous  # every server still serves the previous weights
            raise EngineError("no server loaded the weights from " + path + ": " +
                              "; ".join(f"{u}: {e}" for u, e in failed.items()))

    async def health(self) -> bool:
        async def ok(server: _Server) -> bool:
            try:
                async with self._http().get(server.url + "/health",
                                            timeout=aiohttp.ClientTimeout(total=10)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        return any(await asyncio.gather(*(ok(s) for s in self.servers)))

    def close(self) -> None:
        self._closed = True
        for launcher in self.launchers:
            launcher.close()
        session, self._session = self._session, None
        if session is None or session.closed:
            return
        try:
            asyncio.get_running_loop().create_task(session.close())
        except RuntimeError:
            with contextlib.suppress(RuntimeError):
                asyncio.run(session.close())

    async def aclose(self) -> None:
        session, self._session = self._session, None
        self.close()
        if session is not None:
            await session.close()

    # ------------------------------------------------------------------ internals

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._session_loop = loop
        return self._session

    def _export(self, params) -> str:
        from models import hf_io

        if self.model_config is None:
            raise ValueError("SGLangClient.update_weights got parameters but no model_config "
                             "to export them with; pass model_config= or an HF directory")
        root = self.export_dir or tempfile.mkdtemp(prefix="sglang_weights_")
        self._weights_version += 1
        path = os.path.join(root, f"weights_{self._weights_version:06d}")
        hf_io.save_hf(params, self.model_config, path)
        return path

    def _mark_down(self, server: _Server, error: BaseException) -> None:
        server.down_until = time.monotonic() + self.down_s
        server.last_error = f"{type(error).__name__}: {error}"

    def _pick(self) -> _Server:
        """Least outstanding requests among the servers up; if all are down, the one whose
        penalty ends first (it may be back)."""
        now = time.monotonic()
        up = [s for s in self.servers if s.down_until <= now]
        if up:
            return min(up, key=lambda s: s.outstanding)
        return min(self.servers, key=lambda s: s.down_until)

    async def _sync(self, server: _Server) -> None:
        path = self.weights_path
        async with self._http().post(server.url + "/update_weights_from_disk",
                                     json={"model_path": path}) as r:
            body = await r.json(content_type=None)
            if r.status != 200 or not body.get("success", False):
                raise ServerError(f"update_weights_from_disk({path}) answered {r.status}: "
                                  f"{body.get('message', body)}")
        server.synced_path = path

    async def _post_generate(self, server: _Server, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            if self.weights_path is not None and server.synced_path != self.weights_path:
                await self._sync(server)
            async with self._http().post(server.url + "/generate", json=payload) as r:
                if r.status >= 500:
                    raise ServerError(f"HTTP {r.status}: {(await r.text())[:500]}")
                body = await r.json(content_type=None)
                if r.status != 200:
                    message = (body.get("error") or {}).get("message", body) \
                        if isinstance(body, dict) else body
                    raise ValueError(f"{server.url}/generate rejected the request "
                                     f"(HTTP {r.status}): {message}")
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ServerError(f"{type(e).__name__}: {e}") from e

    async def _generate_one(self, req: GenerateRequest) -> GenerateResult:
        payload = request_payload(req)
        for attempt in range(self.max_retries + 1):
            server = self._pick()
            server.outstanding += 1
            start = time.perf_counter()
            try:
                body = await self._post_generate(server, payload)
            except ServerError as e:
                self._mark_down(server, e)
                if attempt < self.max_retries:
                    await asyncio.sleep(self.backoff * 2**attempt)
                continue
            finally:
                server.outstanding -= 1
            server.down_until = 0.0
            return parse_response(body, time.perf_counter() - start)
        status = "; ".join(f"{s.url} ({s.last_error or 'no error recorded'})"
                           for s in self.servers)
        raise EngineError(f"no inference server answered after {self.max_retries + 1} "
                          f"attempts: {status}")


# ----------------------------------------------------------------------------- launcher

SGLANG_COMMAND = ("{python} -m sglang.launch_server --model-path {model_path} --port {port} "
                  "--tp-size {tp_size} --mem-fraction-static {mem_fraction_static} "
                  "--skip-tokenizer-init --host {host}")


@dataclasses.dataclass
class LauncherConfig:
    """How to start one server.

    model_path: HF directory (or hub id) of the served model.
    port: TCP port; 0 picks a free one.
    host: interface to bind (and to reach the server on).
    tp_size: tensor-parallel GPUs (SGLang --tp-size).
    mem_fraction_static: GPU memory for weights + KV cache (SGLang --mem-fraction-static).
    extra_args: appended verbatim, e.g. ["--dtype", "bfloat16"].
    command: format template; fields python, model_path, port, host, tp_size,
      mem_fraction_static.
    log_path: file receiving stdout+stderr; default a temporary file.
    startup_timeout: seconds to wait for /health.
    env: extra environment variables for the process.
    """

    model_path: str = ""
    port: int = 0
    host: str = "127.0.0.1"
    tp_size: int = 1
    mem_fraction_static: float = 0.85
    extra_args: Sequence[str] = ()
    command: str = SGLANG_COMMAND
    log_path: str | None = None
    startup_timeout: float = 900.0
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangLauncher:
    """Runs one server process; a context manager.

    config: a LauncherConfig, or a mapping / ConfigDict with its fields.
    """

    def __init__(self, config):
        if not isinstance(config, LauncherConfig):
            items = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            known = {f.name for f in dataclasses.fields(LauncherConfig)}
            unknown = set(items) - known
            if unknown:
                raise KeyError(f"unknown launcher option(s) {sorted(unknown)}; "
                               f"known: {sorted(known)}")
            config = LauncherConfig(**items)
        self.config = config
        self.port = config.port or free_port(config.host)
        self.url = f"http://{config.host}:{self.port}"
        self.log_path = config.log_path or tempfile.mkstemp(prefix="server_", suffix=".log")[1]
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """The argv this launcher runs."""
        c = self.config
        fields = {"python": sys.executable, "model_path": c.model_path, "port": self.port,
                  "host": c.host, "tp_size": c.tp_size,
                  "mem_fraction_static": c.mem_fraction_static}
        argv = [part.format(**fields) for part in shlex.split(c.command)]
        return argv + [str(a) for a in c.extra_args]

    def start(self) -> SGLangLauncher:
        """Starts the process and blocks until /health answers 200."""
        self.spawn()
        self.wait_healthy()
        return self

    def spawn(self) -> None:
        """Starts the process without waiting (start several, then `wait_healthy` each)."""
        if self.process is not None:
            raise RuntimeError(f"server {self.url} already started")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env={**os.environ, **self.config.env})

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
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


# ----------------------------------------------------------------------------- from a config


def _launcher_configs(config, model_path: str) -> list[LauncherConfig]:
    sg = config.engine.sglang
    return [LauncherConfig(model_path=model_path, port=int(port), host=sg.host,
                           tp_size=int(sg.tp_size),
                           mem_fraction_static=float(sg.mem_fraction_static),
                           extra_args=tuple(sg.extra_args),
                           startup_timeout=float(sg.health_timeout_s))
            for port in sg.ports]


def launch_commands(config, workdir: str = "WORKDIR") -> list[list[str]]:
    """The server command lines `from_config` would run (one per `engine.sglang.ports`)."""
    model_path = config.model.hf_path or os.path.join(workdir, "sglang_weights", "init")
    return [SGLangLauncher(c).command() for c in _launcher_configs(config, model_path)]


def from_config(config, workdir: str, model_config=None) -> SGLangClient:
    """An SGLangClient from `config.engine.sglang` (see configs.common.sglang_defaults).

    With `urls` it connects to running servers; otherwise, with `launch`, it starts one
    server per port on `config.model.hf_path` (or, for a model trained from scratch, on
    a seed-initialised export of `model_config` that the first `update_weights`
    replaces) and stops them on close.
    model_config: the served Qwen3Config; read from `hf_path` when not given.
    """
    from models import hf_io

    sg = config.engine.sglang
    hf_path = config.model.get("hf_path", "")
    if model_config is None and hf_path:
        model_config = hf_io.load_config(hf_path)
    export_dir = sg.export_dir or os.path.join(workdir, "sglang_weights")
    urls, launchers = list(sg.urls), []
    if not urls:
        if not sg.launch:
            raise ValueError("engine.sglang has no urls and launch=False: nothing to connect to")
        model_path = hf_path or _export_init(model_config, export_dir, int(config.seed))
        launchers = [SGLangLauncher(c) for c in _launcher_configs(config, model_path)]
        try:
            for launcher in launchers:
                launcher.spawn()
            for launcher in launchers:
                launcher.wait_healthy()
        except BaseException:
            for launcher in launchers:
                launcher.close()
            raise
        urls = [launcher.url for launcher in launchers]
    return SGLangClient(urls, timeout=float(sg.timeout_s), max_retries=int(sg.max_retries),
                        model_config=model_config, export_dir=export_dir, launchers=launchers)


def _export_init(model_config, export_dir: str, seed: int) -> str:
    from flax import nnx

    from models import hf_io, qwen3

    if model_config is None:
        raise ValueError("launching SGLang for a model without model.hf_path needs "
                         "model_config to export initial weights")
    path = os.path.join(export_dir, "init")
    hf_io.save_hf(qwen3.Qwen3(model_config, rngs=nnx.Rngs(seed)), model_config, path)
    return path
