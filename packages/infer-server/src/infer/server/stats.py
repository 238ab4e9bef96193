"""The statistics a person watching the server reads (GET /v1/stats, the dashboard): each recent
request's numbers, and 1 Hz histories of the server's state over the last ten minutes.

Prometheus (infer.server.metrics) keeps counters and histograms for machines; this keeps what a
chart needs, per request and per second:

- `RequestRecord`: a finished request's time to first token, queue wait, prefill speed (its
  prefilled, not cached, prompt tokens over the time from being scheduled to its first token),
  decode speed, prompt tokens cached and prefilled, and how it ended (stop, length, tool_calls
  once its chat answer became tool calls, cancelled when its client went away, error).
- `History`: one point per second (the highest value seen in that second, so a request that ran
  for a fraction of it still shows), the newest `window_s`.
  Series: running and waiting requests, KV bytes used and total, prefix-cache bytes and budget,
  generated tokens per second, disconnects per second, the prefix cache's admissions by match
  kind and evicted bytes per second, the bytes offloaded to and restored from the host KV tier
  per second (0 without one), and the % of the memory roofline that
  decoding reached in each second (bytes the decode steps read over their time, over the copy
  bandwidth the engine measured at start-up: infer.engine.roofline).
- The prefix cache's entries (runs of tokens between branches of its tree), as the engine last
  walked them (once a second while it works, and once when it falls idle).
- Speculative decoding, while the engine speculates (null otherwise): the core's totals (rows
  that verified drafts, draft tokens, accepted tokens, and by draft position), the acceptance rate
  and mean accepted length they give (infer.engine.spec_decode.SpecDecodeCounts), and both per
  second in the history (seconds in which drafts were verified).
- The host KV tier, while the engine has one (kv_host_cache_gib; null otherwise): the blocks and
  bytes it holds, its budget, and the core's totals of bytes offloaded, restored and dropped and
  of seconds spent copying.
- Memory, as the engine last read it (infer.engine.memory): the weights, the KV pool (used and
  total) and the device memory in use, whose rest beyond weights and KV pool is `other_bytes`
  (activations, CUDA graphs, the allocator's; on a CPU everything else the process holds).

`ServerStats` is updated from the engine thread (each step's EngineStats) and the event loop
(each dispatched token, each finished request), so it takes a lock; `snapshot()` is the JSON of
GET /v1/stats. Times in records and histories are Unix seconds.
"""

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from infer.engine.spec_decode import SpecDecodeCounts

WINDOW_S = 600  # ten minutes of 1 Hz points
MAX_RECORDS = 500  # the most recent finished requests kept


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    finished_at: float  # Unix seconds
    finish_reason: str  # stop | length | tool_calls | cancelled | error
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None  # None: it ended before its first token
    queue_s: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None  # None: fewer than two tokens
    # Seconds the vision tower spent on its images; None without images.
    vision_encoder_s: float | None = None

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def request_record(
    request_id: str,
    *,
    finished_at: float,
    finish_reason: str,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    arrival_s: float,
    first_token_s: float | None,
    last_token_s: float | None,
    queue_s: float | None,
    vision_encoder_s: float | None = None,
) -> RequestRecord:
    """A record from a request's moments (monotonic seconds; `finished_at` is Unix)."""
    ttft_s = None if first_token_s is None else first_token_s - arrival_s
    prefill_s = None if ttft_s is None or queue_s is None else ttft_s - queue_s
    prefilled = prompt_tokens - cached_tokens
    decode_s = None if first_token_s is None or last_token_s is None else last_token_s - first_token_s
    return RequestRecord(
        request_id=request_id,
        finished_at=finished_at,
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        ttft_s=ttft_s,
        queue_s=queue_s,
        prefill_tokens_per_s=prefilled / prefill_s if prefill_s and prefill_s > 0 else None,
        decode_tokens_per_s=(
            (completion_tokens - 1) / decode_s if decode_s and completion_tokens > 1 else None
        ),
        vision_encoder_s=vision_encoder_s,
    )


