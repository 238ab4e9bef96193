"""pytest-benchmark harness for kernels-bench/: collects `bench_*.py`, skips without CUDA.

Each `bench_<op>.py` lists its cases; every (case, implementation) pair is one benchmark. The
figure that counts is the CUDA-event median of `harness.time_ms` (stored in extra_info with the
achieved GB/s and % of copy bandwidth); pytest-benchmark's own rounds time one launch plus a
device sync, which includes Python launch overhead. A summary table with device, versions and
date is printed at the end. `python kernels-bench/run_all.py --out FILE.md` writes the same table.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `import harness` from the bench files

import harness  # noqa: E402

_cases_run: list[harness.Case] = []


def pytest_collect_file(file_path, parent):
    if file_path.name.startswith("bench_") and file_path.suffix == ".py":
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="kernel benchmarks need a CUDA GPU")
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(skip)


@pytest.fixture
def bench_op(benchmark):
    def run(case: harness.Case, impl: str) -> None:
        fn = harness.impl_fn(case, impl)
        inputs = case.make_inputs()
        ms = harness.time_ms(fn, inputs)
        harness.record_time(case, impl, ms)
        gbps = case.bytes_moved / (ms * 1e-3) / 1e9
        benchmark.extra_info.update(
            event_median_us=ms * 1e3,
            gbps=gbps,
            pct_of_copy_bandwidth=100 * gbps / harness.copy_bandwidth_gbps(),
            bytes_moved=case.bytes_moved,
        )
        benchmark.pedantic(lambda: (fn(*inputs), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)
        if case not in _cases_run:
            _cases_run.append(case)

    return run


def pytest_terminal_summary(terminalreporter):
    if not _cases_run:
        return
    terminalreporter.write_line("")
    terminalreporter.write_line(harness.environment_header())
    terminalreporter.write_line(harness.markdown_table(_cases_run))
