"""Benchmarks: qserve against the raw libraries, and the page that shows them."""
