"""EngineConfig: every engine flag in one frozen, validated place.

Built in code (`EngineConfig(batching_mode="static")`), from a dict, a JSON or TOML file
(`EngineConfig.from_file`), or from command-line flags (`add_cli_arguments` + `from_cli_args`,
where flags override a `--engine-config FILE`). Every route ends in `__post_init__`, so a bad
combination is rejected the same way wherever it came from, with the rule that it breaks.
"""

import argparse
import dataclasses
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infer.engine.sampling_params import POOLING_TYPES
from infer.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from infer.models import DEFAULT_MODEL
from infer.models.config import TORCH_DTYPES
from infer.models.load import LOAD_FORMATS
from infer.models.quantization import QUANTIZATION_CHOICES

# infer.models' dtype table, and "auto": float32 on the CPU (half precision is slow there and
# gains nothing) and bfloat16 on CUDA, whatever the checkpoint stores.
DTYPES = ("auto", *TORCH_DTYPES)
# contiguous: one block of max_seq_len per sequence (the paged pool with block_size = max_seq_len).
KV_CACHE_BACKENDS = ("contiguous", "paged")
# vLLM's names: fp8 is e4m3 (infer.kernels.kv_fp8).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
BATCHING_MODES = ("static", "continuous")
SCHEDULER_POLICIES = ("fcfs", "prefill_first", "decode_round_robin")
DATA_PARALLEL_ROUTINGS = ("cache_aware", "round_robin")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(name: str) -> torch.device:
    """The torch device for a `device` setting: "auto" is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineConfigError(
            f"device {name!r}, but torch {torch.__version__} sees no CUDA device (a CPU build of torch, "
            "or no GPU); use --device cpu, or install the CUDA build of torch on a machine with a GPU"
        )
    return device


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """The torch dtype for a DTYPES name on `device` ("auto" by the rule above)."""
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return TORCH_DTYPES[name]


# Switches whose None means "the measured best for the device" (infer.engine.device_defaults
# fills them in when the engine is built; an explicit true or false is kept).
AUTO_FLAGS = (
    "use_chunked_prefill",
    "use_prefix_caching",
    "use_cuda_graphs",
    "async_scheduling",
    "use_pdl",
    "use_triton_gemv",
)


class EngineConfigError(ValueError):
    """A config value or combination that the engine cannot run; the message names the rule."""


def _flag(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _flag(DEFAULT_MODEL, "model alias or Hugging Face checkpoint folder")
    dtype: str = _flag("auto", "weights and KV dtype; auto: float32 on CPU, bfloat16 on CUDA", choices=DTYPES)
    device: str = _flag("auto", "cpu, cuda or cuda:N; auto: cuda when available")
    # None: the model's max_position_embeddings, capped at 4096 so the default KV pool stays small.
    max_seq_len: int | None = _flag(None, "longest prompt + generation one request may have")
    seed: int = _flag(0, "seeds every request that brings no seed of its own (deterministic steps)")
    max_batch_size: int | None = _flag(
        None, "requests running at once; None: 256 on CUDA (vLLM's default), 8 on a CPU"
    )
    max_num_batched_tokens: int = _flag(2048, "tokens per step: prefill chunks + one per decoding request")
    kv_cache_backend: str = _flag(
        "paged",
        "paged: blocks of block_size tokens taken as sequences grow; "
        "contiguous: one block of max_seq_len per sequence",
        choices=KV_CACHE_BACKENDS,
    )
    kv_cache_dtype: str = _flag(
        "auto",
        "the KV cache's dtype, as vLLM's --kv-cache-dtype: auto (the model's) or fp8 (e4m3, each "
        "token's vector of each layer and head with a power-of-two scale computed as it is written: "
        "about twice the tokens in the same memory; CUDA only)",
        choices=KV_CACHE_DTYPES,
    )
    pooling_type: str = _flag(
        "last",
        "how an embedding request (/v1/embeddings) pools its prompt's final hidden states: last (the "
        "last token's, what decoder-only embedding models are trained for) or mean",
        choices=POOLING_TYPES,
    )
    block_size: int = _flag(16, "tokens per KV block (paged backend)")
    num_gpu_blocks: int | None = _flag(
        None,
        "KV blocks in the pool; None: kv_cache_memory_fraction of free device memory (CUDA), "
        "room for max_batch_size sequences of max_seq_len (CPU)",
    )
    kv_cache_memory_fraction: float | None = _flag(
        None,
        "fraction of the device memory free after loading the weights that the engine takes (CUDA): "
        "the KV pool gets it less what the largest step and the CUDA graphs were measured to need; "
        "None: 0.9 on CUDA unless num_gpu_blocks is set",
    )
    device_memory_limit_gib: float | None = _flag(
        None,
        "most device memory the engine takes (CUDA): weights, KV pool, activations and CUDA graphs, "
        "held to it by the allocator; kv_cache_memory_fraction then takes its share of what the "
        "limit leaves after the weights. None: the whole device",
    )
    batching_mode: str = _flag(
        "continuous",
        "static: fixed batches run to completion; continuous: join and leave every step",
        choices=BATCHING_MODES,
    )
    scheduler_policy: str = _flag("fcfs", "order of a step's work", choices=SCHEDULER_POLICIES)
    decode_service_interval: int = _flag(4, "a decoding request gets a token at least once every N steps")
    use_chunked_prefill: bool | None = _flag(
        None, "split prompts into chunks of prefill_chunk_size that share steps with decodes: true or false"
    )
    prefill_chunk_size: int = _flag(512, "most prompt tokens of one request in one step (chunked prefill)")
    max_prefill_chunks_per_step: int | None = _flag(
        None, "most prompt chunks in one step (chunked prefill); None: no cap"
    )
    max_queue_len: int = _flag(1024, "waiting requests beyond which add_request raises QueueFullError")
    use_cuda_graphs: bool | None = _flag(
        None,
        "replay steps from CUDA graphs captured at start-up (CUDA only): decode-only steps per batch "
        "bucket, and see cuda_graph_mixed_steps: true or false",
    )
    cuda_graph_mixed_steps: bool = _flag(
        True,
        "with use_cuda_graphs, also replay steps that hold prompt chunks, from graphs captured per "
        "bucket of chunk tokens: true or false",
    )
    async_scheduling: bool | None = _flag(
        None,
        "launch each step before the previous step's tokens reach the host, so that scheduling, "
        "stop checks and input building overlap the forward: true or false",
    )
    use_pdl: bool | None = _flag(
        None,
        "programmatic dependent launch (CUDA, compute capability 9.0 and newer) in batch-1 decode "
        "steps: each Triton kernel lets the next one launch while it runs: true or false",
    )
    use_triton_gemv: bool | None = _flag(
        None,
        "dense Linears of one row (batch-1 decode), the LM head included, run infer-kernels' "
        "Triton GEMV instead of cuBLAS, a gated MLP's activation fused into its gate/up GEMV "
        "(CUDA only): true or false",
    )
    use_native_cpu_kernels: bool = _flag(
        True,
        "on a CPU, infer-kernels' C kernels (x86-64 with AVX2, built with the system's C compiler "
        "at start-up, once a machine) for decode steps' attention and int8 and GGUF Linears, where "
        "ATen would run them; ATen's where they cannot be built (a GGUF weight then dequantized "
        "once, to fp32): true or false",
    )
    use_huge_pages: bool = _flag(
        True,
        "on a CPU, the weights moved at start-up into transparent huge pages (Linux, where they "
        "are not off), which a decode step reads faster than 4 KB pages: true or false",
    )
    use_prefix_caching: bool | None = _flag(
        None,
        "reuse the KV of token runs earlier requests left (prefix, supersequence, common prefix), "
        "token by token; needs kv_cache_backend paged and use_chunked_prefill: true or false",
    )
    prefix_cache_max_bytes: int | None = _flag(
        None, "most KV bytes the prefix cache keeps (None: as much of the pool as is free)"
    )
    prefix_cache_ttl_s: float = _flag(1800.0, "cached token runs unused this long are evicted (seconds)")
    prefix_cache_kv_bits: int | None = _flag(
        None,
        "8: when blocks run short, keep cold prefix-cache blocks in int8 (groups of 64, about half the "
        "bytes) before evicting any, and restore them on a hit; None: off",
    )
    prefix_cache_quantized_fraction: float = _flag(
        0.25, "with prefix_cache_kv_bits, the share of the KV cache memory given to the int8 store: (0, 1)"
    )
    prefix_cache_quantize_min_tokens: int = _flag(
        256, "with prefix_cache_kv_bits, only blocks of cached sequences this long or longer go int8"
    )
    kv_host_cache_gib: float | None = _flag(
        None,
        "GiB of host memory (pinned on CUDA) that keeps the prefix-cache blocks the device pool "
        "evicts, restored on a hit instead of recomputed; with prefix_cache_kv_bits 8 they are kept "
        "in int8 there (about half the bytes); None: off",
    )
    quantization: str | None = _flag(
        None,
        "Linear weights in 8 bits: int8 (per output channel) or fp8 (128x128 blocks), or in 4 bits: "
        "int4 (groups of 128 with zero points); None: as the checkpoint stores them (an fp8, int8, "
        "GPTQ or AWQ checkpoint is detected), else dense. On a dense checkpoint the weights are "
        "quantized at load, the LM head included in 8 bits (int4 keeps it, as GPTQ and AWQ do). "
        "gguf (CPU): an alias's GGUF file run in its own Q4_0/Q4_1/Q8_0 blocks",
        choices=QUANTIZATION_CHOICES,
    )
    load_format: str = _flag(
        "auto",
        "how the weights arrive, as vLLM's --load-format: auto reads the checkpoint; dummy makes "
        "random ones on the device (model: a folder with config.json, or a preset such as "
        "llama-3.1-70b), for benchmarks of shapes whose files are not at hand",
        choices=LOAD_FORMATS,
    )
    speculative_config: dict | None = _flag(
        None,
        "speculative decoding, as vLLM's --speculative-config: a JSON mapping, e.g. "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}; '
        "None: off",
    )
    tensor_parallel_size: int = _flag(
        1,
        "processes (one per GPU) that each hold a shard of the model's weights and KV heads, as "
        "vLLM's --tensor-parallel-size: torch.distributed over NCCL on CUDA, gloo on the CPU",
    )
    data_parallel_size: int = _flag(
        1,
        "engine cores (each on its own GPU, or its own tensor-parallel group) behind one frontend, "
        "as vLLM's --data-parallel-size: requests go to the core that served their prefix last, or "
        "the least loaded",
    )
    data_parallel_routing: str = _flag(
        "cache_aware",
        "how requests are spread over data-parallel replicas: cache_aware (the replica last sent "
        "their prefix, else the least busy: SGLang's router policy) or round_robin",
        choices=DATA_PARALLEL_ROUTINGS,
    )
    # Ranks on several hosts, as torchrun names them: tensor_parallel_size / nnodes ranks each.
    nnodes: int = _flag(1, "hosts the tensor-parallel ranks span (torchrun's --nnodes)")
    node_rank: int = _flag(
        0,
        "this host's place among them (torchrun's --node-rank): 0 schedules and serves; another "
        "runs its ranks for node 0 and serves nothing",
    )
    master_addr: str = _flag("127.0.0.1", "the address of node 0, where the ranks meet (torchrun's)")
    master_port: int | None = _flag(
        None, "the port on node 0 where the ranks meet; None: a free one (one host only)"
    )
    prefix_cache_shadow_rate: float = _flag(
        0.0,
        "share of greedy requests served from the prefix cache that are run again without it when the "
        "engine is idle, to count divergences (any is a bug): 0 to 1",
    )

    def __post_init__(self):
        _check_str(self, "model")
        _check_choice(self, "dtype", DTYPES)
        _check_str(self, "device")
        if not _DEVICE.match(self.device):
            raise EngineConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_seq_len is not None:
            _check_int(self, "max_seq_len", minimum=2)
        _check_int(self, "seed", minimum=0)
        if self.max_batch_size is not None:
            _check_int(self, "max_batch_size", minimum=1)
        _check_int(self, "max_num_batched_tokens", minimum=1)
        _check_int(self, "decode_service_interval", minimum=1)
        _check_int(self, "max_queue_len", minimum=1)
        _check_int(self, "block_size", minimum=1)
        _check_int(self, "prefill_chunk_size", minimum=1)
        if self.num_gpu_blocks is not None:
            _check_int(self, "num_gpu_blocks", minimum=1)
        if self.max_prefill_chunks_per_step is not None:
            _check_int(self, "max_prefill_chunks_per_step", minimum=1)
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and (
            isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1
        ):
            raise EngineConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction!r}")
        limit = self.device_memory_limit_gib
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0
        ):
            raise EngineConfigError(f"device_memory_limit_gib must be a number > 0, got {limit!r}")
        if fraction is not None and self.num_gpu_blocks is not None:
            raise EngineConfigError(
                "set num_gpu_blocks or kv_cache_memory_fraction, not both: each sizes the KV pool"
            )
        for name in (
            "use_chunked_prefill",
            "use_cuda_graphs",
            "cuda_graph_mixed_steps",
            "async_scheduling",
            "use_pdl",
            "use_triton_gemv",
            "use_native_cpu_kernels",
            "use_huge_pages",
            "use_prefix_caching",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name in AUTO_FLAGS):
                raise EngineConfigError(f"{name} must be true or false, got {value!r}")
        _check_choice(self, "kv_cache_backend", KV_CACHE_BACKENDS)
        _check_choice(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        _check_choice(self, "pooling_type", POOLING_TYPES)
        if self.kv_cache_dtype != "auto":
            if self.device == "cpu":
                raise EngineConfigError(
                    f"kv_cache_dtype {self.kv_cache_dtype!r} needs a CUDA device (the fp8 kernels are "
                    "Triton's); on a CPU use kv_cache_dtype 'auto'"
                )
            if self.prefix_cache_kv_bits is not None:
                raise EngineConfigError(
                    f"kv_cache_dtype {self.kv_cache_dtype!r} stores a byte an element already; "
                    "prefix_cache_kv_bits=8 would not shrink its blocks: set one of them"
                )
        _check_choice(self, "batching_mode", BATCHING_MODES)
        _check_choice(self, "scheduler_policy", SCHEDULER_POLICIES)
        if self.prefix_cache_max_bytes is not None:
            _check_int(self, "prefix_cache_max_bytes", minimum=0)
        ttl = self.prefix_cache_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
            raise EngineConfigError(f"prefix_cache_ttl_s must be a number > 0, got {ttl!r}")
        if self.prefix_cache_kv_bits is not None:
            if self.prefix_cache_kv_bits != 8 or isinstance(self.prefix_cache_kv_bits, bool):
                raise EngineConfigError(
                    f"prefix_cache_kv_bits must be 8 or None, got {self.prefix_cache_kv_bits!r}"
                )
            if self.use_prefix_caching is False:
                raise EngineConfigError(
                    "prefix_cache_kv_bits=8 stores prefix-cache blocks; set use_prefix_caching=True "
                    "or prefix_cache_kv_bits=None"
                )
        host = self.kv_host_cache_gib
        if host is not None:
            if isinstance(host, bool) or not isinstance(host, int | float) or not host > 0:
                raise EngineConfigError(f"kv_host_cache_gib must be a number > 0 or None, got {host!r}")
            if self.use_prefix_caching is False:
                raise EngineConfigError(
                    "kv_host_cache_gib keeps prefix-cache blocks; set use_prefix_caching=True or "
                    "kv_host_cache_gib=None"
                )
        share = self.prefix_cache_quantized_fraction
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
            raise EngineConfigError(f"prefix_cache_quantized_fraction must be in (0, 1), got {share!r}")
        _check_int(self, "prefix_cache_quantize_min_tokens", minimum=0)
        if self.quantization is not None:
            _check_choice(self, "quantization", QUANTIZATION_CHOICES)
        if self.quantization == "gguf" and self.device.startswith("cuda"):
            raise EngineConfigError(
                f"quantization 'gguf' runs a GGUF file's blocks on the CPU only, got device={self.device!r}; "
                "use device='cpu', or quantization 'int4', 'int8' or 'fp8' on CUDA"
            )
        _check_choice(self, "load_format", LOAD_FORMATS)
        if self.load_format == "dummy" and self.quantization is not None:
            raise EngineConfigError(
                f"load_format 'dummy' makes dense weights; quantization={self.quantization!r} is not made"
            )
        rate = self.prefix_cache_shadow_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise EngineConfigError(f"prefix_cache_shadow_rate must be in [0, 1], got {rate!r}")
        if rate > 0 and self.use_prefix_caching is False:
            raise EngineConfigError(
                f"prefix_cache_shadow_rate={rate} checks the prefix cache; set use_prefix_caching=True "
                "or the rate to 0"
            )
        if self.speculative_config is not None:
            self._check_speculative_config()
        _check_int(self, "tensor_parallel_size", minimum=1)
        _check_int(self, "nnodes", minimum=1)
        _check_int(self, "node_rank", minimum=0)
        if self.master_port is not None:
            _check_int(self, "master_port", minimum=1)
        if self.tensor_parallel_size % self.nnodes:
            raise EngineConfigError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes "
                f"({self.nnodes}): each host runs as many ranks"
            )
        if self.node_rank >= self.nnodes:
            raise EngineConfigError(f"node_rank ({self.node_rank}) must be below nnodes ({self.nnodes})")
        if self.nnodes > 1 and self.master_port is None:
            raise EngineConfigError("nnodes > 1 needs master_port: the hosts must agree on where to meet")
        _check_int(self, "data_parallel_size", minimum=1)
        _check_choice(self, "data_parallel_routing", DATA_PARALLEL_ROUTINGS)
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise EngineConfigError(
                "data_parallel_size > 1 with nnodes > 1 is not supported yet: replicas run on one host"
            )
        if self.data_parallel_size > 1 and re.fullmatch(r"cuda:\d+", self.device):
            raise EngineConfigError(
                f"data_parallel_size > 1 places each replica on GPUs of its own; device={self.device!r} "
                "names one: use device='cuda' (CUDA_VISIBLE_DEVICES picks the GPUs)"
            )
        if self.tensor_parallel_size > 1 and self.speculative_config is not None:
            raise EngineConfigError(
                "speculative_config with tensor_parallel_size > 1 is not supported yet; drop one of the two"
            )
        # The seed's compatibility rules.
        if self.use_chunked_prefill and self.batching_mode != "continuous":
            raise EngineConfigError(
                "use_chunked_prefill=True requires batching_mode='continuous', got "
                f"{self.batching_mode!r}; set batching_mode='continuous' or use_chunked_prefill=False"
            )
        if self.use_prefix_caching and (
            self.kv_cache_backend != "paged" or self.use_chunked_prefill is False
        ):
            raise EngineConfigError(
                "use_prefix_caching=True requires kv_cache_backend='paged' and use_chunked_prefill=True, got "
                f"{self.kv_cache_backend!r} and {self.use_chunked_prefill}"
            )
        if self.use_cuda_graphs and (self.batching_mode != "continuous" or self.kv_cache_backend != "paged"):
            raise EngineConfigError(
                "use_cuda_graphs=True requires batching_mode='continuous' and kv_cache_backend='paged', got "
                f"{self.batching_mode!r} and {self.kv_cache_backend!r}"
            )
        for name in ("use_cuda_graphs", "use_pdl", "use_triton_gemv"):
            if getattr(self, name) and self.device == "cpu":
                raise EngineConfigError(
                    f"{name}=True needs a CUDA device, got device='cpu'; set device='cuda'"
                )
        if self.max_batch_size is not None and self.max_num_batched_tokens < self.max_batch_size:
            # Otherwise the running requests could not all decode in one step, and the
            # decode_service_interval bound could not be kept when they all fall due together.
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_batch_size "
                f"({self.max_batch_size}) so that every running request can decode in one step"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, validated and with its defaults filled in; None: off."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def _check_speculative_config(self) -> None:
        try:
            SpeculativeConfig.from_dict(self.speculative_config)
        except SpeculativeConfigError as error:
            raise EngineConfigError(str(error)) from None

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "the config") -> "EngineConfig":
        """From a mapping of field names; unknown keys are rejected by name."""
        if not isinstance(values, dict):
            raise EngineConfigError(
                f"{source} must be a mapping of engine settings, got {type(values).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise EngineConfigError(f"unknown keys {unknown} in {source}; known keys: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> "EngineConfig":
        """From a .json or .toml file holding the fields at its top level."""
        path = Path(path)
        if path.suffix == ".json":
            values = json.loads(path.read_text())
        elif path.suffix == ".toml":
            values = tomllib.loads(path.read_text())
        else:
            raise EngineConfigError(f"engine config file must end in .json or .toml, got {str(path)!r}")
        return cls.from_dict(values, source=str(path))

    def replace(self, **changes) -> "EngineConfig":
        """A copy with `changes` applied and validated again."""
        return self.from_dict({**dataclasses.asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag-name` per EngineConfig field, plus `--engine-config FILE`.

    Flags default to None so that `from_cli_args` can tell a flag given on the command line
    (which overrides the file) from one left out (the file's value, else the field default).
    """
    group = parser.add_argument_group("engine", "engine settings (see infer.engine.config.EngineConfig)")
    group.add_argument(
        "--engine-config", type=Path, default=None, help="a .json or .toml file of engine settings"
    )
    for config_field in dataclasses.fields(EngineConfig):
        is_bool = config_field.type in (bool, "bool", bool | None)
        kind = parse_bool if is_bool else int
        kind = str if config_field.name in _STRING_FIELDS else kind
        kind = float if config_field.name in _FLOAT_FIELDS else kind
        kind = parse_json_mapping if config_field.name in _MAPPING_FIELDS else kind
        default = config_field.default
        # A boolean flag alone means true, as `infer generate --use-cuda-graphs` has it; a value
        # (true/false) still works, for scripts that pass one either way.
        flag = "--" + config_field.name.replace("_", "-")
        shown = (
            "auto" if default is None and config_field.name in (*AUTO_FLAGS, "max_batch_size") else default
        )
        group.add_argument(
            flag,
            dest=config_field.name,
            type=kind,
            default=None,
            choices=config_field.metadata.get("choices"),
            help=f"{config_field.metadata['help']} (default: {shown}"
            + ("; false turns it off)" if is_bool else ")"),
            **({"nargs": "?", "const": True} if is_bool else {}),
        )


