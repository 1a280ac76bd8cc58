"""Benchmarks: scripts that measure speed and memory and print ratios from one run."""
