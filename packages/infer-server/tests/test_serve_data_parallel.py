"""`infer serve --data-parallel-size 2` on the CPU, as a user runs it: two engine processes
behind one server. The official openai client holds a conversation whose second turn finds its
history in the prefix cache (the router sent it where the first turn ran); /v1/stats and
/metrics show each replica beside the sums; a replica killed with SIGKILL fails only itself
(/health stays 200 and the other answers), and the server exits 1 once both are gone."""

import os
import signal

import httpx
import openai
import pytest

from .test_engine_process import engine_children, start_infer_serve, wait_healthy, wait_until


def metric_value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} not in /metrics")


@pytest.fixture
def data_parallel_server():
    process, base_url = start_infer_serve(
        "--data-parallel-size", "2", "--max-seq-len", "1024", "--use-prefix-caching", "--use-chunked-prefill"
    )
    try:
        wait_healthy(process, base_url)
        yield process, base_url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_two_replicas_serve_a_conversation_from_one_replicas_cache_and_outlive_one_death(
    data_parallel_server,
):
    process, base_url = data_parallel_server
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 8},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    # Two requests in between: routing to the least busy alone (ties in turn) would send the
    # next turn to the other replica.
    for prompt in ("Unrelated: 1, 2, 3,", "Also unrelated: a, b,"):
        client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And two more?"},
    ]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16

    stats = httpx.get(base_url + "/v1/stats").json()
    replicas = stats["replicas"]
    assert [replica["alive"] for replica in replicas] == [True, True]
    assert sum(replica["requests_finished"] for replica in replicas) == 4
    assert min(replica["requests_finished"] for replica in replicas) >= 1  # both served
    metrics = httpx.get(base_url + "/metrics").text
    assert metric_value(metrics, 'infer_replica_up{replica="0"}') == 1
    assert metric_value(metrics, 'infer_replica_up{replica="1"}') == 1
    assert metric_value(metrics, "infer_replica_routed_by_prefix_total") >= 1

    first_replica, second_replica = engine_children(process.pid)
    os.kill(second_replica, signal.SIGKILL)
    wait_until(
        lambda: False in [r["alive"] for r in httpx.get(base_url + "/v1/stats").json()["replicas"]],
        what="the server to see the replica gone",
    )
    assert httpx.get(base_url + "/health").status_code == 200
    for _ in range(3):  # whichever replica each would have gone to, the one left answers
        answer = client.completions.create(model=model, prompt="Colours:", max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason == "length"
    metrics = httpx.get(base_url + "/metrics").text
    assert sorted(metric_value(metrics, f'infer_replica_up{{replica="{r}"}}') for r in "01") == [0, 1]

    os.kill(first_replica, signal.SIGKILL)
    assert process.wait(timeout=30) == 1
    stderr = process.stderr.read()
    assert "Traceback" not in stderr, stderr
    assert "every data-parallel replica failed" in stderr, stderr
