"""brisk serve: an OpenAI-compatible HTTP API over one loaded model (FastAPI + uvicorn).

One generation runs at a time (batch 1, the engine's design point), in one
worker thread, so the event loop never waits for the model; later requests
wait in a bounded FIFO queue and beyond it get HTTP 429. Streamed text
crosses from the worker by an asyncio queue, split on UTF-8 boundaries by
the tokenizer's StreamDecoder; a client that goes away cancels its
generation at the next token, streamed or not. Every error is a JSON body in
OpenAI's format ({"error": {"message", "type", "param", "code"}}), never a
traceback.

For evaluation clients (lm-eval's local-completions): prompts as token lists;
echo + logprobs scores the prompt in one pass, which generation then reuses
(`max_tokens: 0` scores only); the tokenizer at /tokenize, /detokenize and
/tokenizer_info, as vLLM serves them, so a client counts the model's tokens.

Against careless and hostile clients: the body limit counts the bytes read,
whatever the framing (`Gate`, which also times out a body sent too
slowly); a request's headers must arrive within HEADER_TIMEOUT_S
(`GuardedH11Protocol`), an idle keep-alive socket closes after uvicorn's
timeout_keep_alive, and connections near the open-file limit get 503 (uvicorn's
limit_concurrency; the soft limit is raised to the hard one at start); tokenizing and templating run off the event loop; one
request asks for at most MAX_JOBS generations (prompts x n); on SIGTERM the
running generation ends at its next token and everything admitted is
answered 503 (a stream: an error event and [DONE]).
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
from typing import Annotated, Literal, Union

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import chat as chat_format
from .api import LLM, text_pieces
from .errors import BriskError
from .sampling import SamplingParams, masked, sample

MAX_BODY_BYTES = 4 << 20
MAX_CHOICES = 16
MAX_JOBS = 64  # generations one request may ask for (prompts x n)
# to send a request's headers, and between two pieces of a body (BRISKLM_CLIENT_TIMEOUT_S sets both)
HEADER_TIMEOUT_S = BODY_TIMEOUT_S = float(os.environ.get("BRISKLM_CLIENT_TIMEOUT_S") or 10.0)
INT64 = 2 ** 63


class APIError(Exception):
    def __init__(self, status: int, message: str, kind="invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers


def error_json(message: str, kind="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(status: int, message: str, kind="invalid_request_error", param=None, code=None,
               headers=None) -> JSONResponse:
    return JSONResponse(error_json(message, kind, param, code), status, headers=headers)


SHUTTING_DOWN = APIError(503, "the server is shutting down", "server_error", code="shutting_down")


class Gate:
    """ASGI middleware in front of every request (pure ASGI: starlette's
    BaseHTTPMiddleware hid a client's disconnect from the app):

    - the API key (401 with WWW-Authenticate; /health needs none);
    - the body read whole before the app sees it, refused with 413 once it
      passes MAX_BODY_BYTES whatever its framing (Content-Length or chunked),
      and with 408 when a piece of it takes more than BODY_TIMEOUT_S (a body
      shorter than its length, a chunked body never ended); a body without a
      Content-Type is read as JSON, as OpenAI reads it;
    - the count of answers by path and status (/metrics)."""

    def __init__(self, app, api_key: str | None, metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.guarded(scope, receive, counted)
        finally:
            if status:
                path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
                self.metrics.requests.labels(path, str(status[0])).inc()

    async def guarded(self, scope, receive, send):
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] != "/health" and not authorized(headers, self.api_key):
            return await refuse(send, 401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                "authentication_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        if b"content-type" not in headers:
            scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return await refuse(send, 413, f"the request body is {int(declared)} bytes, over the limit of "
                                f"{MAX_BODY_BYTES}", code="body_too_large")
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                return await refuse(send, 408, f"the request body stalled for {BODY_TIMEOUT_S:.0f} s",
                                    code="body_timeout")
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                return await refuse(send, 413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes",
                                    code="body_too_large")
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # (then only the disconnect)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def refuse(send, status: int, message: str, kind="invalid_request_error", code=None, headers=()):
    """An error answered by the middleware itself, and the connection closed."""
    content = json.dumps(error_json(message, kind, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"content-length", str(len(content)).encode()), *headers]})
    await send({"type": "http.response.body", "body": content})


# --- requests (unknown fields are ignored, as OpenAI does) ----------------------

def encodable(text: str) -> str:
    """Text the tokenizer can take: a lone surrogate (JSON's "\\ud800") is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode at character {e.start} (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(encodable)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Union[Text, list[Text], None] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False  # (an extension, as vLLM's: generate max_tokens whatever comes; for load tests)
    response_format: ResponseFormat | None = None
    grammar: Text | None = None  # (an extension, as llama.cpp's: a GBNF grammar, or llguidance's Lark)
    _grammar: object = PrivateAttr(None)  # (the constraint compiled: constrain.Grammar)


class CompletionRequest(Sampling):
    prompt: Union[Text, list[Text], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0)  # (null: OpenAI's default, 16; 0 with echo: score the prompt only)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"  # (JSON text, as OpenAI sends it)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[Text, list[TextPart], None] = None  # (an image part: refused, this model reads text)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    @property
    def tools_on(self) -> bool:
        """Whether the model is offered the tools (and its reply parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The function a call is forced to ("" for any of the tools), or None."""
        if not self.tools_on or self.tool_choice in (None, "auto"):
            return None
        return "" if self.tool_choice == "required" else self.tool_choice.function.name


class TokenizeRequest(BaseModel):  # (vLLM's fields; llama.cpp's content and add_special also taken)
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: Text | None = None
    content: Text | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def message_dict(m: Message) -> dict:
    """A message as chat templates take it (a call's arguments as a dict, as transformers passes them)."""
    out = {"role": m.role, "content": message_text(m.content) if m.content is not None or not m.tool_calls else None}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": json_or_text(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.role == "tool":
        out.update(tool_call_id=m.tool_call_id, name=m.name)
    return out


def json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_prompt_ids(llm: LLM, body: "ChatRequest") -> list[int]:
    """The prompt of a chat request: with tools, rendered by a template that
    knows them (its `tools` variable), else in the Hermes layout
    (chat.with_tools); a special token's text in a message stays text."""
    messages = [message_dict(m) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools_on else None
    tok = llm.require_tokenizer()
    uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not uses_tools:
        return llm.chat_ids(messages)
    if not chat_format.renders_tools(tok.chat_template):
        return llm.chat_ids(chat_format.with_tools(messages, tools))
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_ids[0]) if tok.eos_ids else ""
    try:
        text, contents = chat_format.render_marked(tok.chat_template, messages, bos_token=bos, eos_token=eos,
                                                   tools=tools)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return tok.encode_literal(text, contents)


def compile_constraint(llm: LLM, body: Sampling):
    """body's constraint compiled into body._grammar (in a worker thread: a
    compile takes up to constrain.COMPILE_TIMEOUT_S): a forced tool call's
    grammar, else the grammar field, else response_format. A bad one is a
    400 naming it."""
    from .constrain import closed, compile_grammar
    forced = getattr(body, "forced_tool", None)
    form = body.response_format if body.response_format and body.response_format.type != "text" else None
    if forced is None and body.grammar is not None and form is not None:
        raise APIError(400, "give either grammar or response_format, not both", param="grammar")
    if forced is not None:
        names = [t.function.name for t in body.tools]
        if forced and forced not in names:
            raise APIError(400, f"tool_choice: no tool is named {forced!r} (tools: {', '.join(names)})",
                           param="tool_choice")
        tools = [{"function": {"name": t.function.name, "parameters": closed(t.function.parameters)}}
                 for t in body.tools]
        syntax = chat_format.tool_syntax(llm.tokenizer.chat_template)  # (the family's own call syntax)
        given, param = {"grammar": syntax.grammar(tools, forced or None, body.parallel_tool_calls,
                                                  llm.tokenizer)}, "tools"
    elif body.grammar is not None:
        given, param = {"grammar": body.grammar}, "grammar"
    elif form is not None and form.type == "json_object":
        given, param = {"json_schema": {"type": "object"}}, "response_format"
    elif form is not None:
        if form.json_schema is None or form.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema: give the JSON schema",
                           param="response_format.json_schema.schema")
        schema = form.json_schema.schema_
        given, param = {"json_schema": closed(schema) if form.json_schema.strict else schema}, \
            "response_format.json_schema.schema"
    else:
        return
    try:
        body._grammar = compile_grammar(llm.tokenizer, llm.model.args.vocab_size, **given)
    except BriskError as e:
        reason = str(e).split(": ", 1)[1] if str(e).startswith(tuple(f"{k}: " for k in given)) else str(e)
        raise APIError(400, f"{param}: {reason}", param=param, code="invalid_constraint") from None


