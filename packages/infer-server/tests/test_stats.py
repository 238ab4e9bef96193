"""infer.server.stats by itself: 1 Hz histories keep one point per second (the highest value,
or the sum for rates) over a bounded window; a request's record is the arithmetic of its moments.
The clock is a plain function the test sets (ServerStats takes one), not a mock."""

import dataclasses

import pytest

from infer.engine.protocol import EngineStats, PrefixCacheEntry
from infer.server.stats import History, ServerStats, request_record


def test_a_history_keeps_the_highest_value_of_each_second_within_its_window():
    history = History(window_s=3)
    for now, value in [(10.1, 1), (10.9, 2), (11.0, 5), (12.5, 7), (12.8, 0), (13.2, 8)]:
        history.record(now, value)
    assert history.as_list() == [[11, 5], [12, 7], [13, 8]]


def test_a_rate_history_sums_what_happened_in_each_second():
    history = History()
    for now, amount in [(5.0, 3), (5.7, 4), (7.2, 1)]:
        history.add(now, amount)
    assert history.as_list() == [[5, 7], [7, 1]]


def test_a_record_is_the_arithmetic_of_the_requests_moments():
    record = request_record(
        "r", finished_at=1000.0, finish_reason="stop", prompt_tokens=100, cached_tokens=60,
        completion_tokens=11, arrival_s=50.0, first_token_s=50.5, last_token_s=51.5, queue_s=0.1,
    )  # fmt: skip
    assert record.ttft_s == pytest.approx(0.5)
    assert record.prefill_tokens_per_s == pytest.approx(40 / 0.4)  # prefilled over ttft - queue
    assert record.decode_tokens_per_s == pytest.approx(10 / 1.0)  # tokens after the first
    assert record.prefilled_tokens == 40


def test_a_request_that_ended_before_its_first_token_has_no_speeds():
    record = request_record(
        "r", finished_at=1.0, finish_reason="cancelled", prompt_tokens=8, cached_tokens=0,
        completion_tokens=0, arrival_s=1.0, first_token_s=None, last_token_s=None, queue_s=None,
    )  # fmt: skip
    assert record.ttft_s is record.prefill_tokens_per_s is record.decode_tokens_per_s is None


def test_the_snapshot_counts_what_was_recorded():
    now = [100.0]
    stats = ServerStats(clock=lambda: now[0])
    stats.on_tokens(3)
    now[0] = 101.2
    stats.on_tokens(2)
    stats.on_disconnect()
    for reason, cached in [("stop", 4), ("cancelled", 0)]:
        stats.on_finished(
            request_record(
                reason, finished_at=now[0], finish_reason=reason, prompt_tokens=10, cached_tokens=cached,
                completion_tokens=2, arrival_s=0.0, first_token_s=1.0, last_token_s=2.0, queue_s=0.5,
            )
        )  # fmt: skip
    snapshot = stats.snapshot()
    assert snapshot["history"]["generated_tokens_per_s"] == [[100, 3], [101, 2]]
    assert snapshot["history"]["disconnects_per_s"] == [[101, 1]]
    assert snapshot["totals"] == {
        "requests": 2, "prompt_tokens_cached": 4, "prompt_tokens_prefilled": 16, "generated_tokens": 5,
        "disconnects": 1,
    }  # fmt: skip
    assert snapshot["finish_reasons"] == {"stop": 1, "cancelled": 1}
    assert [record["request_id"] for record in snapshot["requests"]] == ["stop", "cancelled"]


