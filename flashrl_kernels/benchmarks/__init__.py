"""Benchmarks run by `flashrl-kernels bench`: one module per op, see harness.py."""
