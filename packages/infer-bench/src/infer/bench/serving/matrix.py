"""`infer bench matrix`: each server configuration against the same workloads, one table of ratios.

For each configuration row the matrix writes an engine config file, starts the server on it as a
subprocess (`python -m infer.server.cli serve --engine-config FILE --host 127.0.0.1 --port P`),
waits for GET /health to answer 200, runs every workload at every concurrency level, stops the
server with SIGTERM (SIGKILL after `stop_timeout_s`) and moves on. The table puts each row beside
the first row (static batching) measured in the same matrix: throughput ratio, TTFT and ITL.

Out folder: matrix.md, matrix.json (the stats of every run), and per row `<row>/engine_config.json`,
`<row>/server.log`, `<row>/<workload>-c<concurrency>.json` (the full `bench serve` report).
"""

import asyncio
import contextlib
import json
import shlex
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from infer.bench.serving.report import markdown_table, write_json
from infer.bench.serving.runner import benchmark_server
from infer.bench.serving.workloads import CONCURRENCY_LEVELS, make_workload
from infer.engine.config import AUTO_FLAGS
from infer.models.tensor_parallel import free_local_port

DEFAULT_SERVER_COMMAND = f"{sys.executable} -m infer.server.cli serve"


@dataclass(frozen=True)
class ConfigRow:
    """One server configuration: a name, the EngineConfig fields it sets, and `infer serve`
    flags beyond the engine's."""

    name: str
    engine_settings: dict
    server_args: tuple[str, ...] = ()
    # False: max_batch_size is the engine's default, not the matrix's highest concurrency.
    sized_by_matrix: bool = True


# The engine's defaults are the device's measured best (infer.engine.device_defaults), so each
# row but "defaults" turns every fast path off and then on again by name: a row means the same
# configuration whatever the defaults become.
_ALL_OFF = dict.fromkeys(AUTO_FLAGS, False)
# The first design document's baseline matrix (static, +continuous, +paged, +chunked), then the
# scheduler policies and CUDA graphs on the last of them.
_PAGED = {**_ALL_OFF, "batching_mode": "continuous", "kv_cache_backend": "paged"}
_PAGED_CHUNKED = {**_PAGED, "use_chunked_prefill": True}
MATRIX_ROWS = (
    # `infer serve` with no engine flags.
    ConfigRow("defaults", {}, sized_by_matrix=False),
    ConfigRow("static", {**_ALL_OFF, "batching_mode": "static", "kv_cache_backend": "contiguous"}),
    ConfigRow(
        "continuous-contiguous", {**_ALL_OFF, "batching_mode": "continuous", "kv_cache_backend": "contiguous"}
    ),
    ConfigRow("continuous-paged", _PAGED),
    ConfigRow("paged-chunked", _PAGED_CHUNKED),
    ConfigRow("paged-chunked-prefix_cache", {**_PAGED_CHUNKED, "use_prefix_caching": True}),
    ConfigRow("paged-chunked-prefill_first", {**_PAGED_CHUNKED, "scheduler_policy": "prefill_first"}),
    ConfigRow(
        "paged-chunked-decode_round_robin", {**_PAGED_CHUNKED, "scheduler_policy": "decode_round_robin"}
    ),
    # Need CUDA: on a CPU run these rows are listed under failed_rows with the config's reason.
    ConfigRow("paged-cuda_graphs", {**_PAGED, "use_cuda_graphs": True}),
    # Graphs for decode-only steps alone: steps with prompt chunks run eagerly.
    ConfigRow(
        "paged-chunked-decode_graphs",
        {**_PAGED_CHUNKED, "use_cuda_graphs": True, "cuda_graph_mixed_steps": False},
    ),
    ConfigRow("paged-chunked-cuda_graphs", {**_PAGED_CHUNKED, "use_cuda_graphs": True}),
    # Each step launched before the previous step's tokens reach the host.
    ConfigRow("paged-cuda_graphs-async", {**_PAGED, "use_cuda_graphs": True, "async_scheduling": True}),
    ConfigRow(
        "paged-chunked-cuda_graphs-async",
        {**_PAGED_CHUNKED, "use_cuda_graphs": True, "async_scheduling": True},
    ),
    # With the prefix cache: W3's shared system prompt is computed once.
    ConfigRow(
        "paged-chunked-cuda_graphs-async-prefix_cache",
        {**_PAGED_CHUNKED, "use_cuda_graphs": True, "async_scheduling": True, "use_prefix_caching": True},
    ),
    # The same with the engine core in the server's process (a thread), as before it had one of
    # its own: the baseline of the process split.
    ConfigRow(
        "paged-chunked-cuda_graphs-async-in_process",
        {**_PAGED_CHUNKED, "use_cuda_graphs": True, "async_scheduling": True},
        ("--engine-in-process",),
    ),
)


