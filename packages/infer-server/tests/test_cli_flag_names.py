"""Flags are named alike across the `infer` commands (issue 14 found `--cuda-graphs` beside
`--cuda-graph`): read from each command's own argparse parser, one concept has one spelling.

What counts as one concept: the same destination (argparse's `dest`), the same EngineConfig
field, or the same words up to a plural and a `use-`/`enable-` prefix (`--cuda-graph`,
`--cuda-graphs` and `--use-cuda-graphs` are one). The same spelling may mean different things in
different commands (`--seed` seeds the engine, a sampler or a workload): that is not a split.
"""

import argparse
import collections
import dataclasses
import importlib.util
import re

import pytest

from infer.engine.config import EngineConfig

# Splits that live in a package this test cannot change: concept -> its spellings. When one is
# fixed, test_known_splits_are_still_there fails: remove it here.
KNOWN_SPLITS = {
    # infer-bench: `bench matrix --workloads W2,W3` beside `--workload W2` of bench serve,
    # hf-baseline and engine-only (matrix's `--concurrency 16,64` keeps the singular for a list).
    "workload": {"--workload", "--workloads"},
}


def _root_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command line so far, parser) of every package's CLI; infer-bench's when installed."""
    from infer.engine.cli import build_parser as engine_parser
    from infer.models.cli import build_parser as models_parser
    from infer.server.cli import build_serve_parser

    roots = [
        ("infer", engine_parser()),
        ("infer serve", build_serve_parser()),
        ("infer models", models_parser()),
    ]
    if importlib.util.find_spec("infer.bench") is not None:
        from infer.bench.cli import build_parser as bench_parser
        from infer.bench.serving.cli import build_parser as serving_parser

        roots += [("infer", bench_parser()), ("infer bench", serving_parser())]
    return roots


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every leaf command (`infer bench matrix`, ...) and its parser."""
    commands = {}

    def visit(name: str, parser: argparse.ArgumentParser) -> None:
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subcommands:
            commands[name] = parser
        for action in subcommands:
            for sub_name, sub_parser in action.choices.items():
                visit(f"{name} {sub_name}", sub_parser)

    for name, parser in _root_parsers():
        visit(name, parser)
    return commands


def _long_flags() -> list[tuple[str, str, str]]:
    """(command, flag, dest) of every long option but --help."""
    return [
        (command, flag, action.dest)
        for command, parser in _commands().items()
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    ]


def _concept(flag: str) -> str:
    """The flag's words without a plural or a use-/enable- prefix (`--use-cuda-graphs`: cuda-graph)."""
    words = flag.removeprefix("--").split("-")
    if words[0] in ("use", "enable") and len(words) > 1:
        words = words[1:]
    return "-".join(word[:-1] if len(word) > 3 and word.endswith("s") else word for word in words)


def _spellings_by_concept() -> dict[str, set[str]]:
    spellings = collections.defaultdict(set)
    for _, flag, _ in _long_flags():
        spellings[_concept(flag)].add(flag)
    return spellings


def test_the_commands_are_all_read():
    commands = _commands()
    assert {"infer serve", "infer generate", "infer models fetch"} <= set(commands)
    if importlib.util.find_spec("infer.bench") is not None:
        assert {"infer bench serve", "infer bench matrix", "infer bench generate", "infer profile"} <= set(
            commands
        )


def test_every_flag_is_lowercase_words_joined_by_hyphens():
    malformed = [
        (command, flag)
        for command, flag, _ in _long_flags()
        if not re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", flag)
    ]
    assert malformed == [], "spell flags --like-this, never --like_this or --likeThis"


def test_one_destination_has_one_flag_across_commands():
    spellings = collections.defaultdict(set)
    for _, flag, dest in _long_flags():
        spellings[dest].add(flag)
    assert {dest: flags for dest, flags in spellings.items() if len(flags) > 1} == {}


def test_an_engine_config_field_is_always_its_own_flag():
    fields = {field.name for field in dataclasses.fields(EngineConfig)}
    flag_of = {name: "--" + name.replace("_", "-") for name in fields}
    mismatched = [
        (command, flag, dest)
        for command, flag, dest in _long_flags()
        if (dest in fields and flag != flag_of[dest]) or (flag in flag_of.values() and dest not in fields)
    ]
    assert mismatched == [], "an EngineConfig field's flag is --field-name, with dest field_name"


def test_one_concept_has_one_spelling_across_commands():
    splits = {concept: flags for concept, flags in _spellings_by_concept().items() if len(flags) > 1}
    assert {concept: flags for concept, flags in splits.items() if concept not in KNOWN_SPLITS} == {}


@pytest.mark.skipif(importlib.util.find_spec("infer.bench") is None, reason="needs infer-bench")
def test_known_splits_are_still_there():
    spellings = _spellings_by_concept()
    for concept, flags in KNOWN_SPLITS.items():
        assert spellings[concept] == flags, f"now {spellings[concept]}: update KNOWN_SPLITS"
