"""`infer bench serve | matrix | hf-baseline | engine-only | compare` (argv[0] names the subcommand).

infer bench serve --base-url URL [--model NAME] --workload W2 --concurrency 16 --seed 0
                  [--passes N] [--json OUT] [--md OUT]
infer bench serve --base-url URL --workload W7 --concurrency 32 [--max-context-tokens 32768]
                  [--think-time-s 2] [--duration-s 300]
infer bench matrix --model M [--device cuda --dtype bfloat16] --workloads W2,W3 --out DIR
infer bench hf-baseline --model PATH --workload W2 --concurrency 64 [--json OUT]
infer bench engine-only --engine-config FILE --workload W2 --concurrency 64 [--repeats 3] [--passes N]
infer bench compare A.json B.json [C.json ...] [--names off,device,host] [--json OUT] [--md OUT]

--passes N (serve, engine-only) times the same requests N times over, as a cold pass and warm
ones: pass 1 meets a server that has seen none of their images (the untimed warm-up and probe
send other images: workloads.untimed_stand_in), passes 2..N send the same requests again, which a
prefix cache serves from what pass 1 left. Each pass is reported with its TTFT p50 over pass 1's,
and, on a vision-language model, the images the tower encoded and those the cache spared it.

--duration-s D (serve) caps each timed run at D seconds from its start, so that setups which
would take long to finish (W7 with the prefix cache off recomputes every turn's whole context)
stop at the same point: after it no request or turn starts, and what is in flight ends and is
counted. The report says what the cap left out (client.py has the rules).

compare takes `serve --json` reports of one multi-turn workload and seed on several server setups
(the first: the baseline) and sets their TTFT side by side on the (session, turn) pairs of turns
>= 3 that every setup completed: under a time cap a slow setup reaches fewer, earlier turns, so
each run's own "TTFT p50 of turns >= 3" covers other turns (compare.py).
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

from infer.bench.serving.workloads import DEFAULT_VOCAB_SIZE, SHAPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer bench", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="benchmark a running OpenAI-compatible server")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (without /v1)")
    serve.add_argument(
        "--model", default=None, help="the model name to send; default: the first of /v1/models"
    )
    _add_workload_arguments(serve)
    serve.add_argument(
        "--engine-config", type=Path, default=None, help="EngineConfig file the server runs, to record"
    )
    serve.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    serve.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="time cap on the timed run: after D s no request or turn starts, in-flight ones finish "
        "(default: none)",
    )
    serve.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    serve.add_argument("--no-records", action="store_true", help="leave per-request records out of the JSON")
    _add_passes_argument(serve)
    serve.add_argument("--json", dest="json_path", type=Path, help="write the full report here")
    serve.add_argument("--md", dest="md_path", type=Path, help="write the markdown table here")
    _add_client_processes_argument(serve)
    serve.set_defaults(run=_run_serve)

    matrix = commands.add_parser("matrix", help="start our server per config row and compare against static")
    matrix.add_argument(
        "--model", required=True, help="model alias or checkpoint folder (EngineConfig.model)"
    )
    matrix.add_argument("--device", default=None, help="EngineConfig.device (default: the config's)")
    matrix.add_argument("--dtype", default=None, help="EngineConfig.dtype (default: the config's)")
    matrix.add_argument("--workloads", default="W2,W3", help="comma-separated, e.g. W2,W3")
    matrix.add_argument(
        "--concurrency", default=None, help="comma-separated levels for every workload (default: 16,64)"
    )
    matrix.add_argument("--max-batch-size", type=int, default=None, help="default: the largest concurrency")
    matrix.add_argument(
        "--max-seq-len", type=int, default=2048, help="EngineConfig.max_seq_len for every row"
    )
    matrix.add_argument("--num-requests", type=int, default=None, help="default: 2 x concurrency")
    matrix.add_argument("--seed", type=int, default=0)
    matrix.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="prompt token ids are below this"
    )
    matrix.add_argument(
        "--server-command", default=None, help="what starts the server (default: infer serve)"
    )
    matrix.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra server argument, repeatable: --server-arg=--flag --server-arg=value",
    )
    matrix.add_argument("--health-timeout-s", type=float, default=600.0)
    matrix.add_argument(
        "--rows", default=None, help="comma-separated row names (default: every row; see serving/matrix.py)"
    )
    matrix.add_argument(
        "--out", type=Path, required=True, help="folder for matrix.md, matrix.json, per-run JSON"
    )
    _add_client_processes_argument(matrix)
    matrix.set_defaults(run=_run_matrix)

    hf = commands.add_parser("hf-baseline", help="transformers' continuous batching on the same prompts")
    hf.add_argument(
        "--model", required=True, help="Hugging Face checkpoint folder (or alias for fetch_model)"
    )
    _add_workload_arguments(hf)
    hf.add_argument("--device", default="cuda")
    hf.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16", "float16"))
    hf.add_argument(
        "--attn-implementation", default="sdpa", help='"sdpa", "paged|eager" or a flash implementation'
    )
    hf.add_argument("--json", dest="json_path", type=Path)
    hf.add_argument("--md", dest="md_path", type=Path)
    hf.set_defaults(run=_run_hf_baseline)

    engine_only = commands.add_parser(
        "engine-only", help="the workload through the engine in this process, no HTTP (the server's ceiling)"
    )
    engine_only.add_argument(
        "--engine-config", type=Path, required=True, help="EngineConfig file (e.g. a matrix row's)"
    )
    _add_workload_arguments(engine_only)
    engine_only.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs (with --passes N: N each), each on requests of its own (seed, seed + 1, ...), "
        "after one untimed warm-up on requests of another seed",
    )
    _add_passes_argument(engine_only)
    engine_only.add_argument("--json", dest="json_path", type=Path)
    engine_only.add_argument("--md", dest="md_path", type=Path)
    engine_only.set_defaults(run=_run_engine_only)

    compare = commands.add_parser(
        "compare", help="serve reports of one workload on several setups, on the turns all completed"
    )
    compare.add_argument(
        "reports", type=Path, nargs="+", help="`infer bench serve --json` files; the first is the baseline"
    )
    compare.add_argument(
        "--names", default=None, help="comma-separated, one per report (default: the file names' stems)"
    )
    compare.add_argument("--json", dest="json_path", type=Path, help="write the comparison here")
    compare.add_argument("--md", dest="md_path", type=Path, help="write the markdown tables here")
    compare.set_defaults(run=_run_compare)
    return parser


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="W2", choices=sorted(SHAPES))
    parser.add_argument(
        "--concurrency", type=int, default=None, help="clients in the closed loop (W2/W3: 16)"
    )
    parser.add_argument("--num-requests", type=int, default=None, help="default: 2 x concurrency (W1: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="prompt token ids are below this"
    )
    parser.add_argument(
        "--image-size", type=int, default=None, help="pixels per side of each image (W6: 896)"
    )
    parser.add_argument(
        "--max-context-tokens",
        type=int,
        default=None,
        help="agent sessions end where their next turn would pass this context (W7: 32768)",
    )
    parser.add_argument(
        "--think-time-s",
        type=float,
        default=None,
        help="mean pause of an agent session before each turn, exponential and seeded; 0: a closed "
        "loop (W7: 2)",
    )


def _add_passes_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="time the same requests this many times over: pass 1 cold (no untimed request carries "
        "its images), passes 2..N warm (a prefix cache serves what pass 1 left); each pass is "
        "reported with its TTFT p50 over pass 1's (default 1)",
    )


def _add_client_processes_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="processes that read the timed streams (default: one per 16 of the concurrency)",
    )


def _workload(args, *, seed: int | None = None, num_requests: int | None = None):
    """The workload the arguments name; `seed` and `num_requests` override theirs."""
    import dataclasses

    from infer.bench.serving.workloads import make_workload

    shape = SHAPES[args.workload]
    if args.image_size is not None:
        if not shape.image_size:
            raise ValueError(f"--image-size is for workloads with images (W6); {args.workload} has none")
        shape = dataclasses.replace(shape, image_size=args.image_size)
    for flag, name in (("--max-context-tokens", "max_context_tokens"), ("--think-time-s", "think_time_s")):
        value = getattr(args, name)
        if value is not None:
            if shape.kind != "agent":
                raise ValueError(f"{flag} is for agent sessions (W7); {args.workload} has none")
            shape = dataclasses.replace(shape, **{name: value})
    return make_workload(
        args.workload,
        concurrency=args.concurrency,
        seed=args.seed if seed is None else seed,
        num_requests=num_requests or args.num_requests,
        vocab_size=args.vocab_size,
        shape=shape,
    )


def _run_serve(args) -> int:
    from infer.bench.serving.report import serve_markdown, write_json
    from infer.bench.serving.runner import benchmark_server

    if args.duration_s is not None and not args.duration_s > 0:
        raise ValueError(f"--duration-s must be > 0, got {args.duration_s}")
    report = asyncio.run(
        benchmark_server(
            _workload(args),
            base_url=args.base_url,
            model=args.model,
            engine_config_file=args.engine_config,
            timeout_s=args.timeout_s,
            ignore_eos=not args.no_ignore_eos,
            include_records=not args.no_records,
            client_processes=args.client_processes,
            passes=args.passes,
            duration_s=args.duration_s,
        )
    )
    markdown = serve_markdown(report)
    print(markdown)
    _write(report, markdown, args, write_json)
    passes = [report, *report.get("later_passes", [])]
    return 1 if any(one["stats"]["num_errors"] for one in passes) else 0


def _run_engine_only(args) -> int:
    import gc

    from infer.bench.serving.engine_only import engine_only_markdown, run_engine_only, run_passes
    from infer.bench.serving.matrix import run_seed
    from infer.bench.serving.report import write_json
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine

    workload = _workload(args)
    if workload.shape.is_conversation:
        raise ValueError(
            f"{args.workload} is a conversation workload: each turn sends the server's previous reply "
            "back as text, which needs the chat route; run it with `infer bench serve`"
        )
    config = EngineConfig.from_file(args.engine_config)
    if args.repeats < 1 or args.passes < 1:
        raise ValueError(f"--repeats and --passes must be >= 1, got {args.repeats} and {args.passes}")
    # Replicas are processes of their own (Engine.spawn); one core runs in this process.
    engine = Engine.spawn(config) if config.data_parallel_size > 1 else Engine(config)
    # As the engine process does after start-up: what start-up built stays out of the garbage
    # collector's scans, so a run pays the collections that serving itself causes.
    gc.collect()
    gc.freeze()

    try:
        # Untimed: first-call costs (kernel variants, allocator) stay out of the numbers. Its
        # requests are another seed's, so pass 1 meets none of the timed prompts or images.
        warm_up = _workload(args, seed=run_seed(args.seed, "warm-up", workload.concurrency), num_requests=8)
        run_engine_only(engine, warm_up)
        # Each repeat draws requests of its own (the first: --seed's): with a prefix cache, a
        # repeat of the same requests would hit what the one before it left. Passes are those hits.
        runs = []
        for repeat in range(args.repeats):
            requests = workload if repeat == 0 else _workload(args, seed=args.seed + repeat)
            runs += [{"repeat": repeat, **run} for run in run_passes(engine, requests, args.passes)]
    finally:
        engine.shutdown()
        gc.unfreeze()  # frozen objects outlive the exit: nanobind then reports Triton's as leaked
    report = {
        "kind": "infer bench engine-only",
        "workload": workload.describe(),
        "engine_config": config.to_dict(),
    }
    report["runs"] = runs
    markdown = engine_only_markdown(workload, config.to_dict(), runs)
    print(markdown)
    _write(report, markdown, args, write_json)
    return 0


def _run_compare(args) -> int:
    from infer.bench.serving.compare import compare_markdown, compare_reports
    from infer.bench.serving.report import write_json

    names = [path.stem for path in args.reports] if args.names is None else args.names.split(",")
    reports = []
    for path in args.reports:
        try:
            reports.append(json.loads(path.read_text()))
        except OSError as error:
            raise ValueError(f"cannot read {path}: {error}") from error
    comparison = compare_reports(reports, [name.strip() for name in names])
    markdown = compare_markdown(comparison)
    print(markdown)
    _write(comparison, markdown, args, write_json)
    return 0


def _run_matrix(args) -> int:
    from infer.bench.serving.matrix import DEFAULT_SERVER_COMMAND, run_matrix, select_rows

    try:
        rows = select_rows(args.rows)
    except ValueError as error:
        print(f"infer bench matrix: {error}", file=sys.stderr)
        return 2
    workloads = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in workloads if name not in SHAPES]
    if unknown:
        print(f"infer bench matrix: unknown workloads {unknown}; known: {sorted(SHAPES)}", file=sys.stderr)
        return 2
    levels = None
    if args.concurrency:
        chosen = tuple(int(level) for level in args.concurrency.split(","))
        levels = {name: chosen for name in workloads}
    settings = {"max_seq_len": args.max_seq_len}
    for key in ("device", "dtype", "max_batch_size"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    summary = run_matrix(
        model=args.model,
        out_dir=args.out,
        workloads=workloads,
        concurrency_levels=levels,
        rows=rows,
        base_settings=settings,
        server_command=args.server_command or DEFAULT_SERVER_COMMAND,
        extra_server_args=args.server_arg,
        client_processes=args.client_processes,
        seed=args.seed,
        num_requests=args.num_requests,
        vocab_size=args.vocab_size,
        health_timeout_s=args.health_timeout_s,
    )
    print((args.out / "matrix.md").read_text())
    # A row that could not run is a failed benchmark too, not a shorter table.
    failed = summary["failed_rows"] or any(run["stats"]["num_errors"] for run in summary["runs"])
    return 1 if failed else 0


def _run_hf_baseline(args) -> int:
    from infer.bench.serving.hf_baseline import hf_markdown, run_hf_baseline
    from infer.bench.serving.report import write_json

    if SHAPES[args.workload].image_size:
        raise ValueError(
            f"hf-baseline runs text workloads; {args.workload}'s images would not reach the model"
        )
    model_path = args.model
    if not Path(model_path).is_dir():
        from infer.models import fetch_model

        model_path = str(fetch_model(model_path))
    report = run_hf_baseline(
        model_path,
        _workload(args),
        device=args.device,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
    )
    markdown = hf_markdown(report)
    print(markdown)
    _write(report, markdown, args, write_json)
    return 1 if report["stats"]["num_errors"] else 0


def _write(report: dict, markdown: str, args, write_json) -> None:
    if args.json_path:
        write_json(report, args.json_path)
        print(f"wrote {args.json_path}", file=sys.stderr)
    if args.md_path:
        args.md_path.write_text(markdown)
        print(f"wrote {args.md_path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point for `infer bench serve|matrix|hf-baseline|engine-only|compare`; argv starts at the
    subcommand."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, TimeoutError, json.JSONDecodeError) as error:
        print(f"infer bench {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
