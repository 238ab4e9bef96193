"""`infer serve` on two "hosts" that are processes of one machine, as a user deploys two hosts:
node 1 runs `infer serve --node-rank 1` (its tensor-parallel rank, no HTTP server), node 0
`infer serve --node-rank 0` schedules and serves. The oracle is the recompute oracle over the
checkpoint; SIGTERM on node 0 ends both with status 0."""

import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch

from conformance.oracles import RecomputeOracle
from infer.engine.sampling_params import SamplingParams
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint
from infer.models.tensor_parallel import free_local_port

from .test_app_drain import wait_for_health


@pytest.mark.slow
def test_a_two_node_server_answers_with_the_oracles_text_and_sigterm_stops_both(tmp_path):
    folder = make_random_checkpoint("qwen3-tiny", tmp_path / "qwen3-tiny", dtype=torch.float32)
    port = free_local_port()
    base_url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "infer.server.cli", "serve", "--model", str(folder)]
    serve += ["--log-level", "warning"]
    serve += ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(free_local_port())]
    serve += ["--max-seq-len", "128", "--max-batch-size", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    node1 = subprocess.Popen([*serve, "--node-rank", "1"], env=env)
    node0 = subprocess.Popen([*serve, "--node-rank", "0", "--port", str(port)], env=env)
    try:
        wait_for_health(base_url, 200, timeout_s=120)
        (model,) = httpx.get(base_url + "/v1/models").json()["data"]
        prompt = [5, 17, 33, 240, 7, 99, 3, 150]
        body = {"model": model["id"], "prompt": prompt, "max_tokens": 10, "temperature": 0}
        body["ignore_eos"] = True
        answer = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()
        params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
        oracle = RecomputeOracle(load_model(folder, dtype=torch.float32))
        assert answer["choices"][0]["text"] == oracle.generate(prompt, params).text
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=60) == 0
        assert node1.wait(timeout=60) == 0  # node 0's shutdown stopped its rank
    finally:
        for process in (node0, node1):
            if process.poll() is None:
                process.kill()
                process.wait()
