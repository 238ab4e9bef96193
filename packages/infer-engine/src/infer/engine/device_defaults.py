"""The measured-best engine settings for a device: what an EngineConfig's "auto" (None) means.

A user of vLLM or SGLang gets their fast paths without asking, and so does `infer serve`: on
CUDA the engine replays CUDA graphs, schedules asynchronously, chunks prefills, keeps a prefix
cache, runs batch-1 decode on the Triton GEMV with programmatic dependent launch (Hopper and
newer, where they were measured), gives the KV pool 0.9 of the memory free after the weights
(vLLM's `gpu_memory_utilization` 0.9 convention: a tenth stays for activations and graphs) and
runs up to 256 sequences at once (vLLM's `max_num_seqs`). Figures against the fastest flags:
docs/benchmarks/generation.md#defaults (W1) and docs/benchmarks/serving.md#defaults (W2).

On a CPU the defaults stay as they were measured there: eager steps, whole prompts, no prefix
cache, 8 sequences over a pool of 8 whole sequences, infer-kernels' C kernels for decode.

Every switch is an escape hatch: an explicit true or false is kept as given (`--use-pdl false`),
and `describe` says, in one line, what is on and why anything is off.
"""

from dataclasses import dataclass

import torch

from infer.engine.config import AUTO_FLAGS, EngineConfig

# vLLM's defaults, which a user comparing engines expects (see the module docstring).
CUDA_MAX_BATCH_SIZE = 256
CUDA_KV_CACHE_MEMORY_FRACTION = 0.9
CPU_MAX_BATCH_SIZE = 8
# PDL and the one-row Triton GEMV were measured to win on Hopper (H100, H200); elsewhere they
# stay off until measured.
MEASURED_CAPABILITY = (9, 0)

# The switches' names as `describe` prints them.
FAST_PATH_NAMES = {
    "use_cuda_graphs": "CUDA graphs",
    "async_scheduling": "async scheduling",
    "use_chunked_prefill": "chunked prefill",
    "use_prefix_caching": "prefix cache",
    "use_pdl": "PDL",
    "use_triton_gemv": "Triton GEMV",
}


@dataclass(frozen=True)
class ResolvedConfig:
    """An EngineConfig with every auto setting decided, and why each switch that is off is off."""

    config: EngineConfig
    off_reasons: dict[str, str]

    def describe(self) -> str:
        """One line: the fast paths on, the pool and batch sizing, and each switch that is off."""
        config = self.config
        on = [label for name, label in FAST_PATH_NAMES.items() if getattr(config, name)]
        if config.num_gpu_blocks is not None:
            pool = f"KV pool {config.num_gpu_blocks} blocks"
        elif config.kv_cache_memory_fraction is not None:
            pool = f"KV pool {config.kv_cache_memory_fraction:g} of free memory"
        else:
            pool = "KV pool of max_batch_size whole sequences"
        off = [f"{FAST_PATH_NAMES[name]} ({reason})" for name, reason in self.off_reasons.items()]
        parts = [
            f"on: {', '.join(on) if on else 'none'}",
            f"{pool}, max_batch_size {config.max_batch_size}",
        ]
        speculative = config.speculative
        if speculative is not None:
            drafts = speculative.num_speculative_tokens
            backoff = speculative.min_acceptance_rate
            parts.append(
                f"speculative decoding: {speculative.method}, {drafts} draft tokens"
                + (f", backing off below {backoff:g} kept" if backoff > 0 else "")
            )
        if off:
            parts.append(f"off: {'; '.join(off)}")
        return " | ".join(parts)


def resolve_for_device(config: EngineConfig, device: torch.device) -> ResolvedConfig:
    """`config` with each auto (None) setting replaced by the measured best for `device`; explicit
    settings are kept. Raises EngineConfigError where the result breaks a rule (as any config)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return resolve(config, cuda_capability=capability)


def resolve(config: EngineConfig, *, cuda_capability: tuple[int, int] | None) -> ResolvedConfig:
    """`resolve_for_device` for a CUDA device of compute capability `cuda_capability`, or for the
    CPU when it is None."""
    capability = cuda_capability
    on_cuda = capability is not None
    continuous = config.batching_mode == "continuous"
    paged = config.kv_cache_backend == "paged"
    prefix_needed = (
        config.prefix_cache_kv_bits is not None
        or config.kv_host_cache_gib is not None
        or config.prefix_cache_shadow_rate > 0
    )

    # name -> (on by default here, the reason when not)
    automatic: dict[str, tuple[bool, str]] = {}
    automatic["use_prefix_caching"] = (
        (on_cuda or prefix_needed) and continuous and paged and config.use_chunked_prefill is not False,
        _first_reason(
            (not continuous, "static batching"),
            (not paged, "contiguous KV"),
            (config.use_chunked_prefill is False, "chunked prefill is off"),
            (not on_cuda, "CPU default"),
        ),
    )
    prefix_on = config.use_prefix_caching or (
        config.use_prefix_caching is None and automatic["use_prefix_caching"][0]
    )
    automatic["use_chunked_prefill"] = (
        (on_cuda or prefix_on) and continuous,
        "static batching" if not continuous else "CPU default",
    )
    automatic["use_cuda_graphs"] = (
        on_cuda and continuous and paged,
        _first_reason(
            (not on_cuda, "CPU"), (not continuous, "static batching"), (not paged, "contiguous KV")
        ),
    )
    automatic["async_scheduling"] = (on_cuda, "CPU")
    measured = capability is not None and capability >= MEASURED_CAPABILITY
    unmeasured = (
        "CPU" if capability is None else f"not measured on compute capability {capability[0]}.{capability[1]}"
    )
    automatic["use_pdl"] = (measured, unmeasured)
    automatic["use_triton_gemv"] = (measured, unmeasured)

    changes: dict = {}
    off_reasons: dict[str, str] = {}
    for name in AUTO_FLAGS:
        given = getattr(config, name)
        if given is None:
            given, reason = automatic[name]
            changes[name] = given
            if not given:
                off_reasons[name] = reason
        elif not given:
            off_reasons[name] = f"--{name.replace('_', '-')} false"
    if config.max_batch_size is None:
        wanted = CUDA_MAX_BATCH_SIZE if on_cuda else CPU_MAX_BATCH_SIZE
        # The step budget must hold a decode of every running request (EngineConfig's rule).
        changes["max_batch_size"] = min(wanted, config.max_num_batched_tokens)
    if on_cuda and config.num_gpu_blocks is None and config.kv_cache_memory_fraction is None:
        changes["kv_cache_memory_fraction"] = CUDA_KV_CACHE_MEMORY_FRACTION
    return ResolvedConfig(config.replace(**changes), off_reasons)


def _first_reason(*conditions: tuple[bool, str]) -> str:
    return next((reason for holds, reason in conditions if holds), "")
