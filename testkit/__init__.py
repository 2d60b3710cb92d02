"""Helpers the test suite and the benchmarks share (not part of the kvtier package)."""
