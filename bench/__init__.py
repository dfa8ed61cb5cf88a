"""Benchmarks: each prints a table and writes JSON (``--json PATH``)."""
