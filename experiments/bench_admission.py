"""How many W2 sequences run at once in the same KV memory: one block of max_seq_len per sequence
(the old slotted pool, `kv_cache_backend="contiguous"`) against blocks of 16 tokens taken as
sequences grow (`"paged"`).

The real Scheduler and KVCacheManager over a real BlockAllocator, with a stand-in runner that
samples one token whenever a request has computed all its known tokens; every request of the
workload arrives at once. Only the scheduler and the pool decide concurrency, so no model or GPU
is needed. Usage:

    python experiments/bench_admission.py --slots 64 --max-seq-len 5120 --workload W2 --num-requests 256
"""

import argparse
import statistics

from infer.bench.serving.workloads import make_workload
from infer.cache import BlockAllocator
from infer.engine.decision import RunnerOutput
from infer.engine.kv_manager import KVCacheManager
from infer.engine.request import Request
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler


def run(
    workload, *, block_size: int, num_blocks: int, max_seq_len: int, max_batch_size: int, chunk: int
) -> dict:
    scheduler = Scheduler(
        kv_manager=KVCacheManager(BlockAllocator(num_blocks), block_size),
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        max_num_batched_tokens=max(chunk, max_batch_size),
        use_chunked_prefill=True,
        prefill_chunk_size=chunk,
    )
    for request in workload.requests:
        params = SamplingParams(temperature=0.0, max_new_tokens=request.max_tokens, ignore_eos=True)
        scheduler.add(Request(f"r{request.index}", request.prompt_token_ids, params, request.index))
    running, preempted, steps = [], 0, 0
    while scheduler.has_work():
        decision = scheduler.schedule()
        steps += 1
        preempted += len(decision.preempted_request_ids)
        running.append(scheduler.num_running)
        sampled = []
        for request_id, n in decision.num_scheduled_tokens.items():
            request = scheduler.get(request_id)
            done = request.num_computed_tokens + n == request.num_tokens
            sampled.append((0,) if done else ())
        output = RunnerOutput(tuple(decision.num_scheduled_tokens), tuple(sampled))
        for request, _ in scheduler.update(decision, output):
            if len(request.output_ids) >= request.max_new_tokens:
                scheduler.finish(request.request_id)
    return {
        "peak_running": max(running),
        "mean_running": statistics.fmean(running),
        "steps": steps,
        "preemptions": preempted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=64, help="sequences the slotted pool holds")
    parser.add_argument("--max-seq-len", type=int, default=5120)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--workload", default="W2")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-batch-size", type=int, default=1024, help="the row cap for the paged run")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk and step token budget")
    args = parser.parse_args()
    workload = make_workload(args.workload, concurrency=args.num_requests, num_requests=args.num_requests)
    kv_tokens = args.slots * args.max_seq_len
    contiguous = run(
        workload,
        block_size=args.max_seq_len,
        num_blocks=args.slots,
        max_seq_len=args.max_seq_len,
        max_batch_size=args.slots,
        chunk=args.chunk,
    )
    paged = run(
        workload,
        block_size=args.block_size,
        num_blocks=kv_tokens // args.block_size,
        max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size,
        chunk=args.chunk,
    )
    print(
        f"{args.workload}, {args.num_requests} requests at once, KV memory of {args.slots} x "
        f"{args.max_seq_len} = {kv_tokens} tokens, prefill chunk {args.chunk}"
    )
    print("| pool | peak running | mean running | steps | preemptions |")
    print("|---|---:|---:|---:|---:|")
    for name, result in (("contiguous (slotted)", contiguous), (f"paged, block {args.block_size}", paged)):
        print(
            f"| {name} | {result['peak_running']} | {result['mean_running']:.1f} | {result['steps']} | "
            f"{result['preemptions']} |"
        )
    print(f"paged / contiguous peak: {paged['peak_running'] / contiguous['peak_running']:.2f}x")


if __name__ == "__main__":
    main()
