"""Statistics against independent oracles: numpy and the statistics module."""

import math
import random
import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from infer.bench.serving.client import RequestRecord, RunResult
from infer.bench.serving.report import duration_line, turns_markdown
from infer.bench.serving.server_info import (
    PREFIX_CACHE_MATCHES,
    counter_by_label_between,
    histogram_mean_between,
    memory_gauges,
    parse_prometheus_text,
)
from infer.bench.serving.stats import percentile, run_stats, summarize
from infer.bench.serving.workloads import make_workload
from infer.server.metrics import ServerMetrics

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=50), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q, method="linear"), abs=1e-6)


@given(st.lists(finite, min_size=2, max_size=50))
def test_percentiles_match_statistics_quantiles_inclusive(values):
    cut_points = statistics.quantiles(values, n=100, method="inclusive")
    assert [percentile(values, q) for q in range(1, 100)] == pytest.approx(cut_points, abs=1e-6)


def test_summary_matches_numpy():
    values = [0.5, 0.1, 0.9, 0.3, 0.7, 0.2]
    summary = summarize(values)
    assert summary.count == len(values)
    assert summary.mean == pytest.approx(np.mean(values))
    assert [summary.p50, summary.p95, summary.p99] == pytest.approx(np.percentile(values, [50, 95, 99]))


def test_no_values_give_no_summary_and_percentile_refuses():
    assert summarize([]) is None
    with pytest.raises(ValueError, match="at least one value"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"within \[0, 100\]"):
        percentile([1.0], 101)


def _record(index, send, chunk_times, *, prompt_tokens, usage_tokens=None, error=None, chunk_tokens=None):
    """`chunk_tokens`: the tokens each chunk carried (default one each)."""
    record = RequestRecord(index=index, endpoint="/v1/completions", max_tokens=8, send_time=send)
    record.num_prompt_tokens = prompt_tokens
    record.chunk_times = list(chunk_times)
    record.chunk_num_tokens = list(chunk_tokens) if chunk_tokens is not None else [1] * len(chunk_times)
    record.first_token_time = chunk_times[0] if chunk_times else None
    record.end_time = (chunk_times[-1] if chunk_times else send) + 0.001
    record.num_output_tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    record.error = error
    return record


def test_run_stats_from_records_match_numpy_on_the_raw_times():
    records = [
        _record(0, 0.0, [0.10, 0.12, 0.15, 0.16], prompt_tokens=100),
        _record(1, 0.0, [0.30, 0.31, 0.33], prompt_tokens=300),
        _record(2, 0.2, [0.50, 0.58, 0.60, 0.61, 0.65], prompt_tokens=50),
        _record(3, 0.3, [], prompt_tokens=10, error="HTTP 500: boom"),
    ]
    probe = _record(-1, 10.0, [10.05], prompt_tokens=200)
    run = RunResult(make_workload("W2"), 0.0, 0.7, records, ignore_eos_sent=True, probe=probe)
    stats = run_stats(run)
    ok = records[:3]
    ttft = np.array([r.chunk_times[0] - r.send_time for r in ok])
    gaps = np.concatenate([np.diff(r.chunk_times) for r in ok])
    e2e = np.array([r.end_time - r.send_time for r in ok])
    assert (stats["num_ok"], stats["num_errors"]) == (3, 1)
    assert stats["output_tokens"] == 12
    assert stats["output_tokens_per_s"] == pytest.approx(12 / 0.7)
    assert stats["ttft_s"]["mean"] == pytest.approx(ttft.mean())
    assert stats["ttft_s"]["p99"] == pytest.approx(np.percentile(ttft, 99))
    assert stats["itl_s"]["count"] == len(gaps)
    assert stats["itl_s"]["p50"] == pytest.approx(np.median(gaps))
    assert stats["e2e_s"]["p95"] == pytest.approx(np.percentile(e2e, 95))
    # Queue wait: TTFT minus the probe's 0.05 s per 200 prompt tokens, floored at 0.
    prompt = np.array([100, 300, 50])
    expected_wait = np.maximum(0, ttft - 0.05 * prompt / 200)
    assert stats["queue_wait_s"]["mean"] == pytest.approx(expected_wait.mean())
    assert stats["queue_wait_s"]["source"].startswith("estimate")


