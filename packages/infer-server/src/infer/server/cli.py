"""The `infer` command: one entry point whose subcommands live in the package that owns them.

infer models {fetch,list,random,diff} ...         -> infer.models.cli
infer generate [flags] PROMPT...                  -> infer.engine.cli
infer serve [--host H] [--port P] [engine flags]  -> infer.server (the HTTP server)
infer serve --model A --model B [flags]           -> one server, several models
infer bench generate | serve | matrix | hf-baseline, infer profile
                                                  -> infer.bench.cli (infer-bench, when installed)
"""

import argparse
import functools
import importlib
import importlib.util
import logging
import os
import sys

# infer-bench sits above this package and is optional, so its CLI is found by module name when a
# benchmark is asked for: no infer library imports it (tests/test_import_direction.py).
BENCH_CLI = "infer.bench.cli"
# The default of `infer serve --api-key`, as vLLM's VLLM_API_KEY: a key kept out of `ps` output.
API_KEY_ENV = "INFER_API_KEY"

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a usage error, as argparse treats a missing subcommand
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "models":
        from infer.models.cli import main as models_main

        return models_main(rest)
    if command in ("bench", "profile"):
        return bench_main(argv)
    if command == "generate":
        from infer.engine.cli import main as engine_main

        return engine_main(argv)
    if command == "serve":
        return serve_main(rest)
    print(f"infer: unknown command {command!r}; run `infer --help`", file=sys.stderr)
    return 2


def bench_main(argv: list[str]) -> int:
    """Hand `infer bench ...` or `infer profile ...` to infer-bench; exit 2 with how to install it
    when it is absent."""
    if importlib.util.find_spec("infer.bench") is None:
        print(
            f"infer {argv[0]}: needs the infer-bench distribution: pip install infer-bench "
            "(from a checkout: pip install -e packages/infer-bench)",
            file=sys.stderr,
        )
        return 2
    return importlib.import_module(BENCH_CLI).main(argv)