def reasoning_opened(llm: LLM, body: "ChatRequest", ids: list[int]) -> bool | None:
    """Whether a chat reply starts inside a <think> block (the prompt opened
    it), False if it may open one, None where its family does not think in
    them, or a constraint shapes the reply from its first token."""
    tok = llm.require_tokenizer()
    if not chat_format.uses_reasoning(tok.chat_template) or body._grammar is not None:
        return None
    return chat_format.opens_reasoning(tok.decode(ids[-8:]))


def tool_call_object(call: dict, index: int | None = None) -> dict:
    """A call {"name", "arguments"} as OpenAI returns it, with an id of its own."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call["name"], "arguments": call["arguments"]}}
    return out if index is None else {"index": index, **out}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


# The error answers of the generation routes, as the OpenAPI schema documents them.
ERRORS = {code: {"model": ErrorBody, "description": text} for code, text in (
    (400, "a request this server cannot take, naming the field at fault"), (401, "missing or wrong API key"),
    (404, "a model not served here"), (408, "a body that stalled"), (413, "a body over the limit"),
    (429, "the queue is full"), (503, "shutting down, or too many connections"))}


def documented(app: FastAPI):
    """The OpenAPI schema with our error answers in place of FastAPI's 422 (we answer 400)."""
    from fastapi.openapi.utils import get_openapi
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    return schema


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
        self.drafts = Counter("brisk_speculative_draft_tokens", "draft tokens checked (brisk serve --speculate)",
                              registry=self.registry)
        self.kept_drafts = Counter("brisk_speculative_accepted_tokens", "draft tokens the model kept",
                                   registry=self.registry)
        self.target_steps = Counter("brisk_speculative_target_steps", "forwards of the model after each first token "
                                    "(a check of drafts or a plain step)", registry=self.registry)


