"""Summary statistics of a RunResult: throughput, TTFT, ITL, TPOT, end-to-end latency, queue wait.

Percentiles use linear interpolation between closest ranks (Hyndman & Fan type 7; numpy's
default `method="linear"`, `statistics.quantiles(method="inclusive")`): for n sorted values and
q in [0, 100], h = (n - 1) q / 100 and P_q = x[floor h] + (h - floor h)(x[floor h + 1] - x[floor h]).

Definitions (all from the client's clock):
  output_tokens_per_s  sum of output tokens of successful requests / wall time of the run
                       (first request sent to last stream ended)
  ttft_s               first text chunk - send
  itl_s                inter-token latency, per token: each text chunk's gap from the previous
                       one spread evenly over the tokens it carried (a chunk may carry several:
                       a speculating server's verified run, a busy server catching up), pooled
                       over all requests; equal to the gaps between chunks when each carries one
  inter_chunk_s        gaps between consecutive text chunks (per event), pooled over all requests
  tokens_per_chunk     tokens in text chunks / text chunks; `chunk_tokens_from` says whether the
                       server's token_ids counted them or one a chunk was assumed
  tpot_s               per request (end - first token) / (output tokens - 1)
  e2e_s                stream end - send
  spec_decode          what the server's speculative decoding did over the timed run, from its
                       /metrics (infer.bench.spec_decode); None when it does not speculate
  vision               what the server's vision tower did over the timed run and what its prefix
                       cache spared it, from its /metrics (infer.bench.vision); None without a tower
  prefix_cache         what the server says its prefix cache served (usage.prompt_tokens_details
                       .cached_tokens): requests that hit, prompt tokens reused (cached) and
                       computed (prompt - cached); None when it says nothing
  prefix_cache_matches admissions by what the prefix cache held of the request (our server's
                       infer_prefix_cache_matches_total{kind} over the timed run: miss, prefix,
                       supersequence, lcp); for the run as a whole, since the turns of concurrent
                       sessions interleave and a scrape cannot tell them apart; None without it
  turns                multi-turn runs (W5, W7): per turn (1: the first) the requests that got
                       there, TTFT, prompt tokens reused and computed; and the TTFT p50 of turns
                       3 and later (`ttft_p50_turns_from_3_s`), where a session's own history
                       is most of the prompt; None for single requests
  duration_s           the time cap on the timed run (`--duration-s`; None: none), counted from
                       its start: after it no request or turn starts, what is in flight ends
  stopped_by_duration  what the cap left out: `requests_not_started` (a conversation of which no
                       turn was sent counts as one) and `sessions_cut_short` (conversations that
                       stopped for the cap before their last planned turn and their context cap);
                       None without a cap
  queue_wait_s         from the server's queue-time histogram when /metrics has one (mean only);
                       else estimated per request as max(0, TTFT - unloaded prefill), where the
                       unloaded prefill time is the idle-server probe's TTFT scaled linearly by
                       prompt length (an estimate: batched prefill is slower than alone)
"""

import math
import statistics
from dataclasses import asdict, dataclass

from infer.bench.serving.client import RequestRecord, RunResult

