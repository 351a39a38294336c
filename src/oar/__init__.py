"""oar: fine-grained credit assignment for reinforcement learning of LLMs on math reasoning.

Subpackages and modules:

- :mod:`oar.credit` -- advantage estimators (GRPO, Dr. GRPO, KTAE, OAR-P, OAR-G), registered by name.
- :mod:`oar.loss` -- PPO-clip policy loss, aggregation modes and the k3 KL estimator.
- :mod:`oar.data` -- the synthetic arithmetic task, real benchmark loaders and prompt templates.
- :mod:`oar.reward` -- answer checking with math-verify in a pool of worker processes.
- :mod:`oar.models` -- policy loading (local dir, hub id, GGUF) and the tiny model factory.
"""

__version__ = "0.1.0"
