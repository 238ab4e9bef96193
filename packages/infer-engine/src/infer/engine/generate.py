"""Generation without a server: step an `Engine` until one request ends (`infer generate`,
`infer bench generate`, tests). The same engine core as the server, in the calling thread; do
not mix with another thread stepping the same engine.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationChunk:
    """One generated token and the text it releases (may be "" while a stop string could be forming)."""

    token_id: int
    text: str
    finished: bool = False
    # "stop" or "length" on the last chunk, None before.
    finish_reason: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str


def stream(
    engine: Engine, prompt: str | Sequence[int], params: SamplingParams, *, cache_salt: str | None = None
) -> Iterator[GenerationChunk]:
    """Yields one chunk per generated token; the last has finished=True and a finish_reason.
    Raises RuntimeError if the request fails; abandoning the iterator aborts the request.
    `cache_salt`: the prefix cache serves this request only tokens cached under the same salt."""
    request_id = engine.add_request(
        prompt if isinstance(prompt, str) else list(prompt), params, cache_salt=cache_salt
    )
    finished = False
    try:
        while not finished:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                if output.error is not None:
                    finished = True
                    raise RuntimeError(f"request {request_id} failed: {output.error}")
                finished = output.finished
                yield GenerationChunk(
                    output.token_id, output.text_delta, output.finished, output.finish_reason
                )
    finally:
        if not finished and engine.abort(request_id):
            engine.step()


def generate(
    engine: Engine, prompt: str | Sequence[int], params: SamplingParams, *, cache_salt: str | None = None
) -> GenerationResult:
    chunks = list(stream(engine, prompt, params, cache_salt=cache_salt))
    return GenerationResult(
        token_ids=[chunk.token_id for chunk in chunks],
        text="".join(chunk.text for chunk in chunks),
        finish_reason=chunks[-1].finish_reason,
    )
