"""Alternate `infer bench generate` runs of several source trees (or module settings) in one call.

A speed claim compares versions measured on the same device in the same call, alternated so that
a drift of the machine shows in every column. Each variant is `NAME=TREE[:PATCH]`: TREE is a
repository root (its `packages/*/src` go first on PYTHONPATH), PATCH an optional Python
statement run before the benchmark (to try a module constant without a second tree), e.g.

    python kernels-bench/ab_generate.py --models llama-3.2-1b gemma-3-1b --rounds 2 \\
        --variant before=/tmp/old --variant after=. \\
        --variant after-64='.:module("infer.kernels.paged_attention.decode")._MIN_SPLIT_KEYS = 64' \\
        -- --device cuda --dtype bfloat16 --use-cuda-graphs --async-scheduling --repeats 3

A patch reaches a module through `module(NAME)` (importlib.import_module): `import
infer.kernels.paged_attention as p` would bind the function that infer.kernels exports under the
package's name, and an attribute set on it changes nothing (two calls of 2026-11-28 lost their
variants that way).

Checkpoints are `--ckpt-dir/NAME` (made by `infer models random ... --out`). It prints decode
tok/s and % of the roofline a run, the rows alternated, and a table of them last.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = """
import importlib
import sys
exec(sys.argv[1], {"module": importlib.import_module})
from infer.bench.cli import main
sys.exit(main(sys.argv[2:]))
"""


def tree_pythonpath(tree: Path) -> str:
    sources = sorted(str(p) for p in (tree / "packages").glob("*/src"))
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(sources + ([inherited] if inherited else []))


def _run(tree: Path, patch: str, model: Path, bench_args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        command = [sys.executable, "-c", RUNNER, patch, "bench", "generate", "--model", str(model)]
        command += bench_args + ["--json", str(out)]
        env = {**os.environ, "PYTHONPATH": tree_pythonpath(tree)}
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=TREE[:PATCH]")
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--ckpt-dir", default="/tmp/ckpt")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: infer bench generate's flags")
    args = parser.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    variants = []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        tree, _, patch = rest.partition(":")
        variants.append((name, Path(tree).resolve(), patch or "pass"))
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for model in args.models:
        for _ in range(args.rounds):
            for name, tree, patch in variants:
                report = _run(tree, patch, Path(args.ckpt_dir) / model, bench_args)
                tok_s = report["infer"]["decode_tokens_per_s"]
                percent = report["roofline"]["infer_percent"]
                results.setdefault((model, name), []).append((tok_s, percent))
                print(f"{model} {name}: {tok_s:.1f} tok/s, {percent:.1f}% of the roofline", flush=True)
    print(f"\n| shape | {' | '.join(name for name, _, _ in variants)} |")
    print(f"|---|{'---:|' * len(variants)}")
    for model in args.models:
        cells = [
            ", ".join(f"{tok_s:.1f} ({percent:.1f}%)" for tok_s, percent in results[(model, name)])
            for name, _, _ in variants
        ]
        print(f"| {model} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
