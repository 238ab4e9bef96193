"""`infer bench generate | serve | matrix | hf-baseline` and `infer profile` (argv[0] names the
command); the `infer` command of infer-server hands them here.

infer profile [--model M] [--out DIR]                            torch.profiler trace + top ops
infer bench generate [--model M] [--workload copy] [--json OUT]  one request: W1 (256 + 256) or copy
infer bench serve | matrix | hf-baseline | engine-only | compare ...  the serving benchmark (serving/cli.py)
"""

import argparse
import logging
import sys

# `infer bench NAME` for these goes to the serving benchmark; `bench generate` is parsed here.
SERVING_BENCHMARKS = ("serve", "matrix", "hf-baseline", "engine-only", "compare")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in SERVING_BENCHMARKS:
        from infer.bench.serving.cli import main as serving_main

        return serving_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not above: infer.engine.cli loads torch, which the serving client never needs.
    from infer.engine.cli import add_model_arguments

    parser = argparse.ArgumentParser(prog="infer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    profile = commands.add_parser("profile", help="a short generation under torch.profiler")
    add_model_arguments(profile)
    profile.add_argument(
        "--out", default="profile-out", help="folder for the Chrome trace (default %(default)s)"
    )
    profile.add_argument("--prompt-tokens", type=int, default=64)
    profile.add_argument("--gen-tokens", type=int, default=32)
    profile.add_argument("--row-limit", type=int, default=20, help="rows of the top-ops table")
    profile.set_defaults(run=_run_profile)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    bench_generate = bench_commands.add_parser(
        "generate", help="one request (W1 or copy), prefill and decode tokens/s"
    )
    add_model_arguments(bench_generate)
    bench_generate.add_argument(
        "--workload",
        choices=("random", "copy"),
        default="random",
        help="random: W1, a random prompt, EOS ignored; copy: a chat asking to repeat a ~300-token "
        "passage with one change, ending at EOS (default %(default)s)",
    )
    bench_generate.add_argument("--prompt-tokens", type=int, default=256, help="random workload only")
    bench_generate.add_argument(
        "--gen-tokens", type=int, default=None, help="most new tokens (default: 256 random, 400 copy)"
    )
    bench_generate.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported")
    bench_generate.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    bench_generate.add_argument("--compare-hf", action="store_true", help="also time transformers' generate")
    bench_generate.add_argument("--json", dest="json_path", help="write the results as JSON here")
    bench_generate.set_defaults(run=_run_bench_generate)
    return parser


def _run_profile(args: argparse.Namespace) -> int:
    from infer.bench.profile import run_profile

    return run_profile(args)


def _run_bench_generate(args: argparse.Namespace) -> int:
    from infer.bench.generation import run_bench_generate

    return run_bench_generate(args)


if __name__ == "__main__":
    sys.exit(main())
