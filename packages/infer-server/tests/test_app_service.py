"""GET /health, /v1/models and /metrics on a real server; /metrics read by prometheus_client's
own parser (the independent oracle for the exposition format)."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

from infer.server.metrics import CONTENT_TYPE


def scrape(server) -> dict[str, float]:
    """Every sample of GET /metrics, keyed `name` or `name{label="value"}`."""
    response = httpx.get(server.base_url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_health_is_ok_once_the_model_is_loaded(server):
    response = httpx.get(server.base_url + "/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_models_lists_the_served_model_with_its_context_length(server):
    body = server.openai_client().models.list()
    assert [(model.id, model.object) for model in body.data] == [(server.model, "model")]
    assert body.data[0].model_extra["max_model_len"] == server.engine.max_seq_len


def test_one_completion_moves_the_counters_by_its_usage(server):
    before = scrape(server)
    answer = server.openai_client().completions.create(
        model=server.model, prompt="Hello there", max_tokens=5, temperature=0
    )
    after = scrape(server)
    assert (
        after["infer_prompt_tokens_total"] - before["infer_prompt_tokens_total"] == answer.usage.prompt_tokens
    )
    generated = after["infer_generation_tokens_total"] - before["infer_generation_tokens_total"]
    assert generated == answer.usage.completion_tokens
    reason = f'infer_requests_total{{finish_reason="{answer.choices[0].finish_reason}"}}'
    assert after[reason] - before[reason] == 1
    assert after['infer_requests_by_status_total{status="200"}'] > before.get(
        'infer_requests_by_status_total{status="200"}', 0
    )
    # One time-to-first-token per request, one inter-token gap per further token.
    assert (
        after["infer_time_to_first_token_seconds_count"] - before["infer_time_to_first_token_seconds_count"]
        == 1
    )
    queued = (
        after["infer_request_queue_time_seconds_count"] - before["infer_request_queue_time_seconds_count"]
    )
    assert queued == 1
    itl = after["infer_inter_token_latency_seconds_count"] - before["infer_inter_token_latency_seconds_count"]
    assert itl == answer.usage.completion_tokens - 1
    assert after["infer_request_latency_seconds_count"] - before["infer_request_latency_seconds_count"] == 1


def test_gauges_show_an_idle_engine_and_its_kv_pool(server):
    samples = scrape(server)
    assert samples["infer_requests_running"] == samples["infer_requests_waiting"] == 0
    assert samples["infer_kv_cache_usage_ratio"] == 0
    assert samples["infer_kv_cache_total_bytes"] == server.engine.core.kv_pool.kv_bytes


def test_every_connection_the_server_accepts_has_nagles_algorithm_off(server):
    # With Nagle's algorithm on, a small write waits until the one before it is acknowledged, and
    # clients delay ACKs by ~40 ms: a stream's token chunks after its headers, or a body after its
    # headers, came ~40 ms late on a kept-alive connection (uvicorn#3149: asyncio sets
    # TCP_NODELAY only on sockets whose proto is IPPROTO_TCP).
    import http.client
    import socket

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read()
        accepted = [
            protocol.transport.get_extra_info("socket") for protocol in server.server.server_state.connections
        ]
        assert accepted
        assert all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in accepted)
    finally:
        connection.close()
