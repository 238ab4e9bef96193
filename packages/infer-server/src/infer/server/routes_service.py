"""GET /health, GET /v1/models, GET /metrics, GET /v1/stats and GET /dashboard: the endpoints
around generation."""

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from infer.server import responses
from infer.server.metrics import CONTENT_TYPE
from infer.server.server_state import RETRY_AFTER_S, ServerState

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 {"status": "ok"} when generation requests are taken; 503 {"status": "loading" |
    "draining" | "failed"} otherwise, so a load balancer routes around this server."""
    server: ServerState = request.app.state.server
    status, body = server.health()
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    server: ServerState = request.app.state.server
    if server.engine is None:  # the context length is known once the engine exists
        server.require_ready()
    return JSONResponse(
        responses.model_list([(server.served_model_name, server.max_model_len)], server.created)
    )


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    """The client's `models.retrieve`: the served model's object, or 404 naming the served one."""
    server: ServerState = request.app.state.server
    server.check_model(model_id)
    if server.engine is None:
        server.require_ready()
    return JSONResponse(responses.model(server.served_model_name, server.max_model_len, server.created))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    server: ServerState = request.app.state.server
    return Response(server.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/stats")
async def stats(request: Request) -> Response:
    """The dashboard's numbers (infer.server.stats): recent requests and 1 Hz histories."""
    server: ServerState = request.app.state.server
    return JSONResponse(server.stats.snapshot())


@router.get("/dashboard")
async def dashboard() -> Response:
    """The live dashboard: one self-contained page (no CDN) that reads /v1/stats each second."""
    return HTMLResponse(files("infer.server").joinpath("dashboard.html").read_text(encoding="utf-8"))
