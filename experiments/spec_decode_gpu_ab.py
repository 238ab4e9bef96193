"""Speculative decoding on a GPU: what a draft model costs and earns against no speculation.

A target (llama-3.1-8b shapes in docs/benchmarks/speculative.md) decodes W1 (batch 1) and W2 at
16 and 64 through the engine alone (`infer bench engine-only`'s loop), greedy, with each engine
configuration in turn over the one loaded target:

    off           no speculation
    draft         a draft model (llama-3.2-1b shapes), K drafts, the automatic back-off on
    draft@G/M     the same with the back-off's probes spaced G-fold up to every M-th step
    draft-always  the same, min_acceptance_rate 0: it speculates on every step
    ngram         n-gram drafts (vLLM's defaults: lookup of 5 tokens), K drafts
    self          the target as its own draft (acceptance near 1), batch 1 only

Random weights give a draft whose drafts the target ~never keeps: what speculation costs when it
fails. `self` is set against the cost model: a round is K forwards of the draft (its catch-up
and K - 1 decode steps) and the target's one verifying forward, each about a decode step at
batch 1, and emits the mean accepted length; so it predicts
off tok/s x mean_accepted_length / (K + 1).

    python experiments/spec_decode_gpu_ab.py TARGET DRAFT [K] [CONFIGS] [MAX_BATCH_SIZE]

CONFIGS: comma-separated names, each optionally with its workloads (draft@4/128:W1+W2@64). Each run
also reports its engine steps split by whether speculation was involved (a step that verified
drafts or whose decision asked for drafts): their counts and mean times.
"""

import gc
import importlib
import json
import statistics
import sys
import time

import torch

from infer.bench.serving.engine_only import run_engine_only
from infer.bench.serving.workloads import make_workload
from infer.engine import Engine, EngineConfig
from infer.engine.spec_decode import SpeculationBackoff
from infer.engine.spec_decode import backoff as backoff_module
from infer.models.load import load_model

target_path, draft_path = sys.argv[1], sys.argv[2]
k = int(sys.argv[3]) if len(sys.argv) > 3 else 4
ALL = ["off", "draft", "draft-always", "ngram", "self", "off"]
# A name may pick its workloads: draft:W1+W2@64
configs = [entry.split(":") for entry in sys.argv[4].split(",")] if len(sys.argv) > 4 else [[n] for n in ALL]
runs = [(entry[0], entry[1].split("+") if len(entry) > 1 else None) for entry in configs]
max_batch_size = int(sys.argv[5]) if len(sys.argv) > 5 else 64
DEFAULT_SPACING = (backoff_module.GROWTH, backoff_module.MAX_INTERVAL)
device = "cuda" if torch.cuda.is_available() else "cpu"

SPECULATIVE = {
    "off": None,
    "draft": {"method": "draft_model", "model": draft_path, "num_speculative_tokens": k},
    "draft-always": {
        "method": "draft_model",
        "model": draft_path,
        "num_speculative_tokens": k,
        "min_acceptance_rate": 0,
    },
    "ngram": {"method": "ngram", "num_speculative_tokens": k},
    "self": {"method": "draft_model", "model": target_path, "num_speculative_tokens": k},
}
WORKLOADS = {
    "off": ["W1", "W2@16", "W2@64"],
    "draft": ["W1", "W2@16", "W2@64"],
    "draft-always": ["W1", "W2@64"],
    "ngram": ["W1", "W2@64"],
    "self": ["W1"],
}

