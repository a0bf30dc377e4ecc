"""The `ppoz` command line and the benchmarks."""

__version__ = "0.1.0"
