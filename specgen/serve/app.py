"""The HTTP layer: FastAPI routes in OpenAI's shape over the scheduler. It parses, checks,
queues, streams and cancels; it never touches a tensor, and never answers with a traceback.

Routes: GET / (the playground page: playground.py), POST /v1/chat/completions, /v1/completions and
/v1/responses (OpenAI's Responses API,
answered through the chat path: responses.py), streamed as server-sent events when asked; POST
/tokenize (vLLM's: a prompt's token count), GET /v1/models, GET /metrics
(Prometheus), GET /health. Every route but /health needs
`Authorization: Bearer <key>`: the server's local token (in the user's runtime directory) or
its --api-key, compared in constant time.

Requests are read by reading.py (responses.py for /v1/responses) and queued as the scheduler's
tickets, a row per choice; prompts are tokenized off the event loop (encoding.py); answers come
back through delivery.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specgen.config import GenerationConfig
from specgen.decoding.build import why_not
from specgen.serve import api, delivery, discovery, encoding, keys, playground, protocol, reading, responses
from specgen.serve.delivery import error
from specgen.serve.metrics import Metrics
from specgen.serve.scheduler import QueueFull, Scheduler, tickets

RETRY_AFTER_SECONDS = 1
# a stream with nothing to send for this long sends an SSE comment: a client's read timeout
# (cli/remote.py's STREAM_TIMEOUT) then means the server stopped answering, not that it is busy
KEEPALIVE_SECONDS = 15.0
DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class ServerState:
    """What the routes need: the scheduler, the defaults, who may call, what is served."""

    scheduler: Scheduler
    defaults: GenerationConfig
    keys: list[str]  # the local token, and --api-key when given
    model_id: str
    aliases: set[str]
    info: dict  # pid, models, since (shown to authorized callers of /health)
    context_length: int
    metrics: Metrics
    say: Callable[[str], None] = lambda line: None  # the server's log: a line per refused request too
    origins: tuple[str, ...] = ()  # web pages whose scripts may call (CORS); none by default


def create_app(state: ServerState) -> FastAPI:
    """The app: its middleware and error handlers, then the routes, each group added by its own part."""
    # no redirect of a trailing slash: it was answered before the key was checked, with a
    # Location built from the client's Host header
    app = FastAPI(title="specgen", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    _add_middleware(app, state)
    _add_error_handlers(app)
    playground.add_routes(app)  # GET /: the page (no key; every API call it makes needs one)
    encode = encoding.encoder(state.scheduler.pair.target.tokenizer, state.context_length)
    _add_status_routes(app, state)
    _add_tokenizer_routes(app, state, encode)
    _add_completion_routes(app, state, encode)
    return app


def _add_middleware(app: FastAPI, state: ServerState) -> None:
    if state.origins:  # a page's script may call only from an origin named here, with the key as anyone
        # any request header: OpenAI's JavaScript SDK sends X-Stainless-* and OpenAI-* headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.origins),
            allow_methods=["GET", "POST", "HEAD"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "x-request-id"],
            max_age=600,
        )
    app.add_middleware(protocol.RequestIds, stopping=lambda: state.scheduler.stopping)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # never a traceback on the wire
        return error(
            api.ApiError(
                500, f"internal error: {type(exc).__name__}", kind="server_error", code="internal_error"
            )
        )

    @app.exception_handler(HTTPException)
    async def routing(request: Request, exc: HTTPException):  # an unknown path, a wrong method
        routes = ", ".join(
            f"{method} {route.path}" for route in app.routes for method in sorted(route.methods)
        )
        message = {
            404: f"no route {request.url.path}; this server answers {routes}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return error(
            api.ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None),
            headers=exc.headers,
        )


def _unauthorized() -> JSONResponse:
    return error(
        api.ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
    )


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /v1/models and /metrics."""

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what load balancers' checks send
    async def health(request: Request):
        """ "ok"; to a caller with a key, what runs; to `?challenge=C`, proof that this server
        holds its local token (discovery.proof), which a local client checks before it sends it."""
        body = {"status": "ok"}
        challenge = request.query_params.get("challenge")
        if challenge is not None and 0 < len(challenge) <= 128:
            body["proof"] = discovery.proof(state.keys[0], challenge, state.info.get("key", ""))
        if keys.authorized(state.keys, request.headers):
            body.update(state.info, busy=state.scheduler.busy())
        return body

    @app.get("/v1/models")
    async def models(request: Request):
        if not keys.authorized(state.keys, request.headers):
            return _unauthorized()
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_id,
                    "object": "model",
                    "created": int(state.info["since"]),
                    "owned_by": "specgen",
                }
            ],
        }

    @app.get("/metrics")
    async def metrics(request: Request):
        if not keys.authorized(state.keys, request.headers):
            return _unauthorized()
        return Response(state.metrics.text(), media_type=state.metrics.content_type)


