"""Building an engine core: the model, the KV pool and prefix tree, the scheduler and the runner.

`build_engine_parts(config, loaded_model)` makes every part `EngineCore` steps, once, at start-up:
the model loaded (or the one given), the pool sized from the config, the scheduler over the
pool's blocks (with the prefix tree and the grammar matchers), the runner warmed up and its CUDA
graphs captured. `EngineCore(config, loaded_model)` builds its parts here.
"""

import logging
from dataclasses import dataclass

import torch

from infer.cache import (
    HostKVStore,
    KVCacheShape,
    PagedKVPool,
    PrefixTree,
    QuantizedKVStore,
    kv_budget_from_free_memory,
    num_blocks_for_memory,
)
from infer.engine.config import EngineConfig, EngineConfigError, resolve_device, resolve_dtype
from infer.engine.device_defaults import resolve_for_device
from infer.engine.eos import eos_token_ids_of
from infer.engine.kv_manager import KVCacheManager
from infer.engine.protocol import CoreLimits
from infer.engine.roofline import DecodeTraffic, copy_bandwidth
from infer.engine.runner import ModelRunner
from infer.engine.scheduler import Scheduler
from infer.engine.startup_progress import startup_phase
from infer.engine.step_memory import measure_step_memory
from infer.engine.structured_output import StructuredOutput
from infer.models.bf16_cpu import takes_fp32_activations, widen_activations
from infer.models.huge_pages import move_to_huge_pages
from infer.models.kernel_policy import KernelPolicy

logger = logging.getLogger(__name__)

# The default max_seq_len when the config gives none: the model's context, at most this, so the
# default pool (room for max_batch_size sequences of max_seq_len) stays small for small models.
DEFAULT_MAX_SEQ_LEN_CAP = 4096


@dataclass
class EngineParts:
    """What an engine core steps, built (`build_engine_parts`)."""

    config: EngineConfig
    # An infer.models.LoadedModel: kept for the frontend that shares this process (its tokenizer
    # and template); the core itself reads only the model and the folder's EOS declarations.
    loaded: object
    device: torch.device
    max_seq_len: int
    kv_pool: PagedKVPool
    prefix_tree: PrefixTree | None
    scheduler: Scheduler
    runner: ModelRunner
    limits: CoreLimits
    # Measured before the KV pool takes the free memory (bytes/s), and what a decode step reads.
    copy_bandwidth: float
    decode_traffic: DecodeTraffic


