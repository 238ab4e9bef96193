"""The rotary tables `rope` reads: fp32 cos and sin, one row per position and `head_dim // 2`
columns (the distinct frequencies), with a Hugging Face `rope_scaling` applied as they are built."""

import math

import torch


def rope_tables(
    head_dim: int,
    max_positions: int,
    base: float,
    *,
    scaling: dict | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin tables `[max_positions, head_dim // 2]`.

    `scaling` is a Hugging Face `rope_scaling` dict; `rope_type` "llama3" (Llama 3.1+ frequency
    smoothing), "linear" (positions divided by `factor`) and "default"/None are supported.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type not in ("default", None):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")
    positions = torch.arange(max_positions, dtype=torch.float64, device=device)
    angles = torch.outer(positions, inv_freq)
    return angles.cos().float(), angles.sin().float()


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1 long-context recipe: keep high frequencies, divide low ones by `factor`,
    # interpolate smoothly between the two wavelength thresholds.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
