"""Text-to-image generation: the adapter over a diffusers pipeline."""
