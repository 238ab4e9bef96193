"""`infer models ...`: `python -m infer.models` in a separate process as a user runs it (fetch,
list), and `main(argv)` in this process for the error paths, which need no fresh interpreter."""

import subprocess
import sys

import pytest

from infer.models.cli import main
from infer.models.loader.fetch import fetch_model, list_cached_models


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infer.models", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def smollm2_folder():
    return fetch_model("smollm2-135m-instruct")


def test_fetch_prints_the_folder_path(smollm2_folder):
    result = run_cli("fetch", "smollm2-135m-instruct")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(smollm2_folder)


def test_fetch_verify_rehashes_and_succeeds_on_an_intact_folder(smollm2_folder, capsys):
    assert main(["fetch", "smollm2-135m-instruct", "--verify"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_folder)


def test_fetch_of_an_unknown_name_fails_and_lists_the_aliases(capsys):
    assert main(["fetch", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert "smollm2-135m-instruct" in err and "gemma-3-270m" in err


def test_list_shows_every_cached_model_with_its_size(smollm2_folder):
    result = run_cli("list")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()}
    for model in list_cached_models():
        assert str(model.path) in lines[model.alias]
        assert "MB" in lines[model.alias] or "GB" in lines[model.alias]


def test_list_on_an_empty_home_says_so_and_names_what_can_be_fetched(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert f"no models in {tmp_path / 'models'}" in out
    assert "smollm2-135m-instruct" in out


def test_help_lists_the_subcommands_of_this_package(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert "fetch" in out and "list" in out


def test_no_subcommand_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "usage: infer models" in capsys.readouterr().out
