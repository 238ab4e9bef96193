"""The metrics text is valid Prometheus exposition format: checked line by line against a strict
grammar written from the format's spec, and read back by prometheus_client's own parser."""

import math
import re
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from infer.engine.protocol import EngineStats
from infer.server.metrics import Counter, Gauge, Histogram, MetricRegistry, ServerMetrics

# --- the text format 0.0.4, from https://prometheus.io/docs/instrumenting/exposition_formats/
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
LABEL_VALUE = r'"(?:[^"\\\n]|\\\\|\\"|\\n)*"'  # only \\, \" and \n are escapes
VALUE = r"[+-]?(?:Inf|NaN|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
HELP_LINE = re.compile(rf"# HELP (?P<name>{NAME}) (?:[^\\\n]|\\\\|\\n)*")  # HELP escapes \\ and \n
TYPE_LINE = re.compile(rf"# TYPE (?P<name>{NAME}) (?P<kind>counter|gauge|histogram|summary|untyped)")
SAMPLE_LINE = re.compile(
    rf"(?P<name>{NAME})(?:\{{{LABEL}={LABEL_VALUE}(?:,{LABEL}={LABEL_VALUE})*\}})? {VALUE}"
)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def check_exposition(text: str) -> dict[str, str]:
    """Fail unless `text` follows the grammar: per family HELP, TYPE, then its samples, each family
    once; returns {family name: kind}."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    kinds: dict[str, str] = {}
    current = None
    for line in text[:-1].split("\n"):
        if help_match := HELP_LINE.fullmatch(line):
            current = help_match["name"]
            assert current not in kinds, f"family {current} appears twice"
        elif type_match := TYPE_LINE.fullmatch(line):
            assert type_match["name"] == current, f"TYPE for {type_match['name']} must follow its HELP"
            kinds[current] = type_match["kind"]
        else:
            sample = SAMPLE_LINE.fullmatch(line)
            assert sample, f"not a valid sample line: {line!r}"
            allowed = {current} | (
                {current + s for s in HISTOGRAM_SUFFIXES} if kinds[current] == "histogram" else set()
            )
            assert sample["name"] in allowed, f"sample {sample['name']} outside its family {current}"
    return kinds


def parse(text: str) -> dict[str, list]:
    """Sample name -> [(labels, value)], as prometheus_client reads the text."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_server_metric_set_has_the_issue_names_and_kinds():
    metrics = ServerMetrics()
    assert check_exposition(metrics.render()) == {
        "infer_requests_running": "gauge",
        "infer_requests_waiting": "gauge",
        "infer_queue_depth": "gauge",
        "infer_kv_cache_usage_ratio": "gauge",
        "infer_kv_cache_used_bytes": "gauge",
        "infer_kv_cache_total_bytes": "gauge",
        "infer_prefill_tokens_per_second": "gauge",
        "infer_decode_tokens_per_second": "gauge",
        "infer_decode_read_bytes_total": "counter",
        "infer_decode_seconds_total": "counter",
        "infer_copy_bandwidth_bytes_per_second": "gauge",
        "infer_tool_call_answers_total": "counter",
        "infer_requests_total": "counter",
        "infer_requests_by_status_total": "counter",
        "infer_client_disconnects_total": "counter",
        "infer_prompt_tokens_total": "counter",
        "infer_generation_tokens_total": "counter",
        "infer_prompt_tokens_cached_total": "counter",
        "infer_prompt_tokens_prefilled_total": "counter",
        "infer_prefix_cache_matches_total": "counter",
        "infer_prefix_cache_cached_tokens": "histogram",
        "infer_prefix_cache_cached_ratio": "histogram",
        "infer_prefix_cache_used_bytes": "gauge",
        "infer_prefix_cache_budget_bytes": "gauge",
        "infer_prefix_cache_blocks": "gauge",
        "infer_prefix_cache_entries": "gauge",
        "infer_prefix_cache_evictions_total": "counter",
        "infer_prefix_cache_evicted_bytes_total": "counter",
        "infer_prefix_cache_quantized_bytes": "gauge",
        "infer_prefix_cache_quantized_blocks_total": "counter",
        "infer_prefix_cache_restored_blocks_total": "counter",
        "infer_prefix_cache_shadow_runs_total": "counter",
        "infer_prefix_cache_shadow_divergences_total": "counter",
        "infer_time_to_first_token_seconds": "histogram",
        "infer_inter_token_latency_seconds": "histogram",
        "infer_request_queue_time_seconds": "histogram",
        "infer_request_latency_seconds": "histogram",
    }


