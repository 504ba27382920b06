"""Helpers shared by the tests and the benchmarks: start a real server and talk to it."""
