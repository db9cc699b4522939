"""Benchmarks: each module prints a table with its baseline measured in the same run."""
