"""GET /health, GET /v1/models, GET /metrics, GET /v1/stats and GET /dashboard: the endpoints
around generation."""

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from infer.server import responses
from infer.server.metrics import CONTENT_TYPE, render_by_model
from infer.server.server_state import RETRY_AFTER_S, ServerState

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 {"status": "ok"} when generation requests are taken; 503 {"status": "loading" |
    "draining" | "failed"} otherwise, so a load balancer routes around this server. With several
    models, `models` gives each one's state: {"name": "loaded" | "unloaded" | ...}."""
    server: ServerState = request.app.state.server
    status, body = server.health()
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """Every served model, each with its `state` (whether it is resident) beside OpenAI's fields."""
    server: ServerState = request.app.state.server
    if any(model.max_model_len is None for model in server.models.models):
        # A context length is known once its engine was built: 503 until the start's loads end
        # (then a model not loaded yet shows null).
        server.require_ready()
    entries = [
        (model.served_model_name, model.max_model_len, model.state, model.pooling_type)
        for model in server.models.models
    ]
    return JSONResponse(responses.model_list(entries, server.created))


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    """The client's `models.retrieve`: the model's object, or 404 naming the served ones."""
    server: ServerState = request.app.state.server
    model = server.models.get(model_id)
    if model.max_model_len is None:
        server.require_ready()
    return JSONResponse(
        responses.model(
            model.served_model_name,
            model.max_model_len,
            server.created,
            state=model.state,
            pooling=model.pooling_type,
        )
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The server's metrics; with several models, each family's samples carry a `model` label
    (infer.server.metrics.render_by_model)."""
    server: ServerState = request.app.state.server
    _refresh_gauges(server)
    models = server.models.models
    if len(models) == 1:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)
    by_model = {model.served_model_name: model.metrics for model in models}
    return Response(render_by_model(server.metrics, by_model), media_type=CONTENT_TYPE)


@router.get("/v1/stats")
async def stats(request: Request, model: str | None = None) -> Response:
    """The dashboard's numbers (infer.server.stats): recent requests and 1 Hz histories. With
    several models, those of `?model=NAME` (default: the first), with `model` and `models` (every
    name) added so the dashboard can tell."""
    server: ServerState = request.app.state.server
    _refresh_gauges(server)
    if len(server.models) == 1:
        return JSONResponse(server.stats.snapshot())
    chosen = server.models.get(model)
    return JSONResponse(
        {**chosen.stats.snapshot(), "model": chosen.served_model_name, "models": server.models.names}
    )


def _refresh_gauges(server: ServerState) -> None:
    # A busy engine refreshes them only every infer.server.engine_loop.GAUGE_REFRESH_S: a reader
    # gets the latest step's figures.
    for engine_loop in server.models.engine_loops():
        engine_loop.refresh_gauges()


@router.get("/dashboard")
async def dashboard() -> Response:
    """The live dashboard: one self-contained page (no CDN) that reads /v1/stats each second."""
    return HTMLResponse(files("infer.server").joinpath("dashboard.html").read_text(encoding="utf-8"))
