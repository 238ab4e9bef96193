"""The FastAPI application: `create_app(engine_or_factory)` wires the routes, the error bodies,
the metrics and the engine's lifecycle. `infer.server.serve` runs it on uvicorn.

Who may call it is `infer.server.access`: the API key and the CORS origins, as middleware.

Every error leaves as OpenAI's error object: an ApiError with its status, FastAPI's own HTTP
errors (unknown path, wrong method) in the same shape, and anything unexpected as a 500
`internal_error` (logged with its traceback).
"""

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer.server import errors
from infer.server.access import AccessPolicy, CorsForAllowedOrigins, RequireApiKey
from infer.server.errors import ApiError
from infer.server.limits import RequestLimits
from infer.server.media import MediaPolicy
from infer.server.metrics import ServerMetrics
from infer.server.routes_chat import router as chat_router
from infer.server.routes_completions import router as completions_router
from infer.server.routes_embeddings import router as embeddings_router
from infer.server.routes_messages import router as messages_router
from infer.server.routes_responses import router as responses_router
from infer.server.routes_service import router as service_router
from infer.server.routes_tokenize import router as tokenize_router
from infer.server.served_models import DEFAULT_WAIT_TIMEOUT_S, ReturnModelLeases
from infer.server.server_state import RETRY_AFTER_S, ServerState

logger = logging.getLogger(__name__)


def create_app(
    engine_or_factory,
    *,
    served_model_name: str | None = None,
    metrics: ServerMetrics | None = None,
    limits: RequestLimits | None = None,
    media_policy: MediaPolicy | None = None,
    access: AccessPolicy | None = None,
    max_loaded_models: int | None = None,
    idle_unload_s: float | None = None,
    model_wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
) -> FastAPI:
    """The OpenAI-compatible app over one engine, or several.

    `engine_or_factory`: an `infer.engine.Engine`, or a no-argument callable returning one, which
    then runs on a worker thread at startup (GET /health answers 503 until it returns); or a
    mapping {served name: engine or factory} of several models, the request's `model` picking one.
    `served_model_name`: the `model` that requests must name (default: the engine's config.model;
    one model only).
    `max_loaded_models` (default: all), `idle_unload_s` (default: never), `model_wait_timeout_s`:
    how many models stay resident, when an idle one is unloaded, and how long a request waits for
    its model to load (infer.server.served_models).
    `limits`: request body and prompt size limits (default: `RequestLimits()`).
    `media_policy`: which image URLs the server fetches (default: none; data: URLs always work).
    `access`: the API key and the CORS origins (default: no key, no cross-origin browser calls).
    The ServerState is `app.state.server`; `await app.state.server.drain(timeout_s)` drains.
    """
    server = ServerState(
        engine_or_factory,
        served_model_name=served_model_name,
        metrics=metrics or ServerMetrics(),
        limits=limits,
        media_policy=media_policy,
        max_loaded_models=max_loaded_models,
        idle_unload_s=idle_unload_s,
        model_wait_timeout_s=model_wait_timeout_s,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    app = FastAPI(title="infer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.include_router(completions_router)
    app.include_router(chat_router)
    app.include_router(service_router)
    app.include_router(tokenize_router)
    app.include_router(embeddings_router)
    app.include_router(messages_router)
    app.include_router(responses_router)
    app.add_exception_handler(ApiError, _api_error_response)
    app.add_exception_handler(HTTPException, _http_error_response)
    app.add_exception_handler(Exception, _unexpected_error_response)
    # Added innermost first: a request's model leases are given back once its exchange ends; CORS
    # headers go on every answer to an allowed origin, 401s included (so a page can read why), and
    # the 401s are counted by status like any answer.
    app.add_middleware(ReturnModelLeases, models=server.models)
    access = access or AccessPolicy()
    if access.api_key is not None:
        app.add_middleware(RequireApiKey, policy=access)
    app.add_middleware(_CountStatuses, metrics=server.metrics)
    if access.allowed_origins:
        app.add_middleware(CorsForAllowedOrigins, origins=access.allowed_origins)
    return app


async def _api_error_response(request: Request, error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _http_error_response(request: Request, error: HTTPException) -> JSONResponse:
    code = "not_found" if error.status_code == 404 else "http_error"
    body = ApiError(
        error.status_code, f"{request.method} {request.url.path}: {error.detail}", code=code
    ).body()
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


async def _unexpected_error_response(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unexpected error in %s %s", request.method, request.url.path, exc_info=error)
    api_error = errors.internal_error(f"{type(error).__name__}: {error}")
    return JSONResponse(api_error.body(), status_code=500)


class _CountStatuses:
    """Counts every response by status in infer_requests_by_status_total (pure ASGI, so streams
    pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests_by_status_total.inc(status=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)
