"""Benchmark data: item loading, the synthetic and CPython-docs generators, and the shipped sets."""
