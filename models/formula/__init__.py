"""Printed-formula recognition: the adapter, preprocessing, and the default model's training code."""
