"""`infer bench engine-only`: a serving workload through the engine alone, with no HTTP.

The same closed loop as the HTTP client (at most `concurrency` requests in flight, the next one
added as soon as one finishes, in index order; greedy, `ignore_eos`, each request's own
max_tokens), driven by `Engine.step()` in this thread with the core in this process, so nothing
but the engine and its output processor runs. Its output tokens per second is what a server on
the same engine config could reach if HTTP, SSE and the bench client cost nothing: the gap to
`infer bench serve` on that config is what the serving path costs. Chat requests are rendered
with the model's chat template, as the server renders them.

Times are `time.perf_counter()`; TTFT here is from `add_request` to the step that returned the
request's first token. An engine that speculates also reports what speculation did in the run
(infer.bench.spec_decode, from the engine's counters before and after it).
"""

import statistics
import time
from collections import deque

from infer.bench.serving.workloads import BenchRequest, Workload
from infer.bench.spec_decode import spec_decode_from_engine_stats
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams


def prompt_ids(engine: Engine, request: BenchRequest) -> list[int]:
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    text = engine.model_info.chat_template.render(request.messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run_engine_only(engine: Engine, workload: Workload) -> dict:
    """One run of `workload` through `engine`; returns its wall time, tokens and TTFTs."""
    prompts = [prompt_ids(engine, request) for request in workload.requests]
    waiting = deque(zip(workload.requests, prompts, strict=True))
    added_s: dict[str, float] = {}
    ttft_s: list[float] = []
    num_tokens = num_steps = 0
    stats_before = engine.stats()
    start = time.perf_counter()
    while waiting or added_s:
        while waiting and len(added_s) < workload.concurrency:
            request, prompt = waiting.popleft()
            params = SamplingParams(temperature=0.0, max_new_tokens=request.max_tokens, ignore_eos=True)
            request_id = engine.add_request(prompt, params, request_id=f"bench-{request.index}")
            added_s[request_id] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        num_steps += 1
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
    spec_decode = spec_decode_from_engine_stats(stats_before, engine.stats())
    return {
        "wall_s": wall_s,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / wall_s,
        "steps": num_steps,
        "ttft_p50_ms": 1e3 * statistics.median(ttft_s),
        "ttft_max_ms": 1e3 * max(ttft_s),
        **({"spec_decode": spec_decode} if spec_decode is not None else {}),
    }


def engine_only_markdown(workload: Workload, config: dict, runs: list[dict]) -> str:
    speculates = any("spec_decode" in run for run in runs)
    spec_header = " accept % | accepted len |" if speculates else ""
    lines = [
        f"## engine only: {workload.name}, {workload.num_requests} requests, "
        f"concurrency {workload.concurrency}",
        "",
        f"engine config: {config}",
        "",
        "| run | out tok/s | wall (s) | output tokens | steps | TTFT p50 (ms) | TTFT max (ms) |"
        + spec_header,
        "|---|---|---|---|---|---|---|" + "---|" * (2 * speculates),
    ]
    for i, run in enumerate(runs):
        spec = run.get("spec_decode")
        spec_cells = (
            f" {100 * spec['acceptance_rate']:.1f} | {spec['mean_accepted_length']:.2f} |"
            if speculates
            else ""
        )
        lines.append(
            f"| {i} | {run['output_tokens_per_s']:.1f} | {run['wall_s']:.3f} | {run['output_tokens']} | "
            f"{run['steps']} | {run['ttft_p50_ms']:.1f} | {run['ttft_max_ms']:.1f} |" + spec_cells
        )
    return "\n".join(lines) + "\n"
