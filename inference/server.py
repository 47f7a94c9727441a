"""Serves an `Engine` over HTTP with SGLang's native protocol (0.5.x, token ids only).

The routes and fields are those of `sglang/srt/entrypoints/http_server.py` run with
`--skip-tokenizer-init`, so `inference.sglang.SGLangClient` (and any SGLang client
that sends `input_ids`) talks to this server and to a real SGLang server alike:

  POST /generate                 {input_ids, sampling_params, return_logprob, rid}
                                 -> {text, output_ids, meta_info{id, finish_reason,
                                    prompt_tokens, completion_tokens, output_token_logprobs
                                    [[logprob, id, null], ...], ...}} (a list when batched)
  GET  /health, /health_generate
  GET  /get_model_info, /model_info
  POST /update_weights_from_disk {model_path} -> {success, message, num_paused_requests}
  POST /flush_cache, /abort_request {rid | abort_all}
  POST /pause_generation {mode: abort | retract | in_place}, /continue_generation
  GET  /get_server_info, /server_info -> {version, context_length,
                                    enable_deterministic_inference, ...}
  GET  /v1/models                -> {object: list, data: [{id, object: model, root,
                                    max_model_len, ...}]}

A gateway (SGLang's `smg`) registers a server only once it answers /server_info; the
access log names each request's routing key (the `x-smg-routing-key` header), so a
server's own log shows which episodes it served.

As in SGLang: a request longer than the context length answers 400 with SGLang's
message; while generation is paused new requests wait (this engine cannot hold a
running request, so "retract" and "in_place" let running requests finish), and
"abort" ends running ones; a reload while not paused waits for running requests and
holds new ones. `max_new_tokens` 0 returns the prompt only; /flush_cache empties
the engine's prefix cache. Seeds, stop ids and prompt ids are range-checked here, so a
bad one fails its own request and not the engine batch it would have joined. A batched
/generate (lists of input_ids) is checked item by item before any item runs, and one
invalid item fails the whole call with 400, as SGLang's does (its tokenizer manager
validates every item before sending any to the scheduler, and gathers the items' results
without return_exceptions). An aborted request answers finish_reason abort with the
tokens generated so far, as SGLang's does.

Run: `python -m inference.server --preset tiny --seed 0 --port 30000`, or
`--model-path HF_DIR`, or `--config WORKDIR/config.json` (the model and engine sections
of the config a training run wrote in its workdir, `engine_from_saved_config`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from inference.engine import Engine, GenerateRequest, GenerateResult

log = logging.getLogger("inference.server")

# SGLang sampling parameters that are accepted only at their no-op value here.
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "stop": None,
            "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None,
            "structural_tag": None, "logit_bias": None, "custom_params": None}
# Text-side options that have no effect without a tokenizer.
_IGNORED = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
            "stream_interval"}
_SUPPORTED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
              "sampling_seed"}
_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
PROTOCOL_VERSION = "0.5.3"  # the SGLang release whose protocol this server speaks
ROUTING_KEY_HEADER = "x-smg-routing-key"  # smg's sticky-routing header (the episode id)
ACCESS_LOG = f'%a "%r" %s %Tfs routing_key=%{{{ROUTING_KEY_HEADER}}}i'


def parse_sampling(params: dict[str, Any] | None, prompt_ids: Sequence[int],
                   vocab_size: int | None = None, return_logprob: bool = True
                   ) -> tuple[GenerateRequest, bool]:
    """SGLang `sampling_params` + prompt -> (GenerateRequest, prompt_only); bad values
    raise ValueError. prompt_only: max_new_tokens was 0 (the request asks for no output).
    vocab_size: stop ids must lie below it. return_logprob: the body's, for this item."""
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"sampling_params must be an object, got {_clip(params)}")
    params = dict(params or {})
    for key, value in params.items():
        if key in _SUPPORTED or key in _IGNORED:
            continue
        if key not in _NEUTRAL:
            raise ValueError(f"unknown sampling parameter {key!r}")
        if value not in (_NEUTRAL[key], None, [], {}):
            raise ValueError(f"sampling parameter {key}={value!r} is not supported by this "
                             f"server (only {_NEUTRAL[key]!r})")
    max_new = params.get("max_new_tokens")
    max_new = _DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
    if not _is_int(max_new) or max_new < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {_clip(max_new)}")
    seed = params.get("sampling_seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**32):
        raise ValueError(f"sampling_seed must be an integer in [0, 2**32), got {seed!r}")
    for key in ("temperature", "top_p", "top_k"):
        value = params.get(key)
        if value is not None and not (isinstance(value, int | float)
                                      and not isinstance(value, bool)):
            raise ValueError(f"{key} must be a number, got {_clip(value)}")
    top_k = params.get("top_k")
    if top_k is not None and not (_is_int(top_k) and (top_k == -1 or 1 <= top_k < 2**31)):
        raise ValueError(f"top_k must be -1 (every token) or an integer in [1, 2**31), got "
                         f"{_clip(top_k)}")
    stops = params.get("stop_token_ids") or []
    if not isinstance(stops, list):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {_clip(stops)}")
    stops = tuple(stops)
    bad = [t for t in stops if not _is_int(t) or t < 0
           or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise ValueError(f"stop_token_ids {bad} are not token ids of this model "
                         f"(vocabulary size {vocab_size})")
    request = GenerateRequest(
        prompt_ids=prompt_ids, max_new_tokens=max(max_new, 1),
        temperature=float(_given(params, "temperature", 1.0)),
        top_p=float(_given(params, "top_p", 1.0)), top_k=int(_given(params, "top_k", -1)),
        stop_token_ids=stops, seed=seed, return_logprob=return_logprob)
    return request, max_new == 0


def _given(params: dict[str, Any], key: str, default: Any) -> Any:
    return default if params.get(key) is None else params[key]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


async def read_object(http: web.Request, empty_ok: bool = False) -> dict[str, Any]:
    """The request's JSON body as an object; ValueError with the reason otherwise (not
    JSON, nested too deeply for the parser, or not an object). empty_ok: no body is {}."""
    raw = await http.read()
    if not raw.strip() and empty_ok:
        return {}
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ValueError("the request body is nested too deeply") from None
    except ValueError as e:  # includes UnicodeDecodeError
        raise ValueError(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {_clip(body)}")
    return body


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} inputs")
        return value
    return [value] * n


def parse_generate(body: dict[str, Any], vocab_size: int | None = None
                   ) -> tuple[bool, list[tuple[GenerateRequest, bool]], list[str]]:
    """A /generate body -> (batched, (request, prompt_only) per item, rids); each
    request carries its item's return_logprob."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    if body.get("text") is not None or body.get("input_embeds") is not None:
        raise ValueError("this server has no tokenizer (like SGLang's --skip-tokenizer-init): "
                         "send input_ids, not text or input_embeds")
    if body.get("stream"):
        raise ValueError("stream=true is not supported by this server")
    if body.get("logprob_start_len") not in (None, -1):
        raise ValueError(f"logprob_start_len={body['logprob_start_len']!r} is not supported "
                         "(output log-probs only; use -1)")
    if body.get("top_logprobs_num") not in (None, 0):
        raise ValueError(f"top_logprobs_num={body['top_logprobs_num']!r} is not supported")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids must be a non-empty list of token ids or a list of lists")
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    n = len(prompts)
    sampling = _per_item(body.get("sampling_params"), n, "sampling_params")
    rids = _per_item(body.get("rid"), n, "rid")
    rids = [r if r is not None else uuid.uuid4().hex for r in rids]
    if not all(isinstance(r, str) for r in rids):
        raise ValueError(f"rid must be a string (or a list of strings), got "
                         f"{_clip(body.get('rid'))}")
    if len(set(rids)) != len(rids):
        raise ValueError(f"rid has duplicate entries {_clip(rids)}")
    logprob = [False if x is None else x
               for x in _per_item(body.get("return_logprob"), n, "return_logprob")]
    if not all(isinstance(x, bool) for x in logprob):
        raise ValueError(f"return_logprob must be true or false (or a list of them), got "
                         f"{_clip(body.get('return_logprob'))}")
    requests = []
    for i, (prompt, params) in enumerate(zip(prompts, sampling, strict=True)):
        if not isinstance(prompt, list) or not all(_is_int(t) for t in prompt):
            raise ValueError(f"input_ids[{i}] must be a list of integers, got "
                             f"{_clip(prompt)}")
        if vocab_size is not None and any(t >= vocab_size for t in prompt):
            raise ValueError(f"The input_ids {prompt[:64]} contains values greater than the "
                             f"vocab size ({vocab_size}).")  # SGLang's words
        requests.append(parse_sampling(params, prompt, vocab_size, logprob[i]))
    return batched, requests, rids


def _finish_reason(result: GenerateResult, message: str = "") -> dict[str, Any]:
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.output_ids[-1]}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.output_ids)}
    return {"type": "abort", "message": message or "request aborted"}


def render(result: GenerateResult, request: GenerateRequest, rid: str, weight_version: str,
           latency: float) -> dict[str, Any]:
    """One SGLang /generate response item."""
    meta = {
        "id": rid,
        "finish_reason": _finish_reason(result),
        "prompt_tokens": len(request.prompt_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": result.cached_tokens,
        "weight_version": weight_version,
        "e2e_latency": latency,
    }
    if request.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                         zip(result.logprobs, result.output_ids, strict=True)]
        meta["input_token_logprobs"] = []
    return {"text": "", "output_ids": list(result.output_ids), "meta_info": meta}


async def _prompt_only(request: GenerateRequest) -> list[GenerateResult]:
    return [GenerateResult([], [], "length")]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class Server:
    """Routes of one engine. `app()` builds the aiohttp application."""

    def __init__(self, engine: Engine, model_path: str | None = None,
                 weight_version: str = "default", context_length: int | None = None):
        self.engine = engine
        self.model_path = model_path
        self.weight_version = weight_version
        self.context_length = context_length or getattr(engine, "max_len", None)
        self.vocab_size = getattr(engine, "vocab_size", None)
        self.inflight: dict[str, tuple[asyncio.Task, GenerateRequest]] = {}
        self.paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._reloading: asyncio.Event | None = None
        self.started = time.time()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 2**20)
        app.add_routes([
            web.post("/generate", self.generate),
            web.get("/health", self.health),
            web.get("/health_generate", self.health_generate),
            web.get("/get_model_info", self.model_info),
            web.get("/model_info", self.model_info),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/flush_cache", self.flush_cache),
            web.get("/flush_cache", self.flush_cache),
            web.post("/abort_request", self.abort_request),
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.get("/get_server_info", self.server_info),
            web.get("/server_info", self.server_info),
            web.get("/v1/models", self.models),
        ])
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def generate(self, http: web.Request) -> web.Response:
        start = time.perf_counter()
        try:
            batched, items, rids = parse_generate(await read_object(http), self.vocab_size)
            for req, prompt_only in items:
                self._check_context(req, prompt_only)
            busy = [r for r in rids if r in self.inflight]
            if busy:
                raise ValueError(f"rid {busy[0]!r} is already running")
        except ValueError as e:
            return _error(400, str(e))
        await self._resumed.wait()
        while self._reloading is not None:
            await self._reloading.wait()
        requests = [req for req, _ in items]
        tasks = []
        for rid, (req, prompt_only) in zip(rids, items, strict=True):
            task = asyncio.ensure_future(_prompt_only(req) if prompt_only
                                         else self.engine.generate([req]))
            self.inflight[rid] = (task, req)
            tasks.append(task)
        try:
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for rid in rids:
                self.inflight.pop(rid, None)
        items = []
        for outcome, req, rid in zip(outcomes, requests, rids, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                outcome = [GenerateResult([], [], "abort")]
            elif isinstance(outcome, ValueError):
                return _error(400, str(outcome))
            elif isinstance(outcome, BaseException):
                log.exception("generate failed", exc_info=outcome)
                return _error(500, f"{type(outcome).__name__}: {outcome}")
            items.append(render(outcome[0], req, rid, self.weight_version,
                                time.perf_counter() - start))
        return web.json_response(items if batched else items[0])

    def _check_context(self, req: GenerateRequest, prompt_only: bool) -> None:
        """SGLang's two refusals, in its words (clients recognise them)."""
        limit, n = self.context_length, len(req.prompt_ids)
        if limit is None:
            return
        if n >= limit:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context "
                             f"length ({limit} tokens).")
        total = n + (0 if prompt_only else req.max_new_tokens)
        if total > limit:
            raise ValueError(f"Requested token count exceeds the model's maximum context "
                             f"length of {limit} tokens. You requested a total of {total} "
                             f"tokens: {n} tokens from the input messages and "
                             f"{total - n} tokens for the completion.")

    async def health(self, http: web.Request) -> web.Response:
        ok = await self.engine.health()
        return web.Response(status=200 if ok else 503)

    async def health_generate(self, http: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(
                self.engine.generate([GenerateRequest([0], 1, temperature=0.0)]), timeout=60)
        except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
            return web.Response(status=503, text=f"{type(e).__name__}: {e}")
        return web.Response(status=200)

    async def model_info(self, http: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        })

    async def update_weights_from_disk(self, http: web.Request) -> web.Response:
        """Aborts running requests if asked; unless paused, waits for running requests to
        finish and holds new ones until the weights are loaded (SGLang's writer lock)."""
        reloading = asyncio.Event()
        try:
            body = await read_object(http)
            path = body["model_path"]
            if not isinstance(path, str):
                raise TypeError(f"model_path must be a string, got {path!r}")
            if body.get("abort_all_requests"):
                self._abort(list(self.inflight.values()))
            if not self.paused:
                while self._reloading is not None:
                    await self._reloading.wait()
                self._reloading = reloading
                await asyncio.gather(*(t for t, _ in self.inflight.values()),
                                     return_exceptions=True)
            await self.engine.update_weights(path)
        except Exception as e:  # noqa: BLE001 - reported to the caller as SGLang does
            return web.json_response({"success": False, "num_paused_requests": 0,
                                      "message": f"Failed to update weights: "
                                                 f"{type(e).__name__}: {e}"}, status=400)
        finally:
            if self._reloading is reloading:
                self._reloading = None
            reloading.set()
        self.model_path = path
        self.weight_version = str(body.get("weight_version") or path)
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": "Succeeded to update model weights."})

    async def flush_cache(self, http: web.Request) -> web.Response:
        self.engine.flush_cache()
        return web.Response(text="Cache flushed.\n")

    async def abort_request(self, http: web.Request) -> web.Response:
        try:
            body = await read_object(http, empty_ok=True)
            rid, abort_all = body.get("rid"), body.get("abort_all", False)
            if not isinstance(abort_all, bool):
                raise ValueError(f"abort_all must be true or false, got {_clip(abort_all)}")
            if not isinstance(rid, str | None):
                raise ValueError(f"rid must be a string, got {_clip(rid)}")
        except ValueError as e:
            return _error(400, str(e))
        if abort_all:
            targets = list(self.inflight.values())
        else:
            targets = [self.inflight[rid]] if rid in self.inflight else []
        self._abort(targets)
        return web.Response(status=200)

    async def pause_generation(self, http: web.Request) -> web.Response:
        try:
            body = await read_object(http, empty_ok=True)
        except ValueError as e:
            return _error(400, str(e))
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"pause_generation mode must be abort, retract or in_place, "
                               f"got {mode!r}")
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            self._abort(list(self.inflight.values()))
        return web.json_response({})

    async def continue_generation(self, http: web.Request) -> web.Response:
        self.paused = False
        self._resumed.set()
        return web.json_response({})

    async def server_info(self, http: web.Request) -> web.Response:
        return web.json_response({
            "version": PROTOCOL_VERSION, "model_path": self.model_path,
            "context_length": self.context_length, "skip_tokenizer_init": True,
            # Every request is sampled from its seed (inference.embedded).
            "enable_deterministic_inference": True,
            "weight_version": self.weight_version, "is_paused": self.paused})

    async def models(self, http: web.Request) -> web.Response:
        """OpenAI's model list, as SGLang's /v1/models writes it (one served model)."""
        name = self.model_path or "default"
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(self.started), "owned_by": "sglang",
            "root": name, "max_model_len": self.context_length}]})

    def _abort(self, running: Sequence[tuple[asyncio.Task, GenerateRequest]]) -> None:
        """Ends running requests; they answer finish_reason abort with their tokens so far
        (or none, from an engine that cannot abort a request: its call is cancelled)."""
        for task, req in running:
            if not self.engine.abort(req):
                task.cancel()

    async def _on_shutdown(self, app: web.Application) -> None:
        for task, _ in list(self.inflight.values()):
            task.cancel()


