"""oar.pipeline."""