def test_updates_read_back_through_prometheus_client():
    metrics = ServerMetrics()
    metrics.requests_running.set(3)
    metrics.requests_waiting.inc(5)
    metrics.requests_waiting.dec(2)
    metrics.kv_cache_usage_ratio.set(0.375)
    metrics.kv_cache_total_bytes.set(2**34)
    metrics.requests_total.inc(finish_reason="stop")
    metrics.requests_total.inc(2, finish_reason="length")
    metrics.requests_by_status_total.inc(status="200")
    metrics.requests_by_status_total.inc(status="422")
    metrics.generation_tokens_total.inc(1234)
    samples = parse(metrics.render())
    assert samples["infer_requests_running"] == [({}, 3.0)]
    assert samples["infer_requests_waiting"] == [({}, 3.0)]
    assert samples["infer_kv_cache_usage_ratio"] == [({}, 0.375)]
    assert samples["infer_kv_cache_total_bytes"] == [({}, float(2**34))]
    assert dict((labels["finish_reason"], v) for labels, v in samples["infer_requests_total"]) == {
        "stop": 1.0,
        "length": 2.0,
        "abort": 0.0,  # known reasons are shown from the start, so rate() has a first sample
    }
    assert sorted((labels["status"], v) for labels, v in samples["infer_requests_by_status_total"]) == [
        ("200", 1.0),
        ("422", 1.0),
    ]
    assert samples["infer_generation_tokens_total"] == [({}, 1234.0)]
    assert samples["infer_prompt_tokens_cached_total"] == [({}, 0.0)]


SPEC_DECODE_METRICS = {
    "infer_spec_decode_drafts_total": "counter",
    "infer_spec_decode_draft_tokens_total": "counter",
    "infer_spec_decode_accepted_tokens_total": "counter",
    "infer_spec_decode_accepted_tokens_per_pos_total": "counter",
    "infer_spec_decode_draft_tokens_per_pos_total": "counter",
}


def test_spec_decode_metrics_exist_only_once_enabled_with_a_sample_per_position():
    """As vLLM's: registered only when the engine speculates, each position 0 to K - 1 shown from
    the start; the core's totals (EngineStats) read back through prometheus_client."""
    metrics = ServerMetrics()
    assert not set(SPEC_DECODE_METRICS) & set(check_exposition(metrics.render()))
    metrics.enable_spec_decode(num_speculative_tokens=3)
    kinds = check_exposition(metrics.render())
    assert {name: kinds[name] for name in SPEC_DECODE_METRICS} == SPEC_DECODE_METRICS
    per_pos = parse(metrics.render())["infer_spec_decode_accepted_tokens_per_pos_total"]
    assert per_pos == [({"position": "0"}, 0.0), ({"position": "1"}, 0.0), ({"position": "2"}, 0.0)]
    stats = EngineStats(
        *[0] * 16, spec_decode_num_speculative_tokens=3, spec_decode_num_verified_rows=10,
        spec_decode_num_draft_tokens=24, spec_decode_num_accepted_tokens=13,
        spec_decode_accepted_by_position=(7, 4, 2), spec_decode_drafted_by_position=(10, 8, 6),
    )  # fmt: skip
    metrics.update_spec_decode(stats)
    samples = parse(metrics.render())
    assert samples["infer_spec_decode_drafts_total"] == [({}, 10.0)]
    assert samples["infer_spec_decode_draft_tokens_total"] == [({}, 24.0)]
    assert samples["infer_spec_decode_accepted_tokens_total"] == [({}, 13.0)]
    by_position = {
        name: {labels["position"]: value for labels, value in samples[name]}
        for name in (
            "infer_spec_decode_accepted_tokens_per_pos_total",
            "infer_spec_decode_draft_tokens_per_pos_total",
        )
    }
    assert by_position == {
        "infer_spec_decode_accepted_tokens_per_pos_total": {"0": 7.0, "1": 4.0, "2": 2.0},
        "infer_spec_decode_draft_tokens_per_pos_total": {"0": 10.0, "1": 8.0, "2": 6.0},
    }


