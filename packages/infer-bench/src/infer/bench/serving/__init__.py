"""The serving benchmark: seeded workloads, a streaming client, statistics, reports, the config
matrix and the transformers baseline. Entry point: `infer bench serve|matrix|hf-baseline`
(`infer.bench.serving.cli.main`)."""

from infer.bench.serving.client import RequestRecord, RunResult, run_workload
from infer.bench.serving.runner import benchmark_server
from infer.bench.serving.stats import Summary, percentile, run_stats, summarize
from infer.bench.serving.workloads import SHAPES, BenchRequest, Workload, WorkloadShape, make_workload

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