def test_itl_is_per_token_when_a_chunk_carries_several():
    """A chunk of n tokens g seconds after the previous one gives n inter-token latencies of g / n
    (numpy: each gap repeated over its chunk's tokens); the gaps between chunks are kept apart."""
    chunks = [[0.10, 0.16, 0.17, 0.25], [0.40, 0.44, 0.50]]
    tokens = [[2, 3, 1, 4], [1, 1, 2]]
    records = [
        _record(i, 0.0, times, prompt_tokens=8, chunk_tokens=n, usage_tokens=sum(n))
        for i, (times, n) in enumerate(zip(chunks, tokens, strict=True))
    ]
    run = RunResult(make_workload("W2"), 0.0, 1.0, records, ignore_eos_sent=True)
    stats = run_stats(run)
    per_token = np.concatenate(
        [
            np.concatenate([np.zeros(n[0] - 1), np.repeat(np.diff(t) / n[1:], n[1:])])
            for t, n in zip(chunks, tokens, strict=True)
        ]
    )
    per_chunk = np.concatenate([np.diff(t) for t in chunks])
    assert stats["itl_s"]["count"] == len(per_token) == sum(map(sum, tokens)) - len(chunks)
    assert stats["itl_s"]["mean"] == pytest.approx(per_token.mean())
    assert stats["itl_s"]["p50"] == pytest.approx(np.median(per_token))
    assert stats["inter_chunk_s"]["count"] == len(per_chunk)
    assert stats["inter_chunk_s"]["p99"] == pytest.approx(np.percentile(per_chunk, 99))
    assert stats["tokens_per_chunk"] == pytest.approx(np.mean(np.concatenate(tokens)))
    assert stats["chunk_tokens_from"] == "token_ids"
    # Per token, the latencies add up to the time from the first chunk to the last (TPOT's span).
    for record in records:
        assert sum(record.itl_s) == pytest.approx(record.chunk_times[-1] - record.chunk_times[0])


def test_server_queue_time_replaces_the_estimate():
    run = RunResult(
        make_workload("W2"), 0.0, 1.0, [_record(0, 0.0, [0.1], prompt_tokens=4)], ignore_eos_sent=True
    )
    stats = run_stats(run, server_queue_time=(0.25, 7))
    assert stats["queue_wait_s"] == {"source": "server /metrics histogram", "count": 7, "mean": 0.25}


def test_prometheus_parser_agrees_with_prometheus_client_on_our_metrics():
    metrics = ServerMetrics()
    metrics.kv_cache_used_bytes.set(12345)
    metrics.requests_total.inc(3, finish_reason="length")
    for value in (0.003, 0.2, 7.0):
        metrics.time_to_first_token_seconds.observe(value)
    text = metrics.render()
    ours = parse_prometheus_text(text)
    theirs = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    # prometheus_client renames counter samples to <name>_total and keeps NaN; compare the overlap
    assert set(theirs) <= set(ours)
    for key, value in theirs.items():
        assert ours[key] == value or (math.isnan(value) and math.isnan(ours[key]))


def test_histogram_mean_between_two_scrapes_and_memory_gauges():
    metrics = ServerMetrics()
    metrics.time_to_first_token_seconds.observe(1.0)
    before = parse_prometheus_text(metrics.render())
    metrics.time_to_first_token_seconds.observe(0.2)
    metrics.time_to_first_token_seconds.observe(0.4)
    metrics.kv_cache_total_bytes.set(4096)
    after = parse_prometheus_text(metrics.render())
    mean, count = histogram_mean_between(before, after, "infer_time_to_first_token_seconds")
    assert (mean, count) == (pytest.approx(0.3), 2)
    assert histogram_mean_between(before, after, "absent_histogram") is None
    assert memory_gauges(after)["infer_kv_cache_total_bytes"] == 4096


