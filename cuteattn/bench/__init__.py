"""Benchmarks: `python -m cuteattn.bench [--quick] [--varlen] [--json PATH] [--plot [PNG]]`."""
