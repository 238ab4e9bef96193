"""The transformers reference for the serving goal: transformers' own continuous batching
(`ContinuousBatchingManager`, what `model.generate_batch` wraps) on the same seeded prompts.

Why the manager and not `generate_batch`: generate_batch takes one `max_new_tokens` for all
prompts, while W2's outputs differ per request; `manager.add_request` takes one per request,
and `eos_token_id=-1` per request is transformers' spelling of ignore_eos. Greedy
(`do_sample=False`). `max_requests_per_batch` is the workload's concurrency, so at most that many
requests decode together, like the closed loop of `bench serve`; every request is queued at once.

attn_implementation: "sdpa" by default. transformers switches sdpa/eager to flash attention by
itself when flash-attn is installed (ContinuousBatchingConfig.auto_switch_to_flash); the report
records the implementation the model ended with. "paged|eager" is the other built-in choice.

Timing: a short untimed warm-up request first (and transformers' own warm-up: CUDA graphs).
Then wall time from the first add_request to the last finished result; TTFT, ITL and E2E come
from the per-token timestamps transformers records (`record_timestamps=True`), on the same
`time.perf_counter` clock as the request's `created_time`.
"""

import platform
import time

import torch

from infer.bench.serving.stats import summarize
from infer.bench.serving.workloads import Workload

WARMUP_MAX_TOKENS = 4


def load_hf_model(model_path: str, *, device: str, dtype: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    torch_dtype = {
        "auto": "auto",
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[dtype]
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch_dtype, attn_implementation=attn_implementation
    )
    return model.to(device).eval()


def prompt_token_ids(workload: Workload, model_path: str) -> list[list[int]]:
    """Token ids of every request: as given for completions, chat-templated for chat workloads."""
    if workload.shape.is_conversation:
        raise ValueError(
            f"{workload.name} is a conversation workload: each turn sends the server's previous reply, "
            "which a batch of independent prompts cannot; run it with `infer bench serve`"
        )
    if workload.shape.kind == "completion":
        return [request.prompt_token_ids for request in workload.requests]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [
        list(
            tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for request in workload.requests
    ]


def run_hf_baseline(
    model_path: str,
    workload: Workload,
    *,
    device: str = "cuda",
    dtype: str = "bfloat16",
    attn_implementation: str = "sdpa",
    page_size: int | None = None,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
) -> dict:
    """Runs `workload` through transformers' continuous batching; returns the report dict."""
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = load_hf_model(model_path, device=device, dtype=dtype, attn_implementation=attn_implementation)
    vocab_size = model.config.get_text_config().vocab_size
    prompts = prompt_token_ids(workload, model_path)
    too_large = max(max(prompt) for prompt in prompts)
    if too_large >= vocab_size:
        raise ValueError(
            f"workload token id {too_large} is outside the model's vocabulary of {vocab_size}; "
            f"pass --vocab-size {vocab_size} (to both bench serve and hf-baseline, so their prompts match)"
        )
    max_new_tokens = [request.max_tokens for request in workload.requests]
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(max_new_tokens), eos_token_id=-1)
    cb_settings = {"max_requests_per_batch": workload.concurrency}
    if not device.startswith("cuda") and num_blocks is None and max_batch_tokens is None:
        # transformers sizes its cache and static batch tensors from free GPU memory; on a CPU
        # that guess is huge (tens of seconds to fill), so size them to the workload instead.
        page_size = page_size or 256
        longest = max(map(len, prompts)) + max(max_new_tokens)
        num_blocks = workload.concurrency * -(-longest // page_size) + 1
        max_batch_tokens = min(2048, sum(map(len, prompts)))
    for key, value in (
        ("page_size", page_size),
        ("num_blocks", num_blocks),
        ("max_batch_tokens", max_batch_tokens),
    ):
        if value is not None:
            cb_settings[key] = value
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)),
        max_generated_length=max(max_new_tokens),
        num_requests=len(prompts),
    )
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=ContinuousBatchingConfig(**cb_settings),
        workload_hints=hints,
    ) as manager:
        _collect(
            manager, [manager.add_request(prompts[0], max_new_tokens=WARMUP_MAX_TOKENS, eos_token_id=-1)]
        )
        start = time.perf_counter()
        request_ids = [
            manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1, record_timestamps=True)
            for prompt, n in zip(prompts, max_new_tokens, strict=True)
        ]
        results = _collect(manager, request_ids)
        end = time.perf_counter()
    outputs = [results[request_id] for request_id in request_ids]
    errors = [output.error for output in outputs if output.error is not None]
    num_output_tokens = sum(len(output.generated_tokens) for output in outputs)
    ttft = [output.timestamps[0] - output.created_time for output in outputs if output.timestamps]
    itl = [
        later - earlier
        for o in outputs
        if o.timestamps
        for earlier, later in zip(o.timestamps, o.timestamps[1:], strict=False)
    ]
    e2e = [output.lifespan[1] - output.created_time for output in outputs if output.lifespan[1] > 0]
    return {
        "kind": "infer bench hf-baseline",
        "model": str(model_path),
        "workload": workload.describe(),
        "environment": {
            "device": device
            if not device.startswith("cuda")
            else f"{device}: {torch.cuda.get_device_name(device)}",
            "dtype": dtype,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "attn_implementation_requested": attn_implementation,
            "attn_implementation_used": model.config._attn_implementation,
            "continuous_batching_config": cb_settings,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device)
            if device.startswith("cuda")
            else None,
        },
        "stats": {
            "num_requests": len(outputs),
            "num_errors": len(errors),
            "errors": errors[:5],
            "wall_s": end - start,
            "output_tokens": num_output_tokens,
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens_per_s": num_output_tokens / (end - start),
            "requests_per_s": len(outputs) / (end - start),
            "ttft_s": _as_dict(summarize(ttft)),
            "itl_s": _as_dict(summarize(itl)),
            "e2e_s": _as_dict(summarize(e2e)),
        },
        "generated_tokens": [list(output.generated_tokens) for output in outputs],
    }


def _collect(manager, request_ids: list[str], timeout_s: float = 600.0) -> dict:
    """Waits for every request in `request_ids` to finish; returns request id -> GenerationOutput."""
    pending, results = set(request_ids), {}
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"transformers finished {len(results)} of {len(request_ids)} requests in {timeout_s} s"
            )
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(
                    "transformers' continuous batching thread stopped before every request finished"
                )
            continue
        if result.request_id in pending and result.is_finished():
            pending.discard(result.request_id)
            results[result.request_id] = result
    return results


def _as_dict(summary) -> dict | None:
    return summary.as_dict() if summary else None


def hf_markdown(report: dict) -> str:
    stats, env, workload = report["stats"], report["environment"], report["workload"]
    ms = lambda summary, key: "-" if not summary else f"{summary[key] * 1000:.1f}"  # noqa: E731
    return (
        f"## transformers continuous batching: {workload['name']}, {workload['num_requests']} requests, "
        f"max {workload['concurrency']} per batch\n\n"
        f"- model `{report['model']}`, {env['device']}, {env['dtype']}, "
        f"attention {env['attn_implementation_used']}\n"
        f"- torch {env['torch']}, transformers {env['transformers']}\n\n"
        "| out tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | E2E p50 (ms) | errors |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {stats['output_tokens_per_s']:.1f} | {stats['requests_per_s']:.2f} | "
        f"{ms(stats['ttft_s'], 'p50')} | "
        f"{ms(stats['ttft_s'], 'p99')} | {ms(stats['itl_s'], 'p50')} | {ms(stats['e2e_s'], 'p50')} | "
        f"{stats['num_errors']} |\n"
    )
