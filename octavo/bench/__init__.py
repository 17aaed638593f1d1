"""Benchmark harness behind `octavo bench`: fixed workloads, Octavo vs Hugging Face side by side."""