# ----------------------------------------------------------------------------- command line


def engine_from_saved_config(path: str) -> tuple[Engine, str | None]:
    """The engine of a run's config.json (train.py writes it in the workdir): its model
    section, seed and engine options, as train.py builds them."""
    from inference.embedded import EmbeddedOptions  # (as in build_engine)

    with open(path) as f:
        saved = json.load(f)
    model = saved["model"]
    return build_engine(model["hf_path"] or None, model["preset"] or None, int(saved["seed"]),
                        model, EmbeddedOptions.from_section(saved["engine"]))


def build_engine(hf_dir: str | None, preset: str | None, seed: int,
                 overrides: dict[str, Any] | None, options) -> tuple[Engine, str | None]:
    """An EmbeddedEngine (with EmbeddedOptions `options`) over an HF directory or a
    randomly initialised preset (with the Qwen3Config fields found in `overrides`,
    models.loading.model_config)."""
    # JAX and the model load only in a process that serves a model of its own: the
    # Server above wraps any Engine, and its importers need neither.
    from inference.embedded import EmbeddedEngine
    from models import hf_io, loading

    if hf_dir:
        _, model = hf_io.load_hf(hf_dir)
    elif preset:
        model_cfg = {**(overrides or {}), "preset": preset, "hf_path": ""}
        model = loading.build_model(model_cfg, loading.model_config(model_cfg), None, seed)
    else:
        raise ValueError("give --model-path, --preset or --config")
    engine = EmbeddedEngine(model, options, seed=seed)
    return engine, hf_dir


