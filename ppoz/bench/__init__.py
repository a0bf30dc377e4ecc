"""Benchmarks run by `ppoz bench NAME`."""
