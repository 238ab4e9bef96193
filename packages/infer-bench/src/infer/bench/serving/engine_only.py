"""`infer bench engine-only`: a serving workload through the engine alone, with no HTTP.

The same closed loop as the HTTP client (at most `concurrency` requests in flight, the next one
added as soon as one finishes, in index order; greedy, `ignore_eos`, each request's own
max_tokens), driven by `Engine.step()` in this thread with the core in this process, so nothing
but the engine and its output processor runs. Its output tokens per second is what a server on
the same engine config could reach if HTTP, SSE and the bench client cost nothing: the gap to
`infer bench serve` on that config is what the serving path costs. Chat requests become prompt
ids and images as the server's chat route makes them (`request_prompt`), before the clock starts.

Times are `time.perf_counter()`; TTFT here is from `add_request` to the step that returned the
request's first token. An engine that speculates also reports what speculation did in the run
(infer.bench.spec_decode), and one whose model has a vision tower what the tower did
(infer.bench.vision), each from the engine's counters before and after the run.

Passes (`run_passes`): the same requests run again and again; with a prefix cache, a later pass
finds what the earlier ones left, its images among them.
"""

import statistics
import time
from collections import deque

from infer.bench.serving.report import markdown_table
from infer.bench.serving.workloads import BenchRequest, Workload
from infer.bench.spec_decode import spec_decode_from_engine_stats
from infer.bench.vision import VISION_HEADER, vision_cells, vision_from_engine_stats
from infer.engine.engine import Engine
from infer.engine.images import PromptImage
from infer.engine.sampling_params import SamplingParams
from infer.models.registry import image_processor_for
from infer.server import chat_images
from infer.server.errors import ApiError
from infer.server.media import MediaPolicy
from infer.server.schemas import ChatCompletionRequest


def request_prompt(
    engine: Engine, request: BenchRequest, image_processor
) -> tuple[list[int], list[PromptImage]]:
    """The prompt ids and images the engine gets for `request`: a completion's ids as they are; a
    chat's as infer.server.routes_chat makes them (the messages read as the route reads its body,
    the images decoded and preprocessed by infer.server.chat_images, the template rendered, each
    image widened into its placeholder tokens). `image_processor`: the model's
    (infer.models.registry.image_processor_for), None for a model without a vision tower."""
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids, []
    body = ChatCompletionRequest.model_validate({"model": engine.config.model, "messages": request.messages})
    try:
        images = chat_images.load_images(body.image_urls(), image_processor, body.model, MediaPolicy())
        template = engine.model_info.chat_template
        prompt = template.render(
            body.template_messages(), add_generation_prompt=True, **body.template_kwargs()
        )
        return chat_images.encode_with_images(prompt, images, image_processor, body, engine.tokenizer)
    except ApiError as error:  # what the server would answer with a 400
        raise ValueError(f"request {request.index}: {error.message} ({error.param})") from None


def model_image_processor(engine: Engine):
    """The engine's model's image processor, as the server reads it (ServerState.image_processor)."""
    info = engine.model_info
    return image_processor_for(info.path, info.config.model_type)


def run_engine_only(engine: Engine, workload: Workload) -> dict:
    """One run of `workload` through `engine`; returns its wall time, tokens and TTFTs."""
    image_processor = model_image_processor(engine)
    prompts = [request_prompt(engine, request, image_processor) for request in workload.requests]
    waiting = deque(zip(workload.requests, prompts, strict=True))
    added_s: dict[str, float] = {}
    ttft_s: list[float] = []
    num_tokens = 0
    stats_before = engine.stats()
    start = time.perf_counter()
    while waiting or added_s:
        while waiting and len(added_s) < workload.concurrency:
            request, (prompt, images) = waiting.popleft()
            params = SamplingParams(temperature=0.0, max_new_tokens=request.max_tokens, ignore_eos=True)
            request_id = engine.add_request(
                prompt, params, request_id=f"bench-{request.index}", images=images
            )
            added_s[request_id] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed in the engine: {output.error}")
            if output.token_id is not None:
                num_tokens += 1
                if output.completion_tokens == 1:
                    ttft_s.append(now - added_s[output.request_id])
            if output.finished:
                del added_s[output.request_id]
    wall_s = time.perf_counter() - start
    stats_after = engine.stats()
    spec_decode = spec_decode_from_engine_stats(stats_before, stats_after)
    sees = engine.limits.image_token_id is not None  # the model has a vision tower
    return {
        "wall_s": wall_s,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / wall_s,
        # The forward steps the engine's core (each replica's) ran: a spawned engine's step()
        # returns what has arrived, so the loop's own count would be of polls.
        "steps": stats_after.num_steps - stats_before.num_steps,
        "ttft_p50_ms": 1e3 * statistics.median(ttft_s),
        "ttft_max_ms": 1e3 * max(ttft_s),
        **({"spec_decode": spec_decode} if spec_decode is not None else {}),
        **({"vision": vision_from_engine_stats(stats_before, stats_after)} if sees else {}),
    }


def run_passes(engine: Engine, workload: Workload, passes: int) -> list[dict]:
    """`workload` run `passes` times over through `engine`; each run says its pass (1-based) and,
    after the first, its TTFT p50 over the first's (`ttft_p50_ratio_to_pass_1`)."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    runs = []
    for number in range(1, passes + 1):
        run = {"pass": number, **run_engine_only(engine, workload)}
        if number > 1:
            run["ttft_p50_ratio_to_pass_1"] = run["ttft_p50_ms"] / runs[0]["ttft_p50_ms"]
        runs.append(run)
    return runs


def engine_only_markdown(workload: Workload, config: dict, runs: list[dict]) -> str:
    """One table, a row per run: with passes, the run's pass and its TTFT p50 over its first
    pass's; the speculation and vision columns when some run has them."""
    speculates = any("spec_decode" in run for run in runs)
    sees = any("vision" in run for run in runs)
    has_passes = any(run.get("pass", 1) > 1 for run in runs)
    header = ["run", "out tok/s", "wall (s)", "output tokens", "steps", "TTFT p50 (ms)", "TTFT max (ms)"]
    header += ["pass", "TTFT p50 x pass 1"] * has_passes
    header += ["accept %", "accepted len"] * speculates + [*VISION_HEADER] * sees
    lines = [
        f"## engine only: {workload.name}, {workload.num_requests} requests, "
        f"concurrency {workload.concurrency}",
        "",
        f"engine config: {config}",
        "",
    ]
    rows = []
    for i, run in enumerate(runs):
        cells = [
            str(i), f"{run['output_tokens_per_s']:.1f}", f"{run['wall_s']:.3f}", str(run["output_tokens"]),
            str(run["steps"]), f"{run['ttft_p50_ms']:.1f}", f"{run['ttft_max_ms']:.1f}",
        ]  # fmt: skip
        if has_passes:
            ratio = run.get("ttft_p50_ratio_to_pass_1")
            cells += [str(run.get("pass", 1)), "-" if ratio is None else f"{ratio:.2f}"]
        if speculates:
            spec = run.get("spec_decode")
            cells += (
                [f"{100 * spec['acceptance_rate']:.1f}", f"{spec['mean_accepted_length']:.2f}"]
                if spec
                else ["-", "-"]
            )
        if sees:
            cells += vision_cells(run.get("vision"))
        rows.append(cells)
    return "\n".join([*lines, markdown_table(header, rows)]) + "\n"
