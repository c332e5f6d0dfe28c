"""Benchmarks run by hand: `python -m benchmarks [--quick]`. Not pass/fail tests."""
