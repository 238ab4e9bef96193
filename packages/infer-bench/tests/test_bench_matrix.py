"""`infer bench matrix` end to end against a real server process (bench_peer.py started per row)."""

import json
import sys
from pathlib import Path

import httpx
import pytest

from infer.bench.serving import cli as serving_cli
from infer.bench.serving import matrix as serving_matrix
from infer.bench.serving.matrix import MATRIX_ROWS, run_matrix, select_rows, server_process
from infer.models.tensor_parallel import free_local_port

PEER = Path(__file__).with_name("bench_peer.py")


def test_matrix_runs_each_row_on_its_own_server_and_compares_to_static(tmp_path):
    rows = select_rows("static,continuous-contiguous")
    summary = run_matrix(
        model="peer-model",
        out_dir=tmp_path,
        workloads=["W2"],
        concurrency_levels={"W2": (2,)},
        rows=rows,
        server_command=f"{sys.executable} {PEER}",
        num_requests=2,
        vocab_size=50,
        health_timeout_s=60,
    )
    assert [(run["row"], run["workload"], run["concurrency"]) for run in summary["runs"]] == [
        ("static", "W2", 2),
        ("continuous-contiguous", "W2", 2),
    ]
    for row in rows:
        config = json.loads((tmp_path / row.name / "engine_config.json").read_text())
        assert config["batching_mode"] == row.engine_settings["batching_mode"]
        assert config["max_batch_size"] == 2  # the largest concurrency
        report = json.loads((tmp_path / row.name / "W2-c2.json").read_text())
        assert report["server"]["engine_config"]["batching_mode"] == row.engine_settings["batching_mode"]
        assert report["stats"]["num_ok"] == 2
    table = (tmp_path / "matrix.md").read_text()
    static, continuous = (run["stats"]["output_tokens_per_s"] for run in summary["runs"])
    assert f"| W2 | 2 | static | {static:.1f} | 1.00 |" in table
    assert f"| W2 | 2 | continuous-contiguous | {continuous:.1f} | {continuous / static:.2f} |" in table


def test_a_row_whose_server_dies_is_reported_and_the_matrix_goes_on(tmp_path):
    summary = run_matrix(
        model="peer-model",
        out_dir=tmp_path,
        workloads=["W2"],
        concurrency_levels={"W2": (2,)},
        rows=select_rows("static,continuous-contiguous"),
        server_command=f"{sys.executable} -c 'import sys; sys.exit(3)'",
        health_timeout_s=30,
    )
    assert [failure["row"] for failure in summary["failed_rows"]] == ["static", "continuous-contiguous"]
    assert "static failed: the server exited with status 3" in (tmp_path / "matrix.md").read_text()


def test_the_matrix_command_exits_1_when_a_row_failed(tmp_path, capsys):
    dies = f"{sys.executable} -c 'import sys; sys.exit(3)'"
    argv = ["matrix", "--model", "peer-model", "--workloads", "W2", "--concurrency", "2", "--rows", "static"]
    argv += ["--server-command", dies, "--health-timeout-s", "30", "--out", str(tmp_path)]
    assert serving_cli.main(argv) == 1
    assert "static failed: the server exited with status 3" in capsys.readouterr().out


def test_server_process_reports_an_early_exit_with_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with (
        pytest.raises(RuntimeError, match="exited with status 3(.|\n)*no model here"),
        server_process(
            command, f"http://127.0.0.1:{free_local_port()}", log_path=tmp_path / "log", health_timeout_s=30
        ),
    ):
        pass


def test_server_process_is_stopped_on_exit(tmp_path):
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"model": "peer-model"}))
    port = free_local_port()
    command = [sys.executable, str(PEER), "--engine-config", str(config), "--port", str(port)]
    with server_process(
        command, f"http://127.0.0.1:{port}", log_path=tmp_path / "log", health_timeout_s=60
    ) as process:
        assert process.poll() is None
    assert process.poll() is not None
    with pytest.raises(httpx.ConnectError):  # nothing listens any more
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_a_row_whose_config_is_invalid_here_is_reported_without_starting_a_server(tmp_path):
    graphs_row = select_rows("paged-chunked-cuda_graphs")
    summary = run_matrix(
        model="peer-model",
        out_dir=tmp_path,
        workloads=["W2"],
        concurrency_levels={"W2": (2,)},
        rows=graphs_row,
        base_settings={"device": "cpu"},
        server_command=f"{sys.executable} -c 'raise SystemExit(\"must not start\")'",
    )
    assert summary["runs"] == []
    [failure] = summary["failed_rows"]
    assert failure["row"] == "paged-chunked-cuda_graphs"
    assert "use_cuda_graphs=True needs a CUDA device" in failure["error"]


