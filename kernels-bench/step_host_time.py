"""Host time of an engine step at N decoding rows: `Scheduler.schedule` alone, and the whole
`EngineCore.step` less the runner's forward (`ModelRunner._logits`), over steady decode steps.

Where the step's host work bounds a serving run (async scheduling at 64 rows of a small model:
docs/benchmarks/serving.md#host-time-a-step), these microseconds are the step's. They are the
engine's Python, the same on any device, so they can be measured on a CPU with a tiny model; the
minimum and the 10th percentile over the steps are what a busy machine disturbs least. Run it with
another tree first on PYTHONPATH to compare versions:

    python kernels-bench/step_host_time.py --model /tmp/ckpt/tiny-llama [--rows 64] [--steps 300]
"""

import argparse
import time

from infer.engine.config import EngineConfig
from infer.engine.engine_core import EngineCore
from infer.engine.protocol import EngineRequest
from infer.engine.runner import ModelRunner
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler

PROMPT_TOKENS = 40
WARM_UP_STEPS = 20


def timed(cls, name: str, sink: list[float]) -> None:
    """Wraps cls.name so that each call appends its seconds to `sink`."""
    method = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        result = method(self, *args, **kwargs)
        sink.append(time.perf_counter() - start)
        return result

    setattr(cls, name, wrapper)


def spread_us(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    at = lambda q: 1e6 * ordered[int(q * (len(ordered) - 1))]  # noqa: E731
    return f"min {at(0):.1f} us, p10 {at(0.1):.1f} us, median {at(0.5):.1f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    schedules, steps, forwards = [], [], []
    timed(Scheduler, "schedule", schedules)
    timed(EngineCore, "step", steps)
    timed(ModelRunner, "_logits", forwards)
    config = EngineConfig(
        model=args.model,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        device=args.device,
        max_seq_len=PROMPT_TOKENS + WARM_UP_STEPS + args.steps + 16,
        max_batch_size=args.rows,
        num_gpu_blocks=args.rows * (PROMPT_TOKENS + WARM_UP_STEPS + args.steps) // 16 + 2 * args.rows,
        use_chunked_prefill=True,
        use_prefix_caching=True,
    )
    core = EngineCore(config)
    params = SamplingParams(temperature=0.0, max_new_tokens=WARM_UP_STEPS + args.steps + 8, ignore_eos=True)
    for i in range(args.rows):
        prompt = [1 + (i * 7 + j) % 100 for j in range(PROMPT_TOKENS)]  # no two alike
        core.add(EngineRequest(f"r{i}", prompt, params, arrival_s=time.monotonic()))
    for _ in range(WARM_UP_STEPS):  # admission and prefill: every row decodes after these
        core.step()
    for sink in (schedules, steps, forwards):
        sink.clear()
    for _ in range(args.steps):
        core.step()
    print(f"{args.rows} decoding rows, {args.steps} steps")
    rest = [step - forward for step, forward in zip(steps, forwards, strict=True)]
    print(f"Scheduler.schedule: {spread_us(schedules)}")
    print(f"EngineCore.step less the forward: {spread_us(rest)}")


if __name__ == "__main__":
    main()
