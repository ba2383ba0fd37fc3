"""brisk serve: an OpenAI-compatible HTTP API over one loaded model (FastAPI + uvicorn).

One generation runs at a time (batch 1, the engine's design point), in one
worker thread, so the event loop never waits for the model; later requests
wait in a bounded FIFO queue and beyond it get HTTP 429. Streamed text
crosses from the worker by an asyncio queue, split on UTF-8 boundaries by
the tokenizer's StreamDecoder; a client that goes away cancels its
generation at the next token. Every error is a JSON body in OpenAI's format
({"error": {"message", "type", "param", "code"}}), never a traceback.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import LLM, _text_pieces
from .errors import BriskError

MAX_BODY_BYTES = 4 << 20
MAX_CHOICES = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, kind="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(status: int, message: str, kind="invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


# --- requests (unknown fields are ignored, as OpenAI does) ----------------------

class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False  # (an extension, as vLLM's: generate max_tokens whatever comes; for load tests)


class CompletionRequest(Sampling):
    prompt: Union[str, list[str], list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


# --- the engine: one generation at a time, in a worker thread ------------------

class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("brisk_requests", "HTTP requests by path and status", ["path", "status"],
                                registry=self.registry)
        self.tokens = Counter("brisk_generated_tokens", "tokens generated", registry=self.registry)
        self.ttft = Histogram("brisk_time_to_first_token_seconds", "from admission to the first token",
                              registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("brisk_inter_token_seconds", "between two tokens of one generation",
                             registry=self.registry, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        self.queue = Gauge("brisk_queue_depth", "requests admitted and not finished", registry=self.registry)


class Engine:
    """The model behind a single worker thread, and the admission queue in front of it."""

    def __init__(self, llm: LLM, queue: int, metrics: Metrics):
        self.llm, self.limit, self.metrics = llm, queue + 1, metrics  # (the one running counts)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="brisk-engine")
        self.admitted = 0
        self.closing = threading.Event()

    def admit(self):
        if self.admitted >= self.limit:
            raise APIError(429, f"the server is busy: {self.limit - 1} requests are already waiting",
                           "rate_limit_error", code="queue_full")
        self.admitted += 1
        self.metrics.queue.set(self.admitted)

    def release(self):
        self.admitted -= 1
        self.metrics.queue.set(self.admitted)

    async def run(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)
        except BriskError as e:  # a request the model cannot serve
            raise APIError(400, str(e)) from None

    def generate(self, ids: list[int], max_tokens: int, sampling: dict, stop, emit, cancelled,
                 ignore_eos: bool = False) -> dict:
        """In the worker: generate, call emit(text) per piece, stop when cancelled().
        Returns the token ids generated and the finish reason."""
        if cancelled() or self.closing.is_set():
            return {"ids": [], "finish_reason": "cancelled"}
        tokens, state = [], {"done": False}
        eos = set() if ignore_eos else set(self.llm.tokenizer.eos_ids)
        t0 = last = time.perf_counter()

        def counted():
            nonlocal last
            for t in self.llm.stream_ids(ids, max_tokens, stop_ids=eos, **sampling):
                now = time.perf_counter()
                (self.metrics.ttft if not tokens else self.metrics.itl).observe(now - (t0 if not tokens else last))
                last = now
                tokens.append(t)
                self.metrics.tokens.inc()
                yield t
            state["done"] = True

        pieces = _text_pieces(self.llm.tokenizer, counted(), stop, ends=eos)
        try:
            for piece in pieces:
                if cancelled() or self.closing.is_set():
                    return {"ids": tokens, "finish_reason": "cancelled"}
                emit(piece)
        finally:
            pieces.close()
        length = state["done"] and len(tokens) >= max_tokens and (not tokens or tokens[-1] not in eos)
        return {"ids": tokens, "finish_reason": "length" if length else "stop"}


# --- the app ---------------------------------------------------------------------

def make_app(llm: LLM, model_name: str, api_key: str | None = None, queue: int = 16) -> FastAPI:
    metrics = Metrics()
    engine = Engine(llm, queue, metrics)
    app = FastAPI(title="brisk-lm", version="0.1.0")
    app.state.engine = engine
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_body(e.status, e.message, e.kind, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_body(400, "the request body is not valid JSON", code="invalid_json")
        if not loc:  # (the body itself: not an object)
            return error_body(400, "the request body must be a JSON object", code="invalid_json")
        param = ".".join(loc) or None
        return error_body(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param,
                          code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_body(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):  # a bug of ours: said as one line, the server stays up
        return error_body(500, f"internal error: {type(e).__name__}: {str(e)[:200]}", "server_error")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        try:
            size = int(request.headers.get("content-length") or 0)
        except ValueError:
            size = 0
        if size > MAX_BODY_BYTES:
            response = error_body(413, f"the request body is {size} bytes, over the limit of {MAX_BODY_BYTES}",
                                  code="body_too_large")
        elif api_key and path != "/health" and not authorized(request, api_key):
            response = error_body(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                  "authentication_error", code="invalid_api_key")
        else:
            response = await call_next(request)
        known = path if path in KNOWN_PATHS else "other"
        metrics.requests.labels(known, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "brisk-lm"}]}

    def check_model(body: Sampling):
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} is not served here (this server serves {model_name!r})",
                           "not_found_error", "model", "model_not_found")

    def sampling_of(body: Sampling, index: int) -> dict:
        return dict(temperature=body.temperature, top_p=None if body.top_p >= 1 else body.top_p,
                    top_k=body.top_k, min_p=body.min_p,
                    seed=None if body.seed is None else body.seed + index)

    def checked(ids: list[int], max_tokens: int):
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        try:
            llm.check(ids, max_tokens)
        except BriskError as e:
            raise APIError(400, str(e), param="max_tokens" if len(ids) < llm.generator.max_seq_length
                           else "prompt", code="context_length_exceeded") from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        tok = llm.require_tokenizer()
        prompts = [body.prompt] if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) \
            else body.prompt
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        vocab = llm.model.args.vocab_size
        encoded = []
        for p in prompts:
            ids = tok.encode(p) if isinstance(p, str) else list(p)
            if any(not 0 <= i < vocab for i in ids):
                raise APIError(400, f"prompt: token ids must be in 0..{vocab - 1}", param="prompt")
            checked(ids, body.max_tokens)
            encoded.append((p if isinstance(p, str) else tok.decode(ids), ids))
        if body.stream and (body.logprobs is not None or body.echo):
            raise APIError(400, "logprobs and echo are not supported with stream", param="logprobs")
        jobs = [(text, ids, i) for text, ids in encoded for i in range(body.n)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        meta = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        if body.stream:
            return stream(request, jobs, body, meta, chat=False)
        engine.admit()
        try:
            choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
            for index, (text, ids, i) in enumerate(jobs):
                pieces = []
                out = await engine.run(engine.generate, ids, body.max_tokens, sampling_of(body, i), body.stop,
                                       pieces.append, lambda: False, body.ignore_eos)
                completion = "".join(pieces)
                choice = {"text": (text if body.echo else "") + completion, "index": index,
                          "logprobs": None, "finish_reason": out["finish_reason"]}
                if body.logprobs is not None:
                    choice["logprobs"] = await engine.run(completion_logprobs, llm, ids, out["ids"],
                                                          body.logprobs, body.echo)
                choices.append(choice)
                usage["prompt_tokens"] += len(ids) if i == 0 else 0
                usage["completion_tokens"] += len(out["ids"])
        finally:
            engine.release()
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {**meta, "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body)
        messages = [{"role": m.role, "content": message_text(m.content)} for m in body.messages]
        ids = llm.chat_ids(messages)
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            max(1, min(4096, llm.generator.max_seq_length - len(ids)))
        checked(ids, max_tokens)
        if body.stream and body.logprobs:
            raise APIError(400, "logprobs are not supported with stream", param="logprobs")
        body.max_tokens = max_tokens
        jobs = [("", ids, i) for i in range(body.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        meta = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        if body.stream:
            return stream(request, jobs, body, {**meta, "object": "chat.completion.chunk"}, chat=True)
        engine.admit()
        try:
            choices, completion_tokens = [], 0
            for index, (_, ids, i) in enumerate(jobs):
                pieces = []
                out = await engine.run(engine.generate, ids, max_tokens, sampling_of(body, i), body.stop,
                                       pieces.append, lambda: False, body.ignore_eos)
                choice = {"index": index, "message": {"role": "assistant", "content": "".join(pieces)},
                          "logprobs": None, "finish_reason": out["finish_reason"]}
                if body.logprobs:
                    choice["logprobs"] = await engine.run(chat_logprobs, llm, ids, out["ids"], body.top_logprobs or 0)
                choices.append(choice)
                completion_tokens += len(out["ids"])
        finally:
            engine.release()
        usage = {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(ids) + completion_tokens}
        return {**meta, "choices": choices, "usage": usage}

    def stream(request: Request, jobs, body, meta: dict, chat: bool) -> StreamingResponse:
        engine.admit()  # (429 before the stream starts)
        loop = asyncio.get_running_loop()

        async def events():
            cancel = threading.Event()
            try:
                completion_tokens = 0
                for index, (_, ids, i) in enumerate(jobs):
                    queue: asyncio.Queue = asyncio.Queue()
                    if chat:
                        yield sse({**meta, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
                    emit = lambda piece: loop.call_soon_threadsafe(queue.put_nowait, piece)  # noqa: E731
                    job = loop.run_in_executor(engine.worker, engine.generate, ids, body.max_tokens,
                                               sampling_of(body, i), body.stop, emit, cancel.is_set, body.ignore_eos)
                    job.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
                    while (piece := await queue.get()) is not None:
                        delta = {"content": piece} if chat else None
                        choice = {"index": index, "delta": delta} if chat else {"index": index, "text": piece}
                        yield sse({**meta, "choices": [{**choice, "logprobs": None, "finish_reason": None}]})
                    try:
                        out = await job
                    except BriskError as e:  # (the status is sent already: the error goes in the stream)
                        yield sse({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                             "code": None}})
                        return
                    completion_tokens += len(out["ids"])
                    last = {"index": index, "delta": {}} if chat else {"index": index, "text": ""}
                    yield sse({**meta, "choices": [{**last, "logprobs": None, "finish_reason": out["finish_reason"]}]})
                if (body.stream_options or {}).get("include_usage"):
                    prompt_tokens = sum(len(ids) for _, ids, i in jobs if i == 0)
                    yield sse({**meta, "choices": [], "usage": {
                        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens}})
                yield "data: [DONE]\n\n"
            finally:  # also when the client went away (the task is cancelled): the worker stops at its next token
                cancel.set()
                engine.release()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.on_event("shutdown")
    def shutdown():
        engine.closing.set()  # running generations end at their next token
        engine.worker.shutdown(wait=True, cancel_futures=True)

    return app


KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}


def authorized(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# --- log-probabilities (scored by one forward over prompt + completion) ----------

def completion_logprobs(llm: LLM, prompt_ids: list[int], ids: list[int], top: int, echo: bool) -> dict:
    """OpenAI's completions `logprobs` object for the generated tokens (and the prompt's with echo)."""
    tok = llm.tokenizer
    chosen, alternatives = llm.score(prompt_ids + ids, top)
    first = 0 if echo else len(prompt_ids)
    tokens = (prompt_ids + ids)[first:]
    logprobs = ([None] + chosen)[first:]
    tops = ([None] + alternatives)[first:]
    texts = [tok.decode([t]) for t in tokens]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": logprobs, "text_offset": offsets,
            "top_logprobs": [None if t is None else {tok.decode([i]): lp for i, lp in t} for t in tops]
            if top else None}


def chat_logprobs(llm: LLM, prompt_ids: list[int], ids: list[int], top: int) -> dict:
    tok = llm.tokenizer
    chosen, alternatives = llm.score(prompt_ids + ids, top)
    content = []
    for t, lp, alts in zip(ids, chosen[len(prompt_ids) - 1:], alternatives[len(prompt_ids) - 1:]):
        text = tok.decode([t])
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": tok.decode([i]), "logprob": v,
                                          "bytes": list(tok.decode([i]).encode())} for i, v in alts]})
    return {"content": content}


def serve(llm: LLM, host: str, port: int, model_name: str, api_key: str | None, queue: int):
    """Run until SIGINT or SIGTERM: then stop accepting, end the streams in
    flight (uvicorn's graceful shutdown) and exit 0."""
    import signal
    import sys

    import uvicorn
    for sig in (signal.SIGINT, signal.SIGTERM):  # (uvicorn raises the signal again once it has shut down)
        signal.signal(sig, lambda *_: sys.exit(0))
    api_key = api_key or os.environ.get("BRISK_API_KEY") or None
    app = make_app(llm, model_name, api_key, queue)
    print(f"Serving {model_name} on http://{host}:{port}/v1 (OpenAI API; GET /health, /metrics)"
          + (", API key required" if api_key else ""), flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)
