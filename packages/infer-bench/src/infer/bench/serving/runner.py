"""One benchmark of a running server: what it says about itself, the timed run, the report dict."""

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
) -> dict:
    """Runs `workload` against `base_url` and returns the full report (see report.py for its layout).

    `model` None: the first model that GET /v1/models lists. `client_processes`: see run_workload.
    """
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(30.0)) as client:
        model = model or _first_model_id((await server_info.fetch_server_info(client))["models"], base_url)
        before = {}

        async def scrape_before() -> None:
            before.update(await server_info.fetch_server_info(client))

        run = await run_workload(
            workload,
            base_url=base_url,
            model=model,
            ignore_eos=ignore_eos,
            timeout_s=timeout_s,
            before_timed_run=scrape_before,
            client_processes=client_processes,
        )
        after = await server_info.fetch_server_info(client)
    samples_before = _samples(before)
    samples_after = _samples(after)
    queue_time = None
    for name in server_info.QUEUE_TIME_HISTOGRAMS:
        queue_time = queue_time or server_info.histogram_mean_between(samples_before, samples_after, name)
    report = {
        "kind": "infer bench serve",
        "created_unix_s": time.time(),
        "base_url": base_url,
        "model": model,
        "workload": workload.describe(),
        "client": {**client_environment(), "processes": run.client_processes},
        "server": {
            "models": after["models"],
            "health_status": after["health_status"],
            "missing_endpoints": after["missing"],
            "engine_config": engine_config(engine_config_file, after["models"]),
            "memory_after_run": server_info.memory_gauges(samples_after),
            "metrics_after_run": after["metrics_text"],
        },
        "ignore_eos_sent": run.ignore_eos_sent,
        "notes": run.notes,
        "stats": run_stats(
            run,
            server_queue_time=queue_time,
            spec_decode=spec_decode_from_metrics(samples_before, samples_after),
        ),
        "probe": run.probe.as_dict() if run.probe else None,
    }
    if include_records:
        report["records"] = [record.as_dict() for record in run.records]
    return report


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
