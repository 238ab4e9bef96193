"""Checks for specs/spec_decode (loaded by path by conformance/plugin.py)."""
