"""SGLang over HTTP: a client implementing `Engine`.

`SGLangClient` sends one native `/generate` call per request (SGLang batches
concurrent calls itself). Every turn of an episode (requests with the same
`GenerateRequest.session`) goes to one server, where its prefix is cached: through a
gateway (`router`: SGLang's `smg`, consistent hashing of the `x-smg-routing-key`
header, which carries the session), or without one, to the server the client chose for
the session's first turn (the one with the fewest outstanding requests), moved only
when that server is down. Connection errors, timeouts, 5xx answers and malformed
answers are retried with exponential backoff; a failing server is marked down for
`down_s` seconds. Every answer is checked against its request (`parse_response`: at most
max_new_tokens ids in the vocabulary, a finite log-prob <= 0 for each, a finish reason
SGLang writes) and its `weight_version` against the versions loaded into that server:
one that restarted (an older version) is reloaded before it serves again.

Weight sync: `update_weights` exports HF safetensors in the servers' dtype to
`export_dir/weights_<version>` and reloads each server exactly once per version.
SGLang's `/update_weights_from_disk` waits for in-flight requests and blocks new
ones unless generation is paused, so the client first quiesces each server
(`sync_mode`): "pause" (`/pause_generation` in retract mode, reload,
`/continue_generation`; in-flight requests resume on the new weights), "abort"
(the reload aborts in-flight requests; each is continued from its tokens so far)
or "drain" (wait for the client's in-flight requests to finish). New requests for
a server wait while it reloads. Behind a gateway, which hides the server that answers,
new requests wait while any server reloads (a reload is atomic across servers for every
request sent after it began), and a turn's recorded version is the `weight_version` the
answering server reports, checked against the versions loaded. A server that missed a
version is reloaded once before it gets traffic again, and one whose
`/continue_generation` failed (retried) gets none until it answers one. Only the
newest `export_keep` exports stay on disk.

Servers are started, checked and connected to by `inference.launcher`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from inference.engine import (
    BrokenSampleError,
    ContextLengthError,
    Engine,
    EngineError,
    GenerateRequest,
    GenerateResult,
)

log = logging.getLogger(__name__)

SYNC_MODES = ("pause", "abort", "drain")
ROUTING_KEY_HEADER = "x-smg-routing-key"  # smg keeps requests with one key on one server
STICKY_SESSIONS = 1 << 16  # sessions remembered (oldest forgotten first) without a gateway
ON_RESTART = ("reload", "drop")
NAN_MATCHED = "NaN happened"  # SGLang's finish_reason.matched for a non-finite sample
_EXPORT_NAME = re.compile(r"^weights_(\d{6})$")
_CONTEXT_ERROR = re.compile(r"context length|maximum context", re.IGNORECASE)


class ServerError(Exception):
    """A server failed in a way worth retrying elsewhere (connection, timeout, 5xx)."""


def request_payload(req: GenerateRequest, seeded: bool) -> dict[str, Any]:
    """GenerateRequest -> SGLang /generate body (token ids in, log-probs of outputs).
    seeded: send `sampling_seed` (SGLang >= 0.5.3 with --enable-deterministic-inference)."""
    sampling = {"max_new_tokens": req.max_new_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "top_k": req.top_k,
                "stop_token_ids": list(req.stop_token_ids)}
    if seeded and req.seed is not None:
        sampling["sampling_seed"] = req.seed
    return {"input_ids": list(req.prompt_ids), "sampling_params": sampling,
            "return_logprob": True}


FINISH_TYPES = ("stop", "length", "abort")
LOGPROB_SLACK = 1e-5  # float32 rounding of log_softmax's maximum (exactly 0 in real maths)
NO_VOCAB = 2**31  # id bound when the vocabulary is unknown (ids are int32 on the learner)


class BadAnswerError(ServerError):
    """A server answered 200 with something that is not an answer to the request (wrong
    shape, too many tokens, ids outside the vocabulary, missing or impossible log-probs,
    an unknown finish reason); retried on another server."""


def parse_weight_version(value: Any) -> int:
    """A server's `weight_version` -> int: "default" (SGLang's, the weights it started
    with) is 0, a decimal string of a version this client sent is that version; anything
    else (another client's naming, a negative or garbage value) raises BadAnswerError."""
    text = value if isinstance(value, str) else None
    if text == "default":
        return 0
    if text is None or not (text.isascii() and text.isdigit()):
        raise BadAnswerError(f"weight_version {value!r} is not a version this client "
                             f"writes (\"default\" or a decimal count of updates)")
    return int(text)


def parse_response(item: Any, latency: float, policy_version: int | None = None, *,
                   max_new_tokens: int | None = None,
                   vocab_size: int | None = None) -> GenerateResult:
    """SGLang /generate response item -> GenerateResult, checked against the request:
    at most `max_new_tokens` ids, each an int in [0, vocab_size), one finite log-prob
    <= 0 per id, a finish reason SGLang writes. A NaN finish raises BrokenSampleError;
    anything else malformed raises BadAnswerError with what was wrong."""
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if not isinstance(meta, dict):
        raise BadAnswerError(f"/generate answered {_clip(item)}: not an object with "
                             f"meta_info")
    ids, logprobs = _output_tokens(item, meta, vocab_size or NO_VOCAB)
    if max_new_tokens is not None and len(ids) > max_new_tokens:
        raise BadAnswerError(f"/generate answered {len(ids)} tokens for max_new_tokens "
                             f"{max_new_tokens}")
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else None
    if reason == "stop" and finish.get("matched") == NAN_MATCHED:
        raise BrokenSampleError(f"the server sampled from non-finite logits ({finish!r}) "
                                f"after {len(ids)} tokens")
    if reason not in FINISH_TYPES:
        raise BadAnswerError(f"/generate answered finish_reason {finish!r}; expected an "
                             f"object whose type is one of {FINISH_TYPES}")
    _check_finish(finish, ids, max_new_tokens)
    cached = meta.get("cached_tokens", 0)
    if not (_is_int(cached) and cached >= 0):
        raise BadAnswerError(f"/generate answered cached_tokens {_clip(cached)}: not a "
                             f"count (an integer >= 0)")
    # SGLang reports only the end-to-end latency; it is booked as decode time.
    return GenerateResult(output_ids=ids, logprobs=logprobs, finish_reason=reason,
                          timings={"prefill_s": 0.0, "decode_s": latency, "queue_s": 0.0},
                          cached_tokens=cached, policy_version=policy_version)


def _check_finish(finish: dict, ids: list[int], max_new_tokens: int | None) -> None:
    """A finish SGLang could have written for these ids (scheduler `check_finished`):
    "stop" on a stop token ends with it (`matched`, the token id); "length" is
    max_new_tokens ids, or the `length` SGLang cut max_new_tokens to (context)."""
    if finish["type"] == "stop" and not (ids and _is_int(finish.get("matched"))
                                         and ids[-1] == finish["matched"]):
        raise BadAnswerError(f"/generate answered finish_reason {finish!r} after ids "
                             f"{_clip(ids[-3:])}: a stop ends on the token it matched")
    if finish["type"] == "length" and max_new_tokens is not None and len(ids) not in (
            max_new_tokens, finish.get("length")):
        raise BadAnswerError(f"/generate answered finish_reason {finish!r} with "
                             f"{len(ids)} of {max_new_tokens} tokens")


def _output_tokens(item: dict, meta: dict, vocab: int) -> tuple[list[int], list[float]]:
    """(ids, log-probs) of an answer from `output_token_logprobs` [[logprob, id, text],
    ...], which must agree with `output_ids` where both are given."""
    pairs = meta.get("output_token_logprobs")
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) >= 2
                                              for p in pairs):
        raise BadAnswerError(f"/generate answered output_token_logprobs {_clip(pairs)}: "
                             f"not a list of [logprob, token id, ...] entries")
    ids, logprobs = [p[1] for p in pairs], [p[0] for p in pairs]
    listed = item.get("output_ids", ids)
    if listed != ids:
        raise BadAnswerError(f"/generate answered {_clip(listed)} as output_ids but "
                             f"log-probs for {_clip(ids)} ({len(ids)} ids)")
    bad = [t for t in ids if not (_is_int(t) and 0 <= t < vocab)]
    if bad:
        raise BadAnswerError(f"/generate answered token ids {_clip(bad)} outside "
                             f"[0, {vocab}) (integers below the vocabulary size)")
    bad = [x for x in logprobs if not (isinstance(x, int | float) and not isinstance(x, bool)
                                       and math.isfinite(x) and x <= LOGPROB_SLACK)]
    if bad:
        raise BadAnswerError(f"/generate answered log-probs {_clip(bad)}: each must be a "
                             f"finite number <= 0")
    return ids, [float(x) for x in logprobs]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _clip(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def error_text(status: int, body: bytes) -> str:
    """The server's own words from an error body: `{"error": {"message": ...}}`,
    `{"error": "..."}`, `{"message": ...}`, `{"detail": ...}` or plain text."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        return text[:2000] or f"HTTP {status} with an empty body"
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        if isinstance(err, dict):
            err = err.get("message") or err.get("detail") or err
        return str(err)[:2000]
    return str(parsed)[:2000]


@dataclasses.dataclass
class _Server:
    url: str
    outstanding: int = 0
    down_until: float = 0.0
    last_error: str = ""
    version: int = 0  # weight version loaded (0: the weights it started with)
    loading: int = 0  # version of the reload in progress (answers may already carry it)
    reported: int = 0  # highest weight_version it reported to a client that loads none
    paused: bool = False  # paused by this client and not yet confirmed continued
    reloads: int = 0
    reloads_begun: int = 0  # a request aborted after this changed is continued
    lock: asyncio.Lock | None = None  # held while reloading
    open: asyncio.Event | None = None  # cleared while reloading: new requests wait
    stalled: asyncio.Event | None = None  # set when its continue failed for good

    def stuck(self) -> asyncio.Event:
        if self.stalled is None:
            self.stalled = asyncio.Event()
        return self.stalled

    def gates(self) -> tuple[asyncio.Lock, asyncio.Event]:
        if self.lock is None:
            self.lock, self.open = asyncio.Lock(), asyncio.Event()
            self.open.set()
        return self.lock, self.open


@dataclasses.dataclass(frozen=True)
class SGLangConfig:
    """The `engine.sglang` section (documented with its defaults in
    configs.common.sglang_defaults): the servers, how to launch them, and the client's
    retries, weight exports and sync."""

    urls: Sequence[str]
    launch: bool
    ports: Sequence[int]
    host: str
    tp_size: int
    mem_fraction_static: float
    extra_args: Sequence[str]
    timeout_s: float
    max_retries: int
    backoff_s: float
    down_s: float
    export_dir: str
    health_timeout_s: float
    host_gpus: int
    command: str
    python: str
    env: Sequence[str]
    context_length: int
    deterministic: bool
    sync_mode: str
    on_restart: str
    export_dtype: str
    export_keep: int
    router: str

    def __post_init__(self):
        if self.router and self.router != "start" and not self.router.startswith(
                ("http://", "https://")):
            raise ValueError(f"engine.sglang.router must be '', 'start' or an http(s):// URL, "
                             f"got {self.router!r}")
        if self.sync_mode not in SYNC_MODES:
            raise ValueError(f"sync_mode must be one of {SYNC_MODES}, got {self.sync_mode!r}")
        if self.export_keep < 1:
            raise ValueError(f"export_keep must be >= 1, got {self.export_keep}")
        if self.on_restart not in ON_RESTART:
            raise ValueError(f"on_restart must be one of {ON_RESTART}, "
                             f"got {self.on_restart!r}")

    @property
    def servers_launched(self) -> bool:
        """Servers this process starts (no urls, launch on)."""
        return bool(self.launch and not self.urls)


class SGLangClient(Engine):
    """Engine over one or more SGLang (or `inference.server`) URLs.

    urls: base URLs, e.g. ["http://10.0.0.1:30000"].
    cfg: timeouts, retries, exports, sync and seeding (SGLangConfig); exports go to
      `cfg.export_dir` (readable by every server), or a fresh temporary directory.
    model_config: Qwen3Config, needed to export a params pytree in `update_weights`.
    launchers: server processes this client owns and stops on close
      (inference.launcher.SGLangLauncher).
    vocab_size: output ids must lie below it (default model_config's; unknown: 2**31).

    A server answering with an older weight version than this client loaded into it (it
    restarted) is reloaded before its next request, and the answer is re-requested
    (cfg.on_restart "reload") or its request fails with EngineError ("drop").
    """

    def __init__(self, urls: Sequence[str], cfg: SGLangConfig, *, model_config=None,
                 launchers: Sequence[Any] = (), vocab_size: int | None = None):
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        if cfg.router == "start":
            raise ValueError("router='start' is for connect(), which starts the gateway; "
                             "give the client the gateway's URL")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        # The gateway every /generate goes through (control calls go to each server).
        self.router = _Server(cfg.router.rstrip("/")) if cfg.router else None
        self._sticky: collections.OrderedDict[str, _Server] = collections.OrderedDict()
        self._restarted = False  # an answer behind the gateway came from a restarted server
        self.timeout = float(cfg.timeout_s)
        self.max_retries = int(cfg.max_retries)
        self.backoff = float(cfg.backoff_s)
        self.down_s = float(cfg.down_s)
        self.model_config = model_config
        self.export_dir = cfg.export_dir or None
        self.export_dtype = cfg.export_dtype
        self.export_keep = int(cfg.export_keep)
        self.sync_mode = cfg.sync_mode
        self.seeded = bool(cfg.deterministic)
        self.launchers = list(launchers)
        self.vocab_size = vocab_size or (model_config.vocab_size if model_config is not None
                                         else None)
        self.on_restart = cfg.on_restart
        self.version = 0
        self.weights_path: str | None = None
        self._stats: dict[str, float] = {}
        self._update_lock: asyncio.Lock | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ------------------------------------------------------------------ protocol

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if self._closed:
            raise EngineError("SGLangClient is closed")
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def update_weights(self, params_or_path) -> None:
        """Exports params (or takes an HF directory) as the next version and reloads every
        server once; raises EngineError only when no server loaded it."""
        self._update_lock = self._update_lock or asyncio.Lock()
        async with self._update_lock:
            version, stats = self.version + 1, {}
            if isinstance(params_or_path, str | os.PathLike):
                path = os.path.abspath(os.fspath(params_or_path))
            else:
                path, stats = await asyncio.get_running_loop().run_in_executor(
                    None, self._export, params_or_path, version)
            t0 = time.perf_counter()
            reloads = sum(s.reloads for s in self.servers)
            outcomes = await asyncio.gather(*(self._reload(s, path, version)
                                              for s in self.servers), return_exceptions=True)
            failed = {s.url: o for s, o in zip(self.servers, outcomes, strict=True)
                      if isinstance(o, BaseException)}
            if not any(s.version >= version for s in self.servers):
                raise EngineError("no server loaded the weights from " + path + ": " +
                                  "; ".join(f"{u}: {e}" for u, e in failed.items()))
            # Loaded somewhere: the label is true, whether or not that server continued.
            self.version, self.weights_path = version, path
            if len(failed) == len(self.servers):
                raise EngineError(f"weights v{version} from {path} loaded, but no server "
                                  "serves them: " + "; ".join(f"{u}: {e}"
                                                              for u, e in failed.items()))
            self._prune()
            stats.update({"sync/version": version,
                          "sync/reload_s": time.perf_counter() - t0,
                          "sync/reloads": sum(s.reloads for s in self.servers) - reloads,
                          "sync/servers_failed": len(failed)})
            self._stats = stats
            log.info("weights v%d: %s; %d reload(s) on %d server(s) in %.2f s%s", version,
                     path, stats["sync/reloads"], len(self.servers), stats["sync/reload_s"],
                     f"; failed: {failed}" if failed else "")

    def update_stats(self) -> dict[str, float]:
        return dict(self._stats)

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

    # ------------------------------------------------------------------ weights

    def _export_root(self) -> str:
        if not self.export_dir:
            self.export_dir = tempfile.mkdtemp(prefix="sglang_weights_")
        return self.export_dir

    def _export(self, params, version: int) -> tuple[str, dict[str, float]]:
        # The model code (JAX, safetensors) loads only in a client that exports weights:
        # one that connects to servers holding their own needs none of it.
        from models import hf_io

        if self.model_config is None:
            raise ValueError("SGLangClient.update_weights got parameters but no model_config "
                             "to export them with; pass model_config= or an HF directory")
        path = os.path.join(self._export_root(), f"weights_{version:06d}")
        t0 = time.perf_counter()
        hf_io.save_hf(params, self.model_config, path, dtype=self.export_dtype)
        seconds = time.perf_counter() - t0
        size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        log.info("weights v%d exported (%s) to %s: %.1f MB in %.2f s", version,
                 self.export_dtype, path, size / 2**20, seconds)
        return path, {"sync/export_s": seconds, "sync/export_bytes": float(size)}

    def _prune(self) -> None:
        """Deletes all but the newest `export_keep` exports (every server has answered
        the reload, so none is still reading an older one)."""
        if not self.export_dir or not os.path.isdir(self.export_dir):
            return
        versions = sorted(int(m.group(1)) for name in os.listdir(self.export_dir)
                          if (m := _EXPORT_NAME.match(name)))
        for v in versions[:-self.export_keep]:
            shutil.rmtree(os.path.join(self.export_dir, f"weights_{v:06d}"),
                          ignore_errors=True)

    async def _reload(self, server: _Server, path: str, version: int) -> None:
        """One reload of `server` to `version`, its traffic quiesced by `sync_mode`; a
        failure marks it down (it is reloaded before its next request)."""
        lock, gate = server.gates()
        async with lock:
            if server.version >= version:
                return
            gate.clear()
            server.reloads_begun += 1
            server.loading = version
            try:
                if self.sync_mode == "drain":
                    while server.outstanding or (self.router and self.router.outstanding):
                        await asyncio.sleep(0.005)
                elif self.sync_mode == "pause":
                    server.paused = True
                    await self._post(server, "/pause_generation", {"mode": "retract"})
                body = {"model_path": path, "weight_version": str(version),
                        "abort_all_requests": self.sync_mode == "abort"}
                answer = await self._post(server, "/update_weights_from_disk", body)
                if not (isinstance(answer, dict) and answer.get("success", False)):
                    raise ServerError(f"update_weights_from_disk({path}) failed: {answer!r}")
                server.version = version
                server.reloads += 1
                server.down_until = 0.0
            except (ServerError, EngineError) as e:
                self._mark_down(server, e)
                raise
            finally:
                try:
                    await self._continue(server)
                finally:
                    gate.set()

    async def _continue(self, server: _Server) -> None:
        """Ends this client's pause of `server`: `/continue_generation` until it answers
        200 (SGLang answers only after clearing its pause flag, and every /generate waits
        on that flag), with up to `max_retries` retries; else marks the server down and
        raises EngineError naming it (it gets no traffic until a later call succeeds)."""
        if not server.paused:
            return
        for attempt in range(self.max_retries + 1):
            try:
                await self._post(server, "/continue_generation", {})
            except (ServerError, EngineError) as e:
                error = e
                if attempt < self.max_retries:
                    await asyncio.sleep(self.backoff * 2**attempt)
                continue
            server.paused = False
            server.stalled = None
            return
        error = EngineError(f"{server.url} stays paused: /continue_generation failed "
                            f"{self.max_retries + 1} times, last: {error}")
        self._mark_down(server, error)
        server.stuck().set()  # its requests in flight wait for a continue: fail them
        raise error

    async def _ready(self, server: _Server) -> None:
        """Waits while `server` reloads; continues it if a pause was left unconfirmed;
        reloads it first if it missed a version (or restarted)."""
        _, gate = server.gates()
        await gate.wait()
        await self._continue(server)
        if server.version < self.version:
            await self._reload(server, self.weights_path, self.version)

    # ------------------------------------------------------------------ HTTP

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._session_loop = loop
        return self._session

    async def _post(self, server: _Server, route: str, payload: dict[str, Any] | None,
                    headers: Mapping[str, str] | None = None) -> Any:
        """POST JSON (GET when payload is None); 5xx and connection failures raise
        ServerError, other non-200s EngineError (ContextLengthError for a context
        overflow), with the server's text."""
        method = "GET" if payload is None else "POST"
        try:
            async with self._http().request(method, server.url + route, json=payload,
                                            headers=headers) as r:
                raw = await r.read()
                if r.status >= 500:
                    raise ServerError(f"{route} answered HTTP {r.status}: "
                                      f"{error_text(r.status, raw)}")
                if r.status != 200:
                    text = error_text(r.status, raw)
                    kind = ContextLengthError if _CONTEXT_ERROR.search(text) else EngineError
                    raise kind(f"{server.url}{route} rejected the request (HTTP {r.status}): "
                               f"{text}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ServerError(f"{type(e).__name__}: {e}") from e
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            raise ServerError(f"{route} answered 200 with a body that is not JSON: "
                              f"{raw[:200]!r}") from e

    def _mark_down(self, server: _Server, error: BaseException) -> None:
        server.down_until = time.monotonic() + self.down_s
        server.last_error = f"{type(error).__name__}: {error}"

    def _pick(self, session: str = "") -> _Server:
        """The gateway if there is one. Else the session's server while it is up; for a
        new session (or one whose server is down), the server with the fewest outstanding
        requests among those up and not reloading; if all are down, the one whose
        penalty ends first (it may be back)."""
        if self.router is not None:
            return self.router
        now = time.monotonic()
        server = self._sticky.get(session)
        if server is not None and server.down_until <= now:
            self._sticky.move_to_end(session)
            return server
        up = [s for s in self.servers if s.down_until <= now]
        if up:
            server = min(up, key=lambda s: (s.open is not None and not s.open.is_set(),
                                            s.outstanding))
        else:
            server = min(self.servers, key=lambda s: s.down_until)
        if session:
            self._sticky[session] = server
            self._sticky.move_to_end(session)
            if len(self._sticky) > STICKY_SESSIONS:
                self._sticky.popitem(last=False)
        return server

    def _behind(self, server: _Server) -> list[_Server]:
        """The servers a request sent to `server` may reach (all, for the gateway)."""
        return self.servers if server is self.router else [server]

    async def _generate_one(self, req: GenerateRequest) -> GenerateResult:
        """One request with retries; a request aborted by a reload is continued from its
        tokens so far on the new weights."""
        payload = request_payload(req, self.seeded)
        headers = {ROUTING_KEY_HEADER: req.session} if req.session else None
        ids, logprobs, version, attempt, start = [], [], None, 0, time.perf_counter()
        while attempt <= self.max_retries:
            server = self._pick(req.session)
            try:
                if self._restarted:
                    await self._find_restarted()
                for behind in self._behind(server):
                    if behind is server or behind.down_until <= time.monotonic():
                        await self._ready(behind)
            except (ServerError, EngineError) as e:
                attempt = await self._failed(server, e, attempt)
                continue
            try:
                part, begun, started_on = await self._ask(server, payload, headers)
            except ServerError as e:
                attempt = await self._failed(server, e, attempt)
                continue
            ids, logprobs = ids + part.output_ids, logprobs + part.logprobs
            version = started_on if version is None else version
            left = req.max_new_tokens - len(ids)
            # Aborted by a reload (mode "abort", or a server whose pause aborts): continue.
            # A client that loads no weights never aborts its requests itself: an abort is
            # another process's client reloading the shared servers.
            by_reload = self._begun(server) != begun or not self.version
            if part.finish_reason == "abort" and by_reload and left > 0:
                if not part.output_ids:  # no progress: bounded like a retry
                    attempt += 1
                payload = {**payload, "input_ids": list(req.prompt_ids) + ids,
                           "sampling_params": {**payload["sampling_params"],
                                               "max_new_tokens": left}}
                continue
            reason = "length" if part.finish_reason == "abort" and left <= 0 \
                else part.finish_reason
            return dataclasses.replace(
                part, output_ids=ids, logprobs=logprobs, finish_reason=reason,
                policy_version=version,
                timings={**part.timings, "decode_s": time.perf_counter() - start})
        status = "; ".join(f"{s.url} ({s.last_error or 'no error recorded'})"
                           for s in self.servers)
        raise EngineError(f"no inference server answered after {self.max_retries + 1} "
                          f"attempts: {status}")

    async def _ask(self, server: _Server, payload: dict[str, Any],
                   headers: Mapping[str, str] | None = None) -> tuple[GenerateResult, int, int]:
        """One /generate on `server` -> (checked result, reloads begun before it, the
        weight version it started on); a malformed answer raises BadAnswerError."""
        server.outstanding += 1
        try:
            begun, started_on = self._begun(server), await self._serving(server)
            body = await self._unless_stuck(server, self._post(server, "/generate", payload,
                                                               headers))
        finally:
            server.outstanding -= 1
        part = parse_response(body, 0.0,
                              max_new_tokens=payload["sampling_params"]["max_new_tokens"],
                              vocab_size=self.vocab_size)
        if "weight_version" not in body["meta_info"]:  # SGLang >= 0.5.0 always writes it
            raise BadAnswerError(f"{server.url} answered without meta_info.weight_version: "
                                 f"the weights it was sampled under are unknown")
        self._check_version(server, parse_weight_version(body["meta_info"]["weight_version"]),
                            started_on)
        server.down_until = 0.0
        return part, begun, started_on

    @staticmethod
    async def _unless_stuck(server: _Server, request) -> Any:
        """Awaits `request` unless this client gives up continuing `server` first: a
        request there waits for a continue that does not come, so it raises ServerError
        and is retried (`_ready` tries the continue again)."""
        answer, stuck = asyncio.ensure_future(request), asyncio.ensure_future(
            server.stuck().wait())
        try:
            await asyncio.wait({answer, stuck}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stuck.cancel()
            if not answer.done():
                answer.cancel()
        if answer.done() and not answer.cancelled():
            return answer.result()
        raise ServerError(f"{server.url} stays paused ({server.last_error}); the request "
                          f"it held is sent again")

    def _begun(self, server: _Server) -> int:
        return sum(s.reloads_begun for s in self._behind(server))

    def _check_version(self, server: _Server, reported: int, started_on: int) -> None:
        """Refuses an answer whose weight version cannot be the one it was sampled under:
        below the version it started on (the server restarted, or went backwards) or
        above any version loaded into it. A restarted server is reloaded before its next
        request; its answer is re-requested (`on_restart` "reload") or fails its
        episode ("drop"). Behind the gateway the answering server is unknown: the answer
        must lie within what any server was given, and a restart is found by asking each
        server for its version before the next request (`_find_restarted`)."""
        behind = self._behind(server)
        top = max(max(s.version, s.loading) for s in behind) if self.version else reported
        if started_on <= reported <= top:
            server.reported = max(server.reported, reported)
            return
        if reported > top:
            raise BadAnswerError(f"{server.url} answered weight_version {reported}, above "
                                 f"the newest it was given ({top})")
        message = (f"{server.url} answered weight_version {reported} for a request sent "
                   f"while it served version {started_on}: it restarted or went backwards")
        if not self.version:  # another process loads the weights: nothing to reload
            raise BadAnswerError(message)
        if server is self.router:
            self._restarted = True
        server.version = min(server.version, reported)
        if self.on_restart == "drop":
            raise EngineError(message + "; its answer is dropped (on_restart='drop')")
        raise ServerError(message + "; it is reloaded and the request sent again")

    async def _serving(self, server: _Server) -> int:
        """The weight version `server` serves now: the one this client loaded into it; for
        a client that has loaded none (the servers are shared with another process's
        client, which updates them), the `weight_version` the server reports
        (/get_model_info, as the updating client sent it; 0 for the weights it started
        with), which never goes backwards. Behind the gateway: the oldest version any
        server holds (0 for a client that loads none)."""
        if server is self.router:
            return min(s.version for s in self.servers) if self.version else 0
        if self.version:
            return server.version
        info = await self._post(server, "/get_model_info", None)
        reported = parse_weight_version(info.get("weight_version", "default")
                                        if isinstance(info, dict) else info)
        if reported < server.reported:
            raise BadAnswerError(f"{server.url} reports weight_version {reported} after "
                                 f"{server.reported}: it restarted or went backwards")
        server.reported = reported
        return reported

    async def _find_restarted(self) -> None:
        """After an answer behind the gateway came from an older version: each server's
        own /get_model_info; one below what this client loaded into it restarted, and is
        reloaded by `_ready`."""
        self._restarted = False
        for server in self.servers:
            with contextlib.suppress(ServerError, EngineError):
                info = await self._post(server, "/get_model_info", None)
                reported = parse_weight_version(info.get("weight_version", "default")
                                                if isinstance(info, dict) else info)
                server.version = min(server.version, reported)

    async def _failed(self, server: _Server, error: BaseException, attempt: int) -> int:
        self._mark_down(server, error)
        if attempt < self.max_retries:
            await asyncio.sleep(self.backoff * 2**attempt)
        return attempt + 1
