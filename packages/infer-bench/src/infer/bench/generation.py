"""`infer bench generate`: one request, timed. Reports prefill and decode tokens/s and the peak
memory split, with `--compare-hf` also transformers' eager `generate` on the same prompt and the
same number of new tokens in the same run. Two workloads (`--workload`):
- random (W1): a seeded random 256-token prompt and 256 greedy tokens with EOS ignored;
- copy: one chat turn, rendered by the model's template, asking to repeat a ~300-token passage
  with one change (infer.bench.copy_workload); greedy, up to 400 tokens, ending at EOS. Most of
  the answer already occurs in the prompt: the workload of prompt-lookup speculation.

Timing: prefill is the wall time to the first token (one forward over the prompt plus one
sample); decode is the time for the remaining tokens. Each step reads its token back to the
host, which synchronises the device, so wall time is device time.

Speculative decoding (`--speculative-config`, as `infer serve` takes it): beside tok/s, each
run's acceptance rate and mean accepted length, from the engine's counters before and after it
(infer.bench.spec_decode); a verifying step emits several tokens, and decode tok/s counts each.

Roofline: a decode step must read every weight once and the sequence's K/V
(infer.engine.roofline); over the copy bandwidth the engine measured in this process, the mean
bytes of the run's decode steps give the fastest decode the device's memory allows, and decode
tokens/s are reported as a % of it (transformers' too, on the same bytes).

Memory: on CUDA, weights and KV are tensor sizes and `other` is torch.cuda.max_memory_allocated
during the timed runs minus both. On CPU, `other` is the growth of the peak resident set (VmHWM,
reset before the runs) over the resident set at their start, when weights and KV are already
resident: activations, logits and allocator slack.
"""

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from infer.bench.copy_workload import MAX_TOKENS as COPY_MAX_TOKENS
from infer.bench.copy_workload import copy_request_text, expected_copy
from infer.bench.spec_decode import spec_decode_from_engine_stats, spec_decode_line
from infer.engine import load_engine
from infer.engine.cli import encode_prompt, engine_config_from_args, resolve_device_and_dtype
from infer.engine.config import AUTO_FLAGS
from infer.engine.engine import Engine
from infer.engine.generate import generate, stream
from infer.engine.memory import resident_bytes, weights_bytes
from infer.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationTiming:
    prefill_s: float
    decode_s: float
    num_prompt_tokens: int
    num_generated: int
    # What speculative decoding did in the run (infer.bench.spec_decode); None: it was off.
    spec_decode: dict | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes out of the prefill; decode produced the rest.
        return (self.num_generated - 1) / self.decode_s if self.num_generated > 1 else float("nan")

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "total_s": self.total_s,
        }