def test_turn_stats_match_a_brute_force_over_known_timings():
    """Seeded sessions of 1-6 turns with known TTFTs, prompt and cached tokens (one failed turn):
    per turn (numbered from 1) the requests, TTFT p50/p99 of the successful ones (numpy), prompt
    tokens reused and computed; the TTFT p50 of turns 3 and later; and the markdown's rows."""
    rng = random.Random(7)
    records = []
    for session in range(9):
        for turn in range(rng.randint(1, 6)):
            record = _record(session, 0.0, [rng.uniform(0.01, 2.0), 2.5], prompt_tokens=rng.randint(1, 999))
            record.turn, record.num_cached_tokens = turn, rng.randint(0, record.num_prompt_tokens)
            records.append(record)
    records[5].error = "HTTP 500: boom"
    stats = run_stats(RunResult(make_workload("W5"), 0.0, 3.0, records, ignore_eos_sent=True))
    turns = stats["turns"]
    assert [one["turn"] for one in turns["per_turn"]] == list(range(1, max(r.turn for r in records) + 2))
    rows = []
    for one in turns["per_turn"]:
        everyone = [r for r in records if r.turn == one["turn"] - 1]
        ok = [r for r in everyone if r.error is None]
        ttft_ms = 1000 * np.array([r.first_token_time - r.send_time for r in ok])
        prompt = sum(r.num_prompt_tokens for r in ok)
        reused = sum(r.num_cached_tokens for r in ok)
        assert (one["requests"], one["num_ok"]) == (len(everyone), len(ok))
        assert 1000 * one["ttft_s"]["p50"] == pytest.approx(np.percentile(ttft_ms, 50))
        assert 1000 * one["ttft_s"]["p99"] == pytest.approx(np.percentile(ttft_ms, 99))
        assert (one["prompt_tokens"], one["reused_tokens"], one["computed_tokens"]) == (
            prompt,
            reused,
            prompt - reused,
        )
        p50, p99 = np.percentile(ttft_ms, [50, 99])
        cells = [one["turn"], len(everyone), f"{p50:.1f}", f"{p99:.1f}", prompt, prompt - reused, reused]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    later = [r.first_token_time - r.send_time for r in records if r.turn >= 2 and r.error is None]
    assert turns["ttft_p50_turns_from_3_s"] == pytest.approx(np.median(later))
    ok = [r for r in records if r.error is None]
    reused = sum(r.num_cached_tokens for r in ok)
    computed = sum(r.num_prompt_tokens for r in ok) - reused
    markdown = turns_markdown(stats).splitlines()
    assert markdown[0] == (
        f"Whole run: {stats['output_tokens'] / 3.0:.1f} out tok/s, prefill {computed} tokens computed, "
        f"{reused} reused; TTFT p50 of turns >= 3: {1000 * np.median(later):.1f} ms"
    )
    assert markdown[-len(rows) :] == rows


def test_single_requests_have_no_turn_stats():
    run = RunResult(
        make_workload("W2"), 0.0, 1.0, [_record(0, 0.0, [0.1], prompt_tokens=4)], ignore_eos_sent=True
    )
    assert run_stats(run)["turns"] is None


def test_a_time_cap_counts_sessions_it_cut_short_not_those_that_met_their_context_cap():
    """Five W7 sessions under a cap, each planned for more than one turn: one ran a turn whose
    prompt alone fills the context cap (it stopped for the cap), one ran a turn of 10 prompt
    tokens and stopped (for the time cap), one's turn failed (a failure ends a session), two
    never started. Without a cap, nothing is counted."""
    workload = make_workload("W7", concurrency=5)
    assert all(len(request.turns) > 1 for request in workload.requests)
    cap = workload.requests[0].max_context_tokens
    records = [
        _record(0, 0.0, [0.1], prompt_tokens=cap),
        _record(1, 0.0, [0.1], prompt_tokens=10),
        _record(2, 0.0, [], prompt_tokens=10, error="HTTP 500: boom"),
    ]
    run = RunResult(workload, 0.0, 1.0, records, ignore_eos_sent=True, duration_s=300.0)
    stats = run_stats(run)
    assert stats["duration_s"] == 300.0
    assert stats["stopped_by_duration"] == {"requests_not_started": 2, "sessions_cut_short": 1}
    assert duration_line(stats, "agent") == (
        "Stopped at the 300 s cap: 2 requests not started, 1 sessions cut short"
    )
    uncapped = run_stats(RunResult(workload, 0.0, 1.0, records, ignore_eos_sent=True))
    assert (uncapped["duration_s"], uncapped["stopped_by_duration"]) == (None, None)


def test_a_time_cap_that_left_nothing_out_says_so():
    workload = make_workload("W2", concurrency=2, num_requests=2)
    records = [_record(index, 0.0, [0.1, 0.2], prompt_tokens=4) for index in range(2)]
    stats = run_stats(RunResult(workload, 0.0, 0.3, records, ignore_eos_sent=True, duration_s=0.5))
    assert stats["stopped_by_duration"] == {"requests_not_started": 0, "sessions_cut_short": 0}
    assert duration_line(stats, "completion") == "Ran within the 0.5 s cap: every request started"


def test_prefix_cache_matches_between_two_scrapes_of_our_metrics():
    """What each kind of our server's infer_prefix_cache_matches_total gained between scrapes."""
    metrics = ServerMetrics()
    metrics.prefix_cache_matches_total.set_total(4, kind="miss")
    metrics.prefix_cache_matches_total.set_total(1, kind="prefix")
    before = parse_prometheus_text(metrics.render())
    for kind, total in {"miss": 6, "prefix": 10, "lcp": 3}.items():
        metrics.prefix_cache_matches_total.set_total(total, kind=kind)
    after = parse_prometheus_text(metrics.render())
    gained = counter_by_label_between(before, after, *PREFIX_CACHE_MATCHES)
    assert gained == {"miss": 2, "prefix": 9, "supersequence": 0, "lcp": 3}
    assert counter_by_label_between(before, after, "absent_total", "kind") is None