def _add_tokenizer_routes(app: FastAPI, state: ServerState, encode) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info."""
    tokenizer = state.scheduler.pair.target.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """The prompt's tokens as the server would decode them (a chat client fits its
        conversation to the context with it): count, tokens, max_model_len."""
        if not keys.authorized(state.keys, request.headers):
            return _unauthorized()
        try:
            ids = await encode(reading.read_tokenize(reading.parse_body(await _body(request))))
        except api.ApiError as exc:
            return error(exc)
        return {"count": len(ids), "tokens": ids, "max_model_len": state.context_length}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: token ids -> {"prompt": their text} (lm-eval's remote tokenizer decodes with it)."""
        if not keys.authorized(state.keys, request.headers):
            return _unauthorized()
        try:
            ids = reading.read_detokenize(reading.parse_body(await _body(request)), len(tokenizer))
        except api.ApiError as exc:
            return error(exc)
        return {"prompt": tokenizer.decode(ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """vLLM's: the tokenizer's special tokens, chat template and length limit (what lm-eval's
        remote tokenizer probes before it sends token-id prompts)."""
        if not keys.authorized(state.keys, request.headers):
            return _unauthorized()
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": getattr(tokenizer, "unk_token", None),
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": state.context_length,
            "vocab_size": len(tokenizer),
        }


def _add_completion_routes(app: FastAPI, state: ServerState, encode) -> None:
    """/v1/chat/completions, /v1/completions and /v1/responses: read and check the request
    (`_admit`), queue its choices, then stream them or answer once they all finished."""

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "completion")

    @app.post("/v1/responses")
    async def responses_route(request: Request):
        return await complete(request, "responses")

    async def complete(http: Request, endpoint: str):
        """One request of `endpoint` (chat, completion or responses: a chat request answered in the
        Responses API's shape)."""
        if not keys.authorized(state.keys, http.headers):
            state.metrics.refused(endpoint, 401)
            return _unauthorized()
        try:
            request, asked, ids = await _admit(state, http, endpoint, encode)
        except api.ApiError as exc:
            state.metrics.refused(endpoint, exc.status)
            state.say(f"error {exc.status}: {api.shown(exc.message, 300)}")
            return error(exc)
        # (choice, item): a chunk, an answer, an ApiError, None at its end (delivery.py)
        queue: asyncio.Queue = asyncio.Queue()
        rows = tickets(request, ids, delivery.poster(asyncio.get_running_loop(), queue))
        try:
            state.scheduler.submit(*rows)
        except QueueFull:
            state.metrics.refused(endpoint, 503)
            return error(
                api.ApiError(
                    503,
                    "the server's queue is full; try again shortly",
                    kind="server_error",
                    code="queue_full",
                ),
                {"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        if request.stream:
            chunks = delivery.chunks(state.scheduler, rows, queue, KEEPALIVE_SECONDS)
            stream = responses.events(asked, chunks) if asked else delivery.chat_events(chunks)
            return StreamingResponse(
                delivery.closing(stream, chunks),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        answer = await delivery.whole(state.scheduler, rows, queue, http, DISCONNECT_POLL_SECONDS)
        if isinstance(answer, Response):
            return answer
        return JSONResponse(responses.whole(asked, answer) if asked else answer)


async def _admit(
    state: ServerState, http: Request, endpoint: str, encode
) -> tuple[api.ApiRequest, responses.Asked | None, list[list[int]]]:
    """The request read, checked against this server (rows, method, context) and given its
    caller's tenant; a Responses request's own fields (else None); each prompt's ids. An
    ApiError for anything refused."""
    body, served = reading.parse_body(await _body(http)), {state.model_id} | state.aliases
    asked = responses.read(body, state.defaults, served) if endpoint == "responses" else None
    request = asked.chat if asked else reading.read_request(body, endpoint, state.defaults, served)
    if request.rows > state.scheduler.max_queue:  # a 503 would be retried in vain
        raise api.ApiError(
            400,
            f"the request asks for {request.rows} rows ('n' times its prompts) but this "
            f"server queues at most {state.scheduler.max_queue} (its --max-queue)",
            "n",
        )
    why = refusal(state.scheduler.pair, request.config.method)
    if why is not None:
        raise api.ApiError(400, why, "speculative.method")
    request = replace(request, config=replace(request.config, tenant=keys.tenant(state.keys, http.headers)))
    ids = []
    for prompt in request.prompts:
        ids.append(await encode(prompt))
        if len(ids[-1]) + 1 > state.context_length:
            raise api.ApiError(
                400,
                f"the prompt has {len(ids[-1])} tokens but the context holds "
                f"{state.context_length}; shorten it",
                prompt.text_field,
                "context_length_exceeded",
            )
    return request, asked, ids


def refusal(pair, method) -> str | None:
    """Why this server's pair cannot serve `method` (None when it can): a draft model it runs
    without, or what the engine refuses of its draft (build.why_not)."""
    if method.needs_draft_model and pair.draft is None:
        return (
            f"method '{method.value}' needs a draft model and this server runs without one; plain and lookup "
            "need none"
        )
    return why_not(pair, method)


async def _body(request: Request) -> bytes:
    """The body, refused past api.MAX_BODY_BYTES without reading it all; a client that hangs up
    before sending it all gets nothing (499) and leaves no traceback in the log."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > api.MAX_BODY_BYTES:
        raise api.ApiError(
            413, f"the request body is larger than {api.MAX_BODY_BYTES} bytes", code="request_too_large"
        )
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > api.MAX_BODY_BYTES:
                raise api.ApiError(
                    413,
                    f"the request body is larger than {api.MAX_BODY_BYTES} bytes",
                    code="request_too_large",
                )
            chunks.append(chunk)
    except ClientDisconnect:
        if request.scope.get(protocol.TIMED_OUT):  # the server cut it: a slow client, not one that left
            raise api.ApiError(
                408,
                f"the request did not arrive within {protocol.REQUEST_TIMEOUT:g} s; "
                "the connection was closed",
                code="request_timeout",
            ) from None
        raise api.ApiError(
            499, "the client closed the connection before sending its request", code="client_closed"
        ) from None
    return b"".join(chunks)
