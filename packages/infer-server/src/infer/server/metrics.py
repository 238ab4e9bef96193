"""Prometheus metrics in the text exposition format (0.0.4), with no dependency.

Three kinds, each a family with a name, a help line and optional labels:
  Counter    only goes up (`inc`); names end in `_total`.
  Gauge      a value that is set (`set`, `inc`, `dec`).
  Histogram  observations counted into cumulative buckets, plus `_sum` and `_count` (no labels).
`MetricRegistry.render()` writes them all; `ServerMetrics` is the server's set, by name.

Updates take a per-metric lock, so the engine thread and the HTTP loop may both update.
"""

import bisect
import math
import re
import threading
from collections.abc import Iterable, Sequence

from infer.engine.protocol import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def format_value(value: float) -> str:
    """A sample value as Prometheus parses it (Go's ParseFloat): +Inf, -Inf, NaN or a Python float."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    # HELP text escapes only backslash and newline (quotes stay as they are).
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class _Metric:
    kind: str

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        if not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"metric name {name!r} must match {_METRIC_NAME.pattern}")
        for label in labelnames:
            if not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
                raise ValueError(
                    f"label name {label!r} of {name} must match {_LABEL_NAME.pattern}, no leading __"
                )
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = threading.Lock()
        # label values (in labelnames order) -> value; the unlabelled metric exists from the start.
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {list(self.labelnames)}, got {sorted(labels)}")
        return tuple(str(labels[name]) for name in self.labelnames)

    def value(self, **labels: str) -> float:
        """The current value (0 for label values never seen)."""
        return self._values.get(self._key(labels), 0.0)

    def _add(self, amount: float, labels: dict[str, str]) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def samples(self) -> Iterable[tuple[str, tuple[tuple[str, str], ...], float]]:
        with self._lock:
            items = list(self._values.items())
        for key, value in items:
            yield self.name, tuple(zip(self.labelnames, key, strict=True)), value


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        if not name.endswith("_total"):
            raise ValueError(f"counter name {name!r} must end in _total (Prometheus convention)")
        super().__init__(name, help, labelnames)
        # Per label values: what earlier sources counted before the present one restarted at 0
        # (set_total adds it; see carry_over).
        self._offsets: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up; inc got {amount}")
        self._add(amount, labels)

    def set_total(self, total: float, **labels: str) -> None:
        """Mirror a total counted elsewhere (the engine core's): it may only go up."""
        key = self._key(labels)
        with self._lock:
            total = total + self._offsets.get(key, 0.0)
            if total < self._values.get(key, 0.0):
                raise ValueError(
                    f"{self.name}: a counter only goes up; set_total got {total} after a larger one"
                )
            self._values[key] = float(total)

    def carry_over(self) -> None:
        """The source `set_total` mirrors restarts from 0 (a model loaded again): its totals
        count on from the values reached, so the counter still only goes up."""
        with self._lock:
            self._offsets = dict(self._values)

    def touch(self, **labels: str) -> None:
        """Show these label values at 0 before the first `inc`, so rates start from a sample."""
        key = self._key(labels)
        with self._lock:
            self._values.setdefault(key, 0.0)


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._add(amount, labels)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._add(-amount, labels)

    def zero(self) -> None:
        """Every label set at 0 (what it measured is gone)."""
        with self._lock:
            self._values = dict.fromkeys(self._values, 0.0)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        super().__init__(name, help)
        bounds = [float(b) for b in buckets if not math.isinf(b)]
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError(
                f"{name}: buckets must be a non-empty strictly increasing list, got {list(buckets)}"
            )
        self.upper_bounds = bounds  # +Inf is implicit
        self._bucket_counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        # `le` is inclusive: a value equal to a bound lands in that bound's bucket.
        index = bisect.bisect_left(self.upper_bounds, value)
        with self._lock:
            self._bucket_counts[index] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    @property
    def sum(self) -> float:
        return self._sum

    def samples(self) -> Iterable[tuple[str, tuple[tuple[str, str], ...], float]]:
        with self._lock:
            counts, total, count = list(self._bucket_counts), self._sum, self._count
        cumulative = 0
        for bound, bucket_count in zip([*self.upper_bounds, math.inf], counts, strict=True):
            cumulative += bucket_count
            yield f"{self.name}_bucket", (("le", format_value(bound)),), cumulative
        yield f"{self.name}_sum", (), total
        yield f"{self.name}_count", (), count


class MetricRegistry:
    def __init__(self):
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self.register(Counter(name, help, labelnames))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self.register(Gauge(name, help, labelnames))

    def histogram(self, name: str, help: str, buckets: Sequence[float]) -> Histogram:
        return self.register(Histogram(name, help, buckets))

    def __contains__(self, name: str) -> bool:
        return name in self._metrics

    def metrics(self) -> list[_Metric]:
        return list(self._metrics.values())

    def render(self) -> str:
        """Every metric in the text exposition format: HELP, TYPE, then its samples."""
        lines = []
        for metric in self._metrics.values():
            _family_lines(lines, metric.name, metric.help, metric.kind, [((), metric)])
        return "\n".join(lines) + "\n"


def _family_lines(
    lines: list[str], name: str, help: str, kind: str, sources: list[tuple[tuple, _Metric]]
) -> None:
    """HELP, TYPE, then the samples of each (leading labels, metric) source of one family."""
    lines.append(f"# HELP {name} {escape_help(help)}")
    lines.append(f"# TYPE {name} {kind}")
    for leading, metric in sources:
        for sample_name, labels, value in metric.samples():
            labels = leading + labels
            if labels:
                pairs = ",".join(f'{key}="{escape_label_value(val)}"' for key, val in labels)
                lines.append(f"{sample_name}{{{pairs}}} {format_value(value)}")
            else:
                lines.append(f"{sample_name} {format_value(value)}")


def render_by_model(server: "ServerMetrics", by_model: dict[str, "ServerMetrics"]) -> str:
    """/metrics of a server with several models: each family once, with every model's samples
    under a leading `model` label; the HTTP status counter, the server's, without one. A family
    that only some models have (a vision model's) lists those."""
    families: dict[str, list[tuple[tuple, _Metric]]] = {}
    first: dict[str, _Metric] = {}
    for model_name, metrics in by_model.items():
        for metric in metrics.registry.metrics():
            if metric.name == server.requests_by_status_total.name:
                continue
            first.setdefault(metric.name, metric)
            families.setdefault(metric.name, []).append(((("model", model_name),), metric))
    status = server.requests_by_status_total
    families[status.name], first[status.name] = [((), status)], status
    lines: list[str] = []
    for name, sources in families.items():
        _family_lines(lines, name, first[name].help, first[name].kind, sources)
    return "\n".join(lines) + "\n"


# Time to first token spans queueing plus prefill: milliseconds for a short prompt on an idle
# GPU, tens of seconds for a long prompt behind a full queue.
TTFT_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Inter-token latency: ~2-5 ms for a small model decoding alone, ~50 ms or more in a large batch.
ITL_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
# A request's vision-tower time: a tiny tower's image takes a millisecond on a CPU, a SigLIP
# so400m image on a GPU tens of milliseconds, a dozen images on a CPU seconds.
VISION_ENCODER_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Queue time, arrival to first scheduled: zero on an idle server, minutes behind a long queue.
QUEUE_TIME_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Request latency, arrival to last token: from one short answer to a long one behind a queue.
REQUEST_LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)
# infer.cache.MatchKind's values (the server reads them from the engine's stats).
PREFIX_MATCH_KINDS = ("miss", "prefix", "supersequence", "lcp")
CACHED_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
CACHED_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class ServerMetrics:
    """The metrics GET /metrics serves; the server updates the attributes, `render()` writes them."""

    def __init__(self, requests_by_status: Counter | None = None):
        """`requests_by_status`: the server's HTTP status counter, shared by every model's
        metrics of a server with several (default: a counter of its own)."""
        self.registry = registry = MetricRegistry()
        self.requests_running = registry.gauge("infer_requests_running", "Requests in the running batch.")
        self.requests_waiting = registry.gauge("infer_requests_waiting", "Requests waiting to be scheduled.")
        self.queue_depth = registry.gauge(
            "infer_queue_depth", "Requests accepted by the HTTP server and not yet finished."
        )
        self.kv_cache_usage_ratio = registry.gauge(
            "infer_kv_cache_usage_ratio", "Fraction of the KV cache in use (0 to 1)."
        )
        self.kv_cache_used_bytes = registry.gauge("infer_kv_cache_used_bytes", "KV cache bytes in use.")
        self.kv_cache_total_bytes = registry.gauge("infer_kv_cache_total_bytes", "KV cache bytes allocated.")
        self.prefill_tokens_per_second = registry.gauge(
            "infer_prefill_tokens_per_second",
            "Prompt tokens processed per second, over the engine's time in steps that ran prompt tokens.",
        )
        self.decode_tokens_per_second = registry.gauge(
            "infer_decode_tokens_per_second", "Tokens generated per second, over the last engine steps."
        )
        self.decode_read_bytes_total = registry.counter(
            "infer_decode_read_bytes_total",
            "Bytes the decode steps that ran back to back had to read (weights once a step, each "
            "sequence's K/V): over infer_decode_seconds_total, the bandwidth decoding achieved.",
        )
        self.decode_seconds_total = registry.counter(
            "infer_decode_seconds_total",
            "Time of the decode steps that ran back to back (each step's start to the next one's).",
        )
        self.copy_bandwidth_bytes_per_second = registry.gauge(
            "infer_copy_bandwidth_bytes_per_second",
            "The device's copy bandwidth (bytes read + written by a large copy), measured at start-up: "
            "the memory roofline decode is measured against.",
        )
        self.tool_call_answers_total = registry.counter(
            "infer_tool_call_answers_total",
            "Chat answers that became tool calls (finish_reason tool_calls; infer_requests_total "
            "counts them by the engine's reason, stop or length).",
        )
        self.requests_total = registry.counter(
            "infer_requests_total", "Finished requests, by finish reason.", ["finish_reason"]
        )
        for reason in FINISH_REASONS:
            self.requests_total.touch(finish_reason=reason)
        if requests_by_status is None:
            requests_by_status = Counter(
                "infer_requests_by_status_total", "HTTP responses, by status code.", ["status"]
            )
        self.requests_by_status_total = registry.register(requests_by_status)
        self.client_disconnects_total = registry.counter(
            "infer_client_disconnects_total", "Requests aborted because the client went away."
        )
        self.prompt_tokens_total = registry.counter(
            "infer_prompt_tokens_total", "Prompt tokens of all requests."
        )
        self.generation_tokens_total = registry.counter(
            "infer_generation_tokens_total", "Tokens generated for all requests."
        )
        self.prompt_tokens_cached_total = registry.counter(
            "infer_prompt_tokens_cached_total",
            "Prompt tokens of finished requests served from the prefix cache instead of computed.",
        )
        self.prompt_tokens_prefilled_total = registry.counter(
            "infer_prompt_tokens_prefilled_total", "Prompt tokens of finished requests that were computed."
        )
        self.prefix_cache_matches_total = registry.counter(
            "infer_prefix_cache_matches_total",
            "Admissions by what the prefix cache held of the request: miss, prefix (it extends a cached "
            "sequence), supersequence (a cached sequence extends it), lcp (they part mid-way).",
            ["kind"],
        )
        for kind in PREFIX_MATCH_KINDS:
            self.prefix_cache_matches_total.touch(kind=kind)
        self.prefix_cache_cached_tokens = registry.histogram(
            "infer_prefix_cache_cached_tokens",
            "Prompt tokens the prefix cache served, per finished request.",
            CACHED_TOKEN_BUCKETS,
        )
        self.prefix_cache_cached_ratio = registry.histogram(
            "infer_prefix_cache_cached_ratio",
            "Share of a finished request's prompt the prefix cache served (0 to 1).",
            CACHED_RATIO_BUCKETS,
        )
        self.prefix_cache_used_bytes = registry.gauge(
            "infer_prefix_cache_used_bytes",
            "KV bytes the prefix cache holds (part of the KV cache's used bytes).",
        )
        self.prefix_cache_budget_bytes = registry.gauge(
            "infer_prefix_cache_budget_bytes", "The prefix cache's byte budget (0: none but the KV pool)."
        )
        self.prefix_cache_blocks = registry.gauge(
            "infer_prefix_cache_blocks", "KV blocks the prefix cache holds (one per tree node)."
        )
        self.prefix_cache_entries = registry.gauge(
            "infer_prefix_cache_entries",
            "Runs of cached tokens between branches of the prefix tree (a shared system prompt is one, "
            "each conversation after it another); counted at most once a second.",
        )
        self.prefix_cache_evictions_total = registry.counter(
            "infer_prefix_cache_evictions_total", "KV blocks the prefix cache evicted."
        )
        self.prefix_cache_evicted_bytes_total = registry.counter(
            "infer_prefix_cache_evicted_bytes_total", "KV bytes the prefix cache evicted."
        )
        self.prefix_cache_quantized_bytes = registry.gauge(
            "infer_prefix_cache_quantized_bytes",
            "Bytes of the int8 store the prefix cache holds cold blocks in (prefix_cache_kv_bits).",
        )
        self.prefix_cache_quantized_blocks_total = registry.counter(
            "infer_prefix_cache_quantized_blocks_total",
            "Prefix-cache blocks moved into int8 instead of being evicted.",
        )
        self.prefix_cache_restored_blocks_total = registry.counter(
            "infer_prefix_cache_restored_blocks_total",
            "Int8 prefix-cache blocks restored into the KV pool for a hit.",
        )
        self.prefix_cache_shadow_runs_total = registry.counter(
            "infer_prefix_cache_shadow_runs_total",
            "Greedy requests served from the prefix cache that were run again without it (shadow check).",
        )
        self.prefix_cache_shadow_divergences_total = registry.counter(
            "infer_prefix_cache_shadow_divergences_total",
            "Shadow re-runs whose tokens differed from the cached run's: any is a bug.",
        )
        self.time_to_first_token_seconds = registry.histogram(
            "infer_time_to_first_token_seconds",
            "Seconds from request arrival to its first token.",
            TTFT_BUCKETS_S,
        )
        self.inter_token_latency_seconds = registry.histogram(
            "infer_inter_token_latency_seconds",
            "Seconds between consecutive tokens of a request: a step that gives a request n tokens "
            "(a verified speculative run) counts n latencies of the gap since its previous step over n.",
            ITL_BUCKETS_S,
        )
        self.request_queue_time_seconds = registry.histogram(
            "infer_request_queue_time_seconds",
            "Seconds from request arrival in the engine to the first step that scheduled it.",
            QUEUE_TIME_BUCKETS_S,
        )
        self.request_latency_seconds = registry.histogram(
            "infer_request_latency_seconds",
            "Seconds from request arrival to its last token (finished requests).",
            REQUEST_LATENCY_BUCKETS_S,
        )

    def enable_spec_decode(self, num_speculative_tokens: int) -> None:
        """Registers the speculative-decoding counters, positions 0 to K - 1 at 0. As vLLM's
        (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
        _num_accepted_tokens_per_pos), they exist only on a server whose engine speculates."""
        if "infer_spec_decode_drafts_total" in self.registry:  # a model loaded again
            return
        registry, positions = self.registry, [str(j) for j in range(num_speculative_tokens)]
        self.spec_decode_drafts_total = registry.counter(
            "infer_spec_decode_drafts_total",
            "Rows that verified draft tokens (each also emits one token of the target's). Mean "
            "accepted length: 1 + rate(infer_spec_decode_accepted_tokens_total) / "
            "rate(infer_spec_decode_drafts_total).",
        )
        self.spec_decode_draft_tokens_total = registry.counter(
            "infer_spec_decode_draft_tokens_total", "Draft tokens the target verified."
        )
        self.spec_decode_accepted_tokens_total = registry.counter(
            "infer_spec_decode_accepted_tokens_total",
            "Draft tokens the target accepted. Acceptance rate: "
            "rate(infer_spec_decode_accepted_tokens_total) / rate(infer_spec_decode_draft_tokens_total).",
        )
        self.spec_decode_accepted_tokens_per_pos_total = registry.counter(
            "infer_spec_decode_accepted_tokens_per_pos_total",
            "Verified rows whose draft at this position (0-based) was accepted (with every draft "
            "before it); over infer_spec_decode_drafts_total, the acceptance rate by position.",
            ["position"],
        )
        self.spec_decode_draft_tokens_per_pos_total = registry.counter(
            "infer_spec_decode_draft_tokens_per_pos_total",
            "Verified rows that had a draft at this position (0-based): a proposer may draft fewer "
            "than num_speculative_tokens.",
            ["position"],
        )
        for position in positions:
            self.spec_decode_accepted_tokens_per_pos_total.touch(position=position)
            self.spec_decode_draft_tokens_per_pos_total.touch(position=position)

    def update_spec_decode(self, stats) -> None:
        """Mirrors the core's speculative-decoding totals (EngineStats.spec_decode_*)."""
        self.spec_decode_drafts_total.set_total(stats.spec_decode_num_verified_rows)
        self.spec_decode_draft_tokens_total.set_total(stats.spec_decode_num_draft_tokens)
        self.spec_decode_accepted_tokens_total.set_total(stats.spec_decode_num_accepted_tokens)
        for counter, by_position in (
            (self.spec_decode_accepted_tokens_per_pos_total, stats.spec_decode_accepted_by_position),
            (self.spec_decode_draft_tokens_per_pos_total, stats.spec_decode_drafted_by_position),
        ):
            for position, count in enumerate(by_position):
                counter.set_total(count, position=str(position))

    def enable_vision(self) -> None:
        """Registers the vision tower's counters and its per-request time: they exist only on a
        server whose model takes images."""
        if "infer_vision_encoder_runs_total" in self.registry:  # a model loaded again
            return
        registry = self.registry
        self.vision_encoder_runs_total = registry.counter(
            "infer_vision_encoder_runs_total",
            "Images the vision tower encoded (a preempted request's again when it recomputes).",
        )
        self.vision_encoder_skipped_total = registry.counter(
            "infer_vision_encoder_skipped_total",
            "Images whose every token came from the prefix cache: never encoded.",
        )
        self.vision_image_tokens_reused_total = registry.counter(
            "infer_vision_image_tokens_reused_total", "Image tokens whose KV came from the prefix cache."
        )
        self.vision_encoder_seconds_total = registry.counter(
            "infer_vision_encoder_seconds_total", "Seconds the vision tower ran (device time on CUDA)."
        )
        self.request_vision_encoder_seconds = registry.histogram(
            "infer_request_vision_encoder_seconds",
            "Seconds the vision tower spent on a request's images (requests with images).",
            VISION_ENCODER_BUCKETS_S,
        )

    def update_vision(self, stats) -> None:
        """Mirrors the core's vision totals (EngineStats.vision_*)."""
        self.vision_encoder_runs_total.set_total(stats.vision_encoder_runs)
        self.vision_encoder_skipped_total.set_total(stats.vision_encoder_skipped)
        self.vision_image_tokens_reused_total.set_total(stats.vision_image_tokens_reused)
        self.vision_encoder_seconds_total.set_total(stats.vision_encoder_time_s)

    def enable_kv_host(self) -> None:
        """Registers the host-memory KV tier's gauges and counters: they exist only on a server
        whose engine has one (kv_host_cache_gib)."""
        if "infer_kv_host_cache_bytes" in self.registry:  # a model loaded again
            return
        registry = self.registry
        self.kv_host_cache_bytes = registry.gauge(
            "infer_kv_host_cache_bytes",
            "Host-memory bytes holding prefix-cache blocks the device KV pool evicted.",
        )
        self.kv_host_cache_budget_bytes = registry.gauge(
            "infer_kv_host_cache_budget_bytes", "The host KV tier's size in bytes (kv_host_cache_gib)."
        )
        self.kv_host_offloaded_bytes_total = registry.counter(
            "infer_kv_host_offloaded_bytes_total",
            "KV bytes copied from the device pool to host memory as the pool evicted their blocks.",
        )
        self.kv_host_restored_bytes_total = registry.counter(
            "infer_kv_host_restored_bytes_total",
            "KV bytes copied back from host memory into the device pool for a prefix-cache hit.",
        )
        self.kv_host_dropped_bytes_total = registry.counter(
            "infer_kv_host_dropped_bytes_total",
            "KV bytes the full host tier dropped (its least recently used blocks): gone from both tiers.",
        )
        self.kv_host_transfer_seconds_total = registry.counter(
            "infer_kv_host_transfer_seconds_total",
            "Seconds the steps spent on copies to and from host memory (device time on CUDA; the copies "
            "over the bus overlap the forwards, only the steps' share counts).",
        )

    def update_kv_host(self, stats) -> None:
        """Mirrors the core's host-tier figures (EngineStats.kv_host_*)."""
        self.kv_host_cache_bytes.set(stats.kv_host_bytes)
        self.kv_host_cache_budget_bytes.set(stats.kv_host_budget_bytes)
        self.kv_host_offloaded_bytes_total.set_total(stats.kv_host_offloaded_bytes_total)
        self.kv_host_restored_bytes_total.set_total(stats.kv_host_restored_bytes_total)
        self.kv_host_dropped_bytes_total.set_total(stats.kv_host_dropped_bytes_total)
        self.kv_host_transfer_seconds_total.set_total(stats.kv_host_transfer_time_s_total)

    def enable_replicas(self, num_replicas: int) -> None:
        """Registers each data-parallel replica's gauges and counters (label replica="0".."N-1"):
        they exist only on a server with data_parallel_size > 1, whose unlabelled metrics are the
        replicas' sums."""
        if "infer_replica_up" in self.registry:  # a model loaded again
            return
        registry = self.registry
        self.replica_up = registry.gauge(
            "infer_replica_up", "1 while the data-parallel replica serves, 0 once it failed.", ["replica"]
        )
        self.replica_requests_running = registry.gauge(
            "infer_replica_requests_running", "Requests in the replica's running batch.", ["replica"]
        )
        self.replica_requests_waiting = registry.gauge(
            "infer_replica_requests_waiting", "Requests waiting in the replica's queue.", ["replica"]
        )
        self.replica_kv_cache_usage_ratio = registry.gauge(
            "infer_replica_kv_cache_usage_ratio", "Fraction of the replica's KV blocks in use.", ["replica"]
        )
        self.replica_requests_finished_total = registry.counter(
            "infer_replica_requests_finished_total",
            "Requests the replica finished (any reason).",
            ["replica"],
        )
        self.replica_prefix_cache_matches_total = registry.counter(
            "infer_replica_prefix_cache_matches_total",
            "The replica's admissions by prefix-cache match kind (as infer_prefix_cache_matches_total).",
            ["replica", "kind"],
        )
        self.replica_routed_by_prefix_total = registry.counter(
            "infer_replica_routed_by_prefix_total",
            "Requests the router sent to the replica last sent their prefix (the others went to the "
            "least busy).",
        )
        for replica in range(num_replicas):
            self.replica_up.set(1, replica=str(replica))

    def update_replicas(self, replica_stats, alive: list[bool], num_routed_by_prefix: int) -> None:
        """Mirrors each replica's EngineStats (infer.engine.data_parallel)."""
        for index, (stats, up) in enumerate(zip(replica_stats, alive, strict=True)):
            replica = str(index)
            self.replica_up.set(1 if up else 0, replica=replica)
            self.replica_requests_running.set(stats.num_running if up else 0, replica=replica)
            self.replica_requests_waiting.set(stats.num_waiting if up else 0, replica=replica)
            self.replica_kv_cache_usage_ratio.set(stats.kv_usage_ratio if up else 0, replica=replica)
            self.replica_requests_finished_total.set_total(stats.num_finished, replica=replica)
            for kind, count in stats.prefix_cache_matches.items():
                self.replica_prefix_cache_matches_total.set_total(count, replica=replica, kind=kind)
        self.replica_routed_by_prefix_total.set_total(num_routed_by_prefix)

    def engine_restarted(self) -> None:
        """A new engine (the model loaded again) counts its totals from 0: the mirrored counters
        count on from where the last one left them."""
        for metric in self.registry.metrics():
            if isinstance(metric, Counter):
                metric.carry_over()

    def engine_stopped(self) -> None:
        """The engine is gone (its model unloaded): every gauge reads 0 until the next one."""
        for metric in self.registry.metrics():
            if isinstance(metric, Gauge):
                metric.zero()

    def render(self) -> str:
        return self.registry.render()