def build_engine_parts(config: EngineConfig, loaded_model=None, *, tensor_parallel=None) -> EngineParts:
    """`loaded_model`: an infer.models.LoadedModel; None loads config.model (its dtype and
    device then come from the config; a given model keeps its own). The config's auto settings
    are decided for the device first (infer.engine.device_defaults): the parts' `config` is that
    result, and `limits.settings_line` says it in one line.

    With config.tensor_parallel_size > 1, rank 0 (`tensor_parallel` None) starts the other
    ranks (infer.engine.tensor_parallel) and its runner mirrors its calls to them; a worker
    passes its own `tensor_parallel` (an infer.models TensorParallel). Each loads its shard."""
    if config.data_parallel_size > 1:
        raise EngineConfigError(
            f"data_parallel_size {config.data_parallel_size} runs each replica's core in a process of "
            "its own (Engine.spawn, infer serve without --engine-in-process); this builds one core"
        )
    link = None
    if config.tensor_parallel_size > 1:
        if loaded_model is not None:
            raise EngineConfigError(
                "tensor_parallel_size > 1 loads each rank's shard of config.model; an engine "
                "over a loaded model runs on one device"
            )
        if tensor_parallel is None:
            from infer.engine.tensor_parallel import start_workers

            tensor_parallel, link = start_workers(config, resolve_device(config.device).type)
    device = (
        resolve_device(config.device)
        if loaded_model is None
        else next(loaded_model.model.parameters()).device
    )
    resolved = resolve_for_device(config, device)
    config = resolved.config
    settings_line = resolved.describe()
    logger.info("engine settings: %s", settings_line)
    if loaded_model is None:
        from infer.models.load import load_model

        limit_device_memory(config, device)
        loaded_model = load_model(
            config.model,
            dtype=resolve_dtype(config.dtype, device),
            device=device,
            quantization=config.quantization,
            tensor_parallel=tensor_parallel,
            load_format=config.load_format,
        )
    else:
        logger.info(
            "engine uses the given model from %s; config.model/dtype/device are not used",
            loaded_model.path,
        )
        limit_device_memory(config, next(loaded_model.model.parameters()).device)
    model = loaded_model.model
    device = next(model.parameters()).device
    max_seq_len = _resolve_max_seq_len(config, model.config.max_position_embeddings)
    # Measured before the KV pool takes the free memory (it borrows two large buffers).
    bandwidth = copy_bandwidth(device)
    kernel_policy = KernelPolicy(
        device, config.use_triton_gemv, config.use_pdl, config.use_native_cpu_kernels
    )
    draft = _load_draft_model(config, loaded_model, device, max_seq_len)
    for each in (model, draft.model if draft is not None else None):
        if each is not None and takes_fp32_activations(each, device, config.use_native_cpu_kernels):
            # bf16 weights on a CPU: widened in registers by the C kernels, float32 activations
            # and KV cache, so that decode steps take the C stack (infer.models.bf16_cpu).
            widen_activations(each)
            logger.info("bf16 weights under float32 activations and KV cache on the CPU")
        if each is not None and device.type == "cpu" and config.use_huge_pages:
            # Before the runner builds the C decoder stack, which holds the weights' addresses.
            move_to_huge_pages(each)
    shape = _kv_cache_shape(config, model, max_seq_len)
    draft_shape = _kv_cache_shape(config, draft.model, max_seq_len) if draft is not None else None
    kv_pool = _build_kv_pool(
        config,
        shape,
        max_seq_len,
        device,
        held_back_bytes=_step_memory(config, model, shape, max_seq_len, kernel_policy),
        draft_shape=draft_shape,
        tensor_parallel=tensor_parallel,
    )
    logger.info(
        "KV pool: %d blocks of %d tokens (%.1f MiB)",
        kv_pool.num_blocks,
        kv_pool.block_size,
        kv_pool.kv_bytes / 2**20,
    )
    prefix_tree = _build_prefix_tree(config, kv_pool)
    for name in ("use_cuda_graphs", "use_pdl", "use_triton_gemv"):
        if getattr(config, name) and device.type != "cuda":
            raise EngineConfigError(f"{name}=True needs a CUDA device, the model is on {device}")
    eos_token_ids = eos_token_ids_of(loaded_model)
    limits = CoreLimits(
        max_seq_len=max_seq_len,
        block_size=kv_pool.block_size,
        num_blocks=kv_pool.num_blocks,
        max_queue_len=config.max_queue_len,
        vocab_size=model.config.vocab_size,
        eos_token_ids=eos_token_ids,
        config=config,
        settings_line=settings_line,
        image_token_id=model.vision.layout.image_token_id if model.vision is not None else None,
    )
    scheduler = Scheduler.from_engine_config(
        config,
        kv_manager=KVCacheManager(kv_pool.allocator, kv_pool.block_size, prefix_tree),
        max_seq_len=max_seq_len,
        whole_images=model.vision is not None and model.vision.layout.bidirectional,
        # Structured output: a matcher per constrained request.
        structured_output=StructuredOutput(
            loaded_model.tokenizer.hf_tokenizer,
            model.config.vocab_size,
            eos_token_ids,
            device,
            config.max_batch_size,
        ),
    )
    runner = ModelRunner(
        model,
        kv_pool,
        max_batch_size=config.max_batch_size,
        max_seq_len=max_seq_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        use_cuda_graphs=config.use_cuda_graphs,
        cuda_graph_mixed_steps=config.cuda_graph_mixed_steps,
        async_scheduling=config.async_scheduling,
        kernel_policy=kernel_policy,
        eos_token_ids=eos_token_ids,
        draft=_draft_proposer(
            config, draft, draft_shape, kv_pool.num_blocks, device, max_seq_len, kernel_policy
        ),
    )
    # At start-up, not on first use: a kernel compile or a graph capture would land on the
    # latency of whichever request first needs it, and of every request in its step.
    runners = [runner] if runner.draft is None else [runner, runner.draft.runner]
    with startup_phase("warming the kernels up", logger):
        for each in runners:
            each.warm_up()
    if runner.graphs is not None:
        with startup_phase("capturing CUDA graphs (use_cuda_graphs=false skips this)", logger):
            for each in runners:
                each.graphs.capture_all()
        logger.info("captured %d CUDA graphs", sum(each.graphs.num_captured for each in runners))
    if link is not None:
        from infer.engine.tensor_parallel import MirroredRunner

        runner = MirroredRunner(runner, link)
    return EngineParts(
        config=config,
        loaded=loaded_model,
        device=device,
        max_seq_len=max_seq_len,
        kv_pool=kv_pool,
        prefix_tree=prefix_tree,
        scheduler=scheduler,
        runner=runner,
        limits=limits,
        copy_bandwidth=bandwidth,
        decode_traffic=DecodeTraffic.of(model, kv_pool.shape.dtype),
    )