class History:
    """One value per whole second (the highest recorded in it), the newest `window_s` seconds."""

    def __init__(self, window_s: int = WINDOW_S):
        self.points: deque[tuple[int, float]] = deque(maxlen=window_s)

    def record(self, now: float, value: float) -> None:
        second = int(now)
        if self.points and self.points[-1][0] == second:
            self.points[-1] = (second, max(self.points[-1][1], value))
        else:
            self.points.append((second, value))

    def add(self, now: float, amount: float) -> None:
        """Adds `amount` to this second's point (a rate: what happened in each second)."""
        second = int(now)
        if self.points and self.points[-1][0] == second:
            self.points[-1] = (second, self.points[-1][1] + amount)
        else:
            self.points.append((second, amount))

    def as_list(self) -> list[list[float]]:
        return [[second, value] for second, value in self.points]


GAUGE_SERIES = (
    "requests_running",
    "requests_waiting",
    "kv_used_bytes",
    "kv_total_bytes",
    "prefix_cache_bytes",
    "prefix_cache_budget_bytes",
)
# The prefix cache's admissions by match kind (what it held of each request taken in: a hit
# rate per second), its evictions, and the host tier's copies each way, per second, from the
# core's running totals.
MATCH_KINDS = ("miss", "prefix", "supersequence", "lcp")
CACHE_RATE_SERIES = (
    *(f"prefix_cache_{kind}_per_s" for kind in MATCH_KINDS),
    "prefix_cache_evicted_bytes_per_s",
    "kv_host_offloaded_bytes_per_s",
    "kv_host_restored_bytes_per_s",
)
RATE_SERIES = ("generated_tokens_per_s", "disconnects_per_s", *CACHE_RATE_SERIES)
# /v1/stats' "kv_host" section: its names and the EngineStats fields they show.
KV_HOST_FIELDS = {
    "blocks": "kv_host_blocks",
    "bytes": "kv_host_bytes",
    "budget_bytes": "kv_host_budget_bytes",
    "offloaded_bytes": "kv_host_offloaded_bytes_total",
    "restored_bytes": "kv_host_restored_bytes_total",
    "dropped_bytes": "kv_host_dropped_bytes_total",
    "transfer_time_s": "kv_host_transfer_time_s_total",
}
# Derived in snapshot() from what the decode steps read and took in each second.
ROOFLINE_SERIES = "memory_roofline_percent"
# Derived in snapshot() from the drafts verified in each second.
SPEC_DECODE_SERIES = ("spec_decode_acceptance_percent", "spec_decode_mean_accepted_length")


