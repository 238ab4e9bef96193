"""Qwen3-VL's vision encoder: pixels of any size in, one embedding per merged patch out, plus
DeepStack's embeddings of the same tokens for the language model's first layers.

The processor resizes an image to a multiple of `patch_size * spatial_merge_size` in each side
with about its own number of pixels (`smart_resize`, kept between min and max pixels), so the
number of image tokens, `(H / patch) * (W / patch) / merge**2`, depends on the image. The tower
cuts the image into patches, ordered by merge block (each `merge x merge` block of patches is
consecutive, the blocks row by row), and embeds each patch with a Conv3d over
`temporal_patch_size` frames (an image is its own frame repeated). It adds learned positions,
bilinearly resampled from a square grid to the image's grid, and runs pre-norm ViT blocks whose
attention rotates q and k by each patch's (row, column) (2D RoPE) and sees the image's patches
both ways. The merger concatenates each block's patches and maps them into the language model's
width; the DeepStack mergers do the same to the states after blocks `deepstack_visual_indexes`,
and the language model adds those to its hidden states at the image tokens after its first
layers (infer.models.qwen3_vl).

`encode` returns per image `[num_tokens, text_hidden * (1 + num_deepstack)]`: the merger's
embedding, then each DeepStack embedding, side by side, so the engine moves an image's
embeddings as one tensor of rows (ForwardBatch.image_embeds), sliced by token like any other.

The tower runs once per image, never per decode step: plain PyTorch, attention by SDPA per image.
Weights are read from `Qwen3VLForConditionalGeneration`'s layout (TOWER_PREFIXES).
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

from infer.kernels import rope
from infer.models.loader.weights import CheckpointError, checkpoint_tensors
from infer.models.vision import ImageLayout, checkpoint_config

# What Hugging Face's Qwen3VLProcessor writes: its chat template puts the marker where a message
# has an image, and the processor repeats the pad token once per image token between the two.
IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"


def image_layout(folder: str | Path) -> ImageLayout:
    """How a Qwen3-VL checkpoint's prompts spell an image (its config's image token id)."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    return ImageLayout(
        image_token_id=raw.get("image_token_id", 151655),
        image_token=IMAGE_PAD,
        marker=VISION_START + IMAGE_PAD + VISION_END,
        before=VISION_START,
        after=VISION_END,
        bidirectional=False,
    )


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float
    # The language model's width, which the mergers map into.
    out_hidden_size: int

    @classmethod
    def from_file(cls, folder: str | Path) -> "VisionConfig":
        """From a Qwen3-VL checkpoint's config.json (its `vision_config`)."""
        _, vision = checkpoint_config(folder)
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(
                f"vision_config.hidden_act {vision['hidden_act']!r}; Qwen3-VL's tower uses gelu_pytorch_tanh"
            )
        side = math.isqrt(vision["num_position_embeddings"])
        if side**2 != vision["num_position_embeddings"]:
            raise ValueError(
                f"vision_config.num_position_embeddings {vision['num_position_embeddings']} must be a "
                "square: the learned positions are a square grid"
            )
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            depth=vision["depth"],
            num_heads=vision["num_heads"],
            in_channels=vision.get("in_channels", 3),
            patch_size=vision["patch_size"],
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            num_position_embeddings=vision["num_position_embeddings"],
            deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes", ())),
            rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            out_hidden_size=vision["out_hidden_size"],
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's size for a `height` x `width` image: each side a multiple of `factor`,
    the area within [min_pixels, max_pixels], the aspect ratio about kept (transformers'
    qwen2_vl smart_resize)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image's aspect ratio must be at most 200, got {width} x {height}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImagePreprocessing:
    """What Qwen3-VL's image processor does to an image (transformers' Qwen2VLImageProcessorPil):
    transparency over white, resized by Pillow (bicubic) to `smart_resize`'s size, scaled to
    [0, 1], normalized by `mean` and `std`. The defaults are Qwen3-VL's released
    preprocessor_config.json."""

    patch_size: int
    merge_size: int
    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.Resampling.BICUBIC

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ImagePreprocessing":
        """From the checkpoint's preprocessor_config.json, else the vision config's patch and
        merge sizes and the release's other settings."""
        config = VisionConfig.from_file(folder)
        path = Path(folder) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.exists() else {}
        patch_size, merge_size = raw.get("patch_size", config.patch_size), raw.get("merge_size", 2)
        if (patch_size, merge_size) != (config.patch_size, config.spatial_merge_size):
            raise ValueError(
                f"{path}: patch_size {patch_size} and merge_size {merge_size} differ from the vision "
                f"config's {config.patch_size} and {config.spatial_merge_size}"
            )
        size = raw.get("size") or {}
        # Older files name the pixel bounds min_pixels/max_pixels, which transformers prefers.
        return cls(
            patch_size=patch_size,
            merge_size=merge_size,
            min_pixels=raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
            max_pixels=raw.get("max_pixels", size.get("longest_edge", cls.max_pixels)),
            mean=tuple(raw.get("image_mean", cls.mean)),
            std=tuple(raw.get("image_std", cls.std)),
            rescale_factor=raw.get("rescale_factor", cls.rescale_factor),
            resample=raw.get("resample", cls.resample),
        )

    def __call__(self, image) -> torch.Tensor:
        """`[3, H, W]` float32 pixel values of a Pillow image, H and W multiples of
        `patch_size * merge_size`."""
        from PIL import Image

        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            image = image.convert("RGB")
        factor = self.patch_size * self.merge_size
        height, width = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
        resized = np.asarray(image.resize((width, height), Image.Resampling(self.resample)))
        # As transformers: scaled in float64, then float32 for the normalization.
        pixels = (resized.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = (pixels - np.array(self.mean, dtype=np.float32)) / np.array(self.std, dtype=np.float32)
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


class Qwen3VLImageProcessor:
    """The frontend's `ImageProcessor` for Qwen3-VL: an image's tokens follow its size."""

    def __init__(self, preprocessing: ImagePreprocessing, layout: ImageLayout):
        self.preprocessing, self.layout = preprocessing, layout

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Qwen3VLImageProcessor":
        return cls(ImagePreprocessing.from_folder(folder), image_layout(folder))

    def __call__(self, image) -> tuple[torch.Tensor, int]:
        pixels = self.preprocessing(image)
        _, rows, columns = self.grid(pixels)
        return pixels, rows * columns // self.preprocessing.merge_size**2

    def grid(self, pixels: torch.Tensor) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of `[3, H, W]` pixels (transformers' image_grid_thw), which
        infer.models.mrope.mrope_positions takes."""
        patch = self.preprocessing.patch_size
        return 1, pixels.shape[1] // patch, pixels.shape[2] // patch


def patchify(
    pixels: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`[3, H, W]` pixels as the tower's patches, `[num_patches, 3 * temporal * patch * patch]`
    in merge-block order (the image repeated over the temporal patch), and its (t, h, w) grid of
    patches: transformers' `pixel_values` and `image_grid_thw` of one image."""
    channels, height, width = pixels.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = pixels.reshape(
        channels, grid_h // merge_size, merge_size, patch_size, grid_w // merge_size, merge_size, patch_size
    ).permute(1, 4, 2, 5, 0, 3, 6)  # (block row, block column, row, column, channel, y, x)
    patches = patches.unsqueeze(5).expand(*patches.shape[:5], temporal_patch_size, patch_size, patch_size)
    return patches.reshape(grid_h * grid_w, -1), (1, grid_h, grid_w)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """x `[N, hidden]`, the patches of images of `lengths` patches back to back; cos and sin
        `[N, head_dim // 2]`, each patch's rotation."""
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).view(num_patches, 3, self.num_heads, -1).unbind(1)
        rope(q, k, cos, sin, None)
        attended = [
            F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in image)).transpose(0, 1)
            for image in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]
        return self.proj(torch.cat(attended).reshape(num_patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge block's patches, concatenated, to one embedding of the language model's width.
    The main merger normalizes each patch before concatenating; DeepStack's (`postshuffle_norm`)
    normalize the concatenation."""

    def __init__(self, config: VisionConfig, *, postshuffle_norm: bool):
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_size if postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_size))
        else:
            x = self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionTower(nn.Module):
    """Pixels `[3, H, W]` (as the processor makes them) to `[H * W / (patch * merge)**2,
    out_hidden_size * (1 + len(deepstack_visual_indexes))]` image-token embeddings. Parameter
    names are the checkpoint's after its tower prefix."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        patch = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            config.in_channels, config.hidden_size, kernel_size=patch, stride=patch
        )
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle_norm=True) for _ in config.deepstack_visual_indexes
        )
        self.layout: ImageLayout | None = None  # set by load_qwen3_vl_vision

    def encode(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """`VisionTower.encode`: images of any sizes, their patches run as one sequence."""
        device, config = self.pos_embed.weight.device, self.config
        sizes = (config.patch_size, config.spatial_merge_size, config.temporal_patch_size)
        images = [patchify(pixels.to(device, non_blocking=True), *sizes) for pixels in pixel_values]
        grids = [grid for _, grid in images]
        embeds = self(torch.cat([patches for patches, _ in images]), grids)
        return list(embeds.split([t * h * w // config.spatial_merge_size**2 for t, h, w in grids]))

    def rope_positions(
        self, prompt_ids: list[int], pixel_values: list[torch.Tensor]
    ) -> tuple[torch.Tensor, int]:
        """A prompt's `[3, L]` (t, h, w) positions and its rope delta (infer.models.mrope), for
        the prompt's images' pixel values in order: what the engine gives the language model."""
        from infer.models.mrope import mrope_positions

        patch = self.config.patch_size
        grids = [(1, pixels.shape[1] // patch, pixels.shape[2] // patch) for pixels in pixel_values]
        return mrope_positions(
            prompt_ids,
            grids,
            image_token_id=self.layout.image_token_id,
            spatial_merge_size=self.config.spatial_merge_size,
        )

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """`patches` [num_patches, 3 * temporal * patch * patch] of images with (t, h, w) `grids`
        (patchify's), back to back; their tokens' embeddings back to back."""
        config, dtype = self.config, self.pos_embed.weight.dtype
        # A convolution whose kernel is its stride is a matmul; as one, CUDA does not round fp32
        # to TF32 as cuDNN's convolutions do by default.
        proj = self.patch_embed.proj
        x = F.linear(patches.to(dtype), proj.weight.flatten(1), proj.bias)
        x = x + torch.cat([self._positions(grid) for grid in grids]).to(dtype)
        rows = [self._rotation(grid, x.device) for grid in grids]
        cos, sin = torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows])
        # Each frame attends to itself (an image has one).
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if index in config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[config.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _positions(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """The learned positions of a grid's patches, in merge-block order: the square table
        resampled bilinearly (corners aligned) to the grid, in float32, as transformers does."""
        t, h, w = grid
        side, merge = math.isqrt(self.config.num_position_embeddings), self.config.spatial_merge_size
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)
        resampled = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
        blocks = resampled.reshape(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)
        return blocks.reshape(h * w, -1).repeat(t, 1)

    def _rotation(self, grid: tuple[int, int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) `[t * h * w, head_dim // 2]` of a grid's patches, in merge-block order: the
        first half of the frequencies turn with the patch's row, the second with its column."""
        t, h, w = grid
        merge, half = self.config.spatial_merge_size, self.config.head_dim // 2
        inv_freq = 1.0 / (
            self.config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half)
        )
        rows, columns = torch.meshgrid(
            torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
        )
        block_order = (h // merge, merge, w // merge, merge)
        rows, columns = (p.reshape(block_order).transpose(1, 2).flatten() for p in (rows, columns))
        angles = torch.cat([rows[:, None] * inv_freq, columns[:, None] * inv_freq], dim=-1).repeat(t, 1)
        return angles.cos(), angles.sin()


# Where a checkpoint keeps the tower: transformers 4.57+ and the Qwen3-VL releases write the
# first, a bare Qwen3VLModel the second.
TOWER_PREFIXES = ("model.visual.", "visual.")


def load_qwen3_vl_vision(
    folder: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu", load_format: str = "auto"
) -> Qwen3VLVisionTower:
    """The vision tower (mergers included) of a Qwen3-VL checkpoint folder; with
    `load_format="dummy"`, random weights of its shapes made on `device` (infer.models.load)."""
    folder = Path(folder)
    with torch.device("meta"):
        tower = Qwen3VLVisionTower(VisionConfig.from_file(folder))
    tower.layout = image_layout(folder)
    if load_format == "dummy":
        from infer.models.loader.weights import fill_random_weights

        fill_random_weights(tower, "qwen3_vl", dtype=dtype, device=device)
        return tower.eval()
    tensors = checkpoint_tensors(folder)
    prefix = next((p for p in TOWER_PREFIXES if f"{p}patch_embed.proj.weight" in tensors), None)
    if prefix is None:
        raise CheckpointError(f"{folder}: no vision tower in the checkpoint (none of {TOWER_PREFIXES})")
    params = dict(tower.named_parameters())
    missing = [prefix + name for name in params if prefix + name not in tensors]
    if missing:
        raise CheckpointError(f"{folder}: the vision tower lacks {len(missing)} tensors, e.g. {missing[:3]}")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(tensors[prefix + name].file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in names:
                value = handle.get_tensor(prefix + name)
                found, wanted = tuple(value.shape), tuple(params[name].shape)
                if found != wanted:
                    raise CheckpointError(f"{prefix}{name}: shape {found}, the model wants {wanted}")
                module_name, _, leaf = name.rpartition(".")
                owner = tower.get_submodule(module_name)
                setattr(owner, leaf, nn.Parameter(value.to(dtype=dtype, device=device), requires_grad=False))
    return tower.eval()