def _build_prefix_tree(config: EngineConfig, kv_pool: PagedKVPool) -> PrefixTree | None:
    if not config.use_prefix_caching:
        return None
    max_blocks = None
    if config.prefix_cache_max_bytes is not None:
        max_blocks = config.prefix_cache_max_bytes // kv_pool.shape.bytes_per_block()
    return PrefixTree(
        kv_pool.allocator,
        kv_pool.block_size,
        max_blocks=max_blocks,
        slots=kv_pool.store.allocator if kv_pool.store is not None else None,
        # Any block is cheaper to copy back from the host than to recompute; int8 costs accuracy,
        # which only long sequences are worth.
        store_min_tokens=config.prefix_cache_quantize_min_tokens if config.prefix_cache_kv_bits else 0,
        # Sessions idle past the TTL leave the device for the host tier, and leave that last.
        idle_to_store=kv_pool.store is not None and kv_pool.store.on_host,
    )


def _resolve_max_seq_len(config: EngineConfig, model_max_positions: int) -> int:
    if config.max_seq_len is None:
        return min(model_max_positions, DEFAULT_MAX_SEQ_LEN_CAP)
    if config.max_seq_len > model_max_positions:
        raise EngineConfigError(
            f"max_seq_len ({config.max_seq_len}) exceeds the model's max_position_embeddings "
            f"({model_max_positions}); lower max_seq_len"
        )
    return config.max_seq_len


def _memory_limit_bytes(config: EngineConfig) -> int | None:
    gib = config.device_memory_limit_gib
    return None if gib is None else int(gib * 2**30)


