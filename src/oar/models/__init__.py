"""oar.models.loading."""
