"""Benchmarks and profiling of infer, off the library wheels' import path: the serving benchmark
(`infer.bench.serving`). Reached through the `infer` command; no other infer package imports it."""

from infer.bench._version import INTERFACE_VERSION, __version__

__all__ = ["INTERFACE_VERSION", "__version__"]
