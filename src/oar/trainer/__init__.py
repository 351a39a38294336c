"""oar.trainer."""