loaded = load_model(target_path, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
vocab_size = loaded.config.vocab_size
print(
    f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
    f"K {k}, max_batch_size {max_batch_size}",
    flush=True,
)


def workload(label: str):
    if label == "W1":
        return make_workload("W1", num_requests=2, vocab_size=vocab_size)
    name, concurrency = label.split("@")
    return make_workload(name, concurrency=int(concurrency), vocab_size=vocab_size)


class trace_steps:
    """Times each engine step, split by whether a decision it scheduled involved speculation
    (drafts to verify, or drafts to make for the next step): where speculation's cost lands."""

    def __init__(self, engine):
        self.engine, self.scheduler = engine, engine.core.scheduler
        self.plain_s, self.spec_s = [], []
        self._involved = self._prefill = False
        self.prefill_s = []
        schedule, step = self.scheduler.schedule, engine.step

        def traced_schedule():
            decision = schedule()
            if self.scheduler.speculates_after(decision):
                self._involved = True
            if decision.num_prompt_tokens:
                self._prefill = True
            return decision

        def traced_step(*args, **kwargs):
            self._involved = self._prefill = False
            started = time.perf_counter()
            outputs = step(*args, **kwargs)
            elapsed = time.perf_counter() - started
            (self.spec_s if self._involved else self.plain_s).append(elapsed)
            if self._prefill and not self._involved:
                self.prefill_s.append(elapsed)
            return outputs

        self.scheduler.schedule, engine.step = traced_schedule, traced_step
        # The draft model's share: its proposals' time (each ends reading its drafts).
        self.draft = engine.core.runner.draft
        self.propose_s = []
        if self.draft is not None:
            propose = self.draft.propose

            def traced_propose(*args, **kwargs):
                started = time.perf_counter()
                proposals = propose(*args, **kwargs)
                self.propose_s.append(time.perf_counter() - started)
                return proposals

            self.draft.propose = traced_propose
        self.compiled = compiled_kernel_variants()

    def stop(self):
        del self.scheduler.schedule, self.engine.step
        if self.draft is not None:
            del self.draft.propose

    def summary(self) -> dict:
        def mean_ms(times):
            return round(1e3 * sum(times) / len(times), 3) if times else None

        return {
            "plain_steps": len(self.plain_s),
            "plain_ms": mean_ms(self.plain_s),
            "plain_median_ms": round(1e3 * statistics.median(self.plain_s), 3) if self.plain_s else None,
            "plain_prefill_steps": len(self.prefill_s),
            "plain_prefill_ms": mean_ms(self.prefill_s),
            "spec_steps": len(self.spec_s),
            "spec_ms": mean_ms(self.spec_s),
            "spec_total_ms": round(1e3 * sum(self.spec_s), 1),
            "spec_max_ms": round(1e3 * max(self.spec_s), 1) if self.spec_s else None,
            "proposals": len(self.propose_s),
            "propose_ms": mean_ms(self.propose_s),
            "kernels_compiled": sum(compiled_kernel_variants().values()) - sum(self.compiled.values()),
        }


def compiled_kernel_variants() -> dict[str, int]:
    """Compiled variants of each of infer.kernels' Triton kernels (a step that compiles one
    stalls for it)."""
    from triton.runtime.jit import JITFunction

    counts = {}
    for module_name in (
        "paged_attention",
        "store_kv",
        "rope",
        "rms_norm",
        "activation",
        "normed_gemv",
        "argmax",
        "qk_norm_rope",
    ):
        module = importlib.import_module(f"infer.kernels.{module_name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction):
                counts[f"{module_name}.{name}"] = sum(len(c[0]) for c in value.device_caches.values())
    return counts


results = []
for name, only in runs:
    started = time.perf_counter()
    # draft@4/128: the back-off's probes spaced 4-fold up to every 128th step
    base_name, _, spacing = name.partition("@")
    spacing = tuple(int(value) for value in spacing.split("/")) if spacing else DEFAULT_SPACING
    config = EngineConfig(
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_batch_size=max_batch_size,
        max_seq_len=min(2048, loaded.config.max_position_embeddings),
        speculative_config=SPECULATIVE[base_name],
    )
    backoff_module.GROWTH, backoff_module.MAX_INTERVAL = spacing
    engine = Engine(config, loaded_model=loaded)
    print(f"== {name}: built in {time.perf_counter() - started:.1f} s", flush=True)
    for label in only or WORKLOADS[base_name]:
        scheduler = engine.core.scheduler
        if (backoff := scheduler.speculation_backoff) is not None:  # each workload starts afresh
            scheduler.speculation_backoff = SpeculationBackoff(backoff.min_acceptance_rate)
        trace = trace_steps(engine)
        run = run_engine_only(engine, workload(label))
        trace.stop()
        spec = run.get("spec_decode")
        line = {
            "config": name,
            "workload": label,
            "tok_s": round(run["output_tokens_per_s"], 1),
            "tokens": run["output_tokens"],
            "steps": run["steps"],
            "ttft_p50_ms": round(run["ttft_p50_ms"], 1),
        }
        line |= trace.summary()
        if spec is not None:
            line |= {
                "acceptance": round(spec["acceptance_rate"], 3),
                "mean_accepted_length": round(spec["mean_accepted_length"], 2),
                "verified_rows": spec["verified_rows"],
            }
        print(json.dumps(line), flush=True)
        results.append(line)
    engine.shutdown()
    del engine, scheduler
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

by_key = {(line["config"], line["workload"]): line for line in results}
print("== against off (the first off run)")
for line in results:
    base = next((r for r in results if r["config"] == "off" and r["workload"] == line["workload"]), None)
    if base is None:
        continue
    print(f"{line['config']:>12} {line['workload']:>6} {line['tok_s'] / base['tok_s']:.3f}x")
if ("self", "W1") in by_key:
    self_run, off_run = by_key[("self", "W1")], by_key[("off", "W1")]
    predicted = off_run["tok_s"] * self_run["mean_accepted_length"] / (k + 1)
    print(f"self W1: measured {self_run['tok_s']} tok/s, cost model {predicted:.1f} tok/s")
