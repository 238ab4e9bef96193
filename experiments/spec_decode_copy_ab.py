"""Does n-gram speculation speed up SmolLM2's decode on the copy workload (CPU)?

The copy workload of `infer bench generate --workload copy` (repeat a ~300-token passage with one
change), greedy, one request at a time, decoded by two engines over the same loaded model: one
without speculation and one with n-gram drafts of K tokens. They alternate, ROUNDS times each, in
one process; every round must give the same tokens.

    python experiments/spec_decode_copy_ab.py THREADS ROUNDS K
"""

import sys
import time

import torch

from infer.bench.copy_workload import copy_request_text
from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.cli import encode_prompt
from infer.models.load import load_model

threads, rounds, k = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
prompt = encode_prompt(loaded, copy_request_text(), chat=True)
params = SamplingParams(temperature=0, max_new_tokens=400)
spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
engines = {
    "off": Engine(EngineConfig(max_batch_size=1, device="cpu"), loaded_model=loaded),
    "ngram": Engine(
        EngineConfig(max_batch_size=1, device="cpu", speculative_config=spec), loaded_model=loaded
    ),
}
tokens = {}
for r in range(rounds):
    for name, engine in engines.items():
        engine.add_request(prompt, params)
        first = None
        start = time.perf_counter()
        out = []
        while engine.has_work():
            for o in engine.step():
                if o.token_id is not None:
                    out.append(o.token_id)
                    if first is None:
                        first = time.perf_counter()
        end = time.perf_counter()
        decode_tps = (len(out) - 1) / (end - first)
        tokens.setdefault(name, out)
        assert out == tokens[name]
        extra = ""
        if name == "ngram":
            c = engine.core.scheduler.spec_decode_counts
            extra = f" acceptance {c.acceptance_rate:.3f} mean accepted length {c.mean_accepted_length:.2f}"
        print(f"round {r} {name}: {len(out)} tokens, decode {decode_tps:.1f} tok/s{extra}", flush=True)
print("same greedy tokens:", tokens["off"] == tokens["ngram"])
