"""Does the data-parallel router keep a multi-turn conversation's turns where its history is
cached? W5 (multi-turn chat over one system prompt) through `infer serve` with one replica, two
replicas routed cache-aware (the default), and two routed round-robin, each run by `infer bench
serve`; the figure is the share of prompt tokens the server says its prefix cache served
(`usage.prompt_tokens_details.cached_tokens`) and the share of turns with any.

    python experiments/data_parallel_hit_rate.py [CONCURRENCY] [NUM_CONVERSATIONS] [EXTRA SERVE FLAGS...]

On a CPU each server runs the default model with OMP_NUM_THREADS=1 a process (the figure is a
routing property, not a speed).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from infer.models.tensor_parallel import free_local_port

concurrency = int(sys.argv[1]) if len(sys.argv) > 1 else 4
num_conversations = int(sys.argv[2]) if len(sys.argv) > 2 else 8
extra = sys.argv[3:]
CONFIGS = {
    "DP=1": [],
    "DP=2 cache_aware": ["--data-parallel-size", "2"],
    "DP=2 round_robin": ["--data-parallel-size", "2", "--data-parallel-routing", "round_robin"],
}
environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def serve(flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_local_port()
    command = [
        sys.executable,
        "-m",
        "infer.server.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    command += ["--use-prefix-caching", "--use-chunked-prefill", "--max-seq-len", "4096", *extra, *flags]
    process = subprocess.Popen(command, env=environment)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited while starting"
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return process, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not start")


print(f"W5, concurrency {concurrency}, {num_conversations} conversations, serve flags {extra}", flush=True)
results = {}
for name, flags in CONFIGS.items():
    process, base_url = serve(flags)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as report:
            bench = [sys.executable, "-m", "infer.bench.cli", "bench", "serve", "--base-url", base_url]
            bench += ["--workload", "W5", "--concurrency", str(concurrency)]
            bench += ["--num-requests", str(num_conversations), "--json", report.name, "--no-records"]
            subprocess.run(bench, check=True, env=environment, stdout=subprocess.DEVNULL)
            with open(report.name) as written:
                summary = json.load(written)
        stats = httpx.get(base_url + "/v1/stats").json()
    finally:
        process.terminate()
        process.wait(60)
    cache = summary["stats"]["prefix_cache"]
    finished = [r["requests_finished"] for r in stats["replicas"]] if stats.get("replicas") else None
    results[name] = cache
    print(
        json.dumps(
            {
                "config": name,
                "turns": summary["stats"].get("num_ok"),
                "hit_rate": round(cache["hit_rate"], 4),
                "cached_share": round(cache["cached_share"], 4),
                "cached_tokens": cache["cached_tokens"],
                "prompt_tokens": cache["prompt_tokens"],
                "finished_by_replica": finished,
            }
        ),
        flush=True,
    )
