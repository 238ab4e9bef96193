"""Repository-wide pytest setup: `gpu` tests are skipped where CUDA is absent."""

import os

import pytest
import torch

# Without a GPU, Triton kernels can only run through Triton's interpreter, and Triton reads
# TRITON_INTERPRET once per @triton.jit function when it is defined - its own library functions
# (tl.sigmoid, tl.sum) at `import triton`. It must be set before anything imports triton, hence
# here; it changes nothing else on a CPU machine (infer-kernels' tests use it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from hypothesis import settings
except ImportError:  # an environment without the test requirements
    pass
else:
    # CI (.ci/run) draws the same examples every run, so a landing is never refused for an
    # example that no earlier run drew; a developer's runs keep exploring new ones.
    settings.register_profile("ci", derandomize=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config, items):
    _slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _slow_files_first(items) -> None:
    """Orders the files: those holding a `slow` test (gpu ones aside) first, then the others, each
    group by its number of tests, most first; a file's tests stay together and in their order.
    `nox -s tests` hands whole files to two pytest-xdist workers in this order
    (--no-loadscope-reorder), so the long files start first. By count alone, pytest-xdist's
    order, the one-test files came last, among them test_plain_install (100 s) and test_stress
    (80 s); a worker queues files up to three tests ahead, and one was left running them alone for
    the last two minutes (a 2-core VM, 2026-11-30)."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(tests: list) -> tuple[bool, int]:
        slow = any("slow" in test.keywords and "gpu" not in test.keywords for test in tests)
        return not slow, -len(tests)

    items[:] = [item for tests in sorted(files.values(), key=rank) for item in tests]


# On CUDA the engine's KV pool defaults to 0.9 of the memory free after the weights
# (infer.engine.device_defaults), which one engine of one process should take. The GPU suite runs
# several pytest-xdist workers on one GPU, each building engines: each engine that leaves the
# pool's size to the default gets this share of the free memory instead, as a user sharing a GPU
# sets kv_cache_memory_fraction.
GPU_TEST_KV_CACHE_MEMORY_FRACTION = 0.05


@pytest.fixture(autouse=True)
def _share_the_gpu_between_test_workers(monkeypatch):
    if torch.cuda.is_available():
        try:
            from infer.engine import device_defaults
        except ImportError:  # the infer-kernels wheel tested alone
            return
        share = GPU_TEST_KV_CACHE_MEMORY_FRACTION
        monkeypatch.setattr(device_defaults, "CUDA_KV_CACHE_MEMORY_FRACTION", share)
