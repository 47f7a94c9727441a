"""A stand-in for an SGLang 0.5.x server, written from SGLang's source and documentation
(sglang/srt/entrypoints/http_server.py, managers/tokenizer_manager.py and
tokenizer_communicator_mixin.py, docs/advanced_features/sglang_for_rl.md), for tests
of the client's protocol where no GPU can run the real one.

What it reproduces:
- `/generate` holds a reader lock of `model_update_lock` for the whole request and
  first waits while generation is paused; `/update_weights_from_disk` takes the writer
  lock (so it waits for in-flight requests and blocks new ones) unless the server is
  paused, aborts every request first with `abort_all_requests`, and records
  `weight_version`.
- `/pause_generation` {"mode": "abort" | "retract" | "in_place"}: "abort" ends every
  request with finish_reason abort and its tokens so far; the other two hold running
  requests until `/continue_generation`.
- Requests longer than `context_length` answer 400 with SGLang's messages.
- `/get_server_info` reports `version`, `context_length` and
  `enable_deterministic_inference`, and the scheduler's `max_total_num_tokens` (the KV
  pool, `kv_tokens`) and `max_req_input_len` = min(context length, KV pool) - 6
  (scheduler.py: max_req_len = min(...) - 1, max_req_input_len = max_req_len - 5);
  `context_length` is null unless the server was launched with --context-length
  (`launched_context_length`), as SGLang's server_args report it. `sampling_seed` is
  rejected below 0.5.3.
- A prompt holding `nan_token` finishes with `{"type": "stop", "matched": "NaN happened"}`.
- `error_style` chooses how 400s are written: SGLang's `{"error": {"message": ...}}`,
  a plain string under "error", or a text body.
- `meta_info.weight_version` is the server's weight version when the answer is written
  (tokenizer_manager.py: `self.server_args.weight_version`): "default" until a reload
  names one.

For tests of a misbehaving server: `faults[route]` is a list of failures the next calls
of `route` meet instead of running (an HTTP status, or "drop" to close the connection
unanswered); `answer_hook` rewrites each /generate answer before it is sent; `restart()`
puts the server back to its launch weights, as a process restarted on its port would be.

Token i of an output is a function of the whole context, so a request continued from
its tokens so far produces what the uninterrupted request would have.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

from aiohttp import web

VOCAB = 1000


def next_token(context: list[int], vocab: int = VOCAB) -> int:
    return (sum(context) * 31 + len(context)) % vocab


def expected_ids(prompt: list[int], n: int, vocab: int = VOCAB) -> list[int]:
    """The `n` tokens the stub generates greedily after `prompt`."""
    out = []
    for _ in range(n):
        out.append(next_token(list(prompt) + out, vocab))
    return out


def token_logprob(token: int) -> float:
    return -0.01 * (token % 50) - 0.01


class StubSGLang:
    """One server; `await start()` serves it on 127.0.0.1, `await stop()` ends it."""

    def __init__(self, *, version: str = "0.5.3", context_length: int = 4096,
                 deterministic: bool = True, token_s: float = 0.002, load_s: float = 0.05,
                 nan_token: int = 999, error_style: str = "object", vocab: int = VOCAB,
                 launched_context_length: bool = True, kv_tokens: int = 1 << 20):
        self.version, self.context_length = version, context_length
        self.launched_context_length, self.kv_tokens = launched_context_length, kv_tokens
        self.deterministic, self.token_s, self.load_s = deterministic, token_s, load_s
        self.nan_token, self.error_style, self.vocab = nan_token, error_style, vocab
        self.prompt_lengths: list[int] = []  # input length of every /generate
        self.weight_version, self.model_path = "default", "init"
        self.reloads: list[str] = []  # model_path of every reload, in order
        self.reload_overlaps = 0  # token steps taken while a reload ran (must stay 0)
        self.generated_requests = 0
        self.faults: dict[str, list[int | str]] = {}
        self.answer_hook = None
        self.routes_called: list[str] = []
        self._readers = 0
        self._writer = False
        self._lock_cond = asyncio.Condition()
        self._pause_cond = asyncio.Condition()
        self._paused = False
        self._reloading = False
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ------------------------------------------------------------------ lifetime

    async def start(self) -> StubSGLang:
        app = web.Application(middlewares=[self._inject_faults])
        app.add_routes([
            web.post("/generate", self.generate),
            web.get("/health", self.health),
            web.get("/get_server_info", self.server_info),
            web.get("/get_model_info", self.model_info),
            web.post("/update_weights_from_disk", self.update_weights),
            web.post("/pause_generation", self.pause),
            web.post("/continue_generation", self.resume),
            web.post("/flush_cache", self.health),
        ])
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def restart(self) -> None:
        """The state of a fresh process on the launch weights (pause flag cleared)."""
        self.weight_version, self.model_path, self._paused = "default", "init", False

    @web.middleware
    async def _inject_faults(self, http: web.Request, handler):
        self.routes_called.append(http.path)
        queue = self.faults.get(http.path)
        if not queue:
            return await handler(http)
        fault = queue.pop(0)
        if fault == "drop":
            http.transport.close()
            return web.Response()
        return web.json_response({"error": {"message": f"injected {fault}"}}, status=fault)

    # ------------------------------------------------------------------ model_update_lock

    async def _acquire_reader(self) -> None:
        async with self._lock_cond:
            await self._lock_cond.wait_for(lambda: not self._writer)
            self._readers += 1

    async def _release_reader(self) -> None:
        async with self._lock_cond:
            self._readers -= 1
            self._lock_cond.notify_all()

    async def _acquire_writer(self) -> None:
        async with self._lock_cond:
            await self._lock_cond.wait_for(lambda: not self._writer)
            self._writer = True  # new readers wait from here on
            await self._lock_cond.wait_for(lambda: self._readers == 0)

    async def _release_writer(self) -> None:
        async with self._lock_cond:
            self._writer = False
            self._lock_cond.notify_all()

    # ------------------------------------------------------------------ routes

    def _bad_request(self, message: str) -> web.Response:
        if self.error_style == "string":
            return web.json_response({"error": message}, status=400)
        if self.error_style == "text":
            return web.Response(text=message, status=400)
        return web.json_response({"error": {"message": message}}, status=400)

    async def generate(self, http: web.Request) -> web.Response:
        body = await http.json()
        ids, params = list(body["input_ids"]), dict(body.get("sampling_params") or {})
        if "sampling_seed" in params and tuple(map(int, self.version.split(".")[:3])) < (0, 5, 3):
            return self._bad_request("SamplingParams.__init__() got an unexpected keyword "
                                     "argument 'sampling_seed'")
        max_new = int(params.get("max_new_tokens", 128))
        self.prompt_lengths.append(len(ids))
        if len(ids) >= self.context_length:
            return self._bad_request(f"The input ({len(ids)} tokens) is longer than the "
                                     f"model's context length ({self.context_length} tokens).")
        if len(ids) + max_new > self.context_length:
            return self._bad_request(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of {len(ids) + max_new} "
                f"tokens: {len(ids)} tokens from the input messages and {max_new} tokens for "
                f"the completion. Please reduce the number of tokens in the input messages or "
                f"the completion to fit within the limit.")
        async with self._pause_cond:
            await self._pause_cond.wait_for(lambda: not self._paused)
        await self._acquire_reader()
        rid = uuid.uuid4().hex
        self._running.add(rid)
        self.generated_requests += 1
        try:
            out, finish = await self._decode(rid, ids, max_new, set(params.get("stop_token_ids")
                                                                    or ()))
        finally:
            self._running.discard(rid)
            self._aborted.discard(rid)
            await self._release_reader()
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
                "completion_tokens": len(out), "cached_tokens": 0,
                "weight_version": self.weight_version,
                "output_token_logprobs": [[token_logprob(t), t, None] for t in out]}
        answer = {"text": "", "output_ids": out, "meta_info": meta}
        if self.answer_hook is not None:
            answer = self.answer_hook(answer)
        return web.json_response(answer)

    async def _decode(self, rid: str, ids: list[int], max_new: int, stops: set[int]):
        out: list[int] = []
        while True:
            if rid in self._aborted:
                return out, {"type": "abort", "message": "Abort all requests."}
            if self._paused:
                await asyncio.sleep(self.token_s)
                continue
            if len(out) == max_new:
                return out, {"type": "length", "length": max_new}
            if self.nan_token in ids:
                return out, {"type": "stop", "matched": "NaN happened"}
            await asyncio.sleep(self.token_s)
            if self._reloading and not self._paused:
                self.reload_overlaps += 1
            token = next_token(ids + out, self.vocab)
            out.append(token)
            if token in stops:
                return out, {"type": "stop", "matched": token}

    async def update_weights(self, http: web.Request) -> web.Response:
        body = await http.json()
        if body.get("abort_all_requests"):
            self._aborted |= self._running
        paused = self._paused
        if not paused:
            await self._acquire_writer()
        self._reloading = True
        try:
            await asyncio.sleep(self.load_s)
            path = body["model_path"]
            if not os.path.isdir(path):
                return web.json_response(
                    {"success": False, "num_paused_requests": 0,
                     "message": f"Failed to update weights: no directory {path}"}, status=400)
            self.reloads.append(path)
            self.model_path = path
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        finally:
            self._reloading = False
            if not paused:
                await self._release_writer()
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": "Succeeded to update model weights."})

    async def pause(self, http: web.Request) -> web.Response:
        mode = (await http.json()).get("mode", "abort")
        if mode == "abort":
            self._aborted |= self._running
        else:
            async with self._pause_cond:
                self._paused = True
        return web.json_response({})

    async def resume(self, http: web.Request) -> web.Response:
        async with self._pause_cond:
            self._paused = False
            self._pause_cond.notify_all()
        return web.json_response({})

    async def health(self, http: web.Request) -> web.Response:
        return web.Response(text="")

    async def server_info(self, http: web.Request) -> web.Response:
        return web.json_response({
            "version": self.version,
            "context_length": self.context_length if self.launched_context_length else None,
            "max_total_num_tokens": self.kv_tokens,
            "max_req_input_len": min(self.context_length, self.kv_tokens) - 6,
            "enable_deterministic_inference": self.deterministic,
            "model_path": self.model_path, "skip_tokenizer_init": True})

    async def model_info(self, http: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": True,
                                  "weight_version": self.weight_version})