PERCENTILES = (50, 95, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values` by linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values is undefined; pass at least one value")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within [0, 100], got {q}")
    ordered = sorted(values)
    h = (len(ordered) - 1) * q / 100
    low = math.floor(h)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (h - low) * (ordered[high] - ordered[low])


@dataclass(frozen=True)
class Summary:
    count: int
    mean: float
    p50: float
    p95: float
    p99: float

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(values: list[float]) -> Summary | None:
    """Mean and P50/P95/P99; None for no values."""
    if not values:
        return None
    return Summary(len(values), statistics.fmean(values), *(percentile(values, q) for q in PERCENTILES))


def estimated_queue_waits(records: list[RequestRecord], probe: RequestRecord | None) -> list[float]:
    """max(0, TTFT - probe TTFT x prompt tokens / probe prompt tokens) per request that has both."""
    if probe is None or probe.ttft_s is None or not probe.num_prompt_tokens:
        return []
    seconds_per_prompt_token = probe.ttft_s / probe.num_prompt_tokens
    return [
        max(0.0, record.ttft_s - seconds_per_prompt_token * record.num_prompt_tokens)
        for record in records
        if record.ok and record.num_prompt_tokens
    ]


def run_stats(
    run: RunResult,
    *,
    server_queue_time: tuple[float, int] | None = None,
    spec_decode: dict | None = None,
    vision: dict | None = None,
    prefix_cache_matches: dict[str, int] | None = None,
) -> dict:
    """Every statistic of one run as plain data (Summary fields inline), for the JSON report.
    `spec_decode`: the server's speculative-decoding figures over the run (infer.bench.spec_decode);
    `vision`: its vision tower's (infer.bench.vision); `prefix_cache_matches`: its prefix cache's
    admissions by match kind (server_info.counter_by_label_between)."""
    ok = [record for record in run.records if record.ok]
    output_tokens = sum(record.num_output_tokens for record in ok)
    prompt_tokens = sum(record.num_prompt_tokens or 0 for record in ok)
    if server_queue_time is not None:
        mean_s, count = server_queue_time
        queue_wait = {"source": "server /metrics histogram", "count": count, "mean": mean_s}
    else:
        summary = summarize(estimated_queue_waits(ok, run.probe))
        queue_wait = {
            "source": "estimate: TTFT - idle-server probe TTFT scaled by prompt length",
            **(summary.as_dict() if summary else {}),
        }
    ttft = summarize([record.ttft_s for record in ok])
    itl = summarize([gap for record in ok for gap in record.itl_s])
    inter_chunk = summarize([gap for record in ok for gap in record.inter_chunk_s])
    num_chunks = sum(len(record.chunk_num_tokens) for record in ok)
    chunk_tokens = sum(sum(record.chunk_num_tokens) for record in ok)
    tpot = summarize([record.tpot_s for record in ok if record.tpot_s is not None])
    e2e = summarize([record.e2e_s for record in ok])
    return {
        "num_requests": len(run.records),
        "num_ok": len(ok),
        "num_errors": len(run.records) - len(ok),
        "wall_s": run.wall_s,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": output_tokens / run.wall_s if run.wall_s > 0 else math.nan,
        "requests_per_s": len(ok) / run.wall_s if run.wall_s > 0 else math.nan,
        "output_tokens_short_of_max_tokens": sum(max(0, r.max_tokens - r.num_output_tokens) for r in ok),
        "ttft_s": ttft.as_dict() if ttft else None,
        "itl_s": itl.as_dict() if itl else None,
        "inter_chunk_s": inter_chunk.as_dict() if inter_chunk else None,
        "tokens_per_chunk": chunk_tokens / num_chunks if num_chunks else math.nan,
        "chunk_tokens_from": (
            "token_ids" if all(r.chunk_tokens_from == "token_ids" for r in ok) else "assumed 1 per chunk"
        ),
        "spec_decode": spec_decode,
        "vision": vision,
        "tpot_s": tpot.as_dict() if tpot else None,
        "e2e_s": e2e.as_dict() if e2e else None,
        "queue_wait_s": queue_wait,
        "prefix_cache": prefix_cache_stats(ok),
        "prefix_cache_matches": prefix_cache_matches,
        "turns": turn_stats(run.records),
        "duration_s": run.duration_s,
        "stopped_by_duration": run.stopped_by_duration,
    }


def prefix_cache_stats(records: list[RequestRecord]) -> dict | None:
    """What the server says its prefix cache served (usage.prompt_tokens_details.cached_tokens):
    None when it says nothing. Hit rate: requests with any cached prompt token."""
    reported = [record for record in records if record.num_cached_tokens is not None]
    if not reported:
        return None
    prompt_tokens = sum(record.num_prompt_tokens or 0 for record in reported)
    cached = sum(record.num_cached_tokens for record in reported)
    hits = sum(1 for record in reported if record.num_cached_tokens > 0)
    return {
        "requests": len(reported),
        "hits": hits,
        "hit_rate": hits / len(reported),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "computed_tokens": prompt_tokens - cached,
        "cached_share": cached / prompt_tokens if prompt_tokens else math.nan,
    }


def turn_stats(records: list[RequestRecord]) -> dict | None:
    """Per turn of a multi-turn run (see the module); None when every record is a first turn."""
    if not any(record.turn for record in records):
        return None
    by_turn: dict[int, list[RequestRecord]] = {}
    for record in records:
        by_turn.setdefault(record.turn, []).append(record)
    per_turn = []
    for turn in sorted(by_turn):
        ok = [record for record in by_turn[turn] if record.ok]
        ttft = summarize([record.ttft_s for record in ok])
        cache = prefix_cache_stats(ok)
        per_turn.append(
            {
                "turn": turn + 1,
                "requests": len(by_turn[turn]),
                "num_ok": len(ok),
                "ttft_s": ttft.as_dict() if ttft else None,
                "prompt_tokens": sum(record.num_prompt_tokens or 0 for record in ok),
                "reused_tokens": cache["cached_tokens"] if cache else None,
                "computed_tokens": cache["computed_tokens"] if cache else None,
            }
        )
    later = summarize([record.ttft_s for record in records if record.ok and record.turn >= 2])
    return {"per_turn": per_turn, "ttft_p50_turns_from_3_s": later.p50 if later else None}
