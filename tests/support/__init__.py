"""Helpers shared by the test suites (sim engine processes, ports)."""
