"""Is a batch-1 decode step waiting for the GPU, or the GPU for the host?

With async scheduling a step is launched before the one running is collected, so the host has
one GPU step's time to schedule and launch the next. decode_timeline.py's profiled steps show
the GPU idle for tens of µs a step outside the layers (gemma-3-1b on an H200, 2026-11-28: one
elementwise kernel a step 48 µs exposed for 1.2 µs of work, the two input copies 14 µs for 5.8,
the token's copy to the host 7 µs for 1.5), but the profiler slows the host too. This measures
without a profiler, for each checkpoint (W1: a 256-token prompt, 256 new tokens, the engine as
decode_timeline builds it):

- the engine's decode: µs a token, from `Engine.step()` timed on the host;
- the host's wait a step: µs spent in the runner's `_read` (waiting for the step's `done`
  event, then reading the token); near zero means the GPU waits for the host instead;
- the decode graph replayed alone, back to back, timed with CUDA events: µs a replay, the
  step's GPU time without the host (nor the sampling and copies outside the graph).

With `--host-profile N`, one more decode runs under cProfile (which slows the host) and the N
functions with the most time of their own are printed: where the host's step goes.

    python kernels-bench/host_slack.py /tmp/ckpt/gemma-3-1b /tmp/ckpt/llama-3.2-1b ...
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from decode_timeline import decode as decode_w1

from infer.engine import Engine, EngineConfig

REPLAYS = 200


def timed_read(runner) -> list[float]:
    """Wraps the runner's `_read` (the host's wait for a step's token); returns the list each
    call's seconds are appended to."""
    waits, read = [], runner._read

    def wrapper(launched):
        start = time.perf_counter()
        try:
            return read(launched)
        finally:
            waits.append(time.perf_counter() - start)

    runner._read = wrapper
    return waits


def decode(engine: Engine, waits: list[float]) -> tuple[float, float]:
    """(µs a decoded token, µs the host waited a step, the median over every step of the request)
    of one W1 request, decoded as decode_timeline.py decodes it."""
    waits.clear()
    tok_per_s, _ = decode_w1(engine, profiled=False)
    return 1e6 / tok_per_s, 1e6 * statistics.median(waits)


def replay_alone(engine: Engine) -> float:
    """µs a replay of the batch-1 decode graph, back to back (its inputs as the last step left
    them: the replays rewrite that step's key and value, which no request reads any more)."""
    graph, _ = engine.core.runner.graphs._decode_graphs[1]
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / REPLAYS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--no-pdl", action="store_true", help="EngineConfig.use_pdl off")
    parser.add_argument(
        "--host-profile", type=int, default=0, metavar="N",
        help="also decode once more under cProfile and print its N costliest functions (own time)",
    )  # fmt: skip
    args = parser.parse_args()
    print("| checkpoint | µs a token (engine) | host's wait a step, µs (median) | graph replayed alone, µs |")
    print("|---|---:|---:|---:|")
    for folder in args.checkpoints:
        config = EngineConfig(
            model=folder, device="cuda", dtype="bfloat16", max_batch_size=1, max_seq_len=4096,
            use_chunked_prefill=True, use_cuda_graphs=True, async_scheduling=True,
            use_pdl=not args.no_pdl, use_triton_gemv=True,
        )  # fmt: skip
        engine = Engine(config)
        waits = timed_read(engine.core.runner)
        decode(engine, waits)  # warm-up: compiles, captures
        per_token, wait = decode(engine, waits)
        alone = replay_alone(engine)
        print(f"| {folder} | {per_token:.1f} | {wait:.1f} | {alone:.1f} |")
        if args.host_profile:
            profiler = cProfile.Profile()
            profiler.runcall(decode, engine, waits)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.host_profile)
        engine.shutdown()


if __name__ == "__main__":
    main()
