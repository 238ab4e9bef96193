"""200 requests from 32 concurrent clients on an 8-row server, mixed streaming and not, with
random early hang-ups: every request that was not hung up gets exactly one terminal event, the
server answers /health throughout, and afterwards no KV block, request or queue entry is left over."""

import asyncio
import json
import random
import time

import httpx
import pytest

NUM_REQUESTS = 200
NUM_CLIENTS = 32
HANG_UP_RATE = 0.2


@pytest.fixture(scope="module")
def server(start_server):
    running = start_server(max_batch_size=8)
    yield running
    running.stop()


@pytest.mark.slow
def test_many_clients_with_random_hang_ups_leave_nothing_behind(server):
    rng = random.Random(20261122)
    plans = [
        {
            "stream": rng.random() < 0.5,
            "chat": rng.random() < 0.3,
            "max_tokens": rng.randint(1, 16),
            "hang_up": rng.random() < HANG_UP_RATE,
            "hang_up_after_events": rng.randint(1, 3),
            "hang_up_after_s": rng.uniform(0.0, 0.5),
            "prompt": f"Number {rng.randint(0, 999)} is",
        }
        for index in range(NUM_REQUESTS)
    ]
    metrics = server.state.metrics
    disconnects_before = metrics.client_disconnects_total.value()
    results, health_statuses = asyncio.run(_run(server, plans))

    hung_up = [result for result in results if result == "hung up"]
    problems = [result for result in results if result not in ("ok", "hung up")]
    assert not problems, problems[:5]
    assert len(results) == NUM_REQUESTS
    assert health_statuses and set(health_statuses) == {200}, "/health must answer 200 under load"

    # The audit: nothing running, waiting or reserved; every handle handed back.
    deadline = time.monotonic() + 20
    engine = server.engine
    while engine.stats().num_running or engine.stats().num_waiting or server.state.engine_loop.num_live:
        assert time.monotonic() < deadline, f"not idle after the load: {engine.stats()}"
        time.sleep(0.05)
    assert engine.core.kv_pool.allocator.num_used == 0, "a KV block leaked"
    assert engine.core.kv_pool.allocator.audit([]) == []
    assert metrics.queue_depth.value() == 0
    # A hang-up after the answer was complete aborts nothing, so it is not counted.
    assert metrics.client_disconnects_total.value() - disconnects_before <= len(hung_up)


async def _run(server, plans):
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0, limits=limits) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for plan in plans:
            queue.put_nowait(plan)
        results: list[str] = []
        health_statuses: list[int] = []
        stop_polling = asyncio.Event()

        async def worker():
            while not queue.empty():
                results.append(await _one_request(client, server.model, queue.get_nowait()))

        async def poll_health():
            while not stop_polling.is_set():
                health_statuses.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.2)

        poller = asyncio.create_task(poll_health())
        await asyncio.gather(*(worker() for _ in range(NUM_CLIENTS)))
        stop_polling.set()
        await poller
    return results, health_statuses


async def _one_request(client: httpx.AsyncClient, model: str, plan: dict) -> str:
    """ "ok", "hung up", or what went wrong."""
    path = "/v1/chat/completions" if plan["chat"] else "/v1/completions"
    body = {"model": model, "max_tokens": plan["max_tokens"], "temperature": 0.7, "stream": plan["stream"]}
    if plan["chat"]:
        body["messages"] = [{"role": "user", "content": plan["prompt"]}]
    else:
        body["prompt"] = plan["prompt"]
    if plan["stream"]:
        return await _streamed(client, path, body, plan)
    try:
        timeout_s = plan["hang_up_after_s"] if plan["hang_up"] else None
        response = await asyncio.wait_for(client.post(path, json=body), timeout_s)
    except TimeoutError:
        return "hung up"
    if response.status_code != 200:
        return f"status {response.status_code}: {response.text[:200]}"
    answer = response.json()
    return _check_finish(answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"], plan)


async def _streamed(client: httpx.AsyncClient, path: str, body: dict, plan: dict) -> str:
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return f"status {response.status_code}"
        events = []
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if plan["hang_up"] and len(events) >= plan["hang_up_after_events"]:
                return "hung up"  # leaving the block closes the connection mid-stream
    if events[-1:] != ["[DONE]"] or events.count("[DONE]") != 1:
        return f"stream does not end with one [DONE]: {events[-2:]}"
    chunks = [json.loads(event) for event in events[:-1]]
    if any("error" in chunk for chunk in chunks):
        return f"error event: {chunks}"
    finishes = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    if len(finishes) != 1:
        return f"{len(finishes)} terminal chunks"
    return _check_finish(finishes[0], chunks[-1]["usage"]["completion_tokens"], plan)


def _check_finish(finish_reason: str, completion_tokens: int, plan: dict) -> str:
    if finish_reason not in ("stop", "length"):
        return f"finish_reason {finish_reason}"
    # "stop" may come at exactly max_tokens (an EOS as the last token); "length" only there.
    too_many = completion_tokens > plan["max_tokens"]
    if too_many or (finish_reason == "length" and completion_tokens != plan["max_tokens"]):
        return f"{completion_tokens} tokens, finish {finish_reason}, max_tokens {plan['max_tokens']}"
    return "ok"
