"""Benchmarks (run as scripts or with ``python -m benchmarks.<name>``); see README.md."""
