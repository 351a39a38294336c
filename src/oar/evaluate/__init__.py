"""oar.evaluate.evaluation."""
