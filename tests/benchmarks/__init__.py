"""Benchmarks: standalone scripts, run by `make bench` or by hand, never collected by pytest.

pytest collects only ``test_*.py`` files; nothing here is named that way.
"""