def from_cli_args(namespace: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that the parsed flags (and their --engine-config file) describe."""
    path = getattr(namespace, "engine_config", None)
    base = EngineConfig.from_file(path).to_dict() if path is not None else {}
    given = {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(EngineConfig)
        if getattr(namespace, f.name, None) is not None
    }
    return EngineConfig.from_dict({**base, **given}, source="the command line")


_STRING_FIELDS = {f.name for f in dataclasses.fields(EngineConfig) if f.type in (str, "str", str | None)}
_FLOAT_FIELDS = {f.name for f in dataclasses.fields(EngineConfig) if f.type in (float, float | None)}


_MAPPING_FIELDS = {f.name for f in dataclasses.fields(EngineConfig) if f.type in (dict, dict | None)}


def parse_json_mapping(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON mapping, got {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON mapping, got {text!r}")
    return value


def parse_bool(text: str) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return words[text.lower()]


def _check_str(config: EngineConfig, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, str) or not value:
        raise EngineConfigError(f"{name} must be a non-empty string, got {value!r}")


def _check_int(config: EngineConfig, name: str, *, minimum: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise EngineConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise EngineConfigError(f"{name} must be >= {minimum}, got {value}")


def _check_choice(config: EngineConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise EngineConfigError(f"{name} must be one of {list(choices)}, got {value!r}")
