"""model_type (from config.json) -> our model class and its default chat-template family: one
architecture for each of infer.models.config.MODEL_TYPES."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from infer.models.gemma3 import Gemma3ForCausalLM
from infer.models.gemma3_vision import Gemma3ImageProcessor, load_gemma3_vision
from infer.models.llama import LlamaForCausalLM
from infer.models.qwen3 import Qwen3ForCausalLM
from infer.models.qwen3_vl import CHECKPOINT_PREFIXES as QWEN3_VL_PREFIXES
from infer.models.qwen3_vl import IGNORED_PREFIXES as QWEN3_VL_IGNORED
from infer.models.qwen3_vl import Qwen3VLForCausalLM
from infer.models.qwen3_vl_vision import Qwen3VLImageProcessor, load_qwen3_vl_vision
from infer.models.vision import ImageProcessor, has_vision_tower


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
    # as CausalLM.vision, and makes the frontend's image processor from the folder
    # (infer.models.vision).
    load_vision: Callable[..., nn.Module] | None = None
    image_processor: Callable[[Path], ImageProcessor] | None = None


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
        image_processor=Gemma3ImageProcessor.from_folder,
    ),
    # Qwen3-VL: Qwen 3 with multimodal rotary positions and DeepStack, its tower on its own.
    "qwen3_vl": Architecture(
        Qwen3VLForCausalLM,
        "qwen3",
        checkpoint_prefixes=QWEN3_VL_PREFIXES,
        ignored_prefixes=QWEN3_VL_IGNORED,
        load_vision=load_qwen3_vl_vision,
        image_processor=Qwen3VLImageProcessor.from_folder,
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


def image_processor_for(folder: str | Path, model_type: str) -> ImageProcessor | None:
    """The checkpoint's image processor (infer.models.vision); None for a model without a vision
    tower."""
    make = architecture_for(model_type).image_processor
    return make(Path(folder)) if make is not None and has_vision_tower(folder) else None
