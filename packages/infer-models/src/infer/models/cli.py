"""`infer models ...` (also `python -m infer.models ...`): fetch and list real checkpoints.

    infer models fetch NAME [--verify]   fetch and convert once; prints the folder's path
    infer models list                    the folders in $INFER_HOME/models, with their sizes

Other modules of this package add their own subcommands through `register_cli(subparsers)`
(random checkpoints, activation diffs) when they are present.
"""

import argparse
import importlib
import importlib.util
import logging
import sys

from infer.models.loader.fetch import KNOWN_MODELS, fetch_model, list_cached_models, models_dir
from infer.models.loader.manifest import ModelFolderError

# Modules that contribute subcommands, each with register_cli(subparsers) -> None.
_SUBCOMMAND_MODULES = ("infer.models.random_checkpoint", "infer.models.activation_diff")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer models", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")

    fetch = subparsers.add_parser(
        "fetch", help="fetch a model by alias (converted once into $INFER_HOME/models); print its path"
    )
    fetch.add_argument("name", help=f"an alias ({', '.join(sorted(KNOWN_MODELS))}) or a model folder")
    fetch.add_argument("--verify", action="store_true", help="re-hash every file against the manifest")
    fetch.set_defaults(func=_run_fetch)

    listing = subparsers.add_parser("list", help="list the fetched models and their sizes")
    listing.set_defaults(func=_run_list)

    for module_name in _SUBCOMMAND_MODULES:
        # find_spec first, so a module that is absent is skipped but one that fails to import
        # still raises its own error.
        if importlib.util.find_spec(module_name) is not None:
            importlib.import_module(module_name).register_cli(subparsers)
    return parser


def _run_fetch(args: argparse.Namespace) -> int:
    try:
        path = fetch_model(args.name, verify=args.verify)
    except (ValueError, ModelFolderError) as err:
        print(f"infer models fetch: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _run_list(args: argparse.Namespace) -> int:
    cached = list_cached_models()
    for model in cached:
        print(f"{model.alias:<28} {format_size(model.size_bytes):>10}  {model.path}")
    fetched = {model.alias for model in cached}
    not_fetched = [alias for alias in sorted(KNOWN_MODELS) if alias not in fetched]
    if not cached:
        print(f"no models in {models_dir()}")
    if not_fetched:
        print(f"not fetched yet (infer models fetch NAME): {', '.join(not_fetched)}")
    return 0


def format_size(num_bytes: int) -> str:
    if num_bytes < 1000:
        return f"{num_bytes} B"
    size = float(num_bytes)
    for unit in ("KB", "MB"):
        size /= 1000
        if size < 1000:
            return f"{size:.1f} {unit}"
    return f"{size / 1000:.1f} GB"
