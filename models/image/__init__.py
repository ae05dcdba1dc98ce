"""Text-to-image generation: the adapter, the shapes world, its judge and training code."""
