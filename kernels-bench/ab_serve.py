"""Alternate served runs of several source trees (or server flags) in one run.

ab_generate.py's rule for serving: a speed claim compares versions measured on the same machine
in the same run, alternated so that a drift of the machine shows in every column. For each round
and each variant in turn: `infer serve` from the variant's tree (its `packages/*/src` first on
PYTHONPATH) with the common server flags and the variant's own, then `infer bench serve` of each
workload against it, then the server stops. The bench client is this tree's, so every variant
meets the same requests. VARIANT is `NAME=TREE[:FLAGS]`, FLAGS the variant's own server flags
(e.g. an older tree's switches that were not on by default then):

    python kernels-bench/ab_serve.py --rounds 2 --workloads W3 W5 --concurrency 64 \\
        --num-requests 192 --out /tmp/ab --variant 'old=/tmp/old:--use-cuda-graphs true' \\
        --variant new=. -- --model /tmp/ckpt/llama-3.2-1b --dtype bfloat16 --max-batch-size 64

Kept in `--out`: each run's `infer bench serve --json` report (NAME-rROUND-WORKLOAD.json) and
each server's log (NAME-rROUND-server.log). Printed: a line a run as it ends, then per workload
a table of out tok/s and TTFT p50 a round and variant, with each variant's out tok/s over the
first variant's of the same round.
"""

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from ab_generate import tree_pythonpath

from infer.bench.serving.matrix import server_process

HERE = Path(__file__).resolve().parents[1]  # this tree: its bench client runs every workload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_bench(tree: Path, server_flags: list[str], workloads, bench_flags, out: Path, tag: str):
    """Starts a server of `tree`, runs each workload against it; returns {workload: report}."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    # `env` puts the variant's tree first on the server's PYTHONPATH (server_process takes a command).
    command = [
        "env",
        f"PYTHONPATH={tree_pythonpath(tree)}",
        sys.executable,
        "-m",
        "infer.server.cli",
        "serve",
    ]
    command += [*server_flags, "--host", "127.0.0.1", "--port", str(port)]
    reports = {}
    with server_process(command, base_url, log_path=out / f"{tag}-server.log", stop_timeout_s=60.0):
        for workload in workloads:
            path = out / f"{tag}-{workload}.json"
            bench = [sys.executable, "-m", "infer.server.cli", "bench", "serve", "--base-url", base_url]
            bench += ["--workload", workload, "--no-records", "--json", str(path), *bench_flags]
            env = {**os.environ, "PYTHONPATH": tree_pythonpath(HERE)}
            subprocess.run(bench, env=env, check=True, stdout=subprocess.DEVNULL)
            reports[workload] = json.loads(path.read_text())
    return reports


def _figures(report: dict) -> tuple[float, float]:
    """Out tok/s and TTFT p50 (ms) of a bench report."""
    stats = report["stats"]
    return stats["output_tokens_per_s"], 1e3 * stats["ttft_s"]["p50"]


def table(workload: str, names: list[str], results: dict) -> str:
    """Markdown: a row per round, a column pair per variant (out tok/s, TTFT p50), and each
    variant's out tok/s over the first variant's in the same round."""
    rounds = sorted({r for (w, _, r) in results if w == workload})
    header = ["round"]
    for name in names:
        header += [f"{name} out tok/s", f"{name} TTFT p50 (ms)"]
    header += [f"{name} / {names[0]}" for name in names[1:]]
    lines = [f"### {workload}", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in rounds:
        figures = [_figures(results[workload, name, r]) for name in names]
        cells = [str(r)]
        for tok_s, ttft_ms in figures:
            cells += [f"{tok_s:.1f}", f"{ttft_ms:.1f}"]
        cells += [f"{tok_s / figures[0][0]:.3f}" for tok_s, _ in figures[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_variant(spec: str) -> tuple[str, Path, list[str]]:
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"a variant is NAME=TREE[:FLAGS], got {spec!r}")
    tree, _, flags = rest.partition(":")
    return name, Path(tree).resolve(), shlex.split(flags)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=TREE[:FLAGS]")
    parser.add_argument("--workloads", nargs="+", default=["W3", "W5"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=None, help="default: the bench client's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("server_flags", nargs=argparse.REMAINDER, help="after --: every server's flags")
    args = parser.parse_args(argv)
    server_flags = args.server_flags[1:] if args.server_flags[:1] == ["--"] else args.server_flags
    variants = [parse_variant(spec) for spec in args.variant]
    names = [name for name, _, _ in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must differ, got {names}")
    bench_flags = ["--concurrency", str(args.concurrency), "--seed", str(args.seed)]
    if args.num_requests is not None:
        bench_flags += ["--num-requests", str(args.num_requests)]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for r in range(1, args.rounds + 1):
        for name, tree, flags in variants:
            reports = _serve_and_bench(
                tree, server_flags + flags, args.workloads, bench_flags, args.out, f"{name}-r{r}"
            )
            for workload, report in reports.items():
                results[workload, name, r] = report
                tok_s, ttft_ms = _figures(report)
                print(
                    f"round {r} {name} {workload}: {tok_s:.1f} out tok/s, TTFT p50 {ttft_ms:.1f} ms",
                    flush=True,
                )
    print()
    for workload in args.workloads:
        print(table(workload, names, results))


if __name__ == "__main__":
    main()