# The embedded engine's options on the command line, with their help; the defaults are
# the smallest engine's (a standalone server's, as SGLang's launcher has its own); a
# training run's engine section (--config) has those of configs.common.engine_defaults.
OPTION_HELP = {"max_batch": "most requests generating at once",
               "max_len": "longest prompt + output (--context-length sets it)",
               "min_batch": "smallest batch bucket", "min_len": "smallest length bucket",
               "min_cache_len": "smallest attention window",
               "prefix_cache_tokens": "positions of keys/values kept for prompt-prefix reuse "
                                      "(0: off)",
               "chunk_steps": "most decode steps per call",
               "min_chunk_steps": "fewest decode steps per call (0: chunk-steps // 4)"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from inference.embedded import SMALLEST  # (as in build_engine)

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a run's config.json (train.py writes it in the workdir; "
                                     "uses its model and engine sections)")
    p.add_argument("--model-path", help="HF safetensors directory")
    p.add_argument("--preset", help="random model of a models.qwen3.PRESETS size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--context-length", type=int, default=0,
                   help="SGLang's flag: longest prompt + output (sets --max-len)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="accepted for SGLang's command line; sampling is always seeded here")
    for name, text in OPTION_HELP.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(SMALLEST, name),
                       help=text)
    return p.parse_args(argv)


def engine_options(args: argparse.Namespace):
    """The EmbeddedOptions of a command line (without --config)."""
    from inference.embedded import EmbeddedOptions  # (as in build_engine)

    options = {name: getattr(args, name) for name in OPTION_HELP}
    return EmbeddedOptions(**{**options, "max_len": args.context_length or args.max_len})


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.config:
        engine, model_path = engine_from_saved_config(args.config)
    else:
        engine, model_path = build_engine(args.model_path, args.preset, args.seed, None,
                                          engine_options(args))
    server = Server(engine, model_path=model_path)
    log.info("serving on http://%s:%d", args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None,
                handle_signals=True, access_log_format=ACCESS_LOG)
    engine.close()


if __name__ == "__main__":
    main()