KV_HOST_METRICS = {
    "infer_kv_host_cache_bytes": "gauge",
    "infer_kv_host_cache_budget_bytes": "gauge",
    "infer_kv_host_offloaded_bytes_total": "counter",
    "infer_kv_host_restored_bytes_total": "counter",
    "infer_kv_host_dropped_bytes_total": "counter",
    "infer_kv_host_transfer_seconds_total": "counter",
}


def test_kv_host_metrics_exist_only_once_enabled_and_mirror_the_cores_figures():
    metrics = ServerMetrics()
    assert not set(KV_HOST_METRICS) & set(check_exposition(metrics.render()))
    metrics.enable_kv_host()
    kinds = check_exposition(metrics.render())
    assert {name: kinds[name] for name in KV_HOST_METRICS} == KV_HOST_METRICS
    stats = EngineStats(
        *[0] * 16, prefix_cache_store="host", kv_host_blocks=3, kv_host_bytes=3072,
        kv_host_budget_bytes=8192, kv_host_offloaded_bytes_total=5120, kv_host_restored_bytes_total=2048,
        kv_host_dropped_bytes_total=1024, kv_host_transfer_time_s_total=0.125,
    )  # fmt: skip
    metrics.update_kv_host(stats)
    samples = parse(metrics.render())
    assert {name: samples[name] for name in KV_HOST_METRICS} == {
        "infer_kv_host_cache_bytes": [({}, 3072.0)],
        "infer_kv_host_cache_budget_bytes": [({}, 8192.0)],
        "infer_kv_host_offloaded_bytes_total": [({}, 5120.0)],
        "infer_kv_host_restored_bytes_total": [({}, 2048.0)],
        "infer_kv_host_dropped_bytes_total": [({}, 1024.0)],
        "infer_kv_host_transfer_seconds_total": [({}, 0.125)],
    }


def test_a_mirrored_total_may_only_go_up():
    metrics = ServerMetrics()
    metrics.prefix_cache_matches_total.set_total(3, kind="lcp")
    metrics.prefix_cache_matches_total.set_total(3, kind="lcp")
    with pytest.raises(ValueError, match="only goes up"):
        metrics.prefix_cache_matches_total.set_total(2, kind="lcp")
    assert metrics.prefix_cache_matches_total.value(kind="lcp") == 3.0


@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False) | st.sampled_from([0.01, 0.1, 1.0])))
def test_histogram_counts_match_brute_force(observations):
    registry = MetricRegistry()
    histogram = registry.histogram("latency_seconds", "Latency.", [0.01, 0.1, 1.0, 10.0])
    for value in observations:
        histogram.observe(value)
    text = registry.render()
    check_exposition(text)
    samples = parse(text)
    buckets = [(labels["le"], value) for labels, value in samples["latency_seconds_bucket"]]
    # `le` means "less than or equal"; buckets are cumulative and end at +Inf.
    expected = [
        (le, float(sum(v <= float(le) for v in observations))) for le in ["0.01", "0.1", "1.0", "10.0"]
    ]
    assert buckets == [*expected, ("+Inf", float(len(observations)))]
    assert samples["latency_seconds_count"] == [({}, float(len(observations)))]
    assert math.isclose(
        samples["latency_seconds_sum"][0][1], math.fsum(observations), rel_tol=1e-9, abs_tol=1e-9
    )


@given(st.text(alphabet=st.characters(exclude_categories=["Cs"])))
def test_label_values_escape_and_round_trip(value):
    registry = MetricRegistry()
    registry.counter("events_total", "Events.", ["source"]).inc(source=value)
    text = registry.render()
    check_exposition(text)
    assert parse(text)["events_total"] == [({"source": value}, 1.0)]


def test_the_three_label_escapes():
    registry = MetricRegistry()
    registry.gauge("g", "G.", ["path"]).set(1, path='C:\\dir\n"x"')
    assert 'g{path="C:\\\\dir\\n\\"x\\""} 1.0' in registry.render().splitlines()


