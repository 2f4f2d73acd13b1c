"""Benchmarks: each prints the drain's rate as a ratio to the raw client measured in the same run."""