def engine_stats(**fields) -> EngineStats:
    """The core's statistics after a step: zeros but `fields`."""
    required = [
        f.name
        for f in dataclasses.fields(EngineStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    return EngineStats(**{**dict.fromkeys(required, 0), **fields})


def test_the_roofline_is_each_seconds_decode_bandwidth_over_the_copy_bandwidth():
    now = [100.2]
    stats = ServerStats(clock=lambda: now[0])
    for now[0], read, taken in [
        (100.2, 0, 0.0),  # nothing decoded yet: no point
        (100.5, 3e9, 1.0),  # 3 GB in 1 s
        (101.2, 4.5e9, 1.5),  # 1.5 GB in 0.5 s
        (101.4, 4.5e9, 1.5),  # a prefill step: nothing counted
        (101.7, 5.0e9, 2.0),  # 0.5 GB in 0.5 s: second 101 read 2 GB in 1 s
        (103.0, 5.0e9, 2.0),  # idle
    ]:
        stats.on_engine_stats(
            engine_stats(
                decode_bytes_total=int(read), decode_time_s_total=taken, copy_bandwidth_bytes_per_s=4e9
            )
        )
    snapshot = stats.snapshot()
    assert snapshot["history"]["memory_roofline_percent"] == [[100, 75.0], [101, 50.0]]
    assert snapshot["copy_bandwidth_bytes_per_s"] == 4e9


def test_cache_entries_are_the_latest_walk_with_their_ages_now():
    now = [50.0]
    stats = ServerStats(clock=lambda: now[0])
    entry = PrefixCacheEntry(
        start=0,
        num_tokens=20,
        bytes=4096,
        stored_bytes=0,
        hits=3,
        created_at=40.0,
        last_used_at=49.0,
        in_use=False,
    )
    stats.on_engine_stats(engine_stats(prefix_cache_num_entries=1, prefix_cache_entries=(entry,)))
    now[0] = 52.5
    stats.on_engine_stats(engine_stats())  # a step that did not walk the tree keeps the last walk
    (shown,) = stats.snapshot()["prefix_cache_entries"]
    assert shown == {**dataclasses.asdict(entry), "age_s": 12.5, "idle_s": 3.5}
    assert stats.snapshot()["prefix_cache_num_entries"] == 1


def test_an_answer_that_became_tool_calls_corrects_its_record():
    stats = ServerStats()
    for request_id in ("a", "b"):
        stats.on_finished(
            request_record(
                request_id, finished_at=1.0, finish_reason="stop", prompt_tokens=5, cached_tokens=0,
                completion_tokens=2, arrival_s=0.0, first_token_s=0.5, last_token_s=0.6, queue_s=0.1,
            )
        )  # fmt: skip
    stats.on_answer_finish_reason("a", "tool_calls")
    stats.on_answer_finish_reason("gone", "tool_calls")  # out of the window: nothing to correct
    snapshot = stats.snapshot()
    assert [r["finish_reason"] for r in snapshot["requests"]] == ["tool_calls", "stop"]
    assert snapshot["finish_reasons"] == {"stop": 1, "tool_calls": 1}


def test_cache_admissions_by_kind_and_evictions_are_counted_per_second():
    now = [10.2]
    stats = ServerStats(clock=lambda: now[0])
    for now[0], matches, evicted in [
        (10.2, {"miss": 1}, 0),
        (10.7, {"miss": 1, "lcp": 2}, 0),
        (11.3, {"miss": 2, "lcp": 2, "prefix": 1}, 4096),
    ]:
        stats.on_engine_stats(engine_stats(prefix_cache_matches=matches, prefix_cache_evicted_bytes=evicted))
    history = stats.snapshot()["history"]
    assert history["prefix_cache_miss_per_s"] == [[10, 1], [11, 1]]
    assert history["prefix_cache_lcp_per_s"] == [[10, 2], [11, 0]]
    assert history["prefix_cache_prefix_per_s"] == [[10, 0], [11, 1]]
    assert history["prefix_cache_supersequence_per_s"] == [[10, 0], [11, 0]]
    assert history["prefix_cache_evicted_bytes_per_s"] == [[10, 0], [11, 4096]]


def test_the_memory_is_the_latest_steps_and_other_is_what_is_in_use_beyond_weights_and_kv():
    stats = ServerStats(clock=lambda: 100.0)
    assert stats.snapshot()["memory"] is None  # no step yet
    for used in (900, 1000):
        stats.on_engine_stats(
            engine_stats(
                weights_bytes=500, kv_bytes_used=40, kv_bytes_total=300, memory_device="cuda",
                memory_used_bytes=used, memory_reserved_bytes=1200, memory_total_bytes=8000,
                kv_cache_dtype="float8_e4m3fn", kv_tokens_total=6,
            )
        )  # fmt: skip
    assert stats.snapshot()["memory"] == {
        "device": "cuda", "weights_bytes": 500, "kv_used_bytes": 40, "kv_total_bytes": 300,
        "kv_cache_dtype": "float8_e4m3fn", "kv_total_tokens": 6, "kv_tokens_per_gib": 6 * 2**30 // 300,
        "used_bytes": 1000, "reserved_bytes": 1200, "total_bytes": 8000, "other_bytes": 200,
    }  # fmt: skip
    stats.on_engine_stats(engine_stats(weights_bytes=500, kv_bytes_total=300))  # nothing measured
    assert stats.snapshot()["memory"]["other_bytes"] is None


def test_spec_decode_is_null_without_speculation_and_the_cores_counts_with_it():
    stats = ServerStats(clock=lambda: 10.0)
    stats.on_engine_stats(engine_stats())
    snapshot = stats.snapshot()
    assert snapshot["spec_decode"] is None
    assert snapshot["history"]["spec_decode_acceptance_percent"] == []
    now = [20.3]
    stats = ServerStats(clock=lambda: now[0])
    # K = 3; the core's running totals after three steps, the third in the next second.
    for now[0], rows, drafted, accepted, accepted_by_position, drafted_by_position in [
        (20.3, 0, 0, 0, (), ()),  # no row verified drafts yet: no point
        (20.6, 2, 6, 3, (2, 1), (2, 2, 2)),  # rows accepted 2 and 1 of 3 drafts
        (21.1, 4, 10, 6, (3, 2, 1), (4, 3, 3)),  # then 3 of 3 and 0 of 1
    ]:
        stats.on_engine_stats(
            engine_stats(
                spec_decode_num_speculative_tokens=3, spec_decode_num_verified_rows=rows,
                spec_decode_num_draft_tokens=drafted, spec_decode_num_accepted_tokens=accepted,
                spec_decode_accepted_by_position=accepted_by_position,
                spec_decode_drafted_by_position=drafted_by_position,
            )
        )  # fmt: skip
    snapshot = stats.snapshot()
    assert snapshot["spec_decode"] == {
        "num_speculative_tokens": 3, "verified_rows": 4, "draft_tokens": 10, "accepted_tokens": 6,
        "acceptance_rate": 0.6, "mean_accepted_length": 2.5, "accepted_by_position": [3, 2, 1],
        "drafted_by_position": [4, 3, 3], "acceptance_rate_by_position": [0.75, 0.5, 0.25],
    }  # fmt: skip
    # Per second: 3 of 6 drafts over 2 rows in second 20, 3 of 4 over 2 rows in second 21.
    assert snapshot["history"]["spec_decode_acceptance_percent"] == [[20, 50.0], [21, 75.0]]
    assert snapshot["history"]["spec_decode_mean_accepted_length"] == [[20, 2.5], [21, 2.5]]


def test_spec_decode_positions_are_padded_to_k_before_any_draft_reaches_them():
    stats = ServerStats(clock=lambda: 5.0)
    stats.on_engine_stats(
        engine_stats(
            spec_decode_num_speculative_tokens=4, spec_decode_num_verified_rows=1,
            spec_decode_num_draft_tokens=2, spec_decode_accepted_by_position=(),
            spec_decode_drafted_by_position=(1, 1),
        )
    )  # fmt: skip
    summary = stats.snapshot()["spec_decode"]
    assert summary["accepted_by_position"] == [0, 0, 0, 0]
    assert summary["drafted_by_position"] == [1, 1, 0, 0]
    assert (summary["acceptance_rate"], summary["mean_accepted_length"]) == (0.0, 1.0)


def test_kv_host_is_null_without_the_tier_and_the_cores_figures_with_it():
    stats = ServerStats(clock=lambda: 10.0)
    stats.on_engine_stats(engine_stats(prefix_cache_store="int8"))
    assert stats.snapshot()["kv_host"] is None
    now = [30.4]
    stats = ServerStats(clock=lambda: now[0])
    stats.enable_kv_host()
    assert stats.snapshot()["kv_host"] == {
        "blocks": 0, "bytes": 0, "budget_bytes": 0, "offloaded_bytes": 0, "restored_bytes": 0,
        "dropped_bytes": 0, "transfer_time_s": 0.0,
    }  # fmt: skip
    # The core's running totals after three steps, the third in the next second.
    for now[0], held, offloaded, restored in [(30.4, 2, 2, 0), (30.8, 3, 5, 1), (31.2, 3, 6, 4)]:
        stats.on_engine_stats(
            engine_stats(
                prefix_cache_store="host", kv_host_blocks=held, kv_host_bytes=100 * held,
                kv_host_budget_bytes=400, kv_host_offloaded_bytes_total=100 * offloaded,
                kv_host_restored_bytes_total=100 * restored, kv_host_dropped_bytes_total=100,
                kv_host_transfer_time_s_total=0.25,
            )
        )  # fmt: skip
    snapshot = stats.snapshot()
    assert snapshot["kv_host"] == {
        "blocks": 3, "bytes": 300, "budget_bytes": 400, "offloaded_bytes": 600, "restored_bytes": 400,
        "dropped_bytes": 100, "transfer_time_s": 0.25,
    }  # fmt: skip
    assert snapshot["history"]["kv_host_offloaded_bytes_per_s"] == [[30, 500], [31, 100]]
    assert snapshot["history"]["kv_host_restored_bytes_per_s"] == [[30, 100], [31, 300]]
