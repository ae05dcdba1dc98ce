"""Texel's workshop: training, evaluation and data rendering for the default models, and
tiny models built from configs for tests and benchmarks. Serving never imports it, and
the installed package does not ship it; run it from the repository root
(`python -m training.formula.train`)."""
