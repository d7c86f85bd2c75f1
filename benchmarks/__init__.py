"""Benchmarks for tvm_cascade (run ``python -m benchmarks.attention``)."""
