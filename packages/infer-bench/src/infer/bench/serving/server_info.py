"""What the server says about itself: GET /v1/models, /metrics (Prometheus text) and /health.

Every endpoint is optional: a server without /metrics still gets benchmarked, and the report
says what was missing.
"""

import math
import re

import httpx

# name{labels} value [timestamp]; label values are quoted strings with \\, \" and \n escapes.
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?\s*')

# Histograms a server may expose for time spent waiting before the first schedule (ours, vLLM's).
QUEUE_TIME_HISTOGRAMS = (
    "infer_request_queue_time_seconds",
    "infer_queue_wait_seconds",
    "vllm:request_queue_time_seconds",
)
# Gauges that make up the server's memory split, when it has them (bytes).
MEMORY_GAUGE_HINTS = ("memory", "_bytes")


def parse_prometheus_text(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of the text exposition format: (name, sorted (label, value) pairs) -> value."""
    samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, label_text, value_text = match.groups()
        labels = tuple(sorted((key, _unescape(value)) for key, value in _LABEL.findall(label_text or "")))
        samples[(name, labels)] = _parse_value(value_text)
    return samples


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _parse_value(text: str) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    return special[text] if text in special else float(text)


def histogram_mean_between(before: dict, after: dict, name: str) -> tuple[float, int] | None:
    """(mean, count) of the observations a histogram gained between two scrapes; None if absent."""
    sum_key, count_key = (f"{name}_sum", ()), (f"{name}_count", ())
    if sum_key not in after or count_key not in after:
        return None
    count = after[count_key] - before.get(count_key, 0.0)
    if count <= 0:
        return None
    return (after[sum_key] - before.get(sum_key, 0.0)) / count, int(count)


def counter_by_label_between(before: dict, after: dict, name: str, label: str) -> dict[str, int] | None:
    """What each series of counter `name` gained between two scrapes, by its `label`'s value
    (e.g. infer_prefix_cache_matches_total by kind); None when the server has no such series."""
    gained = {}
    for key, value in after.items():
        series, labels = key
        values = dict(labels)
        if series == name and label in values:
            gained[values[label]] = int(value - before.get(key, 0.0))
    return gained or None


# Our server's prefix-cache admissions by match kind (infer.server.metrics).
PREFIX_CACHE_MATCHES = ("infer_prefix_cache_matches_total", "kind")


def memory_gauges(samples: dict) -> dict[str, float]:
    """Every sample whose name mentions memory or bytes (KV cache, weights, activations...)."""
    out = {}
    for (name, labels), value in samples.items():
        if any(hint in name for hint in MEMORY_GAUGE_HINTS) and not name.endswith(
            ("_bucket", "_sum", "_count")
        ):
            label_text = ",".join(f"{key}={val}" for key, val in labels)
            out[f"{name}{{{label_text}}}" if label_text else name] = value
    return out


async def fetch_server_info(client: httpx.AsyncClient) -> dict:
    """/v1/models as returned, the raw /metrics text (None if not served) and /health's status."""
    info: dict = {"models": None, "metrics_text": None, "health_status": None, "missing": []}
    for path, key in (("/v1/models", "models"), ("/metrics", "metrics_text"), ("/health", "health_status")):
        try:
            response = await client.get(path)
        except httpx.HTTPError as error:
            info["missing"].append(f"{path}: {type(error).__name__}")
            continue
        if key == "health_status":
            info[key] = response.status_code
        elif response.status_code == 200:
            info[key] = response.json() if key == "models" else response.text
        else:
            info["missing"].append(f"{path}: HTTP {response.status_code}")
    return info


def engine_config_from_models(models: dict | None) -> dict | None:
    """The engine config a server lists beside its model (our server's `engine_config`), if any."""
    for entry in (models or {}).get("data") or []:
        for key in ("engine_config", "config"):
            if isinstance(entry.get(key), dict):
                return entry[key]
    return None
