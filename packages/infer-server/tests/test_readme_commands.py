"""README's commands and lists for real use (issue 14) hold against the code: every `$ infer ...`
of its shell blocks parses with the real argparse parser of its subcommand (and builds an
EngineConfig), every `--flag` it names in the text is a flag of `infer serve`, and the
`model_type`s it lists are the model registry's. A renamed flag or a new architecture fails here
until README follows.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from infer.engine.config import EngineConfig, from_cli_args

REPO = Path(__file__).resolve().parents[3]
READMES = [REPO / "README.md", REPO / "packages" / "infer-server" / "README.md"]
SHELL_LANGUAGES = {"console", "shell", "bash", "sh"}


def shell_commands(path: Path) -> list[list[str]]:
    """argv of each `$ infer ...` line in the file's fenced shell blocks, continued lines joined."""
    blocks = re.findall(r"^```([\w-]*)\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)
    commands = []
    for language, body in blocks:
        if language not in SHELL_LANGUAGES:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.startswith("$ infer"):
                commands.append(shlex.split(line.removeprefix("$ ")))
    return commands


README_COMMANDS = [argv for path in READMES for argv in shell_commands(path)]


def parse_infer(argv: list[str]):
    """Parse `infer ...` as the `infer` command would hand it on: the argparse Namespace of its
    subcommand, or None for `infer --help`. A parse error fails the test with argparse's message."""
    from infer.server import cli as server_cli

    assert argv[0] == "infer"
    command, rest = argv[1], argv[2:]
    if command in ("-h", "--help"):
        with contextlib.redirect_stdout(io.StringIO()):
            assert server_cli.main([command]) == 0
        return None
    if command == "serve":
        parser, args = server_cli.build_serve_parser(), rest
    elif command == "generate":
        from infer.engine.cli import build_parser

        parser, args = build_parser(), argv[1:]  # the engine's parser takes the subcommand too
    elif command == "models":
        from infer.models.cli import build_parser

        parser, args = build_parser(), rest
    else:
        pytest.fail(f"README shows `infer {command}`, which this test does not know how to parse")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(args)
    except SystemExit as exit_:
        pytest.fail(f"`{shlex.join(argv)}` does not parse (exit {exit_.code}): {errors.getvalue().strip()}")


def test_readme_shows_the_gpu_command():
    # The section for real use: a Hugging Face folder on a GPU. If it moves, this test follows it.
    gpu = [argv for argv in README_COMMANDS if "--device" in argv and "cuda" in argv]
    assert gpu, "README.md should show `infer serve --model FOLDER --device cuda ...` in a shell block"
    # No engine flags: on CUDA the defaults are the fast configuration (infer.engine.device_defaults).
    assert not any(arg.startswith("--use-") or arg == "--async-scheduling" for arg in gpu[0])


@pytest.mark.parametrize("argv", README_COMMANDS, ids=shlex.join)
def test_readme_infer_command_parses(argv):
    args = parse_infer(argv)
    if argv[1] == "serve":
        assert isinstance(from_cli_args(args), EngineConfig)  # the values are valid too


def test_nox_serve_flags_in_readme_parse():
    """`nox -s serve -- FLAGS` hands FLAGS to `infer serve`."""
    text = (REPO / "README.md").read_text()
    found = re.findall(r"`nox -s serve -- ([^`]*)`", text)
    assert found, "README.md no longer shows `nox -s serve -- FLAGS`"
    for flags in found:
        parse_infer(["infer", "serve", *shlex.split(flags)])


def readme_flags() -> list[tuple[str, str]]:
    """(README name, flag) for every `--flag` inside backticks of the READMEs' text."""
    found = []
    for path in READMES:
        for code in re.findall(r"`([^`\n]+)`", path.read_text()):
            flags = re.findall(r"(?<!\S)--[a-z][\w-]*", code)
            found += [(path.relative_to(REPO).as_posix(), flag) for flag in flags]
    return sorted(set(found))


@pytest.mark.parametrize(("readme", "flag"), readme_flags())
def test_readme_flag_is_a_flag_of_infer_serve(readme, flag):
    from infer.server.cli import build_serve_parser

    known = build_serve_parser()._option_string_actions  # argparse's own table of option strings
    assert flag in known, f"{readme} names `{flag}`, which `infer serve` does not take"


def test_readme_model_types_are_the_registrys():
    from infer.models.registry import registered_model_types

    prose = " ".join((REPO / "README.md").read_text().split())
    sentence = re.search(r"the `model_type`s served are (.*?)\.", prose)
    assert sentence is not None, "README.md no longer says `the `model_type`s served are ...`"
    listed = re.findall(r"`([^`]+)`", sentence.group(1))
    assert sorted(listed) == registered_model_types()
