"""Benchmarks: python -m sglang_vc.bench.NAME ... --json OUT."""
