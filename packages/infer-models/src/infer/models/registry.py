"""model_type (from config.json) -> our model class and its default chat-template family: one
architecture for each of infer.models.config.MODEL_TYPES."""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from infer.models.gemma3 import Gemma3ForCausalLM
from infer.models.gemma3_vision import load_gemma3_vision
from infer.models.llama import LlamaForCausalLM
from infer.models.qwen3 import Qwen3ForCausalLM


@dataclass(frozen=True)
class Architecture:
    model_class: type[nn.Module]
    # Used when the tokenizer config does not reveal the template (see templates.detect_family).
    template_family: str
    # Prefixes of the decoder's tensors in the checkpoint, tried in order.
    checkpoint_prefixes: tuple[str, ...] = ("model.",)
    # Checkpoint tensors the decoder's loader skips (another modality's tower).
    ignored_prefixes: tuple[str, ...] = ()
    # Loads the vision tower and projector of a multimodal checkpoint (folder, dtype=, device=),
    # as CausalLM.vision (infer.models.vision).
    load_vision: Callable[..., nn.Module] | None = None


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(LlamaForCausalLM, "llama3"),
    "qwen3": Architecture(Qwen3ForCausalLM, "qwen3"),
    "gemma3_text": Architecture(Gemma3ForCausalLM, "gemma3"),
    # Multimodal Gemma 3 checkpoints: the language model, and the vision tower on its own.
    "gemma3": Architecture(
        Gemma3ForCausalLM,
        "gemma3",
        checkpoint_prefixes=("model.language_model.", "language_model.model."),
        ignored_prefixes=(
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ),
        load_vision=load_gemma3_vision,
    ),
}


def registered_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_for(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; registered: {', '.join(registered_model_types())}"
        )
    return ARCHITECTURES[model_type]