def model_thread() -> ThreadPoolExecutor:
    """The one thread that runs the model: give it the load and the warm-up
    too. On CPUs each thread that has run torch ops keeps OpenMP threads of
    its own, and a second set slows every op of the first (RESULTS.md, the
    server on the CPU)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="brisk-engine")


class Engine:
    """The model behind a single worker thread, and the admission queue in front of it."""

    def __init__(self, llm: LLM, queue: int, metrics: Metrics, worker: ThreadPoolExecutor | None = None):
        self.llm, self.limit, self.metrics = llm, queue + 1, metrics  # (the one running counts)
        self.worker = worker or model_thread()
        self.admitted = 0
        self.closing = threading.Event()

    def switch_when_idle(self):
        """(A thread of its own) Once the step compiling on another thread
        (LLM.warm_up) is ready, switch to it in the worker between requests,
        so that no request pays for the switch's graph captures, unless one
        arrives during it."""
        steps = self.llm.generator.steps
        while steps.compiler is not None and not self.closing.is_set():
            if steps.compiler.is_alive() or self.admitted:
                time.sleep(0.05)
            else:
                self.worker.submit(self.llm.switch_compiled).result()

    def admit(self):
        if self.admitted >= self.limit:
            raise APIError(429, f"the server is busy: {self.limit - 1} requests are already waiting",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        if self.closing.is_set():
            raise SHUTTING_DOWN
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
                 ignore_eos: bool = False, top: int | None = None) -> dict:
        """In the worker: generate, call emit(text) per piece, stop when cancelled().
        Returns the token ids generated and the finish reason. With top (a
        stream with logprobs), emit(text, entries): the (token text, logprob,
        [(id, logprob)] of the top alternatives) of the tokens whose text the
        pieces so far hold."""
        if cancelled() or self.closing.is_set():
            return {"ids": [], "finish_reason": "cancelled"}
        tokens, state, entries = [], {"done": False}, []
        eos = set() if ignore_eos else set(self.llm.tokenizer.eos_ids)
        t0 = last = time.perf_counter()
        source = (self.llm.stream_ids(ids, max_tokens, stop_ids=eos, **sampling) if top is None
                  else self.scored(ids, max_tokens, sampling, eos, top, entries))
        decoder, shares, released, emitted = self.llm.tokenizer.stream(), [], 0, 0

        def counted():  # (checked at every token: a stop string can hold text back for many)
            nonlocal last
            for t in source:
                if cancelled() or self.closing.is_set():
                    state["cancelled"] = True
                    return
                now = time.perf_counter()
                (self.metrics.ttft if not tokens else self.metrics.itl).observe(now - (t0 if not tokens else last))
                last = now
                tokens.append(t)
                self.metrics.tokens.inc()
                if top is not None and t not in eos:
                    shares.append(decoder.push(t))
                yield t
            state["done"] = True

        def release(final=False) -> list:
            """The entries of the tokens whose text has been emitted (final: also one cut by a stop string)."""
            nonlocal released
            out, end = [], sum(map(len, shares[:released]))
            while released < len(shares):
                start, end = end, end + len(shares[released])
                if end > emitted and not (final and start < emitted):
                    break
                out.append((shares[released][:emitted - start], *entries[released][1:]))
                released += 1
            return out

        pieces = text_pieces(self.llm.tokenizer, counted(), stop, ends=eos)
        try:
            for piece in pieces:
                if cancelled() or self.closing.is_set():
                    return {"ids": tokens, "finish_reason": "cancelled"}
                emitted += len(piece)
                if top is None:
                    emit(piece)
                else:
                    emit(piece, release())
        finally:
            pieces.close()
        if top is not None and (rest := release(final=True)):
            emit("", rest)
        if state.get("cancelled"):
            return {"ids": tokens, "finish_reason": "cancelled"}
        length = state["done"] and len(tokens) >= max_tokens and (not tokens or tokens[-1] not in eos)
        return {"ids": tokens, "finish_reason": "length" if length else "stop",
                **(self.drafted() if top is None and tokens else {})}

    def drafted(self) -> dict:
        """In the worker, after a generation (Generator.tokens): the drafts it
        checked and kept, counted in /metrics too; nothing without speculation."""
        stats = self.llm.stats
        if self.llm.drafter is None:
            return {}
        self.metrics.drafts.inc(stats.drafts)
        self.metrics.kept_drafts.inc(stats.kept_drafts)
        self.metrics.target_steps.inc(stats.target_steps)
        return {"drafted": {"drafts": stats.drafts, "kept": stats.kept_drafts, "target_steps": stats.target_steps}}

    def answer(self, ids: list[int], max_tokens: int, sampling: dict, stop, emit, cancelled, ignore_eos=False,
               top: int | None = None, echo: bool = False) -> dict:
        """In the worker: generate (as `generate`); with top (logprobs asked,
        that many alternatives a token), also the entries of the tokens
        returned (`entries`), after the prompt's with echo. The prompt is
        scored before generating, which then reuses its keys and values, and
        the tokens generated are scored from there: no second pass from the
        start. With echo, an end token that finished the text keeps its entry
        (its text is ""): scoring clients count one entry per token."""
        head = prompt_entries(self.llm, ids, top) if echo and top is not None else []
        pieces = []
        if max_tokens == 0:  # (echo: score only)
            out = {"ids": [], "finish_reason": "length"}
        elif top is not None and sampling.get("grammar") is not None:  # (scored under the masks, as a stream is)
            entries = []
            out = self.generate(ids, max_tokens, sampling, stop, lambda piece, got: (entries.extend(got), emit(piece)),
                                cancelled, ignore_eos, top)
            return {**out, "entries": head + entries}
        else:
            out = self.generate(ids, max_tokens, sampling, stop, lambda piece: (pieces.append(piece), emit(piece)),
                                cancelled, ignore_eos)
        if top is not None and out["finish_reason"] != "cancelled":
            ends = set(self.llm.tokenizer.eos_ids) if echo and not ignore_eos else set()
            out["entries"] = head + generated_entries(self.llm, ids, out["ids"], top, "".join(pieces), ends)
        return out

    def scored(self, ids: list[int], max_tokens: int, sampling: dict, eos: set, top: int, entries: list):
        """Tokens made one forward each through Generator.logits, each with its
        log-probability and the `top` most likely (appended to entries as
        (token, logprob, [(id, logprob)])): a stream with logprobs, which plain
        decoding's steps (tokens only, queued ahead) do not give. Under a
        grammar each token's logits are masked first: the log-probabilities
        are those of the distribution sampled, forbidden tokens never listed."""
        gen = self.llm.generator
        try:
            params = SamplingParams(*(sampling[k] for k in ("temperature", "top_k", "top_p", "min_p")))
        except ValueError as e:
            raise BriskError(str(e)) from None
        self.llm.check(ids, max_tokens)
        if sampling.get("seed") is not None:
            torch.manual_seed(sampling["seed"])
        grammar = sampling.get("grammar")
        constraint = grammar.constraint() if grammar is not None else None
        gen.reset()
        try:
            with torch.no_grad():
                logits = gen.logits(ids, 0, last=len(ids) - 1)[0, -1]
                for i in range(max_tokens):
                    if constraint is not None:
                        if (bits := constraint.mask()) is None:  # (the grammar is complete)
                            return
                        logits = masked(logits, bits.to(logits.device))
                    token = int(sample(logits[None], params))
                    logp = logits.float().log_softmax(-1)
                    best = logp.topk(min(top, logp.shape[-1])) if top else None
                    entries.append((token, float(logp[token]),
                                    [(t, v) for t, v in zip(best.indices.tolist(), best.values.tolist())
                                     if v > -float("inf")] if top else []))
                    yield token
                    if token in eos or i + 1 == max_tokens:
                        return
                    if constraint is not None:
                        constraint.advance(token)
                    logits = gen.logits(torch.tensor([token], device=gen.device), len(ids) + i, last=0)[0, -1]
        finally:
            gen.reset()  # (its cache no longer says what it holds)


# --- the app ---------------------------------------------------------------------

def make_app(llm: LLM, model_name: str, api_key: str | None = None, queue: int = 16,
             worker: ThreadPoolExecutor | None = None) -> FastAPI:
    """The app; worker: the thread that loaded llm (model_thread), else a new one."""
    metrics = Metrics()
    llm.remember_requests()  # (prompt lookup drafts from earlier requests' text too)
    engine = Engine(llm, queue, metrics, worker)
    threading.Thread(target=engine.switch_when_idle, name="brisk-switch", daemon=True).start()
    app = FastAPI(title="brisk-lm", version="0.1.0")
    app.state.engine = engine
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_body(e.status, e.message, e.kind, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        # the deepest error names the field at fault (a union's other branches fail higher up)
        first = max(e.errors(), key=lambda error: len(error.get("loc", ())), default={})
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not is_type_tag(x)]
        if first.get("type") == "json_invalid":
            return error_body(400, "the request body is not valid JSON", code="invalid_json")
        if not loc:  # (the body itself: not an object)
            return error_body(400, "the request body must be a JSON object", code="invalid_json")
        param = ".".join(loc) or None
        message = first.get("msg", "invalid value")
        if loc[-1:] == ["type"] and "content" in loc:  # (a content part that is not text: an image, audio)
            message = f"only text parts are supported (this model reads no {first.get('input')!r})"
        return error_body(400, f"{param or 'body'}: {message}", param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_body(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):  # a bug of ours: said as one line, the server stays up
        return error_body(500, f"internal error: {type(e).__name__}: {str(e)[:200]}", "server_error")

    app.add_middleware(Gate, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", responses={401: ERRORS[401]})
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses={401: ERRORS[401]})
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "brisk-lm"}]}

    # The tokenizer as vLLM and llama.cpp serve it: clients that split a text
    # into context and continuation (lm-eval's remote tokenizer) count our tokens.
    @app.get("/tokenizer_info", responses={401: ERRORS[401]})
    async def tokenizer_info():
        tok = llm.require_tokenizer()
        text = lambda i: None if i is None else tok.token_text(i)  # noqa: E731
        return {"tokenizer_class": "brisk-lm", "bos_token": text(tok.bos_id),
                "eos_token": text(tok.eos_ids[0] if tok.eos_ids else None), "pad_token": None,
                "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
                "model_max_length": llm.generator.max_seq_length}

    @app.post("/tokenize", responses={k: ERRORS[k] for k in (400, 401, 404)})
    async def tokenize(body: TokenizeRequest):
        check_model(body)
        text = body.prompt if body.prompt is not None else body.content
        if text is None:
            raise APIError(400, "prompt: give the text to tokenize", param="prompt")
        special = next((v for v in (body.add_special_tokens, body.add_special) if v is not None), True)
        ids = await asyncio.to_thread(llm.require_tokenizer().encode, text, None if special else False)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.generator.max_seq_length}

    @app.post("/detokenize", responses={k: ERRORS[k] for k in (400, 401, 404)})
    async def detokenize(body: DetokenizeRequest):
        check_model(body)
        vocab = llm.model.args.vocab_size
        if any(not 0 <= i < vocab for i in body.tokens):
            raise APIError(400, f"tokens: token ids must be in 0..{vocab - 1}", param="tokens")
        text = await asyncio.to_thread(llm.require_tokenizer().decode, body.tokens)
        return {"prompt": text, "content": text}  # (vLLM's key and llama.cpp's)

    def check_model(body: Sampling):
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} is not served here (this server serves {model_name!r})",
                           "not_found_error", "model", "model_not_found")

    def sampling_of(body: Sampling, index: int) -> dict:
        top_p = 1.0 if body.top_p is None else body.top_p
        constrained = {"grammar": body._grammar} if body._grammar is not None else {}
        return dict(temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=None if top_p >= 1 else top_p, top_k=body.top_k, min_p=body.min_p,
                    seed=None if body.seed is None else (body.seed + index) % 2 ** 64, **constrained)

    async def constrained(body: Sampling, logprobs: bool):
        """Compile body's constraint (compile_constraint); logprobs under one
        are the masked distribution's (Engine.scored)."""
        await asyncio.to_thread(compile_constraint, llm, body)

    def checked(ids: list[int], max_tokens: int):
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max_tokens == 0:  # (scored only: the last token is predicted, never run)
            if len(ids) > llm.generator.max_seq_length + 1:
                raise APIError(400, f"a prompt of {len(ids)} tokens to score exceeds the KV cache of "
                               f"{llm.generator.max_seq_length} tokens (and the one it predicts)", param="prompt",
                               code="context_length_exceeded")
            return
        try:
            llm.check(ids, max_tokens)
        except BriskError as e:
            raise APIError(400, str(e), param="max_tokens" if len(ids) < llm.generator.max_seq_length
                           else "prompt", code="context_length_exceeded") from None

    def bounded(prompts: int, n: int):
        if prompts * n > MAX_JOBS:
            raise APIError(400, f"{prompts} prompts x n={n} is {prompts * n} generations, over the limit of "
                           f"{MAX_JOBS} a request", param="n", code="too_many_generations")

    def encode_prompts(prompts) -> list[tuple[str, list[int]]]:
        """(text, ids) of each prompt (in a worker thread: tokenizing a long one takes seconds)."""
        tok, vocab = llm.require_tokenizer(), llm.model.args.vocab_size
        encoded = []
        for p in prompts:
            ids = tok.encode(p) if isinstance(p, str) else list(p)
            if isinstance(p, str) and not ids:  # "" (as OpenAI: the model continues from its start token)
                ids = [tok.bos_id] if tok.bos_id is not None else list(tok.eos_ids[:1])
            if any(not 0 <= i < vocab for i in ids):
                raise APIError(400, f"prompt: token ids must be in 0..{vocab - 1}", param="prompt")
            encoded.append((p if isinstance(p, str) else tok.decode(ids), ids))
        return encoded

    async def generate_all(request: Request, jobs, body, max_tokens: int, top: int | None = None,
                           echo: bool = False) -> list[tuple[str, dict]]:
        """(text, result) of each job, in turn, cancelled when the client leaves
        (non-streaming); with top, each result's logprobs entries (Engine.answer)."""
        engine.admit()
        cancel = threading.Event()
        watcher = asyncio.create_task(watch_disconnect(request, cancel))
        try:
            results = []
            for text, ids, i in jobs:
                pieces = []
                out = await engine.run(engine.answer, ids, max_tokens, sampling_of(body, i), body.stop,
                                       pieces.append, cancel.is_set, body.ignore_eos, top, echo)
                if engine.closing.is_set():
                    raise SHUTTING_DOWN
                if cancel.is_set():  # (no one to answer)
                    raise APIError(499, "the client went away", code="client_closed")
                results.append(("".join(pieces), out))
            return results
        finally:
            cancel.set()
            watcher.cancel()
            engine.release()

    def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = documented(app)
        return app.openapi_schema

    app.openapi = openapi

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        llm.require_tokenizer()
        single = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))
        prompts = [body.prompt] if single else body.prompt
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        bounded(len(prompts), body.n)
        encoded = await asyncio.to_thread(encode_prompts, prompts)
        body.max_tokens = 16 if body.max_tokens is None else body.max_tokens  # (null: OpenAI's default)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 generates nothing; it needs echo (to score the prompt)",
                           param="max_tokens")
        for _, ids in encoded:
            checked(ids, body.max_tokens)
        if body.stream and body.echo:
            raise APIError(400, "echo is not supported with stream", param="echo")
        await constrained(body, body.logprobs is not None)
        jobs = [(text, ids, i) for text, ids in encoded for i in range(body.n)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        meta = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        if body.stream:
            return stream(request, jobs, body, meta, chat=False)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        results = await generate_all(request, jobs, body, body.max_tokens, body.logprobs, body.echo)
        for index, ((text, ids, i), (completion, out)) in enumerate(zip(jobs, results)):
            choice = {"text": (text if body.echo else "") + completion, "index": index,
                      "logprobs": None, "finish_reason": out["finish_reason"]}
            if body.logprobs is not None:
                choice["logprobs"] = logprobs_object(llm.tokenizer, out["entries"], chat=False,
                                                     top=bool(body.logprobs))
            choices.append(choice)
            usage["prompt_tokens"] += len(ids) if i == 0 else 0
            usage["completion_tokens"] += len(out["ids"])
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {**meta, "choices": choices, "usage": {**usage, **drafted_usage([out for _, out in results])}}

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body)
        bounded(1, body.n)
        ids = await asyncio.to_thread(chat_prompt_ids, llm, body)
        await constrained(body, body.logprobs)
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            max(1, min(4096, llm.generator.max_seq_length - len(ids)))
        checked(ids, max_tokens)
        body.max_tokens = max_tokens
        jobs = [("", ids, i) for i in range(body.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        meta = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        if body.stream:
            return stream(request, jobs, body, {**meta, "object": "chat.completion.chunk"}, chat=True)
        choices, completion_tokens = [], 0
        top = (body.top_logprobs or 0) if body.logprobs else None
        results = await generate_all(request, jobs, body, max_tokens, top)
        opened, syntax = reasoning_opened(llm, body, ids), chat_format.tool_syntax(llm.tokenizer.chat_template)
        for index, (reply, out) in enumerate(results):
            message, finish = {"role": "assistant", "content": reply}, out["finish_reason"]
            if opened is not None:
                reasoning, reply = chat_format.split_reasoning(reply, opened)
                message = {"role": "assistant", "content": reply,
                           **({"reasoning_content": reasoning} if reasoning is not None else {})}
            if body.tools_on:
                content, calls = syntax.parse(reply, [t.function.name for t in body.tools])
                calls = calls if body.parallel_tool_calls else calls[:1]
                if calls:
                    message = {**message, "content": content or None,
                               "tool_calls": [tool_call_object(c) for c in calls]}
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
            if body.logprobs:
                choice["logprobs"] = logprobs_object(llm.tokenizer, out["entries"], chat=True)
            choices.append(choice)
            completion_tokens += len(out["ids"])
        usage = {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(ids) + completion_tokens, **drafted_usage([out for _, out in results])}
        return {**meta, "choices": choices, "usage": usage}

    def stream(request: Request, jobs, body, meta: dict, chat: bool) -> StreamingResponse:
        engine.admit()  # (429 before the stream starts)
        loop = asyncio.get_running_loop()

        top = None  # (with logprobs: how many alternatives a token)
        if chat and body.logprobs:
            top = body.top_logprobs or 0
        elif not chat and body.logprobs is not None:
            top = body.logprobs

        # (a thinking family's reply streams its reasoning apart: through ToolCallDeltas)
        reads = chat and reasoning_opened(llm, body, jobs[0][1]) is not None

        async def events():
            cancel = threading.Event()
            watcher = asyncio.create_task(watch_disconnect(request, cancel))
            try:
                completion_tokens, outs = 0, []
                for index, (_, ids, i) in enumerate(jobs):
                    queue: asyncio.Queue = asyncio.Queue()
                    if chat:
                        yield sse({**meta, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
                    emit = lambda *given: loop.call_soon_threadsafe(queue.put_nowait, given)  # noqa: E731
                    job = loop.run_in_executor(engine.worker, engine.generate, ids, body.max_tokens,
                                               sampling_of(body, i), body.stop, emit, cancel.is_set, body.ignore_eos,
                                               top)
                    job.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
                    offset = 0
                    calls = ToolCallDeltas(llm, body, index, meta, ids) if chat and (body.tools_on or reads) else None
                    while (given := await queue.get()) is not None:
                        piece, entries = given if len(given) == 2 else (given[0], None)
                        if calls is not None:
                            for event in calls.push(piece):
                                yield event
                            continue
                        delta = {"content": piece} if chat else None
                        choice = {"index": index, "delta": delta} if chat else {"index": index, "text": piece}
                        logprobs = None if entries is None else logprobs_object(llm.tokenizer, entries, chat, offset)
                        offset += len(piece)
                        yield sse({**meta, "choices": [{**choice, "logprobs": logprobs, "finish_reason": None}]})
                    try:
                        out = await job
                    except Exception as e:  # (the status is sent already: the error goes in the stream, then [DONE])
                        bad = isinstance(e, BriskError)
                        yield sse(error_json(str(e) if bad else f"internal error: {type(e).__name__}",
                                             "invalid_request_error" if bad else "server_error"))
                        break
                    if engine.closing.is_set():
                        yield sse(SHUTTING_DOWN_EVENT)
                        break
                    completion_tokens += len(out["ids"])
                    outs.append(out)
                    finish = out["finish_reason"]
                    if calls is not None:
                        for event in calls.finish():
                            yield event
                        finish = "tool_calls" if calls.count and finish == "stop" else finish
                    last = {"index": index, "delta": {}} if chat else {"index": index, "text": ""}
                    yield sse({**meta, "choices": [{**last, "logprobs": None, "finish_reason": finish}]})
                else:
                    if (body.stream_options or {}).get("include_usage"):
                        prompt_tokens = sum(len(ids) for _, ids, i in jobs if i == 0)
                        yield sse({**meta, "choices": [], "usage": {
                            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens, **drafted_usage(outs)}})
                yield "data: [DONE]\n\n"
            finally:  # also when the client went away (the task is cancelled): the worker stops at its next token
                cancel.set()
                watcher.cancel()
                engine.release()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.on_event("shutdown")
    def shutdown():
        engine.closing.set()  # running generations end at their next token, queued ones at once
        engine.worker.shutdown(wait=True)

    return app


class ToolCallDeltas:
    """A streamed reply's text as chat deltas, its tool calls as OpenAI
    streams them: a delta that opens each call (index, id, type, name, empty
    arguments), then one with its arguments (the family's splitter holds text
    back until it knows whether a call starts); a thinking family's
    reasoning as reasoning_content deltas (chat.ReasoningSplitter)."""

    def __init__(self, llm: LLM, body: "ChatRequest", index: int, meta: dict, ids: list[int]):
        self.index, self.meta, self.count = index, meta, 0
        self.parallel = body.parallel_tool_calls
        opened = reasoning_opened(llm, body, ids)
        self.reasoning = None if opened is None else chat_format.ReasoningSplitter(opened)
        self.splitter = chat_format.tool_syntax(llm.tokenizer.chat_template).splitter(
            [t.function.name for t in body.tools]) if body.tools_on else None

    def push(self, piece: str) -> list[str]:
        return self.events(self.split(piece, False))

    def finish(self) -> list[str]:
        return self.events(self.split("", True))

    def split(self, piece: str, last: bool) -> list[tuple[str, object]]:
        """("reasoning", text), ("content", text) and ("call", call) events of a piece."""
        found = ([("content", piece)] if piece else []) if self.reasoning is None else (
            self.reasoning.finish() if last else self.reasoning.push(piece))
        if self.splitter is None:
            return found
        out = []
        for kind, value in found:
            out += self.splitter.push(value) if kind == "content" else [(kind, value)]
        return out + (self.splitter.finish() if last else [])

    def events(self, found) -> list[str]:
        out = []
        for kind, value in found:
            if kind == "reasoning":
                out.append(self.delta({"reasoning_content": value}))
            elif kind == "content":
                if self.count and not value.strip():  # (the line breaks between calls)
                    continue
                out.append(self.delta({"content": value}))
            elif self.parallel or not self.count:
                opened = tool_call_object({**value, "arguments": ""}, self.count)
                out.append(self.delta({"tool_calls": [opened]}))
                out.append(self.delta({"tool_calls": [{"index": self.count,
                                                       "function": {"arguments": value["arguments"]}}]}))
                self.count += 1
        return out

    def delta(self, delta: dict) -> str:
        return sse({**self.meta, "choices": [{"index": self.index, "delta": delta, "logprobs": None,
                                              "finish_reason": None}]})


def is_type_tag(part) -> bool:
    """A step of pydantic's error location that names a union's branch, not a field ("str", "list[int]")."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


SHUTTING_DOWN_EVENT = error_json(SHUTTING_DOWN.message, SHUTTING_DOWN.kind, code=SHUTTING_DOWN.code)


async def watch_disconnect(request: Request, cancel: threading.Event, every_s: float = 0.05):
    """Set `cancel` once the client has gone away (checked every every_s):
    the worker reads it at every token, whatever the request sends back."""
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(every_s)


KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenizer_info",
               "/tokenize", "/detokenize"}


def authorized(headers: dict, key: str) -> bool:
    given = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def drafted_usage(outs: list[dict]) -> dict:
    """Speculative decoding's share of a usage block: the drafts kept and not
    as OpenAI's completion_tokens_details prediction tokens (its fields for
    Predicted Outputs, which clients already parse), and the model's
    forwards after each first token (target_steps); {} without speculation."""
    drafted = [out["drafted"] for out in outs if "drafted" in out]
    if not drafted:
        return {}
    kept = sum(d["kept"] for d in drafted)
    return {"completion_tokens_details": {"accepted_prediction_tokens": kept,
                                          "rejected_prediction_tokens": sum(d["drafts"] for d in drafted) - kept,
                                          "target_steps": sum(d["target_steps"] for d in drafted)}}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# --- log-probabilities (scored by one forward over prompt + completion) ----------

def token_texts(tok, ids: list[int], text: str | None = None) -> list[str]:
    """Each token's share of the text the ids decode to, so that the shares
    concatenate to it exactly (a character split over tokens goes to the
    token that completes it); with `text` (a completion as returned: cut
    before a stop string, the end token left out), the tokens past it are
    dropped and the last one cut at its end."""
    decoder, shares, total = tok.stream(), [], 0
    for t in ids:
        if text is not None and total >= len(text):
            break
        share = decoder.push(t)
        if text is not None:
            share = share[:len(text) - total]
        shares.append(share)
        total += len(share)
    return shares


def logprobs_object(tok, entries, chat: bool, offset: int = 0, top: bool = True) -> dict:
    """OpenAI's logprobs object for tokens' (text, logprob, [(id, logprob)] of
    the alternatives, or None): chat's `content` list, or completions'
    parallel lists (offset: where the first token's text starts; top=False:
    no top_logprobs asked)."""
    if chat:
        return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()),
                             "top_logprobs": [{"token": tok.decode([i]), "logprob": v,
                                               "bytes": list(tok.decode([i]).encode())} for i, v in alts]}
                            for text, lp, alts in entries]}
    offsets, at = [], offset
    for text, _, _ in entries:
        offsets.append(at)
        at += len(text)
    return {"tokens": [text for text, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "text_offset": offsets, "top_logprobs": [None if alts is None else {tok.decode([i]): v for i, v in alts}
                                                     for _, _, alts in entries] if top else None}


def prompt_entries(llm: LLM, prompt_ids: list[int], top: int) -> list[tuple]:
    """The prompt's entries, as echo returns them: the first token has no log-probability."""
    chosen, alternatives = llm.score(prompt_ids, top)
    return list(zip(token_texts(llm.tokenizer, prompt_ids), [None] + chosen, [None] + alternatives))


def generated_entries(llm: LLM, prompt_ids: list[int], ids: list[int], top: int, text: str,
                      ends=frozenset()) -> list[tuple]:
    """The entries of the generated tokens that the returned text holds, and
    of an end token in `ends` just past it; scored after the prompt, reusing
    its keys and values."""
    texts = token_texts(llm.tokenizer, ids, text)
    if len(texts) < len(ids) and ids[len(texts)] in ends and len(texts) == len(ids) - 1:
        texts.append("")
    if not texts:
        return []
    chosen, alternatives = llm.score(prompt_ids + ids[:len(texts)], top, start=len(prompt_ids))
    return list(zip(texts, chosen, alternatives))


def guarded_h11():
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers
    (uvicorn times out idle keep-alive sockets only after a first response,
    and any byte cancels that: a slowloris client, or a socket that never
    speaks, held a descriptor forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self.arm()

        def arm(self):
            self.disarm()
            self.deadline = self.loop.call_later(HEADER_TIMEOUT_S, self.expire)

        def disarm(self):
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def handle_events(self):
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self.disarm()

        def on_response_complete(self):
            super().on_response_complete()
            self.arm()  # (the next request on this socket has as long)

        def connection_lost(self, exc):
            self.disarm()
            super().connection_lost(exc)

        def expire(self):
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

    return GuardedH11Protocol


def check_address(host: str, port: int):
    """A BriskError now, before the model loads, for an address that cannot be served."""
    import socket
    if not 0 <= port <= 65535:
        raise BriskError(f"--port {port}: a port is 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise BriskError(f"--host {host!r}: not an address of this machine ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise BriskError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def raise_descriptor_limit() -> int:
    """The soft limit on open files raised to the hard one (each client holds
    a descriptor); returns the limit now."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        if soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return 1024


def serve(llm: LLM, host: str, port: int, model_name: str, api_key: str | None, queue: int,
          worker: ThreadPoolExecutor | None = None):
    """Run until SIGINT or SIGTERM: then stop accepting, end the running
    generation at its next token, answer everything admitted (503 JSON, or an
    error event and [DONE] in a stream) and exit 0."""
    import signal
    import sys

    import uvicorn
    for sig in (signal.SIGINT, signal.SIGTERM):  # (uvicorn raises the signal again once it has shut down)
        signal.signal(sig, lambda *_: sys.exit(0))
    if api_key is None:
        api_key = os.environ.get("BRISK_API_KEY") or None
    app = make_app(llm, model_name, api_key, queue, worker)
    descriptors = raise_descriptor_limit()
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10,
                            http=guarded_h11(), timeout_keep_alive=5,
                            limit_concurrency=max(16, descriptors - 64))  # (idle sockets count too)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.engine.closing.set()  # (before uvicorn waits for the connections to finish)
            super().handle_exit(sig, frame)

    print(f"Serving {model_name} on http://{host}:{port}/v1 (OpenAI API; GET /health, /metrics)"
          + (", API key required" if api_key else ""), flush=True)
    Server(config).run()