def serve_main(argv: list[str] | None = None) -> int:
    """`infer serve` and the `infer-server` script: the OpenAI-compatible server on one model, or
    on several (`--model A --model B`), each with the same engine flags."""
    from infer.engine.config import from_cli_args, resolve_device

    args = build_serve_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        print("infer serve: --event-loop uvloop: uvloop is not installed", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from infer.models.loader.fetch import check_model_name
    from infer.server.cpu_weights import DENSE, default_cpu_weights

    dense = args.quantization == DENSE  # the checkpoint's weights as stored, on any device
    if dense:
        args.quantization = None
    try:
        configs = [
            from_cli_args(argparse.Namespace(**{**vars(args), "model": name}))
            for name in args.models or [None]
        ]
        for config in configs:
            resolve_device(config.device)
            if config.load_format != "dummy":  # dummy takes a preset's name too
                check_model_name(config.model)  # a typo is refused before the server starts
        check_several_models(args, configs)
    except ValueError as error:  # an EngineConfigError, check_model_name's or check_several_models'
        print(f"infer serve: {error}", file=sys.stderr)
        return 2
    config = configs[0]
    if config.node_rank > 0:  # this host runs its tensor-parallel ranks; node 0 serves
        from infer.engine.tensor_parallel_worker import run_node

        return run_node(config, resolve_device(config.device).type)
    from infer.engine.engine import Engine
    from infer.server.limits import RequestLimits
    from infer.server.serve import bind_socket, build_server

    try:
        limits = RequestLimits(
            max_request_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars
        )
        access = access_policy(args)
    except ValueError as error:
        print(f"infer serve: {error}", file=sys.stderr)
        return 2

    try:
        # Bound before the model loads, so a busy port fails at once, not after minutes of loading.
        listening = bind_socket(args.host, args.port)
    except OSError as error:
        print(f"infer serve: cannot listen on {args.host}:{args.port}: {error.strerror}", file=sys.stderr)
        return 2
    if not dense:  # after the port: it may resolve (fetch) the model's folder
        configs = [default_cpu_weights(config) for config in configs]
        config = configs[0]

    def engine_factory(config):
        if args.engine_in_process:
            return functools.partial(Engine, config)
        return functools.partial(Engine.spawn, config, unresponsive_timeout_s=args.engine_timeout_s)

    if len(configs) == 1:
        models, served_model_name = engine_factory(config), args.served_model_name or config.model
    else:
        models, served_model_name = {config.model: engine_factory(config) for config in configs}, None
    server = build_server(
        models,
        host=args.host,
        port=args.port,
        served_model_name=served_model_name,
        drain_timeout_s=args.drain_timeout_s,
        event_loop=args.event_loop,
        log_level=args.log_level,
        limits=limits,
        media_policy=media_policy(args),
        access=access,
        exit_on_failure=True,
        max_loaded_models=args.max_loaded_models,
        idle_unload_s=args.idle_unload_s,
        model_wait_timeout_s=args.model_wait_timeout_s,
    )
    server.run(sockets=[listening])
    if server.failure is not None:
        return 1  # the failure was logged as it happened
    return 130 if server.interrupted else 0  # 128 + SIGINT, as a shell reports a Ctrl-C


def check_several_models(args: argparse.Namespace, configs: list) -> None:
    """ValueError for what `--model A --model B` cannot do (yet), and for bad model-swap flags."""
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise ValueError(f"--max-loaded-models must be >= 1, got {args.max_loaded_models}")
    if args.idle_unload_s is not None and args.idle_unload_s <= 0:
        raise ValueError(f"--idle-unload-s must be > 0, got {args.idle_unload_s}")
    if args.model_wait_timeout_s <= 0:
        raise ValueError(f"--model-wait-timeout-s must be > 0, got {args.model_wait_timeout_s}")
    if len(configs) == 1:
        return
    names = [config.model for config in configs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--model {repeated[0]} is given twice; name each model once")
    if args.served_model_name is not None:
        raise ValueError(
            "--served-model-name names the one model; with several --model, each is served under "
            "its --model value"
        )
    if configs[0].data_parallel_size > 1 or configs[0].nnodes > 1:
        raise ValueError(
            "--data-parallel-size and --nnodes above 1 serve one model; with several --model, leave them at 1"
        )


def build_serve_parser() -> argparse.ArgumentParser:
    from infer.engine.config import add_cli_arguments
    from infer.engine.engine_process import DEFAULT_UNRESPONSIVE_TIMEOUT_S
    from infer.models import DEFAULT_MODEL
    from infer.models.quantization import QUANTIZATION_CHOICES
    from infer.server.cpu_weights import DENSE
    from infer.server.limits import DEFAULT_MAX_REQUEST_BYTES
    from infer.server.serve import DEFAULT_DRAIN_TIMEOUT_S, EVENT_LOOPS
    from infer.server.served_models import DEFAULT_WAIT_TIMEOUT_S

    parser = argparse.ArgumentParser(
        prog="infer serve",
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
        # This parser's --model (repeatable) takes the place of the engine flags' own.
        conflict_handler="resolve",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    parser.add_argument(
        "--served-model-name", default=None, help="the `model` requests must name (default: --model as given)"
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, how long requests in flight may run before they are aborted (default %(default)s)",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the HTTP server's event loop: uvloop (a dependency on Linux and macOS; faster "
        "streaming) or Python's asyncio; auto takes uvloop where it is installed (default %(default)s)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body; larger ones get 413 before they are parsed (default %(default)s)",
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="most characters of one prompt; longer ones get 413 before tokenizing (default: "
        "max_seq_len x the longest token, the most that could ever fit the context)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts whose image URLs (image_url parts) the server fetches, as vLLM's flag: "
        "a.example b.example or a.example,b.example; a listed host may be a private address "
        "(default: none; data: URLs always work)",
    )
    parser.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch image URLs from any public host; a host that resolves to a loopback, private "
        "or link-local address is still refused unless --allowed-media-domains lists it",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help="requests must send `Authorization: Bearer KEY`, else 401; /health, /metrics and the "
        f"/dashboard page stay open (default: ${API_KEY_ENV}; unset or empty: no key)",
    )
    parser.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/metrics needs the API key too (/health stays open for load balancers' probes)",
    )
    parser.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="browser origins that may call the server (CORS), as scheme://host[:port]: "
        "a.example b.example or a,b; * for any (default: none, no CORS headers)",
    )
    parser.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine core in a thread of the server's process instead of a child process "
        "of its own (one GIL for both: slower under load; for debugging)",
    )
    parser.add_argument(
        "--engine-timeout-s",
        type=float,
        default=DEFAULT_UNRESPONSIVE_TIMEOUT_S,
        help="the engine process is taken for hung, killed, and the server exits 1 after this long "
        "without a word from it (default %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default %(default)s)",
    )
    add_cli_arguments(parser)
    # The engine flag again (the parser resolves the clash to this one), with `none` and the CPU's
    # default: infer.server.cpu_weights.
    parser.add_argument(
        "--quantization",
        default=None,
        choices=(*QUANTIZATION_CHOICES, DENSE),
        help="Linear weights: int8 or fp8 (8 bits), int4 (groups of 128), gguf (CPU: the GGUF file "
        "a model was converted from, in its own blocks), none (the checkpoint's weights as stored) "
        "(default: as the checkpoint stores them; on a CPU, gguf for a Llama model converted from a "
        "GGUF file, as the default model is)",
    )
    models = parser.add_argument_group(
        "models", "several models in one server: the request's `model` picks one"
    )
    models.add_argument(
        "--model",
        action=RepeatedModel,
        default=None,
        metavar="MODEL",
        help="model alias or Hugging Face checkpoint folder; repeat it to serve several, each "
        "under its value as given and with the same engine flags, the first being the default of "
        f"/tokenize (default: {DEFAULT_MODEL})",
    )
    models.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        metavar="N",
        help="most models resident at once: a request for another loads it, unloading the least "
        "recently used model with no request in flight first (default: all, loaded at start)",
    )
    models.add_argument(
        "--idle-unload-s",
        type=float,
        default=None,
        metavar="S",
        help="unload a model after S seconds without a request (its engine, memory and prefix "
        "cache go); its next request loads it again (default: never)",
    )
    models.add_argument(
        "--model-wait-timeout-s",
        type=float,
        default=DEFAULT_WAIT_TIMEOUT_S,
        metavar="S",
        help="how long a request waits for its model to load, or for a loaded one to be free to "
        "unload, before a 503 with Retry-After (default %(default)s)",
    )
    parser.set_defaults(models=None)
    return parser


