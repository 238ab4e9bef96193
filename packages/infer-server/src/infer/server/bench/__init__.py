"""The serving benchmark: seeded workloads, a streaming client, statistics, reports, the config
matrix and the transformers baseline. Entry point: `infer bench serve|matrix|hf-baseline`
(`infer.server.bench.cli.main`)."""

from infer.server.bench.client import RequestRecord, RunResult, run_workload
from infer.server.bench.runner import benchmark_server
from infer.server.bench.stats import Summary, percentile, run_stats, summarize
from infer.server.bench.workloads import SHAPES, BenchRequest, Workload, WorkloadShape, make_workload

__all__ = [
    "SHAPES",
    "BenchRequest",
    "RequestRecord",
    "RunResult",
    "Summary",
    "Workload",
    "WorkloadShape",
    "benchmark_server",
    "make_workload",
    "percentile",
    "run_stats",
    "run_workload",
    "summarize",
]
