"""One call from an alias or a checkpoint folder to a ready model, tokenizer and chat template."""

from dataclasses import dataclass
from pathlib import Path

import torch

from infer.models.chat_template import ChatTemplate, chat_template_for, detect_family, read_tokenizer_config
from infer.models.common import CausalLM
from infer.models.config import ModelConfig
from infer.models.loader.fetch import fetch_model
from infer.models.loader.tokenizer import Tokenizer
from infer.models.loader.weights import load_weights
from infer.models.registry import architecture_for


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


def load_causal_lm(
    folder: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> CausalLM:
    """Our model for a checkpoint folder, weights cast to `dtype` (default: the config's, else fp32)."""
    folder = Path(folder)
    config = ModelConfig.from_file(folder)
    dtype = dtype or config.dtype or torch.float32
    architecture = architecture_for(config.model_type)
    # Built on the meta device: no memory and no random init until the real weights arrive.
    with torch.device("meta"):
        model = architecture.model_class(config).to(dtype)
    load_weights(
        model,
        folder,
        config,
        dtype=dtype,
        device=device,
        prefixes=architecture.checkpoint_prefixes,
        ignored_prefixes=architecture.ignored_prefixes,
    )
    return model.eval()


def load_model(
    path_or_alias: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Resolves an alias (or takes a folder), loads the weights, the tokenizer and the chat template."""
    folder = fetch_model(path_or_alias)
    model = load_causal_lm(folder, dtype=dtype, device=device)
    tokenizer_config = read_tokenizer_config(folder)
    family = detect_family(tokenizer_config, model.config.model_type)
    return LoadedModel(
        model=model,
        tokenizer=Tokenizer(folder),
        chat_template=chat_template_for(family),
        config=model.config,
        path=folder,
        ships_chat_template=bool(tokenizer_config.get("chat_template")),
    )
