"""oar.core."""
