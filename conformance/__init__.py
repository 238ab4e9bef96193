"""The spec-driven conformance suites: plugin.py turns specs/*/*.yaml into pytest items."""
