"""oar.tracking.client."""
