"""oar.config."""
