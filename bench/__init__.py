"""Texel's benchmarks: programs that print tables, never timed assertions."""