def limit_device_memory(config: EngineConfig, device: torch.device) -> None:
    """Holds this process's CUDA allocator to device_memory_limit_gib (it raises out-of-memory
    past it), so that everything the engine allocates counts: weights, KV pool, graphs."""
    limit = _memory_limit_bytes(config)
    if limit is None:
        return
    if device.type != "cuda":
        raise EngineConfigError(f"device_memory_limit_gib limits CUDA memory; the device is {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), index)


def _load_draft_model(config: EngineConfig, loaded_model, device: torch.device, max_seq_len: int):
    """The draft model of speculative_config (method draft_model), loaded as the target is; None
    for another method. Refused unless it shares the target's vocabulary and holds max_seq_len
    positions."""
    speculative = config.speculative
    if speculative is None or speculative.method != "draft_model":
        return None
    from infer.models.load import load_model

    draft = load_model(speculative.model, dtype=loaded_model.model.dtype, device=device)
    target_vocab = loaded_model.tokenizer.hf_tokenizer.get_vocab()
    if (
        draft.model.config.vocab_size != loaded_model.model.config.vocab_size
        or draft.tokenizer.hf_tokenizer.get_vocab() != target_vocab
    ):
        raise EngineConfigError(
            f"speculative_config.model {speculative.model!r} does not share the target's vocabulary "
            f"({draft.model.config.vocab_size} ids, the target {loaded_model.model.config.vocab_size}); "
            "a draft model must use the target's tokenizer"
        )
    if draft.model.config.max_position_embeddings < max_seq_len:
        raise EngineConfigError(
            f"speculative_config.model {speculative.model!r} holds "
            f"{draft.model.config.max_position_embeddings} positions, fewer than max_seq_len "
            f"({max_seq_len}); lower max_seq_len"
        )
    logger.info("draft model: %s", draft.path)
    return draft


def _draft_proposer(config, draft, draft_shape, num_blocks: int, device, max_seq_len: int, kernel_policy):
    """The draft model's proposer over a pool of as many blocks as the target's (the target's
    block ids address both), or None."""
    if draft is None:
        return None
    from infer.engine.spec_decode.draft_model import DraftModelProposer

    pool = PagedKVPool(draft_shape, num_blocks=num_blocks, device=device)
    runner = ModelRunner(
        draft.model,
        pool,
        max_batch_size=config.max_batch_size,
        max_seq_len=max_seq_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        use_cuda_graphs=config.use_cuda_graphs,
        # Its catch-up forwards run eagerly; its K - 1 decode steps replay the decode graphs.
        cuda_graph_mixed_steps=False,
        # Its decode steps feed the previous step's drafts as placeholders, which the graphs
        # resolve from the device, as async scheduling's steps do.
        async_scheduling=True,
        kernel_policy=kernel_policy,
    )
    return DraftModelProposer(runner, config.speculative.num_speculative_tokens)


def _kv_cache_shape(config: EngineConfig, model, max_seq_len: int) -> KVCacheShape:
    """Blocks of block_size tokens (paged) or of max_seq_len (contiguous), in the model's dtype or
    fp8 (kv_cache_dtype; CUDA only: the kernels that read and write it are Triton's)."""
    dtype = model.dtype
    if config.kv_cache_dtype != "auto":
        if next(model.parameters()).device.type != "cuda":
            raise EngineConfigError(
                f"kv_cache_dtype {config.kv_cache_dtype!r} needs a CUDA device (the fp8 kernels are "
                "Triton's); on a CPU use kv_cache_dtype 'auto'"
            )
        dtype = torch.float8_e4m3fn
    return KVCacheShape(
        num_layers=model.config.num_layers,
        num_kv_heads=model.num_kv_heads,  # a tensor-parallel rank's share
        head_dim=model.config.head_dim,
        dtype=dtype,
        block_size=config.block_size if config.kv_cache_backend == "paged" else max_seq_len,
    )


def _step_memory(config: EngineConfig, model, shape: KVCacheShape, max_seq_len: int, kernel_policy) -> int:
    """What the pool's share of free memory must leave to serving (infer.engine.step_memory): the
    runner's buffers and its largest step, measured, and as much again for the CUDA graphs. 0
    where the pool is not sized from free memory."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    if not on_cuda or config.num_gpu_blocks is not None or config.kv_cache_memory_fraction is None:
        return 0
    with startup_phase("measuring the largest step's memory", logger):
        try:
            measured = measure_step_memory(
                model,
                shape,
                max_batch_size=config.max_batch_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_seq_len=max_seq_len,
                kernel_policy=kernel_policy,
                use_cuda_graphs=config.use_cuda_graphs,
            )
        except torch.OutOfMemoryError as error:
            raise EngineConfigError(
                f"a step of {config.max_batch_size} rows and {config.max_num_batched_tokens} tokens "
                "does not fit in the device memory left after the weights; "
                "lower max_batch_size or max_num_batched_tokens, or give the engine more memory"
            ) from error
    logger.info(
        "kept from the KV pool: %.1f MiB (runner buffers %.1f, largest step %.1f%s)",
        measured.total_bytes / 2**20,
        measured.runner_bytes / 2**20,
        measured.largest_step_bytes / 2**20,
        ", as much again for the CUDA graphs" if measured.cuda_graphs else "",
    )
    return measured.total_bytes


def _build_kv_pool(
    config: EngineConfig,
    shape: KVCacheShape,
    max_seq_len: int,
    device: torch.device,
    *,
    held_back_bytes: int = 0,
    draft_shape: KVCacheShape | None = None,
    tensor_parallel=None,
) -> PagedKVPool:
    """The pool the config asks for: num_gpu_blocks, or its fraction of the free memory less
    `held_back_bytes`, or room for max_batch_size whole sequences. With `draft_shape`, the memory
    is shared with a draft model's pool of as many blocks."""
    if config.num_gpu_blocks is not None:
        num_blocks = config.num_gpu_blocks
    elif config.kv_cache_memory_fraction is not None:
        budget = kv_budget_from_free_memory(
            device,
            config.kv_cache_memory_fraction,
            memory_limit_bytes=_memory_limit_bytes(config),
            held_back_bytes=held_back_bytes,
        )
        if draft_shape is not None:  # the target's share of each block's bytes
            target, other = shape.bytes_per_block(), draft_shape.bytes_per_block()
            budget = budget * target // (target + other)
        num_blocks = num_blocks_for_memory(shape, budget)
    else:
        # The memory of max_batch_size whole sequences, as the slotted pool had.
        num_blocks = config.max_batch_size * shape.blocks_for_tokens(max_seq_len)
    if tensor_parallel is not None:
        # One block id addresses a block in every rank's pool: the ranks take the smallest.
        agreed = torch.tensor([num_blocks], device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        num_blocks = int(agreed.item())
    store = None
    if config.kv_host_cache_gib is not None:
        store = _host_store(config, shape, device)
    elif config.prefix_cache_kv_bits is not None:
        # The int8 store's share of the same memory: fewer blocks, and slots in their bytes.
        num_store_blocks = round(num_blocks * config.prefix_cache_quantized_fraction)
        num_slots = num_store_blocks * shape.bytes_per_block() // QuantizedKVStore.bytes_per_slot(shape)
        num_blocks -= num_store_blocks
        store = QuantizedKVStore(shape, num_slots, device) if num_slots else None
    if num_blocks < 1:
        raise EngineConfigError(f"the KV pool would hold {num_blocks} blocks; give it more memory")
    return PagedKVPool(shape, num_blocks=num_blocks, device=device, store=store)


def _host_store(config: EngineConfig, shape: KVCacheShape, device: torch.device):
    """The host tier: kv_host_cache_gib of host memory in blocks of the pool's dtype, or of int8
    with prefix_cache_kv_bits; pinned for a CUDA pool, so that copies need not wait."""
    budget = int(config.kv_host_cache_gib * 2**30)
    int8 = config.prefix_cache_kv_bits is not None
    num_slots = budget // (QuantizedKVStore if int8 else HostKVStore).bytes_per_slot(shape)
    if num_slots < 1:
        raise EngineConfigError(
            f"kv_host_cache_gib={config.kv_host_cache_gib} holds no block of {shape.bytes_per_block()} bytes"
        )
    pin = device.type == "cuda"
    if int8:
        return QuantizedKVStore(shape, num_slots, "cpu", on_host=True, pin_memory=pin)
    return HostKVStore(shape, num_slots, pin_memory=pin)
