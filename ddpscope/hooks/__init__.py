"""The rank side: probes that run inside every training process (needs torch).

Nothing in this package may import textual; tests/e2e/test_boundaries.py checks.
"""