def run_bench_generate(args: argparse.Namespace) -> int:
    device, dtype = resolve_device_and_dtype(args)
    runtime_rss = resident_bytes()
    loaded, engine = load_engine(engine_config_from_args(args))
    workload, prompt_ids, params = workload_request(args, loaded)

    # Warm-up: first-call costs (allocator, kernel compilation); graphs were captured at start-up.
    generate(engine, prompt_ids, params, cache_salt="warm-up")
    probe = PeakMemoryProbe(device)
    runs, token_ids = [], []
    for run in range(args.repeats):
        # A salt per run: the prefix cache (on by default on CUDA) must not serve the prompt
        # that the run before computed, or prefill would be timed as a cache hit.
        timing, token_ids = time_generation(engine, prompt_ids, params, cache_salt=f"run-{run}")
        runs.append(timing)
    memory = memory_split(loaded.model, engine, probe.finish(), device)
    ours = median_timing(runs)
    roofline = decode_roofline(engine, len(prompt_ids), ours.num_generated)

    report = {
        "workload": workload,
        "environment": environment(device),
        "model": {"path": str(loaded.path), "revision": model_revision(loaded.path), "dtype": str(dtype)},
        "flags": {key: value for key, value in vars(args).items() if key != "run"},
        "infer": {
            **ours.as_dict(),
            "kv_cache_backend": engine.config.kv_cache_backend,
            # As the engine runs them: the flags' auto settings decided for the device.
            **{
                name: getattr(engine.config, name)
                for name in (*AUTO_FLAGS, "use_native_cpu_kernels", "use_huge_pages", "max_batch_size")
            },
            "settings": engine.settings_line,
            "runs": [r.as_dict() for r in runs],
        },
        "memory": {**memory, "runtime_rss_bytes_before_load": runtime_rss if device.type == "cpu" else None},
        "roofline": {
            **roofline,
            "infer_percent": 100 * ours.decode_tokens_per_s / roofline["decode_tokens_per_s"],
        },
    }
    if args.workload == "copy":
        output_text = loaded.tokenizer.decode(token_ids, skip_special_tokens=True)
        report["copy"] = {"output_text": output_text, "exact_copy": output_text.strip() == expected_copy()}
    if args.compare_hf:
        del engine
        hf_timing, hf_token_ids = time_hf_generate(
            loaded.path, prompt_ids, len(token_ids), device, dtype, args.repeats
        )
        report["transformers"] = {**hf_timing.as_dict(), "attn_implementation": "eager"}
        report["ratio_infer_over_transformers"] = {
            "prefill_tokens_per_s": ours.prefill_tokens_per_s / hf_timing.prefill_tokens_per_s,
            "decode_tokens_per_s": ours.decode_tokens_per_s / hf_timing.decode_tokens_per_s,
            "total_speedup": hf_timing.total_s / ours.total_s,
        }
        report["greedy_tokens_match_transformers"] = first_mismatch(token_ids, hf_token_ids)
        report["roofline"]["transformers_percent"] = (
            100 * hf_timing.decode_tokens_per_s / roofline["decode_tokens_per_s"]
        )
    print(markdown_report(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json_path}", file=sys.stderr)
    return 0


def workload_request(args: argparse.Namespace, loaded) -> tuple[str, list[int], SamplingParams]:
    """The workload's description, prompt ids and sampling parameters."""
    if args.workload == "copy":
        prompt_ids = encode_prompt(loaded, copy_request_text(), chat=True)
        params = SamplingParams(temperature=0, max_new_tokens=args.gen_tokens or COPY_MAX_TOKENS)
        return "copy: a chat turn repeating a ~300-token passage with one change, greedy", prompt_ids, params
    prompt_ids = random_prompt(loaded, args.prompt_tokens, seed=args.seed)
    params = SamplingParams(temperature=0, max_new_tokens=args.gen_tokens or 256, ignore_eos=True)
    return "W1: one request, seeded random prompt, greedy, ignore_eos", prompt_ids, params


def decode_roofline(engine: Engine, num_prompt_tokens: int, num_generated: int) -> dict:
    """The fastest decode the device's memory allows for this run: the copy bandwidth over the
    mean bytes of its decode steps (the k-th reads the weights and prompt + k tokens of K/V)."""
    traffic, bandwidth = engine.core.decode_traffic, engine.core.copy_bandwidth
    steps = range(1, max(num_generated, 2))
    bytes_per_token = sum(traffic.step_bytes([num_prompt_tokens + k]) for k in steps) / len(steps)
    return {
        "bytes_per_decode_token": bytes_per_token,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "decode_tokens_per_s": bandwidth / bytes_per_token,
    }


def random_prompt(loaded, num_tokens: int, *, seed: int) -> list[int]:
    """Seeded uniform token ids below the tokenizer's vocabulary (so every id decodes)."""
    vocab_size = min(loaded.config.vocab_size, loaded.tokenizer.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def time_generation(
    engine: Engine, prompt_ids: list[int], params: SamplingParams, *, cache_salt: str | None = None
) -> tuple[GenerationTiming, list[int]]:
    _synchronize(engine.core.device)
    before = engine.stats()
    start = time.perf_counter()
    chunks = stream(engine, prompt_ids, params, cache_salt=cache_salt)
    token_ids = [next(chunks).token_id]
    first_token_at = time.perf_counter()
    token_ids += [chunk.token_id for chunk in chunks]
    end = time.perf_counter()
    spec_decode = spec_decode_from_engine_stats(before, engine.stats())
    return GenerationTiming(
        first_token_at - start, end - first_token_at, len(prompt_ids), len(token_ids), spec_decode
    ), token_ids


def time_hf_generate(
    folder: Path, prompt_ids: list[int], num_new: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> tuple[GenerationTiming, list[int]]:
    """transformers' eager greedy generate: time to 1 new token (prefill), then to `num_new` tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = (
        AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
        .to(device)
        .eval()
    )
    input_ids = torch.tensor([prompt_ids], device=device)

    def generate(ids: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
        config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        _synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        _synchronize(device)
        return time.perf_counter() - start, out[0, ids.shape[1] :]

    generate(input_ids[:, :16], 4)
    runs, new_ids = [], None
    for _ in range(repeats):
        prefill_s, _ = generate(input_ids, 1)
        total_s, new_ids = generate(input_ids, num_new)
        runs.append(GenerationTiming(prefill_s, total_s - prefill_s, len(prompt_ids), num_new))
    return median_timing(runs), new_ids.tolist()


def median_timing(runs: list[GenerationTiming]) -> GenerationTiming:
    """The run with the median total time (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda run: run.total_s)
    return ordered[(len(ordered) - 1) // 2]


def first_mismatch(ours: list[int], theirs: list[int]) -> dict:
    length = min(len(ours), len(theirs))
    mismatch = next((i for i in range(length) if ours[i] != theirs[i]), None)
    return {"match": mismatch is None and len(ours) == len(theirs), "first_mismatch_index": mismatch}


class PeakMemoryProbe:
    """Peak memory from now on: CUDA allocator peak, or the process's peak resident set (VmHWM)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.start_bytes = torch.cuda.memory_allocated(device)
        else:
            _reset_peak_rss()
            self.start_bytes = resident_bytes()

    def finish(self) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = peak_resident_bytes()
        return {"start_bytes": self.start_bytes, "peak_bytes": peak}


def memory_split(model: torch.nn.Module, engine: Engine, probe: dict, device) -> dict:
    weights = weights_bytes(model)
    kv = engine.core.kv_pool.kv_bytes
    if device.type == "cuda":
        method = "torch.cuda.max_memory_allocated; other = peak - weights - KV"
        other = probe["peak_bytes"] - weights - kv
    else:
        method = "VmHWM reset before the timed runs; other = peak RSS - RSS at their start"
        other = probe["peak_bytes"] - probe["start_bytes"]
    return {"weights_bytes": weights, "kv_bytes": kv, "other_bytes": other, **probe, "method": method}


def peak_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device) -> dict:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {
        "device": f"{device.type}: {name}",
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def model_revision(folder: Path) -> str | None:
    """Where `infer models fetch` got the folder from (package and GGUF sha256), if it did."""
    from infer.models.loader.manifest import read_manifest

    manifest = read_manifest(folder)
    if manifest is None:
        return None
    source = manifest.get("source", {})
    packages = ", ".join(source.get("packages", []))
    return f"{packages} {source.get('gguf_file', '')} sha256:{source.get('gguf_sha256', '?')[:16]}".strip()


def markdown_report(report: dict) -> str:
    env, model, mem = report["environment"], report["model"], report["memory"]
    flags = " ".join(f"{key}={value}" for key, value in report["flags"].items())
    workload_name = report["workload"].split(":")[0]
    lines = [
        f"{workload_name} on {env['device']} ({env['torch_threads']} threads), torch {env['torch']}, "
        f"transformers {env['transformers']}",
        f"model {model['path']} (revision {model['revision']}), {model['dtype']}",
        f"flags: {flags}",
        f"engine: {report['infer']['settings']}",
        "",
        "| engine | KV pool | prompt | generated | prefill s | prefill tok/s | decode tok/s | total s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        _timing_row(
            ", ".join(
                ["infer"]
                + ["CUDA graphs"] * report["infer"]["use_cuda_graphs"]
                + ["async scheduling"] * report["infer"].get("async_scheduling", False)
                + ["PDL"] * report["infer"].get("use_pdl", False)
                + ["Triton GEMV"] * report["infer"].get("use_triton_gemv", False)
            ),
            report["infer"]["kv_cache_backend"],
            report["infer"],
        ),
    ]
    if "transformers" in report:
        lines.append(_timing_row("transformers eager generate", "yes (DynamicCache)", report["transformers"]))
        ratio = report["ratio_infer_over_transformers"]
        match = report["greedy_tokens_match_transformers"]
        lines += [
            "",
            f"infer / transformers: prefill {ratio['prefill_tokens_per_s']:.2f}x, decode "
            f"{ratio['decode_tokens_per_s']:.2f}x, end to end {ratio['total_speedup']:.2f}x faster; "
            f"greedy tokens identical: {match['match']} (first mismatch at {match['first_mismatch_index']})",
        ]
    if report["infer"].get("spec_decode"):
        lines += ["", spec_decode_line(report["infer"]["spec_decode"])]
    if "copy" in report:
        lines += ["", f"the answer is the passage with the change exactly: {report['copy']['exact_copy']}"]
    roofline = report["roofline"]
    lines += [
        "",
        f"memory roofline: {roofline['bytes_per_decode_token'] / 1e6:.1f} MB read per decode token "
        f"(weights and K/V) over a copy bandwidth of {roofline['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
        f"measured in this process = {roofline['decode_tokens_per_s']:.1f} tok/s; infer decodes at "
        f"{roofline['infer_percent']:.1f}% of it"
        + (
            f", transformers at {roofline['transformers_percent']:.1f}%"
            if "transformers_percent" in roofline
            else ""
        )
        + (
            " (a speculating step emits several tokens for one read of the weights, so this may pass 100%)"
            if report["infer"].get("spec_decode")
            else ""
        ),
    ]
    mib = 1024 * 1024
    peak_kind = "allocated" if "cuda" in mem["method"] else "process RSS"
    lines += [
        "",
        "| memory | MiB |",
        "|---|---:|",
        f"| weights | {mem['weights_bytes'] / mib:.1f} |",
        f"| KV cache | {mem['kv_bytes'] / mib:.1f} |",
        f"| other (peak) | {mem['other_bytes'] / mib:.1f} |",
        f"| peak ({peak_kind}) | {mem['peak_bytes'] / mib:.1f} |",
        "",
        f"memory method: {mem['method']}",
    ]
    return "\n".join(lines)


def _timing_row(engine: str, kv: str, timing: dict) -> str:
    return (
        f"| {engine} | {kv} | {timing['num_prompt_tokens']} | {timing['num_generated']} | "
        f"{timing['prefill_s']:.3f} | {timing['prefill_tokens_per_s']:.1f} | "
        f"{timing['decode_tokens_per_s']:.1f} | {timing['total_s']:.2f} |"
    )