def select_rows(names: str | None) -> tuple[ConfigRow, ...]:
    """The rows named in a comma-separated list, in MATRIX_ROWS order; None or "": every row."""
    wanted = {name for name in (names or "").split(",") if name}
    unknown = wanted - {row.name for row in MATRIX_ROWS}
    if unknown:
        raise ValueError(f"unknown matrix rows {sorted(unknown)}; known: {[row.name for row in MATRIX_ROWS]}")
    return tuple(row for row in MATRIX_ROWS if not wanted or row.name in wanted)


@contextlib.contextmanager
def server_process(
    command: list[str],
    base_url: str,
    *,
    log_path: Path,
    health_timeout_s: float = 600.0,
    stop_timeout_s: float = 30.0,
) -> Iterator[subprocess.Popen]:
    """Starts `command`, yields once GET {base_url}/health answers 200, then stops it (SIGTERM)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_health(process, base_url, timeout_s=health_timeout_s, log_path=log_path)
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=stop_timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def wait_for_health(process: subprocess.Popen, base_url: str, *, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"the server exited with status {process.returncode} before /health answered; "
                f"last lines of {log_path}:\n{_tail(log_path)}"
            )
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.25)
    raise TimeoutError(
        f"GET {base_url}/health did not answer 200 within {timeout_s:.0f} s; raise --health-timeout-s "
        f"if the model is large; last lines of {log_path}:\n{_tail(log_path)}"
    )


def _tail(path: Path, num_lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


def run_matrix(
    *,
    model: str,
    out_dir: str | Path,
    workloads: list[str],
    concurrency_levels: dict[str, tuple[int, ...]] | None = None,
    rows: tuple[ConfigRow, ...] = MATRIX_ROWS,
    base_settings: dict | None = None,
    server_command: str = DEFAULT_SERVER_COMMAND,
    extra_server_args: list[str] | None = None,
    seed: int = 0,
    num_requests: int | None = None,
    vocab_size: int | None = None,
    health_timeout_s: float = 600.0,
    client_processes: int | None = None,
) -> dict:
    """Runs every row x workload x concurrency; writes the out folder; returns the summary.
    `client_processes`: see run_workload."""
    from infer.engine.config import EngineConfig, EngineConfigError

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = {name: (concurrency_levels or {}).get(name) or CONCURRENCY_LEVELS[name] for name in workloads}
    settings = {"model": model, **(base_settings or {})}
    matrix_batch_size = {"max_batch_size": max(max(c) for c in levels.values())}
    summary = {
        "model": model,
        "rows": [row.name for row in rows],
        "settings": {**matrix_batch_size, **settings},
        "runs": [],
        "failed_rows": [],
    }
    for row in rows:
        row_dir = out_dir / row.name
        row_dir.mkdir(exist_ok=True)
        try:
            sizing = matrix_batch_size if row.sized_by_matrix else {}
            config = EngineConfig.from_dict(
                {**sizing, **settings, **row.engine_settings}, source=f"matrix row {row.name}"
            )
        except EngineConfigError as error:  # e.g. CUDA graphs on a CPU run
            summary["failed_rows"].append({"row": row.name, "error": str(error)})
            print(f"{row.name}: not run: {error}", file=sys.stderr)
            continue
        config_path = row_dir / "engine_config.json"
        config_path.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        port = free_local_port()
        base_url = f"http://127.0.0.1:{port}"
        command = [
            *shlex.split(server_command),
            "--engine-config", str(config_path), "--host", "127.0.0.1", "--port", str(port),
            *row.server_args, *(extra_server_args or []),
        ]  # fmt: skip
        try:
            with server_process(
                command, base_url, log_path=row_dir / "server.log", health_timeout_s=health_timeout_s
            ):
                for name in workloads:
                    for concurrency in levels[name]:
                        summary["runs"].append(
                            _run_one(
                                row,
                                name,
                                concurrency,
                                base_url,
                                config_path,
                                seed,
                                num_requests,
                                vocab_size,
                                client_processes,
                            )
                        )
        except (RuntimeError, TimeoutError) as error:
            # One broken configuration should not cost the others' numbers; the table says which.
            summary["failed_rows"].append({"row": row.name, "error": str(error)})
            print(f"{row.name}: failed: {error}", file=sys.stderr)
    write_json(summary, out_dir / "matrix.json")
    (out_dir / "matrix.md").write_text(matrix_markdown(summary))
    return summary


def _run_one(
    row, name, concurrency, base_url, config_path, seed, num_requests, vocab_size, client_processes
) -> dict:
    kwargs = {"vocab_size": vocab_size} if vocab_size else {}
    seed = run_seed(seed, name, concurrency)
    workload = make_workload(name, concurrency=concurrency, seed=seed, num_requests=num_requests, **kwargs)
    report = asyncio.run(
        benchmark_server(
            workload, base_url=base_url, engine_config_file=config_path, client_processes=client_processes
        )
    )
    report["matrix_row"] = row.name
    write_json(report, config_path.parent / f"{name}-c{concurrency}.json")
    tokens_per_s = report["stats"]["output_tokens_per_s"]
    print(f"{row.name} {name} c={concurrency}: {tokens_per_s:.1f} output tok/s", file=sys.stderr)
    run = {"row": row.name, "workload": name, "concurrency": concurrency, "seed": workload.seed}
    return {**run, "stats": report["stats"], "notes": report["notes"]}


def run_seed(seed: int, workload: str, concurrency: int) -> int:
    """The seed of one (workload, concurrency) run of a matrix. Each run draws requests of its
    own, because a row's server keeps its prefix cache from run to run: with one seed, W2 at 64
    would start with the prompts W2 at 16 left in the cache."""
    return zlib.crc32(f"{seed}/{workload}/c{concurrency}".encode())


def matrix_markdown(summary: dict) -> str:
    """One table: per workload and concurrency, each row beside the baseline (the first row)."""
    baseline_name = summary["rows"][0]
    by_key = {(run["workload"], run["concurrency"], run["row"]): run["stats"] for run in summary["runs"]}
    header = [
        "workload", "conc", "config", "out tok/s", f"x {baseline_name}", "TTFT p50 (ms)", "TTFT p99 (ms)",
        f"TTFT p50 x {baseline_name}", "ITL p50 (ms)", "ITL p99 (ms)", "E2E p50 (ms)", "errors",
    ]  # fmt: skip
    # Speculative decoding's columns, when some row's server speculated.
    speculates = any(run["stats"].get("spec_decode") for run in summary["runs"])
    if speculates:
        header += ["accept %", "accepted len"]
    rows = []
    for workload, concurrency in dict.fromkeys(
        (run["workload"], run["concurrency"]) for run in summary["runs"]
    ):
        baseline = by_key.get((workload, concurrency, baseline_name))
        for row_name in summary["rows"]:
            stats = by_key.get((workload, concurrency, row_name))
            if stats is None:
                continue
            rows.append([
                workload, str(concurrency), row_name, f"{stats['output_tokens_per_s']:.1f}",
                _ratio(stats["output_tokens_per_s"], baseline and baseline["output_tokens_per_s"]),
                _ms(stats["ttft_s"], "p50"), _ms(stats["ttft_s"], "p99"),
                _ratio(_get(stats["ttft_s"], "p50"), baseline and _get(baseline["ttft_s"], "p50")),
                _ms(stats["itl_s"], "p50"), _ms(stats["itl_s"], "p99"), _ms(stats["e2e_s"], "p50"),
                str(stats["num_errors"]),
            ] + (_spec_decode_cells(stats.get("spec_decode")) if speculates else []))  # fmt: skip
    settings = ", ".join(f"{key}={value}" for key, value in summary["settings"].items())
    failed = [f"- {f['row']} failed: {f['error'].splitlines()[0]}" for f in summary.get("failed_rows", [])]
    return (
        "\n".join(
            [
                f"# infer bench matrix: {summary['model']}",
                "",
                f"settings: {settings}",
                "",
                markdown_table(header, rows),
            ]
            + (["", *failed] if failed else [])
        )
        + "\n"
    )


def _spec_decode_cells(spec_decode: dict | None) -> list[str]:
    """Acceptance (%) and mean accepted length; "-" for a row that did not speculate."""
    if not spec_decode:
        return ["-", "-"]
    return [f"{100 * spec_decode['acceptance_rate']:.1f}", f"{spec_decode['mean_accepted_length']:.2f}"]


def _get(summary: dict | None, key: str) -> float | None:
    return None if not summary else summary.get(key)


def _ms(summary: dict | None, key: str) -> str:
    value = _get(summary, key)
    return "-" if value is None else f"{value * 1000:.1f}"


def _ratio(value: float | None, baseline: float | None) -> str:
    return "-" if value is None or not baseline else f"{value / baseline:.2f}"
