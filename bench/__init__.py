"""Benchmarks of the runtime agent, run against the real agent process with simulated engines."""
