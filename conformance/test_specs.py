"""Placeholder that anchors the spec suites: plugin.py collects specs/*/*.yaml in its place.

One anchor file means `pytest conformance` and a plain `pytest` from the repository root collect
the suites exactly once, as `conformance/test_specs.py::ALLOC-001[PagedKVPool]` and so on.
"""
