"""`infer` hands each subcommand to the package that owns it."""

import sys

import pytest

from infer.server.cli import main


@pytest.mark.parametrize(
    ("argv", "owner_flag"),
    [
        (["generate", "--help"], "--chat"),  # infer.engine.cli
        (["serve", "--help"], "--drain-timeout-s"),
    ],
)
def test_subcommand_reaches_its_parser(argv, owner_flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert owner_flag in capsys.readouterr().out


BENCH_COMMANDS = [["bench", "generate", "--help"], ["bench", "serve"], ["bench"], ["profile"]]


@pytest.mark.parametrize("argv", BENCH_COMMANDS)
def test_benchmarks_without_infer_bench_exit_2_with_what_to_install(argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "infer.bench", None)  # as if only the library wheels were installed
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"infer {argv[0]}: needs the infer-bench distribution: pip install infer-bench "
        "(from a checkout: pip install -e packages/infer-bench)"
    ]


def test_unknown_command_exits_2_and_names_it(capsys):
    assert main(["frobnicate"]) == 2
    assert "'frobnicate'" in capsys.readouterr().err


def test_no_arguments_print_the_usage_and_exit_2(capsys):
    """Issue 14: `infer` alone is a usage error (exit 2), with the commands on stderr."""
    assert main([]) == 2
    assert "infer serve" in capsys.readouterr().err


def test_help_prints_the_usage_and_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "infer serve" in capsys.readouterr().out
