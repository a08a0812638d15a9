"""Helpers the tests and benchmarks share: import as tests.support.<module>."""
