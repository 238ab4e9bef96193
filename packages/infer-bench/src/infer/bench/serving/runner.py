"""One benchmark of a running server: what it says about itself, the timed run, the report dict."""

import functools
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import httpx

from infer.bench.serving import server_info
from infer.bench.serving.client import run_workload
from infer.bench.serving.stats import run_stats
from infer.bench.serving.workloads import Workload
from infer.bench.spec_decode import spec_decode_from_metrics
from infer.bench.vision import vision_from_metrics


async def benchmark_server(
    workload: Workload,
    *,
    base_url: str,
    model: str | None = None,
    engine_config_file: str | Path | None = None,
    timeout_s: float = 600.0,
    ignore_eos: bool = True,
    include_records: bool = True,
    client_processes: int | None = None,
    passes: int = 1,
    duration_s: float | None = None,
) -> dict:
    """Runs `workload` against `base_url` and returns the full report (see report.py for its layout).

    `model` None: the first model that GET /v1/models lists. `client_processes`: see run_workload.
    `passes`: the timed requests run this many times over, the warm-up and probe before the first
    only; the report's stats and records are pass 1's, `later_passes` holds the others'.
    `duration_s`: the time cap on each pass's timed run (see client.py; None: none).
    """
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    timed = []  # per pass: its run and the /metrics samples before and after it
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(30.0)) as client:
        model = model or _first_model_id((await server_info.fetch_server_info(client))["models"], base_url)
        for number in range(1, passes + 1):
            before: dict = {}
            run = await run_workload(
                workload,
                base_url=base_url,
                model=model,
                ignore_eos=ignore_eos,
                timeout_s=timeout_s,
                warmup=number == 1,
                before_timed_run=functools.partial(_scrape_into, client, before),
                client_processes=client_processes,
                duration_s=duration_s,
            )
            ignore_eos = run.ignore_eos_sent  # as the warm-up found the server takes it
            after = await server_info.fetch_server_info(client)
            timed.append((run, _samples(before), _samples(after)))
    first = timed[0][0]
    stats = [_pass_stats(*one) for one in timed]
    report = {
        "kind": "infer bench serve",
        "created_unix_s": time.time(),
        "base_url": base_url,
        "model": model,
        "workload": workload.describe(),
        "client": {**client_environment(), "processes": first.client_processes},
        "server": {
            "models": after["models"],
            "health_status": after["health_status"],
            "missing_endpoints": after["missing"],
            "engine_config": engine_config(engine_config_file, after["models"]),
            "memory_after_run": server_info.memory_gauges(timed[-1][2]),
            "metrics_after_run": after["metrics_text"],
        },
        "ignore_eos_sent": first.ignore_eos_sent,
        "notes": first.notes,
        "stats": stats[0],
        "probe": first.probe.as_dict() if first.probe else None,
    }
    if include_records:
        report["records"] = [record.as_dict() for record in first.records]
    if passes > 1:
        report["later_passes"] = []
        for number, ((run, _, _), pass_stats) in enumerate(zip(timed[1:], stats[1:], strict=True), start=2):
            later = {
                "pass": number,
                "stats": pass_stats,
                "ttft_p50_ratio_to_pass_1": _ttft_p50_ratio(pass_stats, stats[0]),
            }
            if include_records:
                later["records"] = [record.as_dict() for record in run.records]
            report["later_passes"].append(later)
    return report


async def _scrape_into(client: httpx.AsyncClient, into: dict) -> None:
    into.update(await server_info.fetch_server_info(client))


def _pass_stats(run, samples_before: dict, samples_after: dict) -> dict:
    """run_stats with what the server's /metrics say of the run."""
    queue_time = None
    for name in server_info.QUEUE_TIME_HISTOGRAMS:
        queue_time = queue_time or server_info.histogram_mean_between(samples_before, samples_after, name)
    return run_stats(
        run,
        server_queue_time=queue_time,
        spec_decode=spec_decode_from_metrics(samples_before, samples_after),
        vision=vision_from_metrics(samples_before, samples_after),
        prefix_cache_matches=server_info.counter_by_label_between(
            samples_before, samples_after, *server_info.PREFIX_CACHE_MATCHES
        ),
    )


def _ttft_p50_ratio(stats: dict, first: dict) -> float | None:
    if not stats["ttft_s"] or not first["ttft_s"]:
        return None  # a pass whose every request failed
    return stats["ttft_s"]["p50"] / first["ttft_s"]["p50"]


def _first_model_id(models: dict | None, base_url: str) -> str:
    listed = [entry.get("id") for entry in (models or {}).get("data") or [] if entry.get("id")]
    if not listed:
        raise RuntimeError(f"GET {base_url}/v1/models listed no model; pass --model NAME")
    return listed[0]


def _samples(info: dict) -> dict:
    return server_info.parse_prometheus_text(info["metrics_text"]) if info["metrics_text"] else {}


def engine_config(path: str | Path | None, models: dict | None) -> dict | None:
    """The full EngineConfig: from `--engine-config FILE` (validated, defaults filled in), else as
    the server lists it in /v1/models, else None."""
    if path is not None:
        from infer.engine.config import EngineConfig

        return {"source": str(path), **EngineConfig.from_file(path).to_dict()}
    listed = server_info.engine_config_from_models(models)
    return {"source": "/v1/models", **listed} if listed else None


def client_environment() -> dict:
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "httpx": httpx.__version__,
        "infer-bench": _version("infer-bench"),
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
