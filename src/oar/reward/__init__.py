"""oar.reward.score."""
