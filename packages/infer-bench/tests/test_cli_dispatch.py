"""`infer bench ...` and `infer profile` reach infer-bench's parsers through the `infer` command
of infer-server."""

import pytest

from infer.server.cli import main


@pytest.mark.parametrize(
    ("argv", "owner_flag"),
    [
        (["bench", "serve", "--help"], "--base-url"),  # infer.bench.serving.cli
        (["bench", "matrix", "--help"], "--server-command"),
        (["bench", "hf-baseline", "--help"], "--attn-implementation"),
        (["bench", "engine-only", "--help"], "--repeats"),
        (["bench", "compare", "--help"], "--names"),
        (["bench", "generate", "--help"], "--compare-hf"),  # infer.bench.cli
        (["profile", "--help"], "--row-limit"),
    ],
)
def test_subcommand_reaches_its_parser(argv, owner_flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert owner_flag in capsys.readouterr().out
