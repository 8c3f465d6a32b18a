"""Registers the test-only recurrence before the battery collects the registry."""

from tests.contracts import scratch_recurrence  # noqa: F401
