"""A vision-language model's image figures over a benchmark's timed run: from the engine's
counters (EngineStats.vision_*, `infer bench engine-only`) or from the server's Prometheus
counters (infer_vision_*, `infer bench serve`), each read before and after the run. None where
the model has no vision tower (our server registers the counters only then).

  images_encoded       images the vision tower encoded (a preempted request's again)
  images_skipped       images whose every token's K/V came from the prefix cache: never encoded
  image_tokens_reused  image tokens whose K/V came from the prefix cache
  encoder_s            seconds the tower ran (device time on CUDA)
  encoder_s_per_image  encoder_s / images_encoded (nan when it encoded none)
"""

import math

# Our server's counters (infer.server.metrics), in the order of vision_summary's arguments.
PROMETHEUS_NAMES = (
    "infer_vision_encoder_runs_total",
    "infer_vision_encoder_skipped_total",
    "infer_vision_image_tokens_reused_total",
    "infer_vision_encoder_seconds_total",
)
# The markdown reports' columns (vision_cells).
VISION_HEADER = ("images encoded", "images skipped", "encoder ms/image")


def vision_summary(
    images_encoded: int, images_skipped: int, image_tokens_reused: int, encoder_s: float
) -> dict:
    """The figures (see the module) from a run's counts."""
    return {
        "images_encoded": images_encoded,
        "images_skipped": images_skipped,
        "image_tokens_reused": image_tokens_reused,
        "encoder_s": encoder_s,
        "encoder_s_per_image": encoder_s / images_encoded if images_encoded else math.nan,
    }


def vision_from_engine_stats(before, after) -> dict:
    """Between two infer.engine EngineStats (ask only of an engine whose model has a tower:
    a text model's counters stay 0)."""
    return vision_summary(
        after.vision_encoder_runs - before.vision_encoder_runs,
        after.vision_encoder_skipped - before.vision_encoder_skipped,
        after.vision_image_tokens_reused - before.vision_image_tokens_reused,
        after.vision_encoder_time_s - before.vision_encoder_time_s,
    )


def vision_from_metrics(before: dict, after: dict) -> dict | None:
    """Between two scrapes of /metrics (server_info.parse_prometheus_text); None when the server
    shows no vision counters."""
    keys = [(name, ()) for name in PROMETHEUS_NAMES]
    if any(key not in after for key in keys):
        return None
    encoded, skipped, reused, seconds = (after[key] - before.get(key, 0.0) for key in keys)
    return vision_summary(int(encoded), int(skipped), int(reused), seconds)


def vision_cells(figures: dict | None) -> list[str]:
    """The markdown cells under VISION_HEADER ("-" for a run without figures)."""
    if figures is None:
        return ["-"] * len(VISION_HEADER)
    per_image = figures["encoder_s_per_image"]
    return [
        str(figures["images_encoded"]),
        str(figures["images_skipped"]),
        "-" if math.isnan(per_image) else f"{1e3 * per_image:.1f}",
    ]
