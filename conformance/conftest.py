"""Activates the spec plugin (plugin.py) for this folder; see docs/conformance.md."""

from conformance.plugin import (  # noqa: F401 - pytest finds hooks by name in this module
    pytest_addoption,
    pytest_configure,
    pytest_ignore_collect,
    pytest_pycollect_makemodule,
)
