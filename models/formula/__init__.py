"""Printed-formula recognition: adapter, preprocessing, and the default model's training."""
