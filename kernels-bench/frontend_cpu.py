"""CPU seconds the server's own process (the HTTP frontend; the engine core is its child) spends
a streamed chat request, against a running `infer serve`.

Where the frontend bounds a served run (many short requests a second on a fast device: W3 at 64
on an H200 answers ~125 requests a second), its cost a request and a token is the ceiling, and it
is the same Python on any machine, so a CPU server with a small model measures it. The server's
own CPU time (utime + stime of /proc/PID/stat) over N requests, after a warm-up, is what another
job on the machine disturbs least. Compare trees by starting each one's server in turn:

    infer serve --port 8000 &
    python kernels-bench/frontend_cpu.py --base-url http://127.0.0.1:8000 --pid $! \\
        --requests 300 --concurrency 8 --max-tokens 1

`--max-tokens 1` gives the cost a request; a second run with more tokens gives, by difference,
the cost a token.
"""

import argparse
import asyncio
import os
import time

import httpx

WARM_UP_REQUESTS = 16
SYSTEM_PROMPT = "You are a helpful assistant. " * 20  # ~120 tokens: a short chat's system prompt


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args) -> tuple[float, float]:
    """(server CPU seconds, wall seconds) over the timed requests."""
    body = {
        "model": args.model,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Say hi"}],
        "max_tokens": args.max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    slots = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:

        async def one() -> None:
            async with slots, client.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for _ in response.aiter_lines():
                    pass

        await asyncio.gather(*(one() for _ in range(WARM_UP_REQUESTS)))
        cpu_s, wall_s = process_cpu_s(args.pid), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(args.requests)))
        return process_cpu_s(args.pid) - cpu_s, time.perf_counter() - wall_s


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--pid", type=int, required=True, help="the `infer serve` process")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the served model's name")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()
    cpu_s, wall_s = asyncio.run(run(args))
    print(
        f"{args.requests} requests, max_tokens {args.max_tokens}, concurrency {args.concurrency}: "
        f"server CPU {cpu_s:.2f} s, {1e3 * cpu_s / args.requests:.2f} ms a request; wall {wall_s:.1f} s"
    )


if __name__ == "__main__":
    main()