class ServerStats:
    """The server's statistics (see the module). `clock` gives Unix seconds."""

    def __init__(self, *, clock: Callable[[], float] = time.time, window_s: int = WINDOW_S):
        self.clock = clock
        self._lock = threading.Lock()
        self.history = {name: History(window_s) for name in (*GAUGE_SERIES, *RATE_SERIES)}
        self.records: deque[RequestRecord] = deque(maxlen=MAX_RECORDS)
        self.totals = {
            "requests": 0,
            "prompt_tokens_cached": 0,
            "prompt_tokens_prefilled": 0,
            "generated_tokens": 0,
            "disconnects": 0,
        }
        self.finish_reasons: dict[str, int] = {}
        # Admissions by what the prefix cache held (miss, prefix, supersequence, lcp): the core's
        # own running counts, as its latest step sent them.
        self.prefix_cache_matches: dict[str, int] = {}
        # The engine's latest walk of the prefix cache: its entries (PrefixCacheEntry, made into
        # JSON only when asked for) and how many there were.
        self.prefix_cache_entries: tuple = ()
        self.prefix_cache_num_entries = 0
        # Where the prefix cache keeps what the device pool evicts: "int8", "host", "host int8", or
        # None (EngineStats.prefix_cache_store).
        self.prefix_cache_store: str | None = None
        # Decode steps: bytes read and seconds taken in each second, and the core's totals so far.
        self._decode_bytes = History(window_s)
        self._decode_seconds = History(window_s)
        self._decode_totals = (0, 0.0)
        self.copy_bandwidth_bytes_per_s = 0.0
        self._cache_totals = dict.fromkeys(CACHE_RATE_SERIES, 0)  # the core's, at its last step
        self.memory: dict | None = None  # memory_of the core's latest statistics
        self.replicas: list[dict] | None = None  # on_replica_stats: with data parallelism only
        # Speculative decoding: the core's latest counts (None while it does not speculate), and
        # the rows, draft tokens and accepted tokens verified in each second.
        self.spec_decode: SpecDecodeCounts | None = None
        # The vision tower's totals (EngineStats.vision_*); None for a model without one.
        self.vision: dict | None = None
        # The host KV tier's figures (EngineStats.kv_host_*); None without one.
        self.kv_host: dict | None = None
        self.spec_decode_num_speculative_tokens = 0
        self._spec_decode_seconds = {name: History(window_s) for name in ("rows", "drafted", "accepted")}

    def on_replica_stats(self, replica_stats, alive: list[bool]) -> None:
        """Each data-parallel replica's state after its latest step (EngineStats), and whether it
        still serves."""
        replicas = [
            {
                "replica": index,
                "alive": up,
                "requests_running": stats.num_running,
                "requests_waiting": stats.num_waiting,
                "kv_usage_ratio": stats.kv_usage_ratio,
                "requests_finished": stats.num_finished,
                "prefix_cache_matches": dict(stats.prefix_cache_matches),
            }
            for index, (stats, up) in enumerate(zip(replica_stats, alive, strict=True))
        ]
        with self._lock:
            self.replicas = replicas

    def enable_vision(self) -> None:
        """The model has a vision tower: its totals are shown (from 0)."""
        with self._lock:
            self.vision = dict.fromkeys(("encoder_runs", "encoder_skipped", "image_tokens_reused"), 0)
            self.vision["encoder_time_s"] = 0.0

    def enable_kv_host(self) -> None:
        """The engine has a host KV tier: its figures are shown (from 0)."""
        with self._lock:
            self.kv_host = dict.fromkeys(KV_HOST_FIELDS, 0)
            self.kv_host["transfer_time_s"] = 0.0

    def engine_restarted(self) -> None:
        """A new engine (the model loaded again) counts its totals from 0: the per-second rates
        are taken from there, not from the last engine's totals."""
        with self._lock:
            self._decode_totals = (0, 0.0)
            self._cache_totals = dict.fromkeys(CACHE_RATE_SERIES, 0)
            self.spec_decode = None

    def on_engine_stats(self, stats) -> None:
        """The core's state after a step (infer.engine.protocol.EngineStats)."""
        now = self.clock()
        values = {
            "requests_running": stats.num_running,
            "requests_waiting": stats.num_waiting,
            "kv_used_bytes": stats.kv_bytes_used,
            "kv_total_bytes": stats.kv_bytes_total,
            "prefix_cache_bytes": stats.prefix_cache_bytes,
            "prefix_cache_budget_bytes": stats.prefix_cache_budget_bytes,
        }
        with self._lock:
            self.prefix_cache_matches = dict(stats.prefix_cache_matches)
            for name, value in values.items():
                self.history[name].record(now, value)
            self.copy_bandwidth_bytes_per_s = stats.copy_bandwidth_bytes_per_s
            self.memory = memory_of(stats)
            totals = (stats.decode_bytes_total, stats.decode_time_s_total)
            if totals[1] > self._decode_totals[1]:
                self._decode_bytes.add(now, totals[0] - self._decode_totals[0])
                self._decode_seconds.add(now, totals[1] - self._decode_totals[1])
                self._decode_totals = totals
            self.prefix_cache_store = stats.prefix_cache_store
            if stats.prefix_cache_entries is not None:
                self.prefix_cache_entries = stats.prefix_cache_entries
                self.prefix_cache_num_entries = stats.prefix_cache_num_entries
            cache_totals = {
                **{
                    f"prefix_cache_{kind}_per_s": stats.prefix_cache_matches.get(kind, 0)
                    for kind in MATCH_KINDS
                },
                "prefix_cache_evicted_bytes_per_s": stats.prefix_cache_evicted_bytes,
                "kv_host_offloaded_bytes_per_s": stats.kv_host_offloaded_bytes_total,
                "kv_host_restored_bytes_per_s": stats.kv_host_restored_bytes_total,
            }
            for name, total in cache_totals.items():
                self.history[name].add(now, total - self._cache_totals[name])
            self._cache_totals = cache_totals
            if stats.spec_decode_num_speculative_tokens:
                self._on_spec_decode(now, stats)
            if self.vision is not None:
                self.vision = {
                    "encoder_runs": stats.vision_encoder_runs,
                    "encoder_skipped": stats.vision_encoder_skipped,
                    "image_tokens_reused": stats.vision_image_tokens_reused,
                    "encoder_time_s": stats.vision_encoder_time_s,
                }
            if self.kv_host is not None:
                self.kv_host = {name: getattr(stats, field) for name, field in KV_HOST_FIELDS.items()}
            for name in ("generated_tokens_per_s", "disconnects_per_s"):  # a point for every second the
                self.history[name].add(now, 0)  # engine ran, 0 if nothing happened

    def _on_spec_decode(self, now: float, stats) -> None:
        counts = SpecDecodeCounts(
            num_draft_tokens=stats.spec_decode_num_draft_tokens,
            num_accepted_tokens=stats.spec_decode_num_accepted_tokens,
            num_verified_rows=stats.spec_decode_num_verified_rows,
            accepted_by_position=list(stats.spec_decode_accepted_by_position),
            drafted_by_position=list(stats.spec_decode_drafted_by_position),
        )
        before = self.spec_decode or SpecDecodeCounts()
        if counts.num_verified_rows > before.num_verified_rows:
            for name, total, earlier in (
                ("rows", counts.num_verified_rows, before.num_verified_rows),
                ("drafted", counts.num_draft_tokens, before.num_draft_tokens),
                ("accepted", counts.num_accepted_tokens, before.num_accepted_tokens),
            ):
                self._spec_decode_seconds[name].add(now, total - earlier)
        self.spec_decode = counts
        self.spec_decode_num_speculative_tokens = stats.spec_decode_num_speculative_tokens

    def on_tokens(self, count: int) -> None:
        now = self.clock()
        with self._lock:
            self.history["generated_tokens_per_s"].add(now, count)
            self.totals["generated_tokens"] += count

    def on_disconnect(self) -> None:
        now = self.clock()
        with self._lock:
            self.history["disconnects_per_s"].add(now, 1)
            self.totals["disconnects"] += 1

    def on_finished(self, record: RequestRecord) -> None:
        with self._lock:
            self.records.append(record)
            self.totals["requests"] += 1
            self.totals["prompt_tokens_cached"] += record.cached_tokens
            self.totals["prompt_tokens_prefilled"] += record.prefilled_tokens
            self.finish_reasons[record.finish_reason] = self.finish_reasons.get(record.finish_reason, 0) + 1

    def on_answer_finish_reason(self, request_id: str, finish_reason: str) -> None:
        """The finish_reason the request's client got, where it differs from the engine's (a chat
        answer that became tool calls), once the answer is made: after its record, which it
        corrects (the answer is made right after, so its record is among the newest)."""
        with self._lock:
            for index in range(len(self.records) - 1, -1, -1):
                record = self.records[index]
                if record.request_id == request_id:
                    break
            else:
                return  # dropped from the window already
            if record.finish_reason == finish_reason:
                return
            self.finish_reasons[record.finish_reason] -= 1
            if not self.finish_reasons[record.finish_reason]:
                del self.finish_reasons[record.finish_reason]
            self.finish_reasons[finish_reason] = self.finish_reasons.get(finish_reason, 0) + 1
            self.records[index] = dataclasses.replace(record, finish_reason=finish_reason)

    def snapshot(self) -> dict:
        """GET /v1/stats: {"time", "totals", "finish_reasons", "prefix_cache_matches", "prefix_cache_store",
        "prefix_cache_num_entries", "prefix_cache_entries" (most recently used first, with their age and
        idle time now), "copy_bandwidth_bytes_per_s", "memory" (memory_of; null before the first step),
        "spec_decode" (null while the engine does not speculate), "vision" (the vision tower's runs, skips,
        reused image tokens and seconds; null for a model without one), "kv_host" (the host KV tier's
        blocks and bytes held, budget, bytes offloaded, restored and dropped, and seconds copying; null
        without one), "replicas" (each data-parallel replica's state; null with one core; the totals are
        their sums), "requests" (oldest first), "history": {series: [[unix_second, value], ...]}}."""
        with self._lock:
            now = self.clock()
            history = {name: history.as_list() for name, history in self.history.items()}
            history[ROOFLINE_SERIES] = self._roofline_percent()
            history.update(self._spec_decode_history())
            return {
                "time": now,
                "totals": dict(self.totals),
                "finish_reasons": dict(self.finish_reasons),
                "prefix_cache_matches": dict(self.prefix_cache_matches),
                "prefix_cache_store": self.prefix_cache_store,
                "prefix_cache_num_entries": self.prefix_cache_num_entries,
                "prefix_cache_entries": [
                    {**asdict(entry), "age_s": now - entry.created_at, "idle_s": now - entry.last_used_at}
                    for entry in self.prefix_cache_entries
                ],
                "copy_bandwidth_bytes_per_s": self.copy_bandwidth_bytes_per_s,
                "memory": self.memory,
                "spec_decode": self._spec_decode_summary(),
                "vision": self.vision,
                "kv_host": self.kv_host,
                "replicas": self.replicas,
                "requests": [asdict(record) for record in self.records],
                "history": history,
            }

    def _spec_decode_summary(self) -> dict | None:
        """The core's speculative-decoding counts, and the rates they give; by position j (0-based,
        padded to K): rows whose draft j was accepted, rows that had a draft j, and the accepted
        over all verified rows (vLLM's per-position acceptance rate: the rates sum to the mean accepted
        length minus one)."""
        counts, k = self.spec_decode, self.spec_decode_num_speculative_tokens
        if counts is None:
            return None

        def padded(values: list[int]) -> list[int]:
            return [*values, *[0] * (k - len(values))]

        accepted = padded(counts.accepted_by_position)
        rows = counts.num_verified_rows
        return {
            "num_speculative_tokens": k,
            "verified_rows": rows,
            "draft_tokens": counts.num_draft_tokens,
            "accepted_tokens": counts.num_accepted_tokens,
            "acceptance_rate": counts.acceptance_rate,
            "mean_accepted_length": counts.mean_accepted_length,
            "accepted_by_position": accepted,
            "drafted_by_position": padded(counts.drafted_by_position),
            "acceptance_rate_by_position": [count / rows if rows else 0.0 for count in accepted],
        }

    def _spec_decode_history(self) -> dict[str, list[list[float]]]:
        """Each second's acceptance (% of the draft tokens verified in it) and mean accepted
        length; only seconds in which drafts were verified have a point."""
        rows, drafted, accepted = (
            self._spec_decode_seconds[n].points for n in ("rows", "drafted", "accepted")
        )
        percent, length = [], []
        for (second, num_rows), (_, num_drafted), (_, num_accepted) in zip(
            rows, drafted, accepted, strict=True
        ):
            percent.append([second, 100 * num_accepted / num_drafted])
            length.append([second, 1 + num_accepted / num_rows])
        return dict(zip(SPEC_DECODE_SERIES, (percent, length), strict=True))

    def _roofline_percent(self) -> list[list[float]]:
        """Each second's decode bandwidth (bytes read over the time taken) as a % of the copy
        bandwidth; only seconds in which decode steps ran back to back have a point."""
        bandwidth = self.copy_bandwidth_bytes_per_s
        if not bandwidth:
            return []
        return [
            [second, 100 * read / seconds / bandwidth]
            for (second, read), (_, seconds) in zip(
                self._decode_bytes.points, self._decode_seconds.points, strict=True
            )
        ]


