"""The statistics a person watching the server reads (GET /v1/stats, the dashboard): each recent
request's numbers, and 1 Hz histories of the server's state over the last ten minutes.

Prometheus (infer.server.metrics) keeps counters and histograms for machines; this keeps what a
chart needs, per request and per second:

- `RequestRecord`: a finished request's time to first token, queue wait, prefill speed (its
  prefilled, not cached, prompt tokens over the time from being scheduled to its first token),
  decode speed, prompt tokens cached and prefilled, and how it ended (stop, length, cancelled
  when its client went away, error).
- `History`: one point per second (the highest value seen in that second, so a request that ran
  for a fraction of it still shows), the newest `window_s`.
  Series: running and waiting requests, KV bytes used and total, prefix-cache bytes and budget,
  generated tokens per second, disconnects per second.

`ServerStats` is updated from the engine thread (each step's EngineStats) and the event loop
(each dispatched token, each finished request), so it takes a lock; `snapshot()` is the JSON of
GET /v1/stats. Times in records and histories are Unix seconds.
"""

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

WINDOW_S = 600  # ten minutes of 1 Hz points
MAX_RECORDS = 500  # the most recent finished requests kept


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    finished_at: float  # Unix seconds
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None  # None: it ended before its first token
    queue_s: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None  # None: fewer than two tokens

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
RATE_SERIES = ("generated_tokens_per_s", "disconnects_per_s")


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
            for name in RATE_SERIES:  # a point for every second the engine ran, 0 if nothing happened
                self.history[name].add(now, 0)

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

    def snapshot(self) -> dict:
        """GET /v1/stats: {"time", "totals", "finish_reasons", "prefix_cache_matches", "requests"
        (oldest first), "history": {series: [[unix_second, value], ...]}}."""
        with self._lock:
            return {
                "time": self.clock(),
                "totals": dict(self.totals),
                "finish_reasons": dict(self.finish_reasons),
                "prefix_cache_matches": dict(self.prefix_cache_matches),
                "requests": [asdict(record) for record in self.records],
                "history": {name: history.as_list() for name, history in self.history.items()},
            }