class RepeatedModel(argparse.Action):
    """`--model`, repeatable: `models` holds every one given, `model` the first (the EngineConfig
    field, so that `from_cli_args` of the parsed flags reads one model as it always did)."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.models = [*(namespace.models or []), value]
        setattr(namespace, self.dest, namespace.models[0])


def access_policy(args: argparse.Namespace):
    """The AccessPolicy of `infer serve`'s --api-key (or $INFER_API_KEY), --protect-metrics and
    --allowed-origins; ValueError for a key or an origin that could never match."""
    from infer.server.access import AccessPolicy, parse_origins

    policy = AccessPolicy(
        api_key=args.api_key,
        protect_metrics=args.protect_metrics,
        allowed_origins=parse_origins(args.allowed_origins),
    )
    if policy.api_key is not None:  # what is open, never the key
        logger.info("an API key is required on every path but %s", ", ".join(sorted(policy.open_paths)))
    return policy


def media_policy(args: argparse.Namespace):
    """The MediaPolicy of `infer serve`'s --allowed-media-domains (vLLM's: one host per value, or
    ours: a comma-separated list; host names compare lower-case, as URLs' do) and
    --allow-remote-media."""
    from infer.server.media import MediaPolicy

    hosts = [host.strip().lower() for value in args.allowed_media_domains for host in value.split(",")]
    return MediaPolicy(allowed_domains=frozenset(filter(None, hosts)), allow_remote=args.allow_remote_media)


if __name__ == "__main__":
    sys.exit(main())
