"""Benchmarks and profiling of infer, off the library wheels' import path: `infer bench generate`
(`generation`), `infer profile` (`profile`) and the serving benchmark (`serving`). Reached through
the `infer` command (`cli.main`); no other infer package imports it."""

from infer.bench._version import INTERFACE_VERSION, __version__

__all__ = ["INTERFACE_VERSION", "__version__"]