# prometheus_client drops whitespace around the HELP text, so the oracle can only judge text without it.
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"])).map(str.strip))
def test_help_text_escapes_and_round_trips(help_text):
    registry = MetricRegistry()
    registry.gauge("g", help_text)
    text = registry.render()
    check_exposition(text)
    [family] = text_string_to_metric_families(text)
    assert family.documentation == help_text


@pytest.mark.parametrize(("value", "written"), [(math.inf, "+Inf"), (-math.inf, "-Inf"), (1e-5, "1e-05")])
def test_special_values(value, written):
    registry = MetricRegistry()
    registry.gauge("g", "G.").set(value)
    text = registry.render()
    check_exposition(text)
    assert text.splitlines()[-1] == f"g {written}"
    assert parse(text)["g"] == [({}, value)]


def test_nan_is_written_as_NaN():
    registry = MetricRegistry()
    registry.gauge("g", "G.").set(math.nan)
    text = registry.render()
    check_exposition(text)
    assert math.isnan(parse(text)["g"][0][1])


def test_concurrent_increments_are_not_lost():
    counter = Counter("hits_total", "Hits.", ["worker"])

    def work():
        for _ in range(20_000):
            counter.inc(worker="a")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counter.value(worker="a") == 80_000


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda: Counter("hits", "Hits."), "must end in _total"),
        (lambda: Gauge("bad-name", "x"), "metric name"),
        (lambda: Gauge("g", "x", ["__reserved"]), "label name"),
        (lambda: Histogram("h", "x", [1.0, 0.5]), "strictly increasing"),
        (lambda: Counter("hits_total", "Hits.").inc(-1), "only goes up"),
        (lambda: Counter("hits_total", "Hits.", ["worker"]).inc(), "takes labels ['worker']"),
        (lambda: Gauge("g", "x").set(1, worker="a"), "takes labels []"),
    ],
)
def test_misuse_is_refused_with_the_rule(build, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        build()


def test_a_name_registers_once():
    registry = MetricRegistry()
    registry.gauge("g", "G.")
    with pytest.raises(ValueError, match="already registered"):
        registry.gauge("g", "Again.")


def test_several_models_render_each_family_once_with_a_model_label():
    """render_by_model: valid exposition, read back by prometheus_client, each model's samples
    under its `model` label, the shared HTTP status counter once and unlabelled."""
    from infer.server.metrics import render_by_model

    server = ServerMetrics()
    by_model = {name: ServerMetrics(requests_by_status=server.requests_by_status_total) for name in "ab"}
    by_model["a"].generation_tokens_total.inc(3)
    by_model["b"].generation_tokens_total.inc(5)
    by_model["b"].enable_vision()  # a family only one model has
    server.requests_by_status_total.inc(status="200")
    text = render_by_model(server, by_model)
    check_exposition(text)
    samples = parse(text)
    assert samples["infer_generation_tokens_total"] == [({"model": "a"}, 3.0), ({"model": "b"}, 5.0)]
    assert samples["infer_requests_by_status_total"] == [({"status": "200"}, 1.0)]
    assert samples["infer_vision_encoder_runs_total"] == [({"model": "b"}, 0.0)]
    histogram_counts = samples["infer_time_to_first_token_seconds_count"]
    assert sorted(labels["model"] for labels, _ in histogram_counts) == ["a", "b"]


def test_a_mirrored_counter_counts_on_across_an_engine_restart():
    """A model loaded again: its new engine's totals start at 0, the counter goes on from where
    the last engine left it, and the gauges read 0 while no engine runs."""
    metrics = ServerMetrics()
    metrics.decode_read_bytes_total.set_total(100)
    metrics.requests_running.set(2)
    metrics.engine_stopped()
    assert metrics.requests_running.value() == 0
    metrics.engine_restarted()
    metrics.decode_read_bytes_total.set_total(30)
    assert metrics.decode_read_bytes_total.value() == 130
    metrics.enable_vision()
    metrics.enable_vision()  # once per load: registered once
    check_exposition(metrics.render())
