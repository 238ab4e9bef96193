"""Gemma 3's vision tower and projector: pixels in, one embedding per image token out.

A SigLIP vision transformer (`SiglipEncoder`: a patch embedding, learned positions, pre-norm
encoder layers of bidirectional attention and a GELU MLP, a final LayerNorm) encodes a
`[B, 3, S, S]` image into `(S / patch)^2` patch states; Gemma 3's projector average-pools them to
`mm_tokens_per_image` (256 for every released size: 64 x 64 patches pooled 4 x 4), normalizes
them with Gemma's RMSNorm (scale `1 + weight`) and maps them into the language model's width.
The language model puts those embeddings at the image's placeholder tokens.

The vision tower is run once per image, never per decode step, so it is plain PyTorch
(`F.scaled_dot_product_attention`): its cost is a prefill's, on a fixed 896 x 896 input.
Weights are read from the checkpoint layouts of `Gemma3ForConditionalGeneration`
(TOWER_PREFIXES, PROJECTOR_PREFIXES).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from infer.models.loader.weights import CheckpointError, checkpoint_tensors
from infer.models.vision import ImageLayout, checkpoint_config

# What Hugging Face's Gemma3Processor writes: its chat template puts BOI where a message has an
# image, and the processor widens that into a blank line, BOI, the soft tokens, EOI, a blank line.
BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


def image_layout(folder: str | Path) -> ImageLayout:
    """How a Gemma 3 checkpoint's prompts spell an image (its config's image token id)."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    return ImageLayout(
        image_token_id=raw.get("image_token_index", 262144),
        image_token=IMAGE_TOKEN,
        marker=BOI,
        before=f"\n\n{BOI}",
        after=f"{EOI}\n\n",
        bidirectional=True,
    )


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int

    @classmethod
    def from_file(cls, folder: str | Path) -> "VisionConfig":
        """From a Gemma 3 multimodal checkpoint's config.json (its `vision_config`)."""
        raw, vision = checkpoint_config(folder)
        text = raw["text_config"]
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(
                f"vision_config.hidden_act {vision['hidden_act']!r}; Gemma 3's SigLIP uses gelu_pytorch_tanh"
            )
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
            mm_tokens_per_image=raw.get("mm_tokens_per_image", 256),
            text_hidden_size=text["hidden_size"],
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class ImagePreprocessing:
    """What Gemma 3's image processor does to an image (pan-and-scan off, the default): an image
    with transparency over white, resized to `size` x `size` (Pillow's bilinear), scaled to
    [0, 1], normalized by `mean` and `std`."""

    size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ImagePreprocessing":
        """From the checkpoint's preprocessor_config.json, else the vision config's image size
        and SigLIP's normalization."""
        config = VisionConfig.from_file(folder)
        path = Path(folder) / "preprocessor_config.json"
        if not path.exists():
            return cls(size=config.image_size)
        raw = json.loads(path.read_text())
        if raw.get("do_pan_and_scan"):
            raise ValueError(f"{path}: do_pan_and_scan is not supported; turn it off")
        size = raw.get("size", {}).get("height", config.image_size)
        return cls(
            size=size,
            mean=tuple(raw.get("image_mean", cls.mean)),
            std=tuple(raw.get("image_std", cls.std)),
            rescale_factor=raw.get("rescale_factor", cls.rescale_factor),
        )

    def __call__(self, images) -> torch.Tensor:
        """`[len(images), 3, size, size]` float32 pixel values of Pillow images."""
        from PIL import Image

        arrays = []
        for image in images:
            if image.mode != "RGB":  # transparency over white, as transformers' convert_to_rgb
                rgba = image.convert("RGBA")
                image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert(
                    "RGB"
                )
            resized = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
            pixels = np.asarray(resized, dtype=np.float32) * np.float32(self.rescale_factor)
            pixels = (pixels - np.array(self.mean, dtype=np.float32)) / np.array(self.std, dtype=np.float32)
            arrays.append(pixels.transpose(2, 0, 1))
        return torch.from_numpy(np.stack(arrays))