def test_rows_are_selected_by_name_and_unknown_names_are_refused():
    assert [row.name for row in select_rows("static,continuous-paged")] == ["static", "continuous-paged"]
    assert select_rows(None) == MATRIX_ROWS
    with pytest.raises(ValueError, match="unknown matrix rows \\['nope'\\]"):
        select_rows("static,nope")


def _stats(tokens_per_s, ttft_p50, ttft_p99, itl_p50, itl_p99, e2e_p50, errors=0):
    return {
        "output_tokens_per_s": tokens_per_s,
        "ttft_s": {"p50": ttft_p50, "p99": ttft_p99},
        "itl_s": {"p50": itl_p50, "p99": itl_p99},
        "e2e_s": {"p50": e2e_p50},
        "num_errors": errors,
    }


def test_matrix_table_puts_each_row_beside_the_first_rows_run_of_its_workload():
    """Expected lines written out by hand from the numbers below, not from the code's output."""
    summary = {
        "model": "m",
        "settings": {"seed": 0},
        "rows": ["static", "paged"],
        "runs": [
            {
                "row": "static",
                "workload": "W2",
                "concurrency": 4,
                "stats": _stats(100.0, 0.2, 0.4, 0.01, 0.03, 2.0),
            },
            {
                "row": "paged",
                "workload": "W2",
                "concurrency": 4,
                "stats": _stats(250.0, 0.05, 0.1, 0.008, 0.02, 1.0),
            },
            # The baseline's run of W3 failed: its ratios have nothing to compare with.
            {
                "row": "paged",
                "workload": "W3",
                "concurrency": 4,
                "stats": _stats(80.0, 0.5, 0.9, 0.02, 0.05, 3.0, 1),
            },
        ],
        "failed_rows": [{"row": "static", "error": "W3 failed: the server died\ntraceback..."}],
    }
    lines = serving_matrix.matrix_markdown(summary).splitlines()
    assert lines[0] == "# infer bench matrix: m"
    assert "settings: seed=0" in lines
    assert "| W2 | 4 | static | 100.0 | 1.00 | 200.0 | 400.0 | 1.00 | 10.0 | 30.0 | 2000.0 | 0 |" in lines
    assert "| W2 | 4 | paged | 250.0 | 2.50 | 50.0 | 100.0 | 0.25 | 8.0 | 20.0 | 1000.0 | 0 |" in lines
    assert "| W3 | 4 | paged | 80.0 | - | 500.0 | 900.0 | - | 20.0 | 50.0 | 3000.0 | 1 |" in lines
    assert lines[-1] == "- static failed: W3 failed: the server died"


def test_matrix_table_gains_acceptance_columns_when_a_row_speculated():
    """Expected lines written out by hand: acceptance 60/80 = 75.0%, mean accepted length
    1 + 60/25 = 3.40; "-" for the row that did not speculate."""
    spec = {"acceptance_rate": 0.75, "mean_accepted_length": 3.4}
    summary = {
        "model": "m",
        "settings": {"seed": 0},
        "rows": ["plain", "ngram"],
        "runs": [
            {
                "row": "plain",
                "workload": "W1",
                "concurrency": 1,
                "stats": _stats(50.0, 0.1, 0.1, 0.02, 0.02, 5.0),
            },
            {
                "row": "ngram",
                "workload": "W1",
                "concurrency": 1,
                "stats": {**_stats(100.0, 0.1, 0.1, 0.01, 0.01, 2.5), "spec_decode": spec},
            },
        ],
    }
    lines = serving_matrix.matrix_markdown(summary).splitlines()
    assert any(line.endswith("| errors | accept % | accepted len |") for line in lines)
    assert (
        "| W1 | 1 | plain | 50.0 | 1.00 | 100.0 | 100.0 | 1.00 | 20.0 | 20.0 | 5000.0 | 0 | - | - |" in lines
    )
    assert (
        "| W1 | 1 | ngram | 100.0 | 2.00 | 100.0 | 100.0 | 1.00 | 10.0 | 10.0 | 2500.0 | 0 | 75.0 | 3.40 |"
        in lines
    )


def test_each_run_of_a_matrix_draws_prompts_of_its_own():
    # A row's server keeps its prefix cache across runs: a run must not find another's prompts.
    from infer.bench.serving.matrix import run_seed
    from infer.bench.serving.workloads import make_workload

    workloads = [make_workload("W2", concurrency=c, seed=run_seed(0, "W2", c)) for c in (16, 64)]
    drawn = [{tuple(request.prompt_token_ids) for request in w.requests} for w in workloads]
    assert drawn[0] and drawn[1] and not drawn[0] & drawn[1]
    assert run_seed(0, "W2", 16) == run_seed(0, "W2", 16) != run_seed(1, "W2", 16)
