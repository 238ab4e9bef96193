"""GET /v1/stats on a real server: after a few requests (two sharing a prefix, one whose client
hangs up) each finished request has its record, and the record's numbers are the ones its
client got (usage, cached tokens, finish reason; time to first token within what the client
waited); the totals and the 1 Hz histories account for them."""

import time

import httpx
import pytest

PREFIX = "The history of the city begins with a small harbour, a market and a bridge over the river. " * 4


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(max_batch_size=4, use_chunked_prefill=True, use_prefix_caching=True)


def stats(server) -> dict:
    response = httpx.get(f"{server.base_url}/v1/stats", timeout=30.0)
    assert response.status_code == 200
    return response.json()


def wait_for_records(server, count: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = stats(server)
        if len(snapshot["requests"]) >= count or time.monotonic() > deadline:
            return snapshot
        time.sleep(0.05)


def test_each_finished_request_has_the_record_its_client_saw(server):
    before = stats(server)
    answers = []
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        for ending in ("Its people", "Its bridges"):
            body = {"model": server.model, "prompt": PREFIX + ending, "max_tokens": 6, "temperature": 0}
            started = time.monotonic()
            response = client.post("/v1/completions", json=body)
            answers.append((response.json(), time.monotonic() - started))
        long_body = {"model": server.model, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as stream:
            events = (line for line in stream.iter_lines() if line.startswith("data:"))
            next(events), next(events)  # generating; then the client hangs up
    snapshot = wait_for_records(server, len(before["requests"]) + 3)
    records = {record["request_id"]: record for record in snapshot["requests"]}
    for answer, waited_s in answers:
        record = records[answer["id"]]
        usage = answer["usage"]
        assert record["prompt_tokens"] == usage["prompt_tokens"]
        assert record["completion_tokens"] == usage["completion_tokens"]
        assert record["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert record["finish_reason"] == answer["choices"][0]["finish_reason"]
        assert 0 < record["ttft_s"] <= waited_s
        assert record["decode_tokens_per_s"] > 0 and record["prefill_tokens_per_s"] > 0
    assert records[answers[1][0]["id"]]["cached_tokens"] > 0  # the second reused the first's prefix
    (cancelled,) = [r for r in snapshot["requests"][len(before["requests"]) :] if r["request_id"] not in
                    {answer["id"] for answer, _ in answers}]  # fmt: skip
    assert cancelled["finish_reason"] == "cancelled" and cancelled["completion_tokens"] >= 2

    new = snapshot["requests"][len(before["requests"]) :]
    totals, old_totals = snapshot["totals"], before["totals"]
    assert totals["requests"] - old_totals["requests"] == 3
    assert totals["disconnects"] - old_totals["disconnects"] == 1
    assert totals["generated_tokens"] - old_totals["generated_tokens"] == sum(
        r["completion_tokens"] for r in new
    )
    cached = sum(r["cached_tokens"] for r in new)
    assert totals["prompt_tokens_cached"] - old_totals["prompt_tokens_cached"] == cached
    history = snapshot["history"]
    assert sum(value for _, value in history["disconnects_per_s"]) == totals["disconnects"]
    assert max(value for _, value in history["requests_running"]) >= 1
    assert all(value > 0 for _, value in history["kv_total_bytes"])
    assert history["prefix_cache_budget_bytes"]  # a point per second the engine stepped
    seconds = [second for second, _ in history["requests_running"]]
    assert seconds == sorted(set(seconds))  # one point per second, in order


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_answer_that_became_tool_calls_is_recorded_as_tool_calls(server, stream):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    before = stats(server)
    answer = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=40,
        stream=stream,
    )
    if stream:
        chunks = list(answer)
        request_id, reason = (
            chunks[0].id,
            next(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason),
        )
    else:
        request_id, reason = answer.id, answer.choices[0].finish_reason
    assert reason == "tool_calls"
    snapshot = wait_for_records(server, len(before["requests"]) + 1)
    (record,) = [r for r in snapshot["requests"] if r["request_id"] == request_id]
    assert record["finish_reason"] == "tool_calls"
    assert snapshot["finish_reasons"]["tool_calls"] == before["finish_reasons"].get("tool_calls", 0) + 1


def test_stats_and_metrics_give_the_same_numbers(server):
    """The page's numbers and Prometheus's agree (read when idle, after the test above), parsed
    by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
        deadline = time.monotonic() + 30
        while (
            client.get("/v1/stats").json()["history"]["requests_running"][-1][1]
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        time.sleep(1.1)  # a second with nothing running, so the last gauge points read idle
        snapshot = client.get("/v1/stats").json()
        samples = {}
        for family in text_string_to_metric_families(client.get("/metrics").text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    totals = snapshot["totals"]
    assert totals["requests"] >= 3

    def metric(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    by_reason = {
        labels[0][1]: value for (name, labels), value in samples.items() if name == "infer_requests_total"
    }
    assert totals["requests"] == sum(by_reason.values())
    reasons = snapshot["finish_reasons"]
    assert reasons.get("cancelled", 0) == by_reason["abort"]
    # /metrics counts a tool-call answer by the engine's reason, and apart.
    answered = sum(reasons.get(reason, 0) for reason in ("stop", "length", "tool_calls"))
    assert answered == by_reason["stop"] + by_reason["length"]
    assert reasons.get("tool_calls", 0) == metric("infer_tool_call_answers_total")
    assert totals["disconnects"] == metric("infer_client_disconnects_total")
    assert totals["prompt_tokens_cached"] == metric("infer_prompt_tokens_cached_total")
    assert totals["prompt_tokens_prefilled"] == metric("infer_prompt_tokens_prefilled_total")
    assert totals["generated_tokens"] == metric("infer_generation_tokens_total")
    matches = snapshot["prefix_cache_matches"]
    assert sum(matches.values()) >= 3 and matches.get("lcp", 0) >= 1  # the second request parted mid-way
    for kind, count in matches.items():
        assert count == metric("infer_prefix_cache_matches_total", kind=kind)
    assert snapshot["history"]["kv_total_bytes"][-1][1] == metric("infer_kv_cache_total_bytes")
    assert snapshot["history"]["prefix_cache_bytes"][-1][1] == metric("infer_prefix_cache_used_bytes")


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["prefix_cache_off", "prefix_cache_on"])
def test_stats_and_metrics_count_every_prompt_token_the_tokenizer_counts(
    start_server, smollm2_loaded, prefix_caching
):
    """Prefilled plus cached prompt tokens are the prompts' tokens as transformers' tokenizer
    counts them, on /v1/stats and on /metrics alike, with the prefix cache off (all prefilled)
    and on (the second prompt's shared prefix cached)."""
    from prometheus_client.parser import text_string_to_metric_families
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_loaded.path)
    server = start_server(max_batch_size=2, use_chunked_prefill=True, use_prefix_caching=prefix_caching)
    prompts = [PREFIX + "Its people", PREFIX + "Its bridges"]
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        for prompt in prompts:  # one after the other: the second may reuse the first's blocks
            body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
        totals = wait_for_records(server, len(prompts))["totals"]
        metrics = {
            sample.name: sample.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            for sample in family.samples
        }
    num_prompt_tokens = sum(len(tokenizer(prompt)["input_ids"]) for prompt in prompts)
    cached, prefilled = totals["prompt_tokens_cached"], totals["prompt_tokens_prefilled"]
    assert cached + prefilled == num_prompt_tokens
    assert metrics["infer_prompt_tokens_prefilled_total"] == prefilled
    assert metrics["infer_prompt_tokens_cached_total"] == cached
    assert metrics["infer_prompt_tokens_total"] == num_prompt_tokens
    if prefix_caching:
        assert cached > 0
    else:
        assert cached == 0


def test_a_reader_sees_the_latest_step_while_the_engine_thread_holds_back(server, monkeypatch):
    """A busy engine's thread refreshes the gauges only every GAUGE_REFRESH_S; /metrics and
    /v1/stats refresh them on reading. With the period made endless, the thread's last refresh
    was taken idle, before the request below: only a refresh on reading shows it running."""
    from prometheus_client.parser import text_string_to_metric_families

    from infer.server import engine_loop

    monkeypatch.setattr(engine_loop, "GAUGE_REFRESH_S", float("inf"))
    body = {"model": server.model, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=120.0) as client,
        client.stream("POST", "/v1/completions", json=body) as stream,
    ):
        events = (line for line in stream.iter_lines() if line.startswith("data:"))
        next(events), next(events)  # generating
        running = {
            sample.name: sample.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            for sample in family.samples
        }["infer_requests_running"]
        history = client.get("/v1/stats").json()["history"]["requests_running"]
    assert running == 1
    assert history[-1][1] == 1
