"""POST /v1/embeddings: each input's pooled final hidden state, L2-normalized, in OpenAI's shape.

Every input runs through the engine as a pooling request (`SamplingParams.pooling`: a request of
one token whose step returns the pooled hidden state beside it; infer.engine.pooling), batched
with whatever else runs, the model's `EngineConfig.pooling_type` choosing the last token's
state or the mean over the prompt (named in /v1/models as `pooling`). A text input is tokenized
with the tokenizer's special tokens, as /v1/completions does; token ids are taken as they are.
The vectors are normalized to length 1, as OpenAI's are (and vLLM's by default), so a dot
product is their cosine similarity. `usage` counts the input tokens.
"""

import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from infer.engine.sampling_params import SamplingParams
from infer.server import errors, responses
from infer.server.errors import CLIENT_CLOSED_REQUEST, ApiError, parse_request
from infer.server.generation import collect, submit
from infer.server.limits import check_prompt_chars, read_body
from infer.server.schemas import INVALID_VALUE, UNSUPPORTED_VALUE, EmbeddingRequest
from infer.server.served_models import ServedModel
from infer.server.server_state import ServerState

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    server: ServerState = request.app.state.server
    body = parse_request(EmbeddingRequest, await read_body(request, server.limits.max_request_bytes))
    model = await server.model_for(request, body.model)
    _check_dimensions(body.dimensions, model)
    inputs_ids = [
        await _input_ids(model, item, index, len(body.inputs)) for index, item in enumerate(body.inputs)
    ]
    _check_batch(len(inputs_ids), model)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, pooling=model.engine.config.pooling_type)
    handles = submit(
        model.engine_loop,
        [(ids, params) for ids in inputs_ids],
        responses.new_request_id("embd"),
        prompt_field="input",
    )
    collected = await collect(request, model.engine_loop, handles)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    data = []
    for index, choice in enumerate(collected):
        vector = choice.final.embedding
        norm = float(np.linalg.norm(vector))
        vector = vector / norm if norm > 0 else vector
        data.append(
            {"object": "embedding", "index": index, "embedding": _encoded(vector, body.encoding_format)}
        )
    num_tokens = sum(choice.final.prompt_tokens for choice in collected)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": body.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )


async def _input_ids(model: ServedModel, item: str | list[int], index: int, count: int) -> list[int]:
    """An input's token ids; 400 naming it for text over the size limit or an id outside the
    vocabulary (the engine would fail on it, not the client's request)."""
    field = f"input.{index}" if count > 1 else "input"
    tokenizer = model.engine.tokenizer
    if isinstance(item, str):
        check_prompt_chars(len(item), model.max_prompt_chars, field)
        return await run_in_threadpool(tokenizer.encode, item, add_special_tokens=True)
    outside = next((token_id for token_id in item if token_id >= tokenizer.vocab_size), None)
    if outside is not None:
        raise ApiError(
            400,
            f"{field}: token id {outside} is outside the vocabulary (ids 0..{tokenizer.vocab_size - 1})",
            errors.INVALID_REQUEST,
            field,
            INVALID_VALUE,
        )
    return list(item)


def _check_dimensions(dimensions: int | None, model: ServedModel) -> None:
    width = model.engine.model_info.config.hidden_size
    if dimensions is not None and dimensions != width:
        raise ApiError(
            400,
            f"dimensions {dimensions} is not supported: this model's embeddings have {width} "
            "dimensions and are not shortened; leave dimensions out",
            errors.INVALID_REQUEST,
            "dimensions",
            UNSUPPORTED_VALUE,
        )


def _check_batch(count: int, model: ServedModel) -> None:
    """All inputs are queued at once: more than the engine's queue holds could never run."""
    limit = model.engine.limits.max_queue_len
    if count > limit:
        raise ApiError(
            400,
            f"input holds {count} items; this server queues at most {limit} at once "
            "(--max-queue-len): send fewer per request",
            errors.INVALID_REQUEST,
            "input",
            INVALID_VALUE,
        )


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()