def memory_of(stats) -> dict:
    """The memory panel's figures from the core's EngineStats: `device` ("cuda", "cpu"),
    `weights_bytes`, `kv_used_bytes`, `kv_total_bytes`, `used_bytes` (CUDA: allocated; CPU: the
    process's resident set), `reserved_bytes` (CUDA: held by the allocator; 0 on a CPU),
    `total_bytes` (the device's, or the machine's RAM), and `other_bytes`: in use beyond the
    weights and the whole KV pool (None where nothing was measured). The pool: `kv_cache_dtype`,
    the tokens it holds (`kv_total_tokens`) and so `kv_tokens_per_gib` (fp8 about twice bf16's)."""
    used = stats.memory_used_bytes
    return {
        "device": stats.memory_device,
        "weights_bytes": stats.weights_bytes,
        "kv_used_bytes": stats.kv_bytes_used,
        "kv_total_bytes": stats.kv_bytes_total,
        "kv_cache_dtype": stats.kv_cache_dtype,
        "kv_total_tokens": stats.kv_tokens_total,
        "kv_tokens_per_gib": (
            round(stats.kv_tokens_total * 2**30 / stats.kv_bytes_total) if stats.kv_bytes_total else None
        ),
        "used_bytes": used,
        "reserved_bytes": stats.memory_reserved_bytes,
        "total_bytes": stats.memory_total_bytes,
        "other_bytes": used - stats.weights_bytes - stats.kv_bytes_total if used else None,
    }
