"""Checks of the scheduler contract (specs/scheduler); see checks.py."""
