"""Helpers for heteroflow's own tests and benchmarks (multi-process runs on one machine)."""

from heteroflow.testing.multiproc import MultiprocError, run_ranks

__all__ = ["MultiprocError", "run_ranks"]
