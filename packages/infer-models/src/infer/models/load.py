"""One call from an alias or a checkpoint folder to a ready model, tokenizer and chat template."""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.models.chat_template import ChatTemplate, chat_template_for, detect_family, read_tokenizer_config
from infer.models.common import CausalLM
from infer.models.config import ModelConfig
from infer.models.kernel_policy import KernelPolicy, apply_kernel_policy
from infer.models.linear import quantize_linears
from infer.models.loader.fetch import fetch_model, models_dir
from infer.models.loader.gguf_weights import load_gguf_causal_lm
from infer.models.loader.tokenizer import Tokenizer
from infer.models.loader.weights import fill_random_weights, load_weights
from infer.models.quantization import GGUF_QUANTIZATION, resolve_quantization
from infer.models.random_checkpoint import PRESETS, make_random_checkpoint
from infer.models.registry import architecture_for
from infer.models.tensor_parallel import TensorParallel, shard_model
from infer.models.vision import has_vision_tower

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    """What a frontend needs of a model without its weights: the tokenizer, the chat template,
    the config (context length, vocabulary) and the folder (EOS declarations)."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate
    config: ModelConfig
    path: Path
    # Whether the checkpoint ships a chat template of its own (instruction-tuned models do; a
    # base model does not, and `chat_template` is then only its family's).
    ships_chat_template: bool = True


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    config: ModelConfig
    path: Path
    # Whether the checkpoint ships a chat template of its own (instruction-tuned models do; a
    # base model does not, and `chat_template` is then only its family's).
    ships_chat_template: bool = True

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.tokenizer, self.chat_template, self.config, self.path, self.ships_chat_template)


# How weights arrive (vLLM's --load-format): "auto" reads the checkpoint, "dummy" makes them.
LOAD_FORMATS = ("auto", "dummy")


def load_causal_lm(
    folder: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    tensor_parallel: TensorParallel | None = None,
    load_format: str = "auto",
) -> CausalLM:
    """Our model for a checkpoint folder, weights cast to `dtype` (default: the config's, else
    fp32). Linear weights stay 8-bit where the checkpoint stores them so, and `quantization`
    ("int8", "fp8") quantizes those of an unquantized checkpoint at load. The model runs the
    plain kernel policy, `KernelPolicy(device)`, until the engine applies its own. With
    `tensor_parallel`, the model is that rank's shard (infer.models.tensor_parallel).
    `load_format="dummy"` (vLLM's name) reads no weights: they are made at random on the device
    (`fill_random_weights`), so a folder with config.json and a tokenizer is enough.
    `quantization="gguf"` reads the weights from the GGUF file an alias's folder was converted
    from, Q4_0 / Q4_1 / Q8_0 tensors kept in their blocks, float32 activations (CPU only;
    infer.models.loader.gguf_weights)."""
    folder = Path(folder)
    config = ModelConfig.from_file(folder)
    architecture = architecture_for(config.model_type)
    if quantization == GGUF_QUANTIZATION:
        if tensor_parallel is not None or load_format != "auto":
            raise ValueError(
                "quantization 'gguf' reads the GGUF file whole: no tensor parallelism, no dummy weights"
            )
        if dtype not in (None, torch.float32):
            raise ValueError(f"quantization 'gguf' runs float32 activations, not {dtype}")
        model = load_gguf_causal_lm(folder, config, architecture.model_class)
        return apply_kernel_policy(model.eval(), KernelPolicy(device))
    dtype = dtype or config.dtype or torch.float32
    resolved = resolve_quantization(config.quantization, quantization)
    # Built on the meta device: no memory and no random init until the real weights arrive.
    with torch.device("meta"):
        model = architecture.model_class(config).to(dtype)
        if resolved is not None:
            quantize_linears(model, resolved)
    model.quantization = resolved
    if tensor_parallel is not None:
        shard_model(model, tensor_parallel)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "dummy":
        if resolved is not None:
            raise ValueError(f"load_format 'dummy' makes dense weights; {resolved.method} is not made")
        # random_tensor's norm rule tells Gemma's (1 + w) norms by the family name.
        family = "gemma3" if config.model_type.startswith("gemma3") else config.model_type
        fill_random_weights(model, family, dtype=dtype, device=device)
    else:
        load_weights(
            model,
            folder,
            config,
            dtype=dtype,
            device=device,
            prefixes=architecture.checkpoint_prefixes,
            ignored_prefixes=architecture.ignored_prefixes,
            quantization=resolved,
        )
    if architecture.load_vision is not None and has_vision_tower(folder):
        # Whole on every tensor-parallel rank: it runs once per image, and its embeddings join
        # the hidden states that every rank holds whole.
        model.vision = architecture.load_vision(folder, dtype=dtype, device=device, load_format=load_format)
    return apply_kernel_policy(model.eval(), KernelPolicy(device))


def model_folder(path_or_alias: str | Path, load_format: str = "auto") -> Path:
    """The checkpoint folder: `fetch_model`'s, or with load_format "dummy" and a preset's name
    (infer.models.random_checkpoint.PRESETS, e.g. "llama-3.1-70b") the preset's config.json and
    tokenizer without weights, written once under the models cache."""
    if load_format == "dummy" and str(path_or_alias) in PRESETS:
        folder = models_dir() / "dummy" / str(path_or_alias)
        if not (folder / "config.json").is_file():
            make_random_checkpoint(str(path_or_alias), folder, weights=False)
        return folder
    return fetch_model(path_or_alias)


def load_model_info(path_or_alias: str | Path, load_format: str = "auto") -> ModelInfo:
    """Resolves an alias (or takes a folder) and reads the tokenizer, chat template and config,
    not the weights."""
    folder = model_folder(path_or_alias, load_format)
    return _model_info(folder, ModelConfig.from_file(folder))


def load_model(
    path_or_alias: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    tensor_parallel: TensorParallel | None = None,
    load_format: str = "auto",
) -> LoadedModel:
    """Resolves an alias (or takes a folder), loads the weights (a tensor-parallel rank's shard
    of them with `tensor_parallel`; made at random with load_format "dummy"), the tokenizer and
    the chat template."""
    folder = model_folder(path_or_alias, load_format)
    started_s = time.perf_counter()
    model = load_causal_lm(
        folder,
        dtype=dtype,
        device=device,
        quantization=quantization,
        tensor_parallel=tensor_parallel,
        load_format=load_format,
    )
    weights = next(model.parameters())
    logger.info(
        "loaded the weights of %s (%s on %s): %.1f s",
        folder.name,
        weights.dtype,
        weights.device,
        time.perf_counter() - started_s,
    )
    info = _model_info(folder, model.config)
    return LoadedModel(
        model=model,
        tokenizer=info.tokenizer,
        chat_template=info.chat_template,
        config=info.config,
        path=folder,
        ships_chat_template=info.ships_chat_template,
    )


def _model_info(folder: Path, config: ModelConfig) -> ModelInfo:
    tokenizer_config = read_tokenizer_config(folder)
    family = detect_family(tokenizer_config, config.model_type)
    return ModelInfo(
        tokenizer=Tokenizer(folder),
        chat_template=chat_template_for(family),
        config=config,
        path=folder,
        ships_chat_template=bool(tokenizer_config.get("chat_template")),
    )