class Gemma3ImageProcessor:
    """The frontend's `ImageProcessor` for Gemma 3: every image becomes `size` x `size` pixels
    and `mm_tokens_per_image` placeholders."""

    def __init__(self, preprocessing: ImagePreprocessing, layout: ImageLayout, tokens_per_image: int):
        self.preprocessing, self.layout, self.tokens_per_image = preprocessing, layout, tokens_per_image

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Gemma3ImageProcessor":
        config = VisionConfig.from_file(folder)
        return cls(ImagePreprocessing.from_folder(folder), image_layout(folder), config.mm_tokens_per_image)

    def __call__(self, image) -> tuple[torch.Tensor, int]:
        return self.preprocessing([image])[0], self.tokens_per_image


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        width = config.hidden_size
        self.num_heads = config.num_heads
        self.layer_norm1 = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.out_proj = nn.Linear(width, width)
        self.layer_norm2 = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(width, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        h = self.layer_norm1(x)

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(h).view(batch, length, self.num_heads, -1).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        x = x + self.out_proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class Gemma3VisionTower(nn.Module):
    """SigLIP and Gemma 3's projector: `[B, 3, S, S]` pixels (normalized as the processor does)
    to `[B, mm_tokens_per_image, text_hidden_size]` image-token embeddings."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.patch_embedding = nn.Conv2d(3, width, kernel_size=config.patch_size, stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side**2, width)
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_layers))
        self.post_layernorm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        tokens_per_side = math.isqrt(config.mm_tokens_per_image)
        if tokens_per_side**2 != config.mm_tokens_per_image or config.patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} must be a square whose side divides "
                f"the {config.patches_per_side} patches per side"
            )
        self.pool = config.patches_per_side // tokens_per_side
        self.mm_soft_emb_norm = nn.Parameter(torch.zeros(width))  # Gemma's RMSNorm: scale 1 + weight
        self.mm_input_projection = nn.Parameter(torch.zeros(width, config.text_hidden_size))
        self.layout: ImageLayout | None = None  # set by load_gemma3_vision

    def encode(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """`VisionTower.encode`: every Gemma 3 image has the same size, so one batch."""
        device = self.patch_embedding.weight.device
        return list(self(torch.stack([pixels.to(device, non_blocking=True) for pixels in pixel_values])))

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        x = x + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        batch, _, width = x.shape
        side = self.config.patches_per_side
        grid = x.transpose(1, 2).reshape(batch, width, side, side)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)
        normed = pooled.float() * torch.rsqrt(
            pooled.float().pow(2).mean(-1, keepdim=True) + self.config.layer_norm_eps
        )
        normed = (normed * (1.0 + self.mm_soft_emb_norm.float())).to(dtype)
        return normed @ self.mm_input_projection


# Where a checkpoint keeps the vision tower and the projector: Hugging Face's Gemma 3 releases
# and transformers 4.x write the first two, transformers 5.x the last two.
TOWER_PREFIXES = (
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
)
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def _checkpoint_names(tower: Gemma3VisionTower) -> dict[str, tuple[str, str]]:
    """Our parameter -> (which part: "tower" or "projector", its name after the part's prefix)."""
    names = {
        "patch_embedding.weight": ("tower", "embeddings.patch_embedding.weight"),
        "patch_embedding.bias": ("tower", "embeddings.patch_embedding.bias"),
        "position_embedding.weight": ("tower", "embeddings.position_embedding.weight"),
        "post_layernorm.weight": ("tower", "post_layernorm.weight"),
        "post_layernorm.bias": ("tower", "post_layernorm.bias"),
        "mm_soft_emb_norm": ("projector", "mm_soft_emb_norm.weight"),
        "mm_input_projection": ("projector", "mm_input_projection_weight"),
    }
    modules = ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2")
    modules += tuple(f"self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "out_proj"))
    for index in range(len(tower.layers)):
        for module in modules:
            for leaf in ("weight", "bias"):
                ours = f"layers.{index}.{module.rpartition('.')[2]}.{leaf}"
                names[ours] = ("tower", f"encoder.layers.{index}.{module}.{leaf}")
    return names


def load_gemma3_vision(
    folder: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu", load_format: str = "auto"
) -> Gemma3VisionTower:
    """The vision tower and projector of a Gemma 3 multimodal checkpoint folder; with
    `load_format="dummy"`, random weights of its shapes made on `device` (infer.models.load)."""
    folder = Path(folder)
    config = VisionConfig.from_file(folder)
    with torch.device("meta"):
        tower = Gemma3VisionTower(config)
    tower.layout = image_layout(folder)
    if load_format == "dummy":
        from infer.models.loader.weights import fill_random_weights

        fill_random_weights(tower, "siglip", dtype=dtype, device=device)
        return tower.eval()
    tensors = checkpoint_tensors(folder)
    prefixes = {
        "tower": next(
            (p for p in TOWER_PREFIXES if f"{p}embeddings.patch_embedding.weight" in tensors), None
        ),
        "projector": next(
            (p for p in PROJECTOR_PREFIXES if f"{p}mm_input_projection_weight" in tensors), None
        ),
    }
    if None in prefixes.values():
        raise CheckpointError(f"{folder}: no vision tower and projector in the checkpoint")
    names = {ours: prefixes[part] + name for ours, (part, name) in _checkpoint_names(tower).items()}
    missing = [name for name in names.values() if name not in tensors]
    if missing:
        raise CheckpointError(f"{folder}: the vision tower lacks {len(missing)} tensors, e.g. {missing[:3]}")
    params = dict(tower.named_parameters())
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(tensors[theirs].file, []).append((ours, theirs))
    for file, pairs in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for ours, theirs in pairs:
                value = handle.get_tensor(theirs)
                if tuple(value.shape) != tuple(params[ours].shape):
                    raise CheckpointError(
                        f"{theirs}: shape {tuple(value.shape)}, the model wants {tuple(params[ours].shape)}"
                    )
                module_name, _, leaf = ours.rpartition(".")
                owner = tower.get_submodule(module_name) if module_name else tower
                setattr(owner, leaf, nn.Parameter(value.to(dtype=dtype, device=device), requires_grad=False))
    return tower.eval()
